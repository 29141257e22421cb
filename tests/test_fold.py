"""MX -> FP8 group-scale folding: exact within 14 binades, inexact elements counted."""

import pytest
import torch

from fp4train import quantize
from fp4train.formats.fold import MAX_EXACT_SPAN, fold


@pytest.mark.parametrize("group_rows", [1, 128])
def test_fold_is_exact_on_ordinary_tensors(group_rows):
    torch.manual_seed(0)
    x = torch.randn(200, 512)
    x[:, ::37] *= 30  # outlier channels: blocks within a group differ by a few binades
    q = quantize(x, "mxfp4")
    f = fold(q, group_rows)
    assert f.inexact == 0
    assert torch.equal(f.dequantize(), q.dequantize(torch.float32))
    assert f.scales.shape == ((200 + group_rows - 1) // group_rows, 4)
    assert torch.isin(f.codes & 0x7F, torch.arange(0, 127, dtype=torch.uint8)).all()  # no NaN codes


@pytest.mark.parametrize("span", range(0, 18))
def test_exact_up_to_14_binades_and_counted_beyond(span):
    # one row, 4 blocks in one 1x128 group: block 0 has exponent 0 (max), block 1 is 2**-span smaller
    x = torch.zeros(1, 128)
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.5, -6.0])
    x[0, :10] = grid
    x[0, 32:42] = grid * 2.0**-span
    q = quantize(x, "mxfp4")
    f = fold(q, 1)
    if span <= MAX_EXACT_SPAN:
        assert f.inexact == 0 and torch.equal(f.dequantize(), q.dequantize(torch.float32))
    else:
        assert f.inexact > 0
        assert not torch.equal(f.dequantize(), q.dequantize(torch.float32))


def test_nan_block_poisons_its_group_and_bad_inputs():
    x = torch.randn(2, 256)
    x[0, 5] = float("nan")
    f = fold(quantize(x, "mxfp4"), 1)
    assert torch.isnan(f.scales[0, 0]) and torch.isfinite(f.scales[0, 1]) and torch.isfinite(f.scales[1]).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        fold(quantize(torch.randn(4, 96), "mxfp4"), 1)
    with pytest.raises(ValueError, match="2D MXFP4 tensor with 1x32 blocks"):
        fold(quantize(torch.randn(4, 128), "nvfp4"), 1)
    with pytest.raises(ValueError, match="group_rows must be 1"):
        fold(quantize(torch.randn(4, 128), "mxfp4"), 64)


def test_blocks_shifted_past_float32s_range_are_counted_inexact():
    """A block 157 binades below its group's top: every nonzero element is shifted below 2**-149
    (E4M3 holds none of them). The count must say so - in FP32 a shifted 0.5 would underflow to
    zero and pass as exact (found when the tile-fold kernel counted 5617 where the reference said 5428)."""
    x = torch.zeros(1, 128)
    grid = torch.tensor([0.5, 1.0, 1.5, -0.5, 6.0])
    x[0, :5] = grid * 2.0**120
    x[0, 32:37] = grid * 2.0**-37
    f = fold(quantize(x, "mxfp4"), 1)
    assert f.inexact == 5 and (f.codes[0, 32:37] & 0x7F == 0).all()
