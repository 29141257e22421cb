"""Every bad input gets an error that says what was wrong and how to fix it."""

import pytest
import torch

import fp4train
from fp4train import hadamard, quantize
from fp4train.recipes import QuantSpec, Recipe, TransformSpec

X = torch.randn(4, 64)

CASES = [
    # (id, call, exception, message pattern)
    ("int dtype", lambda: quantize(torch.ones(4, 32, dtype=torch.int32), "mxfp4"), TypeError,
     r"expects a floating-point tensor .* got torch.int32; convert it first, e.g. x.float\(\)"),
    ("bool dtype", lambda: quantize(torch.ones(4, 32, dtype=torch.bool), "mxfp4"), TypeError, r"got torch.bool"),
    ("fp8 input", lambda: quantize(torch.ones(4, 32).to(torch.float8_e4m3fn), "mxfp4"), TypeError, r"float8_e4m3fn"),
    ("not a tensor", lambda: quantize([1.0, 2.0], "mxfp4"), TypeError, r"expects a torch.Tensor, got list"),
    ("unknown format", lambda: quantize(X, "mxfp5"), ValueError, r"unknown format 'mxfp5'; choose one of \['fp8', 'mxfp4'"),
    ("0-d", lambda: quantize(torch.tensor(1.0), "mxfp4"), ValueError, r"0-d tensor; use x.reshape\(1\)"),
    ("rounding", lambda: quantize(X, "mxfp4", rounding="up"), ValueError, r"unknown rounding 'up'"),
    ("scale rule", lambda: quantize(X, "mxfp4", scale="round"), ValueError, r"unknown scale rule 'round'"),
    ("ceil nvfp4", lambda: quantize(X, "nvfp4", scale="ceil"), ValueError, r"nvfp4 uses e4m3\+fp32 scales, so leave scale='floor'"),
    ("4/6 mxfp4", lambda: quantize(X, "mxfp4", four_over_six=True), ValueError, r"four_over_six is an NVFP4 option"),
    ("seed float", lambda: quantize(X, "mxfp4", rounding="stochastic", seed=1.5), TypeError, r"seed must be an int"),
    ("axis", lambda: quantize(X, "mxfp4", axis=2), ValueError, r"axis=2 is out of range for a tensor with 2 dims"),
    ("odd block", lambda: quantize(X, "mxfp4", block=15), ValueError, r"block size must be an even int >= 2, got 15"),
    ("rect tile", lambda: quantize(X, "mxfp4", block=(16, 32)), ValueError, r"2D blocks must be square, like \(32, 32\)"),
    ("tile on 1D", lambda: quantize(torch.randn(64), "mxfp4", block=(16, 16)), ValueError, r"need a tensor with >= 2 dims"),
    ("fp8 block", lambda: quantize(X, "fp8", block=32), ValueError, r"fp8 is scaled per row; pass block=None"),
    ("fp8 tile", lambda: quantize(X, "fp8", block=(32, 32)), ValueError, r"fp8 is scaled per row; it has no 2D tiles"),
    ("hadamard divisible", lambda: hadamard(torch.randn(4, 48), 32), ValueError,
     r"dimension -1 has size 48, not a multiple of block=32; pad it or pick a block that divides it"),
    ("hadamard block", lambda: hadamard(X, 24), ValueError, r"power of two in \[2, 256\], got 24"),
    ("hadamard int", lambda: hadamard(torch.ones(4, 32, dtype=torch.int64)), TypeError, r"floating-point tensor, got torch.int64"),
    ("hadamard axis", lambda: hadamard(X, 32, axis=3), ValueError, r"axis=3 is out of range"),
    ("recipe name", lambda: fp4train.recipes.get("fp4"), ValueError, r"unknown recipe 'fp4'; available: .*tib2d"),
    ("recipe file", lambda: fp4train.recipes.get("nope.toml"), FileNotFoundError, r"recipe file 'nope.toml' does not exist"),
    ("recipe type", lambda: fp4train.recipes.get(3), TypeError, r"a name, a path or a Recipe, got int"),
    ("recipe suffix", lambda: Recipe.load("r.yaml"), ValueError, r"recipe files are .json or .toml"),
    ("recipe field", lambda: Recipe.from_dict({"name": "x", "lr": 1}), ValueError, r"unknown recipe field\(s\) \['lr'\]"),
    ("spec format", lambda: QuantSpec("int4"), ValueError, r"unknown operand format 'int4'; choose 'bf16' or one of"),
    ("spec ceil", lambda: QuantSpec("nvfp4", scale="ceil"), ValueError, r"scale='ceil' is for MX formats"),
    ("spec block", lambda: QuantSpec("mxfp4", block=(16, 32)), ValueError, r"2D blocks must be square"),
    ("spec fp8 tile", lambda: QuantSpec("fp8", block=(32, 32)), ValueError, r"fp8 is scaled per row"),
    ("transform", lambda: TransformSpec(block=48), ValueError, r"power of two"),
    ("transform kind", lambda: TransformSpec(kind="dct"), ValueError, r"unknown transform 'dct'"),
    ("keep_last", lambda: Recipe("x", keep_last_blocks=1.5), ValueError, r"fraction in \[0, 1\], got 1.5"),
    ("backend", lambda: fp4train.backends.get("fast"), ValueError, r"unknown GEMM backend 'fast'; available: emulated"),
]


@pytest.mark.parametrize("call,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_has_a_clear_error(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
