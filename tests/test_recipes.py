"""Recipes: presets as docs/methods.md defines them, serialization, lookup, custom recipes."""

import pytest
import torch

import fp4train
from fp4train.recipes import GemmSpec, LinearSpec, Override, QuantSpec, Recipe, TransformSpec

PRESETS = ["adahop", "adahop_measured", "bf16", "fp8_rowwise", "hadamard_mxfp4", "mxfp4", "nvfp4", "tib2d"]


def test_names_and_get():
    assert set(PRESETS) <= set(fp4train.recipes.names())
    for n in PRESETS:
        r = fp4train.recipes.get(n)
        assert r.name == n and r.description
    assert fp4train.recipes.get(fp4train.recipes.get("mxfp4")).name == "mxfp4"
    assert "tib2d" in fp4train.recipes.describe()


@pytest.mark.parametrize("name", PRESETS)
def test_roundtrip_json_and_toml(name, tmp_path):
    r = fp4train.recipes.get(name)
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_toml(r.to_toml()) == r
    for suffix in (".json", ".toml"):
        p = tmp_path / f"r{suffix}"
        r.save(p)
        assert Recipe.load(p) == r
        assert fp4train.recipes.get(str(p)) == r


def test_mxfp4_is_naive():
    lin = fp4train.recipes.get("mxfp4").linear
    for g in (lin.fprop, lin.dgrad, lin.wgrad):
        assert g.transform is None
        for q in (g.a, g.b):
            assert (q.format, q.block_size, q.is_2d, q.scale, q.rounding) == ("mxfp4", 32, False, "floor", "nearest")


def test_nvfp4_matches_nvidia_recipe():
    r = fp4train.recipes.get("nvfp4")
    lin = r.linear
    assert lin.fprop.b.block == (16, 16) and lin.dgrad.b.block == (16, 16)  # W in 16x16 tiles
    assert lin.fprop.a.block_size == 16 and not lin.fprop.a.is_2d
    assert lin.wgrad.transform == TransformSpec(block=16, random_signs=True)  # RHT-16 on wgrad
    assert lin.fprop.transform is None and lin.dgrad.transform is None
    assert lin.dgrad.a.stochastic and lin.wgrad.a.stochastic  # SR on gradients
    assert not lin.fprop.a.stochastic and not lin.fprop.b.stochastic
    assert r.keep_last_blocks == 0.15
    assert r.spec_for("layers.9.mlp.up_proj", 9, 10) is None and r.spec_for("layers.0.mlp.up_proj", 0, 10) is lin


def test_hadamard_mxfp4_transforms_every_gemm():
    lin = fp4train.recipes.get("hadamard_mxfp4").linear
    for g in (lin.fprop, lin.dgrad, lin.wgrad):
        assert g.transform == TransformSpec(block=32)
    assert lin.dgrad.a.stochastic and lin.wgrad.a.stochastic and not lin.fprop.a.stochastic


def test_tib2d_matches_paper_004():
    r = fp4train.recipes.get("tib2d")
    lin = r.linear
    assert lin.fprop.b.block == (32, 32) and lin.dgrad.b == lin.fprop.b  # W: one 32x32 quantization
    assert lin.dgrad.a.block == (32, 32) and lin.wgrad.a == lin.dgrad.a  # dY: one 32x32 quantization
    assert lin.fprop.a.block == 32 and lin.wgrad.b.block == 32  # X: 1x32
    assert all(q.scale == "ceil" for g in (lin.fprop, lin.dgrad, lin.wgrad) for q in (g.a, g.b))
    assert lin.dgrad.a.stochastic and not lin.fprop.a.stochastic and not lin.fprop.b.stochastic
    q_spec = r.spec_for("model.layers.3.self_attn.q_proj")
    assert q_spec.fprop.a.format == "mxfp8" and r.spec_for("model.layers.3.self_attn.k_proj").fprop.b.format == "mxfp8"
    assert r.spec_for("model.layers.3.self_attn.v_proj") is lin


def test_lm_head_and_embeddings_stay_high_precision_by_default():
    for n in PRESETS:
        r = fp4train.recipes.get(n)
        assert r.spec_for("lm_head") is None and r.spec_for("model.lm_head") is None
        assert r.spec_for("model.embed_out") is None


def test_a_custom_recipe_in_a_few_lines():
    fp4 = QuantSpec("mxfp4", scale="ceil")
    custom = Recipe(
        name="my_mxfp4_sr",
        linear=LinearSpec(
            fprop=GemmSpec(fp4, fp4),
            dgrad=GemmSpec(QuantSpec("mxfp4", rounding="stochastic"), fp4),
            wgrad=GemmSpec(QuantSpec("mxfp4", rounding="stochastic"), fp4, TransformSpec(block=64)),
        ),
        overrides=(Override("*.down_proj"), Override("lm_head")),
    )
    fp4train.recipes.register(custom, overwrite=True)
    assert fp4train.recipes.get("my_mxfp4_sr") == custom
    assert custom.spec_for("layers.1.mlp.down_proj") is None
    assert Recipe.from_toml(custom.to_toml()) == custom
    with pytest.raises(ValueError, match="exists"):
        fp4train.recipes.register(custom)


def test_recipes_are_frozen_and_hashable():
    r = fp4train.recipes.get("tib2d")
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"
    assert hash(r.linear) == hash(fp4train.recipes.get("tib2d").linear)


def test_shape_problems():
    lin = fp4train.recipes.get("tib2d").linear
    assert lin.shape_problems(64, 96) == []
    assert any("in_features (K)=40" in p for p in lin.shape_problems(40, 64))
    assert any("out_features (N)=48" in p for p in lin.shape_problems(64, 48))
    assert fp4train.recipes.get("fp8_rowwise").linear.shape_problems(7, 9) == []


def test_four_over_six_is_a_recipe_option_on_every_nvfp4_operand_and_on_in_fullstack():
    # Full-Stack FP4 fixes 4/6 for all its experiments: on in its presets
    for name in ("fullstack", "fullstack_qadamw"):
        r = fp4train.recipes.get(name)
        assert r.four_over_six
        spec = r.spec_for("layers.0.attention.wq", 0, 4)
        ops = [q for g in (spec.fprop, spec.dgrad, spec.wgrad) for q in (g.a, g.b)]
        assert all(q.four_over_six for q in ops) and not any(q.four_over_six for g in (r.linear.fprop,) for q in (g.a, g.b))
    assert Recipe.from_dict(r.to_dict()) == r and "four_over_six = true" in r.to_toml()
    plain = fp4train.recipes.get("fullstack").replace(four_over_six=False).spec_for("layers.0.attention.wq", 0, 4)
    assert not any(q.four_over_six for g in (plain.fprop, plain.dgrad, plain.wgrad) for q in (g.a, g.b))
    # it changes the layer's numerics: 4/6 picks per block the scale with the smaller error
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    outs = [fp4train.convert(torch.nn.Sequential(lin), fp4train.recipes.get("nvfp4").replace(four_over_six=f), backend="emulated",
                             numerics="eager")(x) for f in (False, True)]
    exact = lin(x)
    assert (outs[1] - exact).square().sum() < (outs[0] - exact).square().sum()
    with pytest.raises(ValueError, match="four_over_six applies to NVFP4 operands"):
        fp4train.recipes.get("mxfp4").replace(four_over_six=True)
