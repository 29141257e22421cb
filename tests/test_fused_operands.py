"""`numerics="compiled"`: operands that a GEMM uses at once are prepared in one compiled
graph (quantize + exact BF16 split) - the layer's outputs and gradients stay bit-identical."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.formats.qtensor import ScaledBF16
from fp4train.linear.operands import FPROP, OP_A, WGRAD, make, prepare
from fp4train.linear.plan import Where, immediate
from fp4train.quantizer import Quantizer
from fp4train.recipes import QuantSpec, TransformSpec


DEV = "cuda" if torch.cuda.is_available() else "cpu"


# Inductor compiles each recipe's graphs for tens of seconds on a CPU: 1x32 MXFP4 and FP8 rowwise on every run,
# 32x32 tiles, Hadamard butterflies and AdaHOP's extraction with --runslow
@pytest.mark.parametrize("recipe", ["mxfp4", "fp8_rowwise",
                                    *(pytest.param(r, marks=pytest.mark.slow) for r in ("tib2d", "hadamard_mxfp4", "adahop-oe"))])
def test_compiled_layer_equals_eager_bit_for_bit(recipe, layer_run, spec_of):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(DEV)
    x = torch.randn(64, 64, device=DEV)
    x[:, 3] *= 20
    x[7] *= 50
    dy = torch.randn(64, 96, device=DEV)
    eager = layer_run(lin, spec_of(recipe), x, dy)
    compiled = layer_run(lin, spec_of(recipe), x, dy, numerics="compiled")
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_an_operand_made_at_once_is_the_scaled_split_of_prepare():
    x = (torch.randn(64, 96) * torch.logspace(-2, 2, 96)).to(DEV)
    q = QuantSpec("nvfp4", rounding="stochastic")
    t = TransformSpec(block=16, random_signs=True)
    kw = dict(axis=0, transform=t, seed=123, gemm=WGRAD, operand=OP_A, compute_dtype=torch.float32)
    ref = prepare(x, q, quantizer=Quantizer(), **kw).scaled_bf16()
    where = Where("compiled", False, x.is_cuda, False)
    prep = immediate(q, t, tuple(x.shape), x.dtype, 0, where)
    assert prep.how == "compiled values"
    got = make(x, prep, q, **kw)
    assert isinstance(got, ScaledBF16) and got.block_axis == 0
    assert torch.equal(got.values, ref.values) and torch.equal(got.divisor, ref.divisor) and got.scale is None
    # eager numerics: the operand is the reference's packed one
    eager = Where("eager", False, x.is_cuda, False)
    prep = immediate(QuantSpec("mxfp4"), None, tuple(x.shape), x.dtype, 1, eager)
    assert prep.how == "reference"
    plain = make(x, prep, QuantSpec("mxfp4"), axis=1, transform=None, seed=0, gemm=FPROP, operand=OP_A, compute_dtype=torch.float32)
    assert isinstance(plain, fp4train.QuantizedTensor)
