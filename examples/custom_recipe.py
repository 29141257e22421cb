from fp4train.recipes import Recipe, LinearSpec, GemmSpec, QuantSpec, TransformSpec, Override
w = QuantSpec("mxfp4", block=(32, 32), scale="ceil")
g = QuantSpec("mxfp4", rounding="stochastic")
mine = Recipe("mine", LinearSpec(fprop=GemmSpec(QuantSpec("mxfp4"), w), dgrad=GemmSpec(g, w),
              wgrad=GemmSpec(g, QuantSpec("mxfp4"), TransformSpec(block=32))),
              overrides=(Override("lm_head"), Override("*.down_proj")))   # these stay BF16
