"""Packed FP4 (MXFP4 / NVFP4) back to exact BF16 values in Triton: the saved activation's decode.

The quantized linear saves X for the wgrad GEMM packed (two E2M1 codes per byte + one scale per
block); backward needs it as BF16 values for the tensor-core GEMM. One pass: read half a byte
per element and a scale per block, write two bytes - ``e2m1 * 2**e`` (MXFP4, E8M0 scales; NaN
scale -> NaN) or ``e2m1 * sb`` (NVFP4, E4M3 block scales; the FP32 tensor scale stays an outer
divisor). Bit-identical to ``QuantizedTensor.scaled_bf16()``: these products are exact in FP32
and BF16, and never overflow (E8M0 exponents stop at 125).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.qtensor import QuantizedTensor, ScaledBF16
from .mx_quantize import _pow2
from .mx_values import _e2m1_value


@triton.jit
def _e4m3_value(c):
    """Float32 value of a non-negative E4M3 code (0x7F: NaN)."""
    exp = (c >> 3) & 15
    man = (c & 7).to(tl.float32)
    sub = man * (1.0 / 512.0)
    nrm = (1.0 + man * 0.125) * _pow2(exp - 7)
    return tl.where(c == 0x7F, float("nan"), tl.where(exp == 0, sub, nrm))


@triton.jit
def _decode_kernel(codes_ptr, scales_ptr, y_ptr, R, K, sc, ss, sy,
                   BLOCK: tl.constexpr, NV: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    half = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    rmask = r < R
    byte = tl.load(codes_ptr + r[:, None] * sc + half[None, :], mask=rmask[:, None] & (half < K // 2)[None, :], other=0).to(tl.int32)
    code = tl.reshape(tl.join(byte & 15, byte >> 4), [RB, BK])  # element 2j in the low nibble
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    cmask = rmask[:, None] & (c < K)[None, :]
    s = tl.load(scales_ptr + r[:, None] * ss + (c // BLOCK)[None, :], mask=cmask, other=0).to(tl.int32)
    if NV:
        scale = _e4m3_value(s)
    else:
        scale = tl.where(s == 255, float("nan"), _pow2(s - 127))
    val = _e2m1_value(code) * scale
    tl.store(y_ptr + r[:, None] * sy + c[None, :], val.to(y_ptr.dtype.element_ty), mask=cmask)


def decode_fp4_scaled(q: QuantizedTensor) -> ScaledBF16 | None:
    """``q.scaled_bf16()`` through the kernel, for 2D MXFP4/NVFP4 tensors with 1D blocks (either
    axis); None for anything else (the caller falls back to the reference)."""
    if q.fmt not in ("mxfp4", "nvfp4") or q.ndim != 2 or q.layout.is_2d:
        return None
    codes, scales = q.codes, q.scales
    R, half = codes.shape
    K = half * 2
    if not (codes.is_contiguous() and scales.is_contiguous()):
        return None
    y = torch.empty(R, K, dtype=torch.bfloat16, device=codes.device)
    block = q.layout.block[0]
    if R and K:
        rb, bk = 16, 128
        _decode_kernel[(triton.cdiv(R, rb), triton.cdiv(K, bk))](codes, scales, y, R, K, codes.stride(0), scales.stride(0),
                                                                  y.stride(0), BLOCK=block, NV=q.fmt == "nvfp4", RB=rb, BK=bk)
    x = q.layout.from_canonical(y)
    if q.transposed:
        x = x.mT
    return ScaledBF16(x, None, q.tensor_scale if q.fmt == "nvfp4" else None, q.block_axis)
