"""E4M3 round-to-nearest-even in integer arithmetic, for Triton kernels.

``x.to(tl.float8e4nv)`` rounds to nearest-even on the GPU but not in Triton's CPU interpreter, so
kernels that must match the reference bit for bit in CI round E4M3 themselves:

* normal range (``|y| >= 2**-6``): keep 3 of the 23 mantissa bits, ties to even, by adding
  ``0x7FFFF + lsb`` to the float's bits and clearing the low 20 (a carry moves into the exponent);
* subnormal range (step ``2**-9``): ``t = y * 2**9`` is exact; ``(t + 2**23) - 2**23`` rounds it
  to an integer, ties to even, in FP32.

Inputs are finite magnitudes already clamped to ``[0, 448]`` (448 is representable, so rounding
never leaves the range).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_rtne(y):
    """(code int32 in 0..126, value float32) of the E4M3 nearest-even to ``y`` in [0, 448]."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    rb = (bits + 0x7FFFF + lsb) & ~0xFFFFF
    v_norm = rb.to(tl.float32, bitcast=True)
    code_norm = ((((rb >> 23) & 0xFF) - 127 + 7) << 3) | ((rb >> 20) & 7)
    t = (y * 512.0 + 8388608.0) - 8388608.0  # RTNE to an integer multiple of 2**-9
    v_sub = t * (1.0 / 512.0)
    code_sub = t.to(tl.int32)
    sub = y < 0.015625  # 2**-6
    return tl.where(sub, code_sub, code_norm), tl.where(sub, v_sub, v_norm)


@triton.jit
def e4m3_value(code):
    """Float32 value of non-negative E4M3 codes 0..126 (exact)."""
    ex = code >> 3
    man = (code & 7).to(tl.float32)
    normal = ((ex + 117) << 23).to(tl.float32, bitcast=True)  # 2**(ex - 10), ex in 1..15: a normal float
    return tl.where(ex == 0, man * (1.0 / 512.0), (8.0 + man) * normal)


@triton.jit
def e4m3_codes(v, u, SR: tl.constexpr):
    """E4M3 codes (int32, sign in bit 7) of finite values: RTNE saturating at 448, or stochastic
    rounding with uniforms ``u`` - between neighbours ``g_lo <= |v| < g_hi`` up with probability
    ``(|v| - g_lo) / (g_hi - g_lo)``. The gap is a power of two (2**-9 among subnormals, 2**(E - 3)
    in binade E), so the division is an exact multiplication by its reciprocal (the reference's IEEE
    division is exact too), and ``|v| - g_lo`` is exact (Sterbenz)."""
    a = tl.minimum(tl.abs(v), 448.0)
    near, g_near = e4m3_rtne(a)
    if SR:
        lo = tl.where(g_near > a, near - 1, near)
        lo = tl.minimum(tl.maximum(lo, 0), 126)
        g_lo = e4m3_value(lo)
        ex = lo >> 3
        inv_gap = ((127 + tl.where(ex == 0, 9, 10 - ex)) << 23).to(tl.float32, bitcast=True)  # 1 / (g_hi - g_lo)
        up = (u < (a - g_lo) * inv_gap) & (lo < 126)
        near = lo + up.to(tl.int32)
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit, -0.0 included
    return near | (sign << 7)
