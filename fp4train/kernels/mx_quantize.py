"""Fused MX quantization in Triton: one pass from BF16/FP32 to element codes + E8M0 scales.

MXFP4 (E2M1 codes packed two per byte) and MXFP8 (E4M3 codes, a byte each), in 1x32 blocks along
the last dim, 32x1 blocks along dim 0 (the column kernel: read in place, stored transposed as the reference
stores them) or 32x32 tiles, with the same signatures and bit-identical results as the reference
``fp4train.quantize(x, "mxfp4" | "mxfp8", ...)`` for 2D tensors (1x32: last dim a multiple of 32,
the case of every GEMM operand after the layer's own padding): same scale rule (exponent from the
float's bits; ``ceil`` one more exactly when the mantissa exceeds the element's largest, 1.5 for
E2M1 and 1.75 for E4M3), same rounding (E2M1's RTNE threshold table; E4M3 RTNE in integers,
:mod:`.e4m3`), same stochastic-rounding uniforms (the counter hash of :mod:`fp4train.counter_rng`,
recomputed in-kernel from the element's blocked index), same NaN/Inf rule (a block holding one
gets the NaN scale 0xFF and zero codes). The element type is a constexpr (``ELEM``) of one kernel
per geometry; ``quantize_mxfp4_dual`` writes both layouts of X from one read.

A 1x32 program quantizes ``BLOCKS`` consecutive 32-element blocks of one row: it reads each
element once and writes its code plus one scale byte per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import counter_rng
from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor
from .e4m3 import e4m3_codes


@triton.jit
def _lowbias32(x):
    """counter_rng.lowbias32 on uint32 (products wrap mod 2**32, as the reference's masked ones)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _pow2(k):
    """float32 2**k for integer k in [-149, 127], built from the bit pattern (subnormals too, without
    arithmetic that a flush-to-zero mode could touch)."""
    normal = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def _with_sign(mag, neg):
    """``mag`` (float32, >= 0 or NaN) with its sign bit set where ``neg``, by bits, so that a negative
    zero code decodes to ``-0.0`` whatever the compiler makes of negating a zero (the sign-checking decode test)."""
    return (mag.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _mx_scale_exponent(amax, CEIL: tl.constexpr, EMAX: tl.constexpr, CEIL_MANTISSA_BITS: tl.constexpr):
    """E8M0 exponent from the bits of a finite amax: floor(log2 amax) - EMAX (+1 for ceil when the
    mantissa bits exceed those of the element's largest value, e.g. 1.5 -> 0x400000 for E2M1,
    1.75 -> 0x600000 for E4M3); zero/subnormal amax and the clamp to [-127, 127 - EMAX] as in
    formats/scales.py."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - EMAX
    if CEIL:
        e = e + ((bits & 0x7FFFFF) > CEIL_MANTISSA_BITS).to(tl.int32)
    e = tl.where(bits < 0x00800000, -127, e)
    return tl.minimum(tl.maximum(e, -127), 127 - EMAX)


@triton.jit
def _scale_exponent(amax, CEIL: tl.constexpr):
    """The MXFP4 (E2M1: emax 2, largest mantissa 1.5) E8M0 exponent."""
    return _mx_scale_exponent(amax, CEIL, 2, 0x400000)


E2M1, E4M3 = 0, 1  # the ELEM constexpr of the MX kernels: MXFP4 or MXFP8


@triton.jit
def _mx_exponent(amax, CEIL: tl.constexpr, ELEM: tl.constexpr):
    """The E8M0 exponent for MXFP4 (ELEM 0) or MXFP8 (ELEM 1: E4M3, emax 8, largest mantissa 1.75)."""
    if ELEM == 0:
        e = _mx_scale_exponent(amax, CEIL, 2, 0x400000)
    else:
        e = _mx_scale_exponent(amax, CEIL, 8, 0x600000)
    return e


@triton.jit
def _mx_store_codes(code_ptr, row_offs, col0, v, u, keep, mask, SR: tl.constexpr, ELEM: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr):
    """Round scaled elements ``v`` [ROWS, COLS] (columns ``col0 ..``) onto the element grid and store
    their codes (zero where ``keep`` is False): E2M1 packed two per byte (element 2j in the low nibble),
    E4M3 one byte each. ``row_offs``: the rows' offsets in ``code_ptr`` ([ROWS, 1])."""
    if ELEM == 0:
        code = tl.where(keep, _e2m1_codes(v, u, SR), 0)
        lo, hi = tl.split(tl.reshape(code, [ROWS, COLS // 2, 2]))
        pmask = tl.max(tl.reshape(mask.to(tl.int32), [ROWS, COLS // 2, 2]), axis=2) > 0  # a pair is in or out together
        pc = col0 // 2 + tl.arange(0, COLS // 2)
        tl.store(code_ptr + row_offs + pc[None, :], (lo | (hi << 4)).to(tl.uint8), mask=pmask)
    else:
        code = tl.where(keep, e4m3_codes(v, u, SR), 0)
        tl.store(code_ptr + row_offs + (col0 + tl.arange(0, COLS))[None, :], code.to(tl.uint8), mask=mask)


@triton.jit
def _e2m1_codes(v, u, SR: tl.constexpr):
    """E2M1 codes (int32, sign in bit 3) of scaled values: RTNE thresholds, or SR with uniforms u."""
    av = tl.abs(v)
    if SR:
        # up by one grid step with probability (ac - g_lo) / gap, g_lo the grid point at or below ac. From 1 up,
        # g_lo is ac's float with one mantissa bit kept, its code (exponent, that bit) - 252, and the gap
        # 2**(E - 1): its exact reciprocal 2**(1 - E) from the exponent bits, so the product is the same float
        # as the reference's division (both round one real number once). At ac = 6 (saturated) this gives
        # code 7 with probability 0 of going up, where the reference steps up from 4 with probability 1.
        ac = tl.minimum(av, 6.0)
        bits = ac.to(tl.int32, bitcast=True)
        ge1 = ac >= 1.0
        half = ac >= 0.5
        g_lo = tl.where(ge1, (bits & 0x7FC00000).to(tl.float32, bitcast=True), tl.where(half, 0.5, 0.0))
        inv_gap = tl.where(ge1, ((255 - (bits >> 23)) << 23).to(tl.float32, bitcast=True), 2.0)
        lo = tl.where(ge1, (bits >> 22) - 252, half.to(tl.int32))
        idx4 = lo + (u < (ac - g_lo) * inv_gap).to(tl.int32)
    else:
        # RTNE onto the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to the even code): from 1 up, round the FP32
        # bits to one mantissa bit - (exponent, mantissa bit) is then the code: 1.0 -> 2 ... 6.0 -> 7, and
        # 8 or more saturates at 7; below 1 the two thresholds 0.25 (tie -> 0) and 0.75 (tie -> 1.0)
        bits = av.to(tl.int32, bitcast=True)
        big = tl.minimum(((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - (126 << 1), 7)
        small = (av > 0.25).to(tl.int32) + (av >= 0.75).to(tl.int32)
        idx4 = tl.where(av >= 1.0, big, small)
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit, -0.0 included
    return idx4 | (sign << 3)


@triton.jit
def _even_odd(x_ptr, even, mask, mask_odd, BF16_PAIRS: tl.constexpr):
    """The elements at offsets ``even`` and ``even + 1`` of x as float32 ``(xe, xo)`` (masked ones 0):
    the even/odd kernels hold a block as its even and its odd elements, so that the two codes of a byte are
    computed side by side and packed without a reshape or split (a layout change). ``BF16_PAIRS``: BF16 input
    with even offsets, read as one 32-bit word per pair (the even element in the low half: little endian) and
    widened by shifts; a pair is then in or out together (``mask``)."""
    if BF16_PAIRS:
        w = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + (even >> 1), mask=mask, other=0)
        xe = (w << 16).to(tl.float32, bitcast=True)
        xo = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        xe = tl.load(x_ptr + even, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + even + 1, mask=mask_odd, other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def _uniforms(idx, key, key2):
    """counter_rng.uniform for flat blocked indices ``idx``."""
    h = _lowbias32(_lowbias32(idx.to(tl.uint32) ^ key.to(tl.uint32)) ^ key2.to(tl.uint32))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _kernel_keys(key, key2, KEYS_PTR: tl.constexpr):
    """The stochastic-rounding keys a kernel hashes with: the host ints ``key``, ``key2`` as launched, or
    (``KEYS_PTR``) the pair ``[key, key2]`` read from the int64 tensor ``key`` points to - a seed that lives on
    the device (:func:`fp4train.counter_rng.seed_keys_tensor`), so that a CUDA graph replays fresh draws."""
    if KEYS_PTR:
        k1 = tl.load(key)
        k2 = tl.load(key + 1)
    else:
        k1 = key
        k2 = key2
    return k1, k2


@triton.jit(do_not_specialize=["key", "key2"])
def _mx_kernel(
    x_ptr, codes_ptr, scales_ptr,
    n_blocks_row, stride_x, stride_c, stride_s,
    key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, BLOCKS: tl.constexpr, ELEM: tl.constexpr,
    KEYS_PTR: tl.constexpr = False,
):
    """``BLOCKS`` consecutive 32-element blocks of one row."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
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

    e = _mx_exponent(amax, CEIL, ELEM)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, always a normal float here
    v = x * inv[:, None]
    u = v  # unused unless SR
    if SR:
        u = _uniforms((row * n_blocks_row + blk)[:, None] * 32 + j[None, :], key, key2)
    # blocks [BLOCKS, 32] stored as one row of BLOCKS * 32 elements from column b0 * 32
    _mx_store_codes(codes_ptr, row * stride_c, b0 * 32, tl.reshape(v, [1, BLOCKS * 32]), tl.reshape(u, [1, BLOCKS * 32]),
                    tl.reshape(tl.broadcast_to(~nan_block[:, None], [BLOCKS, 32]), [1, BLOCKS * 32]),
                    tl.reshape(tl.broadcast_to(m, [BLOCKS, 32]), [1, BLOCKS * 32]), SR, ELEM, 1, BLOCKS * 32)
    sbyte = tl.where(nan_block, 255, e + 127).to(tl.uint8)
    tl.store(scales_ptr + row * stride_s + blk, sbyte, mask=bmask)


@triton.jit(do_not_specialize=["key", "key2"])
def _mxfp4_pairs_kernel(
    x_ptr, codes_ptr, scales_ptr,
    n_blocks_row, stride_x, stride_c, stride_s,
    key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, BLOCKS: tl.constexpr, BF16_PAIRS: tl.constexpr,
    KEYS_PTR: tl.constexpr = False,
):
    """MXFP4 of ``BLOCKS`` consecutive 32-element blocks of one row, as :func:`_mx_kernel` (the same bits),
    with each block held as its even and its odd elements, two [BLOCKS, 16] tensors (:func:`_even_odd`, the
    32x32 tile kernel's way): no reshape and split to pack the codes as :func:`_mx_store_codes` does."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # block index within the row
    h = tl.arange(0, 16)[None, :]  # pair within the block
    bmask = blk < n_blocks_row
    m = bmask[:, None]
    xe, xo = _even_odd(x_ptr, row * stride_x + blk[:, None] * 32 + 2 * h, m, m, BF16_PAIRS)
    ae, ao = tl.abs(xe), tl.abs(xo)
    fin_e, fin_o = ae < float("inf"), ao < float("inf")  # False for NaN and Inf
    nan_block = tl.max(tl.where(fin_e & fin_o, 0, 1), axis=1) > 0
    amax = tl.max(tl.maximum(tl.where(fin_e, ae, 0.0), tl.where(fin_o, ao, 0.0)), axis=1)
    e = _mx_exponent(amax, CEIL, 0)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**-e, always a normal float here
    ve, vo = xe * inv, xo * inv
    ue, uo = ve, vo  # unused unless SR
    if SR:  # the reference's indices: element (row, 32 * blk + j) is row * K + 32 * blk + j
        idx = (row * n_blocks_row + blk)[:, None] * 32 + 2 * h
        ue, uo = _uniforms(idx, key, key2), _uniforms(idx + 1, key, key2)
    keep = ~nan_block[:, None]
    lo = tl.where(keep, _e2m1_codes(ve, ue, SR), 0)
    hi = tl.where(keep, _e2m1_codes(vo, uo, SR), 0)
    tl.store(codes_ptr + row * stride_c + blk[:, None] * 16 + h, (lo | (hi << 4)).to(tl.uint8), mask=m)
    tl.store(scales_ptr + row * stride_s + blk, tl.where(nan_block, 255, e + 127).to(tl.uint8), mask=bmask)


def _check(name: str, x: torch.Tensor, scale: str, rounding: str) -> torch.Tensor:
    if x.ndim != 2:
        raise ValueError(f"{name} needs a 2D tensor, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} takes float32/bfloat16/float16, got {x.dtype}")
    if scale not in ("floor", "ceil") or rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad scale {scale!r} or rounding {rounding!r}")
    return x.contiguous()


# (blocks per program, warps) of the 1D MX kernel by format: the fastest measured on the
# H200 (16384 x 8192 BF16): MXFP4 64 blocks, 4 warps
# (nearest 0.274 ms, stochastic 0.438 ms; the earlier 4 blocks 0.752 / 0.948 ms), MXFP8 32 blocks, 4 warps (0.269 ms;
# 4 blocks 0.748 ms). MXFP4 runs the even/odd-element kernel by default: at 64 blocks, 4 warps it took
# 0.272 / 0.422 ms against 0.299 / 0.467 for the kernel that packs by reshape at that launch and 0.292 / 0.427 at its
# best (32 blocks).
MX1D_LAUNCH = {"mxfp4": (64, 4), "mxfp8": (32, 4)}


def _quantize_1d(fmt: str, x, scale, rounding, seed, blocks_per_program=None, num_warps=None, pairs=True) -> QuantizedTensor:
    name = f"quantize_{fmt}"
    if x.ndim == 2 and x.shape[1] % 32:
        raise ValueError(f"{name} needs a 2D tensor whose last dim is a multiple of 32, got {tuple(x.shape)}")
    x = _check(name, x, scale, rounding)
    rows, k = x.shape
    nb = k // 32
    elem = E2M1 if fmt == "mxfp4" else E4M3
    codes = torch.empty(rows, k // 2 if elem == E2M1 else k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    bp, warps = blocks_per_program or MX1D_LAUNCH[fmt][0], num_warps or MX1D_LAUNCH[fmt][1]
    if bp < 1 or bp & (bp - 1):
        raise ValueError(f"{name}: blocks_per_program must be a power of two, got {bp}")
    if rows and nb and pairs and elem == E2M1:
        bf16_pairs = x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0  # rows are even (k % 32 == 0)
        _mxfp4_pairs_kernel[(rows, triton.cdiv(nb, bp))](
            x, codes, scales, nb, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
            CEIL=scale == "ceil", SR=sr, BLOCKS=bp, BF16_PAIRS=bf16_pairs, KEYS_PTR=kp, num_warps=warps)
    elif rows and nb:
        _mx_kernel[(rows, triton.cdiv(nb, bp))](
            x, codes, scales, nb, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
            CEIL=scale == "ceil", SR=sr, BLOCKS=bp, ELEM=elem, KEYS_PTR=kp, num_warps=warps)
    return QuantizedTensor(fmt, codes, scales, None, BlockLayout(tuple(x.shape), (32,), 1), x.dtype)


def quantize_mxfp4(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                   blocks_per_program: int | None = None, num_warps: int | None = None, pairs: bool = True) -> QuantizedTensor:
    """MXFP4 along the last dim of a 2D tensor (last dim a multiple of 32), fused; see the module docstring.
    ``blocks_per_program`` (a power of two) / ``num_warps``: launch tuning (:data:`MX1D_LAUNCH`), the same bits.
    ``pairs``: the even/odd-element kernel (:func:`_mxfp4_pairs_kernel`, the default: 4-10% faster on the H200) or, if False, :func:`_mx_kernel`, which packs codes by a reshape; the same bits."""
    return _quantize_1d("mxfp4", x, scale, rounding, seed, blocks_per_program, num_warps, pairs)


def quantize_mxfp8(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                   blocks_per_program: int | None = None, num_warps: int | None = None) -> QuantizedTensor:
    """MXFP8 (E4M3 elements, one code byte each) along the last dim, as :func:`quantize_mxfp4`."""
    return _quantize_1d("mxfp8", x, scale, rounding, seed, blocks_per_program, num_warps)


@triton.jit(do_not_specialize=["key_r", "key2_r", "key_c", "key2_c"])
def _mxfp4_dual_kernel(
    x_ptr, rc_ptr, rs_ptr, cc_ptr, cs_ptr,
    M, K, stride_x, stride_rc, stride_rs, stride_cc, stride_cs,
    key_r, key2_r, key_c, key2_c,
    CEIL_R: tl.constexpr, SR_R: tl.constexpr, CEIL_C: tl.constexpr, SR_C: tl.constexpr, NB: tl.constexpr,
    KEYS_PTR_R: tl.constexpr = False, KEYS_PTR_C: tl.constexpr = False,
):
    """One read of a [32, 32*NB] tile -> MXFP4 along K (rows) and along M (columns)."""
    key_r, key2_r = _kernel_keys(key_r, key2_r, KEYS_PTR_R)  # host ints, or device seeds' keys (CUDA graphs)
    key_c, key2_c = _kernel_keys(key_c, key2_c, KEYS_PTR_C)
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    BK: tl.constexpr = 32 * NB
    i = tl.arange(0, 32)
    kk = pk * BK + tl.arange(0, BK)
    m = pm * 32 + i
    kmask = kk < K
    x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    af = tl.where(finite, a, 0.0)
    bad = tl.where(finite, 0, 1)

    # ---- along K: 1x32 blocks of each row (the fprop layout) ----
    af3 = tl.reshape(af, [32, NB, 32])
    amax_r = tl.max(af3, axis=2)
    nan_r = tl.max(tl.reshape(bad, [32, NB, 32]), axis=2) > 0
    e_r = _scale_exponent(amax_r, CEIL_R)
    inv_r = ((127 - e_r) << 23).to(tl.float32, bitcast=True)
    v_r = tl.reshape(tl.reshape(x, [32, NB, 32]) * inv_r[:, :, None], [32, BK])
    u_r = v_r
    if SR_R:
        u_r = _uniforms(m[:, None] * K + kk[None, :], key_r, key2_r)  # blocked index of axis=-1: m*K + k
    code_r = _e2m1_codes(v_r, u_r, SR_R)
    nan_r_el = tl.reshape(tl.broadcast_to(nan_r[:, :, None], [32, NB, 32]), [32, BK])
    code_r = tl.where(nan_r_el, 0, code_r)
    lo_r, hi_r = tl.split(tl.reshape(code_r, [32, BK // 2, 2]))
    pk_r = pk * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(rc_ptr + m[:, None] * stride_rc + pk_r[None, :], (lo_r | (hi_r << 4)).to(tl.uint8), mask=(pk_r < K // 2)[None, :])
    kb = pk * NB + tl.arange(0, NB)
    tl.store(rs_ptr + m[:, None] * stride_rs + kb[None, :], tl.where(nan_r, 255, e_r + 127).to(tl.uint8), mask=(kb < K // 32)[None, :])

    # ---- along M: 32x1 blocks of each column (the wgrad layout, stored as X^T [K, M]) ----
    _store_columns(x, af, bad, m, kk, kmask, pm, M, key_c, key2_c, cc_ptr, cs_ptr, stride_cc, stride_cs, CEIL_C, SR_C, BK)


@triton.jit
def _store_columns(x, af, bad, m, kk, kmask, pm, M, key_c, key2_c, cc_ptr, cs_ptr, stride_cc, stride_cs,
                   CEIL_C: tl.constexpr, SR_C: tl.constexpr, BK: tl.constexpr, ELEM: tl.constexpr = 0):
    """MX quantization of a [32, BK] tile of X (rows ``m``, columns ``kk``; ``af`` = finite |x|, ``bad`` = NaN/Inf)
    along M: 32x1 blocks down each column, stored as X^T with E8M0 scales [K, M/32] - MXFP4 (``ELEM`` 0) codes
    packed two per byte [K, M/2], MXFP8 (1) E4M3 codes a byte each [K, M]."""
    amax_c = tl.max(af, axis=0)
    nan_c = tl.max(bad, axis=0) > 0
    e_c = _mx_exponent(amax_c, CEIL_C, ELEM)
    inv_c = ((127 - e_c) << 23).to(tl.float32, bitcast=True)
    v_c = tl.trans(x * inv_c[None, :])  # [BK, 32]
    u_c = v_c
    if SR_C:
        u_c = _uniforms(kk[:, None] * M + m[None, :], key_c, key2_c)  # blocked index of axis=0: k*M + m
    if ELEM == 0:
        code_c = tl.where(nan_c[:, None], 0, _e2m1_codes(v_c, u_c, SR_C))
        lo_c, hi_c = tl.split(tl.reshape(code_c, [BK, 16, 2]))
        pm_c = pm * 16 + tl.arange(0, 16)
        tl.store(cc_ptr + kk[:, None] * stride_cc + pm_c[None, :], (lo_c | (hi_c << 4)).to(tl.uint8), mask=kmask[:, None])
    else:
        code_c = tl.where(nan_c[:, None], 0, e4m3_codes(v_c, u_c, SR_C))
        tl.store(cc_ptr + kk[:, None] * stride_cc + m[None, :], code_c.to(tl.uint8), mask=kmask[:, None])
    tl.store(cs_ptr + kk * stride_cs + pm, tl.where(nan_c, 255, e_c + 127).to(tl.uint8), mask=kmask)


@triton.jit(do_not_specialize=["key", "key2"])
def _mx_cols_kernel(x_ptr, cc_ptr, cs_ptr, M, K, stride_x, stride_cc, stride_cs, key, key2,
                    CEIL: tl.constexpr, SR: tl.constexpr, BK: tl.constexpr, ELEM: tl.constexpr = 0,
                    KEYS_PTR: tl.constexpr = False):
    """A [32, BK] tile of X -> MXFP4 / MXFP8 (``ELEM``) along M (32x1 blocks down the columns), stored as X^T."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    pm = tl.program_id(0)
    m = pm * 32 + tl.arange(0, 32)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    kmask = kk < K
    x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    _store_columns(x, tl.where(finite, a, 0.0), tl.where(finite, 0, 1), m, kk, kmask, pm, M, key, key2,
                   cc_ptr, cs_ptr, stride_cc, stride_cs, CEIL, SR, BK, ELEM)


# (columns per program, warps) of the along-M kernel by format. MXFP4: the fastest measured on the H200
# (0.254 ms on 16384 x 8192 BF16; 64 columns and 4 warps took 0.468 ms).
# MXFP8: the same launch, not swept (it writes twice the code bytes).
MX_COLUMNS_LAUNCH = {"mxfp4": (128, 2), "mxfp8": (128, 2)}


def _quantize_columns(fmt: str, x, scale, rounding, seed, block_cols, num_warps) -> QuantizedTensor:
    name = f"quantize_{fmt}_columns"
    x = _check(name, x, scale, rounding)
    if x.shape[0] % 32:
        raise ValueError(f"{name} needs dim 0 to be a multiple of 32, got {tuple(x.shape)}")
    bk, warps = block_cols or MX_COLUMNS_LAUNCH[fmt][0], num_warps or MX_COLUMNS_LAUNCH[fmt][1]
    if bk < 1 or bk & (bk - 1):
        raise ValueError(f"{name}: block_cols must be a power of two, got {bk}")
    M, K = x.shape
    elem = E2M1 if fmt == "mxfp4" else E4M3
    cc = torch.empty(K, M // 2 if elem == E2M1 else M, dtype=torch.uint8, device=x.device)
    cs = torch.empty(K, M // 32, dtype=torch.uint8, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    if M and K:
        _mx_cols_kernel[(M // 32, triton.cdiv(K, bk))](x, cc, cs, M, K, x.stride(0), cc.stride(0), cs.stride(0), key, key2,
                                                       CEIL=scale == "ceil", SR=sr, BK=bk, ELEM=elem, KEYS_PTR=kp,
                                                       num_warps=warps)
    return QuantizedTensor(fmt, cc, cs, None, BlockLayout((M, K), (32,), 0), x.dtype)


def quantize_mxfp4_columns(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                           block_cols: int | None = None, num_warps: int | None = None) -> QuantizedTensor:
    """MXFP4 along dim 0 of a 2D tensor (``quantize(x, "mxfp4", axis=0, ...)`` bit for bit; dim 0 a
    multiple of 32) straight from ``x``'s row-major layout - no transposed copy of ``x``.
    ``block_cols`` (a power of two) and ``num_warps``: launch tuning (:data:`MX_COLUMNS_LAUNCH`), the same bits."""
    return _quantize_columns("mxfp4", x, scale, rounding, seed, block_cols, num_warps)


def quantize_mxfp8_columns(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                           block_cols: int | None = None, num_warps: int | None = None) -> QuantizedTensor:
    """MXFP8 along dim 0, as :func:`quantize_mxfp4_columns` (E4M3 codes a byte each, stored as X^T ``[K, M]``).
    tib2d's q/k projections save X this way for wgrad: the transposed BF16 copy it replaces cost 7.6 ms of a 1b
    step on the H200."""
    return _quantize_columns("mxfp8", x, scale, rounding, seed, block_cols, num_warps)


def _keys(rounding: str, seed: int | torch.Tensor | None, device: torch.device | None = None):
    """``(stochastic?, key, key2, keys_ptr)`` for a launch: the host ints of ``seed`` (a fresh one if None), or -
    ``seed`` an int64 tensor ``[key, key2]`` on ``device`` (:func:`fp4train.counter_rng.seed_keys_tensor`) - that
    tensor and 0, and ``keys_ptr`` True: launch the kernel with ``KEYS_PTR=keys_ptr``, and it reads the keys there."""
    sr = rounding == "stochastic"
    if isinstance(seed, torch.Tensor):
        return sr, (counter_rng.check_keys(seed, device) if sr else 0), 0, sr
    if sr and seed is None:
        seed = counter_rng.fresh_seed()
    return (sr, *counter_rng.seed_keys(int(seed or 0)), False)


def quantize_mxfp4_dual(
    x: torch.Tensor, *, scale: tuple[str, str] = ("floor", "floor"), rounding: tuple[str, str] = ("nearest", "nearest"),
    seed: tuple[int | None, int | None] = (None, None), blocks_per_program: int = 4,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Both layouts a linear needs of X ``[M, K]`` from one read: along K (fprop) and along M (wgrad).

    Equal bit for bit to ``quantize(x, "mxfp4", axis=-1, ...)`` and ``quantize(x, "mxfp4", axis=0, ...)``;
    ``scale``/``rounding``/``seed`` are (along K, along M) pairs. M and K must be multiples of 32.
    """
    if x.ndim != 2 or x.shape[0] % 32 or x.shape[1] % 32:
        raise ValueError(f"quantize_mxfp4_dual needs a 2D tensor with both dims multiples of 32, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_mxfp4_dual takes float32/bfloat16/float16, got {x.dtype}")
    x = x.contiguous()
    M, K = x.shape
    rc = torch.empty(M, K // 2, dtype=torch.uint8, device=x.device)
    rs = torch.empty(M, K // 32, dtype=torch.uint8, device=x.device)
    cc = torch.empty(K, M // 2, dtype=torch.uint8, device=x.device)
    cs = torch.empty(K, M // 32, dtype=torch.uint8, device=x.device)
    sr_r, k_r, k2_r, kp_r = _keys(rounding[0], seed[0], x.device)
    sr_c, k_c, k2_c, kp_c = _keys(rounding[1], seed[1], x.device)
    grid = (M // 32, triton.cdiv(K, 32 * blocks_per_program))
    if M and K:
        _mxfp4_dual_kernel[grid](x, rc, rs, cc, cs, M, K, x.stride(0), rc.stride(0), rs.stride(0), cc.stride(0), cs.stride(0),
                                 k_r, k2_r, k_c, k2_c, CEIL_R=scale[0] == "ceil", SR_R=sr_r, CEIL_C=scale[1] == "ceil",
                                 SR_C=sr_c, NB=blocks_per_program, KEYS_PTR_R=kp_r,
                                 KEYS_PTR_C=kp_c, num_warps=8)  # 4 warps: 148-255 registers (ptxas)
    rows = QuantizedTensor("mxfp4", rc, rs, None, BlockLayout((M, K), (32,), 1), x.dtype)
    cols = QuantizedTensor("mxfp4", cc, cs, None, BlockLayout((M, K), (32,), 0), x.dtype)
    return rows, cols


@triton.jit(do_not_specialize=["key", "key2"])
def _mx_tile_kernel(
    x_ptr, codes_ptr, scales_ptr, R, C, n_tc, stride_x, stride_c, stride_s, key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, ELEM: tl.constexpr, TC: tl.constexpr,
    KEYS_PTR: tl.constexpr = False,
):
    """``TC`` 32x32 tiles side by side (a [32, TC * 32] strip) -> one E8M0 scale and 1024 codes each
    (E2M1 packed along the columns, or E4M3)."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    tr = tl.program_id(0)
    tc = tl.program_id(1) * TC + tl.arange(0, TC)  # this program's tiles
    r = tr * 32 + tl.arange(0, 32)
    c = tl.program_id(1) * TC * 32 + tl.arange(0, TC * 32)
    m = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
    a = tl.reshape(tl.abs(x), [32, TC, 32])
    finite = a < float("inf")
    nan_tile = tl.max(tl.max(tl.where(finite, 0, 1), axis=2), axis=0) > 0  # [TC]
    amax = tl.max(tl.max(tl.where(finite, a, 0.0), axis=2), axis=0)
    e = _mx_exponent(amax, CEIL, ELEM)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = tl.reshape(tl.reshape(x, [32, TC, 32]) * inv[None, :, None], [32, TC * 32])
    u = v
    if SR:
        # the reference's blocked layout: tile (tr, tc) is block tr * n_tc + tc, element (i, j) at i * 32 + j
        i = tl.arange(0, 32)
        idx = (tr * n_tc + tc[None, :, None]) * 1024 + i[:, None, None] * 32 + i[None, None, :]
        u = tl.reshape(_uniforms(idx, key, key2), [32, TC * 32])
    keep = tl.reshape(tl.broadcast_to(~nan_tile[None, :, None], [32, TC, 32]), [32, TC * 32])
    in_tensor = tl.broadcast_to((c < n_tc * 32)[None, :], [32, TC * 32])  # tiles past the last: not stored
    _mx_store_codes(codes_ptr, r[:, None] * stride_c, tl.program_id(1) * TC * 32, v, u, keep, in_tensor, SR, ELEM, 32, TC * 32)
    tl.store(scales_ptr + tr * stride_s + tc, tl.where(nan_tile, 255, e + 127).to(tl.uint8), mask=tc < n_tc)


@triton.jit(do_not_specialize=["key", "key2"])
def _mxfp4_tile_kernel(
    x_ptr, codes_ptr, scales_ptr, R, C, n_tc, stride_x, stride_c, stride_s, key, key2,
    CEIL: tl.constexpr, SR: tl.constexpr, TC: tl.constexpr, BF16_PAIRS: tl.constexpr,
    KEYS_PTR: tl.constexpr = False,
):
    """MXFP4 of ``TC`` 32x32 tiles side by side, as :func:`_mx_tile_kernel` (the same bits), with the tile
    view built from loads alone: each tile is held as its even and its odd columns, two [32, TC, 16]
    tensors (:func:`_even_odd`), so that the two codes of a byte are computed side by side and packed without
    a reshape, split or layout change. ``BF16_PAIRS``: BF16 input with an even row length, read as one 32-bit
    word per pair of columns."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    tr = tl.program_id(0)
    tc = tl.program_id(1) * TC + tl.arange(0, TC)  # this program's tiles
    i = tl.arange(0, 32)[:, None, None]  # row within the tile
    h = tl.arange(0, 16)[None, None, :]  # column pair within the tile
    r = tr * 32 + i
    ce = tc[None, :, None] * 32 + 2 * h  # even column
    m = (r < R) & (ce < C)  # BF16_PAIRS: C even, a pair is in or out together
    xe, xo = _even_odd(x_ptr, r * stride_x + ce, m, (r < R) & (ce + 1 < C), BF16_PAIRS)
    ae, ao = tl.abs(xe), tl.abs(xo)
    fin_e, fin_o = ae < float("inf"), ao < float("inf")  # False for NaN and Inf
    bad = tl.where(fin_e & fin_o, 0, 1)
    nan_tile = tl.max(tl.max(bad, axis=2), axis=0) > 0  # [TC]
    amax = tl.max(tl.max(tl.maximum(tl.where(fin_e, ae, 0.0), tl.where(fin_o, ao, 0.0)), axis=2), axis=0)
    e = _mx_exponent(amax, CEIL, 0)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[None, :, None]  # 2**-e
    ve, vo = xe * inv, xo * inv
    ue, uo = ve, vo  # unused unless SR
    if SR:
        # the reference's blocked layout: tile (tr, tc) is block tr * n_tc + tc, element (i, j) at i * 32 + j
        idx = (tr * n_tc + tc[None, :, None]) * 1024 + i * 32 + 2 * h
        ue, uo = _uniforms(idx, key, key2), _uniforms(idx + 1, key, key2)
    keep = ~nan_tile[None, :, None]
    lo = tl.where(keep, _e2m1_codes(ve, ue, SR), 0)
    hi = tl.where(keep, _e2m1_codes(vo, uo, SR), 0)
    tl.store(codes_ptr + r * stride_c + tc[None, :, None] * 16 + h, (lo | (hi << 4)).to(tl.uint8),
             mask=(r >= 0) & (tc < n_tc)[None, :, None])  # tiles past the last: not stored
    tl.store(scales_ptr + tr * stride_s + tc, tl.where(nan_tile, 255, e + 127).to(tl.uint8), mask=tc < n_tc)


# The 32x32 tile launch by rounding: (even/odd-column kernel?, tiles per program, warps), the fastest measured
# on the H200 (16384 x 8192 BF16, ceil scale):
# stochastic rounding (tib2d's dY) the even/odd-column kernel, 4 tiles, 4 warps (0.426 ms; the general kernel's best
# 0.429; the earlier launch, 8 tiles / 8 warps, 0.473); nearest (its W) the general kernel, 4 tiles, 8 warps (0.290 ms;
# the even/odd-column kernel's best 0.332, at 8 tiles / 8 warps). MXFP8 tiles (the general kernel) keep 8 tiles,
# 8 warps (not swept).
MXFP4_TILE_LAUNCH = {"stochastic": (True, 4, 4), "nearest": (False, 4, 8)}
MXFP8_TILE_LAUNCH = (8, 8)


def _quantize_tiles(fmt: str, x, scale, rounding, seed, launch=(None, None), pairs: bool | None = None) -> QuantizedTensor:
    x = _check(f"quantize_{fmt}_2d", x, scale, rounding)
    R, C = x.shape
    layout = BlockLayout((R, C), (32, 32), None)
    rp, cp = layout.canonical_shape
    elem = E2M1 if fmt == "mxfp4" else E4M3
    codes = torch.empty(rp, cp // 2 if elem == E2M1 else cp, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rp // 32, cp // 32, dtype=torch.uint8, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    pairs_default, tc, warps = MXFP4_TILE_LAUNCH[rounding] if elem == E2M1 else (False, *MXFP8_TILE_LAUNCH)
    pairs = pairs_default if pairs is None else pairs
    tc, warps = launch[0] or tc, launch[1] or warps
    if tc < 1 or tc & (tc - 1):
        raise ValueError(f"tiles_per_program must be a power of two, got {tc}")
    grid = (rp // 32, triton.cdiv(cp // 32, tc))
    if rp and cp and elem == E2M1 and pairs:
        bf16_pairs = x.dtype == torch.bfloat16 and C % 2 == 0 and x.data_ptr() % 4 == 0
        _mxfp4_tile_kernel[grid](x, codes, scales, R, C, cp // 32, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
                                 CEIL=scale == "ceil", SR=sr, TC=tc, BF16_PAIRS=bf16_pairs, KEYS_PTR=kp,
                                 num_warps=warps)
    elif rp and cp:
        _mx_tile_kernel[grid](x, codes, scales, R, C, cp // 32, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
                              CEIL=scale == "ceil", SR=sr, ELEM=elem, TC=tc, KEYS_PTR=kp, num_warps=warps)
    return QuantizedTensor(fmt, codes, scales, None, layout, x.dtype)


def quantize_mxfp4_2d(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None,
                      tiles_per_program: int | None = None, num_warps: int | None = None,
                      pairs: bool | None = None) -> QuantizedTensor:
    """MXFP4 with 32x32 tiles (transposition-invariant) of a 2D tensor, any shape (padded like the reference).
    ``tiles_per_program`` / ``num_warps``: launch tuning, the same bits. ``pairs``: True runs the even/odd-column
    kernel (:func:`_mxfp4_tile_kernel`), False the general one (:func:`_mx_tile_kernel`, also MXFP8's) - the same
    bits; None (default) takes the faster for the rounding (:data:`MXFP4_TILE_LAUNCH`, with its launch)."""
    return _quantize_tiles("mxfp4", x, scale, rounding, seed, (tiles_per_program, num_warps), pairs)


def quantize_mxfp8_2d(x: torch.Tensor, *, scale: str = "floor", rounding: str = "nearest", seed: int | None = None) -> QuantizedTensor:
    """MXFP8 with 32x32 tiles of a 2D tensor, any shape (padded like the reference)."""
    return _quantize_tiles("mxfp8", x, scale, rounding, seed)
