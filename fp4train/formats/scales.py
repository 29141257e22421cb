"""Power-of-two (E8M0) block scales for the MX formats.

An E8M0 scale is ``2**e`` with ``e`` in [-127, 127], stored as the biased byte ``e + 127``;
the byte ``0xFF`` is NaN. For a block with largest magnitude ``amax`` and an element format
whose largest value is ``emax_value = m * 2**emax`` (E2M1: 6 = 1.5 * 2**2; E4M3: 448 = 1.75 * 2**8):

* ``floor`` (OCP MX v1.0): ``e = floor(log2(amax)) - emax``. Then ``amax / 2**e`` lies in
  ``[2**emax, 2**(emax+1))``, so values above ``emax_value * 2**e`` are clipped.
* ``ceil`` (truncation-free, arXiv 2607.24953): the smallest ``e`` with ``amax <= emax_value * 2**e``,
  i.e. ``2**ceil(log2(amax / emax_value))``. Nothing clips.

Both are computed exactly from ``frexp`` (no ``log2``, whose rounding could be off by one
near powers of two): ``amax = f * 2**E`` with ``f`` in [0.5, 1), so ``floor(log2 amax) = E - 1``,
and ``ceil`` is one more than ``floor`` exactly when ``2f > m``.

Edge cases (decided here, tested in ``tests/test_formats.py``):
* an all-zero block gets the smallest scale ``2**-127`` and all-zero codes;
* ``e`` is clamped to ``[-127, emax_cap]``: tiny blocks (amax below about 2**-125) lose
  precision or flush to zero, and ``emax_cap`` keeps ``emax_value * 2**e`` finite in FP32
  (so huge blocks clip like ``floor`` instead of dequantizing to Inf);
* a block holding NaN or Inf gets the NaN scale ``0xFF`` and dequantizes to all-NaN
  (the OCP MX rule), so non-finite input never becomes silently finite.
"""

from __future__ import annotations

import enum

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127


class ScaleRule(str, enum.Enum):
    """How an MX block scale is chosen from the block's largest magnitude."""

    FLOOR = "floor"
    """OCP rule: ``2**(floor(log2 amax) - emax)``; clips values above ``max * scale``."""
    CEIL = "ceil"
    """Truncation-free: the smallest power of two with ``amax <= max * scale``; never clips."""


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for integer ``e`` in [-149, 127], built from the bit pattern."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def e8m0_exponent(amax: torch.Tensor, *, emax: int, emax_mantissa: float, rule: ScaleRule) -> torch.Tensor:
    """Unbiased scale exponent (int32) per block from its float32 ``amax`` (>= 0, finite)."""
    f, E = torch.frexp(amax)
    e = E - 1 - emax  # floor(log2(amax)) - emax
    if ScaleRule(rule) is ScaleRule.CEIL:
        e = e + (2.0 * f > emax_mantissa).to(e.dtype)
    # keep emax_value * 2**e finite in FP32 (< 2**128): m * 2**(emax + e) with m < 2 needs
    # emax + e <= 127. Only ``ceil`` on blocks near the FP32 maximum reaches this cap.
    e = e.clamp(E8M0_MIN_EXP, 127 - emax)
    return torch.where(amax == 0, torch.full_like(e, E8M0_MIN_EXP), e)


def encode_e8m0(e: torch.Tensor, nan_mask: torch.Tensor) -> torch.Tensor:
    """Unbiased exponents -> E8M0 bytes, ``0xFF`` where ``nan_mask``."""
    biased = (e + E8M0_BIAS).to(torch.uint8)
    return torch.where(nan_mask, torch.full_like(biased, E8M0_NAN), biased)


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 scales (NaN for ``0xFF``)."""
    s = pow2(scales.to(torch.int32) - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(s, float("nan")), s)
