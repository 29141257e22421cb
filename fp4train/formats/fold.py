"""Folding MX block scales into FP8 group scales, so MXFP4 GEMMs run on FP8 tensor cores.

Hopper has no FP4 tensor cores, but every E2M1 value is exact in E4M3, and MX scales are powers
of two (docs/methods.md, Hopper execution). For a group of 32-element blocks sharing one FP32 scale - ``1 x 128``
(4 blocks of a row: activations) or ``128 x 128`` (128 rows x 4 blocks: weights) - with block
exponents ``e_b`` and group maximum ``g = max e_b``:

    element in FP8:  f = q * 2**(6 - (g - e_b))     (the group's largest block tops out at 6 * 2**6 = 384 <= 448)
    group scale:     s = 2**(g - 6)                  so that f * s = q * 2**e_b exactly

``f`` is exact in E4M3 while the block's distance ``d = g - e_b <= 14`` (E2M1's smallest step
0.5 * 2**(6 - d) must stay >= E4M3's smallest subnormal 2**-9); farther blocks lose precision or
flush to zero. :func:`fold` counts those elements (nonzero ones only: zeros are always exact)
so a backend can report - or refuse - an inexact GEMM. A group with a NaN block gets a NaN scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import e2m1, e4m3
from .qtensor import QuantizedTensor
from .scales import E8M0_BIAS, E8M0_NAN, pow2

MAX_EXACT_SPAN = 14  # binades between a group's largest block and a block that still folds exactly


@dataclass
class FoldedFP8:
    """An FP8 operand with one FP32 scale per group: ``values = decode(codes) * expand(scales)``."""

    codes: torch.Tensor  # uint8 E4M3 bit patterns, [rows, K]
    scales: torch.Tensor  # float32, [rows / group_rows, K / 128]
    group_rows: int  # 1 (1x128) or 128 (128x128)
    inexact: int | torch.Tensor  # nonzero elements whose folded value differs from the MX value (kernels: a device counter)

    def dequantize(self) -> torch.Tensor:
        s = self.scales.repeat_interleave(self.group_rows, 0)[: self.codes.shape[0]].repeat_interleave(128, 1)
        return e4m3.decode(self.codes) * s


def empty_folded(rows: int, k: int, group_rows: int, *, device=None, like: torch.Tensor | None = None,
                 scale_per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``(codes, scales)`` in :class:`FoldedFP8`'s layout for a ``[rows, k]`` operand:
    uint8 ``[rows, k]`` and float32 ``[ceil(rows / group_rows), k / 128]`` (``scale_per_row``: one
    row of scales per row). The one statement of that geometry, for the kernels that write it and
    for the shapes a compiled graph is traced with (``like``: a tensor whose ``new_empty`` to use,
    fake tensors included)."""
    srows = rows if scale_per_row else -(-rows // group_rows)
    if like is not None:
        return like.new_empty((rows, k), dtype=torch.uint8), like.new_empty((srows, k // 128), dtype=torch.float32)
    return (torch.empty(rows, k, dtype=torch.uint8, device=device),
            torch.empty(srows, k // 128, dtype=torch.float32, device=device))


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 ``2**e`` for integer ``e`` in [-1022, 1023], from the bit pattern (``torch.pow``
    on a GPU need not be exact). Fold shifts reach down to 6 - 255 binades (a NaN group's 128 over
    a zero block's -127)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def fold(q: QuantizedTensor, group_rows: int, *, count_on_device: bool = False) -> FoldedFP8:
    """Fold a 2D MXFP4 tensor (1x32 blocks along its last dim, K % 128 == 0) into FP8 + group scales.
    ``count_on_device``: the inexact count stays a 0-d tensor (no host synchronisation) instead of an int."""
    if q.fmt != "mxfp4" or q.layout.is_2d or q.transposed or q.layout.axis != q.ndim - 1 or q.ndim != 2:
        raise ValueError("fold() takes a 2D MXFP4 tensor with 1x32 blocks along its last dimension")
    rows, k = q.layout.shape
    if k % 128:
        raise ValueError(f"fold() needs the last dim to be a multiple of 128 (1x128 groups), got {k}")
    if group_rows not in (1, 128):
        raise ValueError(f"group_rows must be 1 (1x128 groups) or 128 (128x128 groups), got {group_rows}")
    e = q.scales.to(torch.int32) - E8M0_BIAS  # [rows, K/32]
    nan = q.scales == E8M0_NAN
    # group maximum exponent over (group_rows x 4) blocks
    pad_r = -rows % group_rows
    ep = torch.nn.functional.pad(e, (0, 0, 0, pad_r), value=-(2**20))
    g = ep.reshape(-1, group_rows, k // 128, 4).amax(dim=(1, 3))  # [rows/group_rows, K/128]
    nan_g = torch.nn.functional.pad(nan, (0, 0, 0, pad_r)).reshape(-1, group_rows, k // 128, 4).any(dim=(1, 3))
    g_b = g.repeat_interleave(group_rows, 0)[:rows].repeat_interleave(4, 1)  # per block
    d = g_b - e  # >= 0
    values = e2m1.decode(e2m1.unpack(q.codes))  # [rows, K] element values on the E2M1 grid
    shift = pow2((6 - d).clamp(min=-149)).repeat_interleave(32, 1)
    exact_val = values * shift  # exact in FP32 (a power-of-two shift of a 2-bit value) down to 2**-149
    codes = e4m3.encode(exact_val)  # anything below E4M3's 2**-10 encodes as zero either way
    # the count compares with the true shifted value in FP64: in FP32 a shift past 2**-149 (a NaN
    # group, or blocks > 155 binades apart) would underflow to zero and look exact
    true_val = values.double() * _pow2_f64(6 - d).repeat_interleave(32, 1)
    inexact = ((e4m3.decode(codes).double() != true_val) & (values != 0)).sum()
    inexact = inexact if count_on_device else int(inexact)
    scales = pow2((g - 6).clamp(-149, 127))
    scales = torch.where(nan_g, torch.full_like(scales, float("nan")), scales)
    return FoldedFP8(codes, scales, group_rows, inexact)
