"""FP8 rowwise: E4M3 elements with one FP32 scale per row (the Hopper FP8 baseline).

A "row" is every element along the quantization axis (for a GEMM, its inner dimension).
Encode ``s = amax_row / 448`` (FP32), ``q = e4m3(x / s)``; decode ``q * s``. An all-zero row
uses ``s = 1``; a row holding NaN/Inf gets ``s = NaN`` (decodes to NaN).
"""

from __future__ import annotations

import torch

from . import e4m3
from .ieee import div, true_div


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Row scales from the rows' finite amax (FP32): ``amax / 448`` rounded once, 1 for an all-zero row.
    The clamp: amax / 448 must not underflow to 0 for a nonzero row (x / 0 would be Inf)."""
    return torch.where(amax == 0, torch.ones_like(amax), div(amax, e4m3.E4M3_MAX).clamp(min=2.0**-149))


def encode_rows(xr: torch.Tensor, *, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(*rows, n)`` -> (E4M3 codes, FP32 scales ``(*rows, 1)``)."""
    finite = torch.isfinite(xr)
    nan_row = ~finite.all(dim=-1, keepdim=True)
    amax = torch.where(finite, xr.abs(), torch.zeros_like(xr)).amax(dim=-1, keepdim=True)
    s = scale_from_amax(amax)
    v = true_div(xr, s)
    codes = e4m3.encode(v) if u is None else e4m3.encode_stochastic(v, u)
    s = torch.where(nan_row, torch.full_like(s, float("nan")), s)
    return codes, s
