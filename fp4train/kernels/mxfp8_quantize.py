"""Fused MXFP8 quantization in Triton: one pass from BF16/FP32 to E4M3 codes + E8M0 scales.

Same signatures and bit-identical results as the reference ``fp4train.quantize(x, "mxfp8", ...)``
(1x32 blocks along the last dim, or 32x32 tiles): the scale exponent from the float's bits
(``floor(log2 amax) - 8``; ``ceil`` one more exactly when the mantissa exceeds 1.75, E4M3's
largest 448 = 1.75 * 2**8), RTNE to E4M3 in integer arithmetic (:mod:`.e4m3`, so the CPU
interpreter agrees too), the reference's stochastic-rounding uniforms, and its NaN/Inf rule (a
block holding one gets the NaN scale 0xFF and zero codes).

Stochastic rounding between the two E4M3 neighbours ``g_lo <= |v| < g_hi`` rounds up with
probability ``(|v| - g_lo) / (g_hi - g_lo)``; the gap is a power of two (2**-9 among subnormals,
2**(E - 3) in binade E), so the division is a multiplication by an exact reciprocal here and an
exact IEEE division in the reference; ``|v| - g_lo`` is exact (Sterbenz). Values are clamped to
448 first, so nothing rounds past the largest finite E4M3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor
from .e4m3 import e4m3_rtne
from .mx_quantize import _keys, _mx_scale_exponent, _pow2, _uniforms

E4M3_EMAX = 8
E4M3_CEIL_MANTISSA_BITS = 0x600000  # 1.75


@triton.jit
def _e4m3_value(code):
    """Float32 value of non-negative E4M3 codes 0..126 (exact)."""
    ex = code >> 3
    man = (code & 7).to(tl.float32)
    return tl.where(ex == 0, man * (1.0 / 512.0), (8.0 + man) * _pow2(ex - 10))


@triton.jit
def _e4m3_codes(v, u, SR: tl.constexpr):
    """E4M3 codes (int32, sign in bit 7) of finite scaled values: RTNE (saturating at 448), or SR
    with uniforms ``u``."""
    a = tl.minimum(tl.abs(v), 448.0)
    near, g_near = e4m3_rtne(a)
    if SR:
        lo = tl.where(g_near > a, near - 1, near)
        lo = tl.minimum(tl.maximum(lo, 0), 126)
        g_lo = _e4m3_value(lo)
        ex = lo >> 3
        inv_gap = _pow2(tl.where(ex == 0, 9, 10 - ex))  # 1 / (g_hi - g_lo), a power of two
        up = (u < (a - g_lo) * inv_gap) & (lo < 126)
        near = lo + up.to(tl.int32)
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit, -0.0 included
    return near | (sign << 7)


@triton.jit(do_not_specialize=["key", "key2"])
def _mxfp8_kernel(
    x_ptr, codes_ptr, scales_ptr,
    n_blocks_row, stride_x, stride_c, stride_s,
    key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, BLOCKS: tl.constexpr,
):
    """``BLOCKS`` consecutive 32-element blocks of one row."""
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)
    bmask = blk < n_blocks_row
    offs = blk[:, None] * 32 + j[None, :]
    m = bmask[:, None]
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")  # False for NaN and Inf
    nan_block = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    amax = tl.max(tl.where(finite, a, 0.0), axis=1)
    e = _mx_scale_exponent(amax, CEIL, E4M3_EMAX, E4M3_CEIL_MANTISSA_BITS)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e: e <= 119, always a normal float
    v = x * inv[:, None]
    u = v  # unused unless SR
    if SR:
        u = _uniforms((row * n_blocks_row + blk)[:, None] * 32 + j[None, :], key, key2)
    code = tl.where(nan_block[:, None], 0, _e4m3_codes(v, u, SR))
    tl.store(codes_ptr + row * stride_c + offs, code.to(tl.uint8), mask=m)
    tl.store(scales_ptr + row * stride_s + blk, tl.where(nan_block, 255, e + 127).to(tl.uint8), mask=bmask)


@triton.jit(do_not_specialize=["key", "key2"])
def _mxfp8_tile_kernel(
    x_ptr, codes_ptr, scales_ptr, R, C, n_tc, stride_x, stride_c, stride_s, key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr,
):
    """One 32x32 tile -> one E8M0 scale and 1024 codes."""
    tr = tl.program_id(0)
    tc = tl.program_id(1)
    r = tr * 32 + tl.arange(0, 32)
    c = tc * 32 + tl.arange(0, 32)
    m = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    nan_tile = tl.max(tl.max(tl.where(finite, 0, 1), axis=1), axis=0) > 0
    amax = tl.max(tl.max(tl.where(finite, a, 0.0), axis=1), axis=0)
    e = _mx_scale_exponent(amax, CEIL, E4M3_EMAX, E4M3_CEIL_MANTISSA_BITS)
    v = x * ((127 - e) << 23).to(tl.float32, bitcast=True)
    u = v
    if SR:
        # the reference's blocked layout: tile (tr, tc) is block tr * n_tc + tc, element (i, j) at i * 32 + j
        i = tl.arange(0, 32)
        u = _uniforms((tr * n_tc + tc) * 1024 + i[:, None] * 32 + i[None, :], key, key2)
    code = tl.where(nan_tile, 0, _e4m3_codes(v, u, SR))
    tl.store(codes_ptr + r[:, None] * stride_c + c[None, :], code.to(tl.uint8))
    tl.store(scales_ptr + tr * stride_s + tc, tl.where(nan_tile, 255, e + 127).to(tl.uint8))


def _check(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.ndim != 2:
        raise ValueError(f"{name} needs a 2D tensor, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} takes float32/bfloat16/float16, got {x.dtype}")
    return x.contiguous()


def quantize_mxfp8(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                   blocks_per_program: int = 4) -> QuantizedTensor:
    """MXFP8 along the last dim of a 2D tensor (last dim a multiple of 32), fused; see the module docstring."""
    x = _check(x, "quantize_mxfp8")
    if x.shape[1] % 32:
        raise ValueError(f"quantize_mxfp8 needs a last dim that is a multiple of 32, got {tuple(x.shape)}")
    if scale not in ("floor", "ceil") or rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad scale {scale!r} or rounding {rounding!r}")
    rows, k = x.shape
    nb = k // 32
    codes = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    sr, key, key2 = _keys(rounding, seed)
    if rows and nb:
        _mxfp8_kernel[(rows, triton.cdiv(nb, blocks_per_program))](
            x, codes, scales, nb, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
            CEIL=scale == "ceil", SR=sr, BLOCKS=blocks_per_program)
    return QuantizedTensor("mxfp8", codes, scales, None, BlockLayout(tuple(x.shape), (32,), 1), x.dtype)


def quantize_mxfp8_2d(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None) -> QuantizedTensor:
    """MXFP8 with 32x32 tiles (transposition-invariant) of a 2D tensor, any shape (padded like the reference)."""
    x = _check(x, "quantize_mxfp8_2d")
    R, C = x.shape
    layout = BlockLayout((R, C), (32, 32), None)
    rp, cp = layout.canonical_shape
    codes = torch.empty(rp, cp, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rp // 32, cp // 32, dtype=torch.uint8, device=x.device)
    sr, key, key2 = _keys(rounding, seed)
    if rp and cp:
        _mxfp8_tile_kernel[(rp // 32, cp // 32)](x, codes, scales, R, C, cp // 32, x.stride(0), codes.stride(0), scales.stride(0),
                                                key, key2, CEIL=scale == "ceil", SR=sr)
    return QuantizedTensor("mxfp8", codes, scales, None, layout, x.dtype)
