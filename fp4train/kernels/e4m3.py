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

