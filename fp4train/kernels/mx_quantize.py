"""Fused MXFP4 quantization in Triton: one pass from BF16/FP32 to packed E2M1 codes + E8M0 scales.

Same signature and bit-identical results as the reference ``fp4train.quantize(x, "mxfp4",
axis=-1, scale=..., rounding=..., seed=...)`` for a 2D tensor whose last dim is a multiple of 32
(the case of every GEMM operand after the layer's own padding): same scale rule (exponent from
the float's bits; ``ceil`` one more exactly when the mantissa exceeds 1.5), same RTNE threshold
table, same stochastic-rounding uniforms (the counter hash of :mod:`fp4train.counter_rng`,
recomputed in-kernel from the element's blocked index), same NaN/Inf rule (a block holding one
gets the NaN scale 0xFF and zero codes).

One program quantizes ``BLOCKS`` consecutive 32-element blocks of one row: it reads each element
once and writes half a byte per element plus one scale byte per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import counter_rng
from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor

_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


@triton.jit
def _lowbias32(x):
    """counter_rng.lowbias32 on uint32 (products wrap mod 2**32, as the reference's masked ones)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit(do_not_specialize=["key", "key2"])
def _mxfp4_kernel(
    x_ptr, codes_ptr, scales_ptr,
    n_blocks_row, stride_x, stride_c, stride_s,
    key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, BLOCKS: tl.constexpr,
):
    row = tl.program_id(0)
    b0 = tl.program_id(1) * BLOCKS
    blk = b0 + tl.arange(0, BLOCKS)  # block index within the row
    j = tl.arange(0, 32)
    bmask = blk < n_blocks_row
    offs = blk[:, None] * 32 + j[None, :]
    m = bmask[:, None]
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)

    a = tl.abs(x)
    finite = a < float("inf")  # False for NaN and Inf
    nan_block = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    amax = tl.max(tl.where(finite, a, 0.0), axis=1)

    # E8M0 exponent: floor(log2 amax) - 2 from the float's bits; subnormal/zero amax clamps to -127
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 2
    if CEIL:
        e = e + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # mantissa > 1.5: amax > 6 * 2**e
    e = tl.where(bits < 0x00800000, -127, e)
    e = tl.minimum(tl.maximum(e, -127), 125)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, always a normal float here
    v = x * inv[:, None]
    av = tl.abs(v)

    if SR:
        idx = ((row * n_blocks_row + blk)[:, None] * 32 + j[None, :]).to(tl.uint32)
        h = _lowbias32(_lowbias32(idx ^ key.to(tl.uint32)) ^ key2.to(tl.uint32))
        u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        ac = tl.minimum(av, 6.0)
        lo = ((ac >= 0.5).to(tl.int32) + (ac >= 1.0).to(tl.int32) + (ac >= 1.5).to(tl.int32) + (ac >= 2.0).to(tl.int32)
              + (ac >= 3.0).to(tl.int32) + (ac >= 4.0).to(tl.int32) + (ac >= 6.0).to(tl.int32))
        lo = tl.minimum(lo, 6)
        g_lo = tl.where(lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo == 4, 2.0, tl.where(lo == 5, 3.0, 4.0)))
        step = tl.where(lo < 4, 0.5, tl.where(lo < 6, 1.0, 2.0))  # grid gaps: 0.5 up to 2, 1 up to 4, then 2
        p = (ac - g_lo) / step
        idx4 = lo + (u < p).to(tl.int32)
    else:
        idx4 = ((av > 0.25).to(tl.int32) + (av >= 0.75).to(tl.int32) + (av > 1.25).to(tl.int32) + (av >= 1.75).to(tl.int32)
                + (av > 2.5).to(tl.int32) + (av >= 3.5).to(tl.int32) + (av > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit, -0.0 included
    code = idx4 | (sign << 3)
    code = tl.where(nan_block[:, None], 0, code)

    pairs = tl.reshape(code, [BLOCKS, 16, 2])
    c_lo, c_hi = tl.split(pairs)
    packed = (c_lo | (c_hi << 4)).to(tl.uint8)
    poffs = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(codes_ptr + row * stride_c + poffs, packed, mask=m)
    sbyte = tl.where(nan_block, 255, e + 127).to(tl.uint8)
    tl.store(scales_ptr + row * stride_s + blk, sbyte, mask=bmask)


def quantize_mxfp4(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                   blocks_per_program: int = 4) -> QuantizedTensor:
    """MXFP4 along the last dim of a 2D tensor (last dim a multiple of 32), fused; see the module docstring."""
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_mxfp4 needs a 2D tensor whose last dim is a multiple of 32, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_mxfp4 takes float32/bfloat16/float16, got {x.dtype}")
    if scale not in ("floor", "ceil") or rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad scale {scale!r} or rounding {rounding!r}")
    x = x.contiguous()
    rows, k = x.shape
    nb = k // 32
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    sr = rounding == "stochastic"
    if sr and seed is None:
        seed = counter_rng.fresh_seed()
    s = int(seed or 0)
    key = (s * _GOLDEN) & _MASK32
    key2 = ((s >> 32) ^ 0x85EBCA6B) & _MASK32
    grid = (rows, triton.cdiv(nb, blocks_per_program))
    if rows and nb:
        _mxfp4_kernel[grid](x, codes, scales, nb, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
                            CEIL=scale == "ceil", SR=sr, BLOCKS=blocks_per_program)
    layout = BlockLayout(tuple(x.shape), (32,), 1)
    return QuantizedTensor("mxfp4", codes, scales, None, layout, x.dtype)
