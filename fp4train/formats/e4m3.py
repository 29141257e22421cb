"""FP8 E4M3 (``float8_e4m3fn``): the element of MXFP8/FP8 and the block scale of NVFP4.

1 sign, 4 exponent (bias 7), 3 mantissa bits; largest finite 448, smallest subnormal 2**-9;
no Inf, one NaN pattern per sign (``0x7F``/``0xFF``). We round to nearest-even through
PyTorch's cast, but never let the cast decide out-of-range behaviour: PyTorch versions
differ there (some saturate, some give NaN, and some turn Inf into 448). So values are
clamped to +-448 first, and NaN/Inf are routed explicitly to the NaN code.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F
E4M3_MAX_CODE = 0x7E  # 448; positive codes are ordered like their values, so code + 1 is the next value up


def encode(v: torch.Tensor) -> torch.Tensor:
    """Float32 -> E4M3 bit patterns (uint8): RTNE, saturating at +-448, NaN/Inf -> NaN code."""
    r = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # the cast rounds (RTNE)
    codes = encode_fields(r.to(torch.float32)) if torch.compiler.is_compiling() else r.view(torch.uint8)
    return torch.where(torch.isfinite(v), codes, torch.full_like(codes, E4M3_NAN_CODE))


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) -> float32."""
    return decode_fields(codes) if torch.compiler.is_compiling() else codes.view(torch.float8_e4m3fn).to(torch.float32)


def encode_fields(r: torch.Tensor) -> torch.Tensor:
    """The codes (uint8) of float32 values ``r`` that are each exactly an E4M3 value, from the sign, exponent and
    mantissa fields, with comparisons and selections of constants only (exact on every device). Compiled code takes
    this path and :func:`decode_fields`, not a byte view: the same bits, fused all the same, and it runs under
    ``torch.vmap`` (the multi-tensor optimizer updates), which has no batching rule for ``Tensor.view(dtype)`` before
    PyTorch 2.13. Eager code keeps the view, an order of magnitude faster there."""
    return _magnitude_code(r.abs()).to(torch.uint8) | (torch.signbit(r).to(torch.uint8) << 7)


def decode_fields(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) -> float32 from the sign, exponent and mantissa fields (see :func:`encode_fields`)."""
    c = codes.to(torch.int32)
    exp, mant = (c >> 3) & 15, (c & 7).to(torch.float32)
    unit = torch.full_like(mant, 2.0**-9)  # 2**(exp - 10): the value of one mantissa step (the subnormals' too)
    for f in range(2, 16):
        unit = torch.where(exp == f, 2.0 ** (f - 10), unit)
    a = torch.where(exp == 0, mant, mant + 8) * unit
    a = torch.where((c & 0x7F) == E4M3_NAN_CODE, torch.full_like(a, float("nan")), a)
    return torch.where(c >= 128, -a, a)


def _magnitude_code(a: torch.Tensor) -> torch.Tensor:
    """The 7-bit code (int32) of E4M3 magnitudes ``a`` (float32, each exactly an E4M3 value, at most 448)."""
    # the exponent e and 2**-e by comparisons with constants, exact on every device (no log2 or exp2 to round),
    # and a product with 2**-e rather than a quotient by 2**e (GPU code may divide approximately)
    e, inv_scale = torch.full_like(a, -6.0), torch.full_like(a, 2.0**6)
    for k in range(-5, 9):
        above = a >= 2.0**k
        e, inv_scale = e + above.to(a.dtype), torch.where(above, 2.0**-k, inv_scale)
    code = torch.where(a >= 2.0**-6, (e + 7) * 8 + a * inv_scale * 8 - 8, a * 2.0**9)  # else subnormal or zero
    return code.to(torch.int32)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to the nearest E4M3 value (RTNE, saturating), as float32."""
    return decode(encode(v))


def encode_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Float32 -> E4M3 codes with stochastic rounding driven by uniforms ``u`` in [0, 1).

    Positive E4M3 codes 0..126 are ordered by magnitude, so the two neighbours of ``|v|`` are
    adjacent codes: find the nearest code, step down one if it lies above ``|v|``, and round
    up with probability proportional to the distance. Saturates at 448; NaN/Inf -> NaN code.
    """
    a = v.abs().clamp(max=E4M3_MAX)
    near = encode(a).to(torch.int32)
    lo = torch.where(decode(near.to(torch.uint8)) > a, near - 1, near).clamp(0, 126)
    hi = (lo + 1).clamp(max=126)
    g_lo = decode(lo.to(torch.uint8))
    g_hi = decode(hi.to(torch.uint8))
    step = torch.where(hi > lo, g_hi - g_lo, torch.ones_like(g_lo))
    up = (u < (a - g_lo) / step) & (hi > lo)
    codes = (lo + up.to(lo.dtype)).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 7)
    return torch.where(torch.isfinite(v), codes, torch.full_like(codes, E4M3_NAN_CODE))
