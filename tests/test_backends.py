"""The emulated backend's BF16 split of quantized operands (its CUDA fast path) is exact."""

import pytest
import torch

import fp4train
from fp4train.backends.emulated import _bf16_factors


def _recompose(op):
    v, row, div = _bf16_factors(op)
    y = v.float()
    if row is not None:
        y = y * row[:, None]
    if div is not None:
        y = y / div
    return v, y


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4", "fp8"])
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_split_recomposes_the_dequantized_operand(fmt, transposed):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-3, 3, 48)[:, None]
    x[5, 7] = float("nan")
    # blocks along the GEMM's inner (last) dimension, directly or through a free transpose
    q = fp4train.quantize(x.T.contiguous(), fmt, axis=0).t() if transposed else fp4train.quantize(x, fmt)
    assert q.block_axis == 1
    v, y = _recompose(q)
    assert v.dtype == torch.bfloat16
    ref = q.dequantize(torch.float32)
    # values split without rounding: BF16 holds them exactly, and they recompose the reference
    # up to one rounding of the outer factor (none at all for MX)
    if fmt.startswith("mx"):
        torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(y, ref, rtol=2**-23, atol=0, equal_nan=True)
    assert torch.isnan(y[5]).any() and torch.isnan(ref[5]).any()


def test_float32_tensors_have_no_split():
    assert _bf16_factors(torch.randn(4, 4)) is None
    assert _bf16_factors(torch.randn(4, 4).bfloat16()) is not None
