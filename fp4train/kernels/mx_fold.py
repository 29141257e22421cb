"""MXFP4 quantization folded into FP8 E4M3 with 1x128 or 128x128 group scales, in one pass.

The operand form of an MXFP4 GEMM on Hopper's FP8 tensor cores (docs/methods.md, Hopper execution,
:mod:`fp4train.formats.fold`): quantize ``x`` to MXFP4 along its last dim exactly as the
reference does (scale rule, RTNE or counter-hash stochastic rounding, NaN/Inf blocks), then per
group of 32-element blocks - four of a row (``group_rows=1``) or 128 rows x 4 blocks
(``group_rows=128``) - with block exponents ``e_b`` and group maximum ``g``::

    codes = e4m3(q * 2**(6 - (g - e_b)))      scale = 2**(g - 6)

Equal bit for bit to ``fold(quantize(x, "mxfp4"), group_rows)``, including the count of inexact
elements (nonzero E2M1 values that E4M3 cannot hold after the shift), which is accumulated on the
device (no host synchronisation) into ``counter``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats.fold import FoldedFP8, empty_folded
from ..formats.qtensor import QuantizedTensor
from .e4m3 import e4m3_rtne
from .hadamard import _butterfly, _butterfly_sums
from .mx_quantize import _e2m1_codes, _kernel_keys, _keys, _pow2, _scale_exponent, _uniforms, _with_sign, quantize_mxfp4_columns


@triton.jit
def _round_bf16(y):
    """FP32 -> the nearest-even BF16 value, as FP32 (in integers: the interpreter's float cast truncates)."""
    bits = y.to(tl.uint32, bitcast=True)
    rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, y, rne.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["key", "key2"])
def _fold_kernel(x_ptr, d_ptr, codes_ptr, scales_ptr, count_ptr, R, K, s_r, s_k, sc, ss, key, key2,
                 CEIL: tl.constexpr, SR: tl.constexpr, GR: tl.constexpr, RB: tl.constexpr,
                 HAD: tl.constexpr, LOG_HAD: tl.constexpr, HAS_D: tl.constexpr, NORM: tl.constexpr, ROUND_BF16: tl.constexpr,
                 KEYS_PTR: tl.constexpr = False, SUMS: tl.constexpr = False):
    """Program (i, j): rows i*RB .. +RB, columns j*128 .. +128 (RB = GR for 128x128 groups; any power of
    two for 1x128 groups, which are per row) of
    the operand [R, K] whose element (r, k) is ``x_ptr[r * s_r + k * s_k]``: x itself (``s_k`` = 1) or,
    for blocks along x's dim 0, x transposed, read in place (``s_r`` = 1: no transposed copy).
    ``HAD`` > 0: first the block-HAD Hadamard transform along the rows (signs ``d`` if HAS_D), exactly as
    kernels/hadamard.py does it, rounded to BF16 when the input is BF16 (the reference transforms into
    the input's dtype, then quantizes). ``SUMS``: its butterfly stages as sums over the pair axis
    (:func:`~fp4train.kernels.hadamard._butterfly_sums`) instead of permutes; the same bits."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    rmask = r < R
    mask = rmask[:, None]
    x = tl.load(x_ptr + r[:, None] * s_r + c[None, :] * s_k, mask=mask, other=0.0).to(tl.float32)
    if HAD > 0:
        NB: tl.constexpr = RB * (128 // HAD)
        y = tl.reshape(x, [NB, HAD])
        if HAS_D:
            y = y * tl.load(d_ptr + tl.arange(0, HAD))[None, :]
        for s in tl.static_range(LOG_HAD):
            if SUMS:
                y = _butterfly_sums(y, NB, HAD, 1 << s)
            else:
                y = _butterfly(y, NB, HAD, 1 << s)
        x = tl.reshape(y * NORM, [RB, 128])
        if ROUND_BF16:
            x = _round_bf16(x)
    u = x
    if SR:
        u = _uniforms(r[:, None] * K + c[None, :], key, key2)
    usual, g = _fold_rows_float(x, u, r, rmask, codes_ptr, scales_ptr, count_ptr, sc, ss, CEIL, SR, RB, GR, HAD == 0)
    if HAD == 0:
        if usual == 0:
            _fold_rows_reread(x_ptr, g, c, R, K, s_r, s_k, key, key2, codes_ptr, count_ptr, sc, CEIL, SR, RB, GR)


@triton.jit
def _block_exponents(x, CEIL: tl.constexpr, RB: tl.constexpr):
    """``(mb, bad, e, eb)`` of a [RB, 128] tile's four 1x32 blocks per row: the bits of each block's max
    |x| (>= Inf's bits: NaN/Inf in it), that flag, the scale exponent (bad blocks: unused) and the
    exponent the reference's fold reads (a NaN block's 0xFF scale: 128)."""
    mb = tl.max(tl.reshape(x.to(tl.int32, bitcast=True), [RB, 4, 32]) & 0x7FFFFFFF, axis=2)
    bad = mb >= 0x7F800000
    e = _scale_exponent(mb.to(tl.float32, bitcast=True), CEIL)
    return mb, bad, e, tl.where(bad, 128, e)


@triton.jit
def _fold_rows_reread(x_ptr, g, c, R, K, s_r, s_k, key, key2, codes_ptr, count_ptr, sc,
                      CEIL: tl.constexpr, SR: tl.constexpr, RB: tl.constexpr, GR: tl.constexpr):
    """The general path of :func:`_fold_rows_float` (its last branch) for a tile of x itself, four rows at
    a time read again from memory (a loop: its per-element temporaries then do not set the kernel's
    register count, which the usual path's occupancy pays for). ``g``: the tile's group maximum (used
    for 128x128 groups; 1x128 groups take each row's own). The same bytes and inexact count as the
    in-register path: the same exponents, uniforms and rule (:func:`_fold_bytes_any`)."""
    CH: tl.constexpr = 4 if RB >= 4 else RB
    for ci in range(RB // CH):
        rc = tl.program_id(0) * RB + ci * CH + tl.arange(0, CH)
        mc = rc < R
        xc = tl.load(x_ptr + rc[:, None] * s_r + c[None, :] * s_k, mask=mc[:, None], other=0.0).to(tl.float32)
        _, bad, e, eb = _block_exponents(xc, CEIL, CH)
        if GR == 1:
            _, _, d = _group_max(eb, bad, mc, GR)
        else:
            d = g - tl.where(mc[:, None], eb, g)
        v = tl.reshape(xc, [CH, 4, 32]) * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, :, None]
        uc = v
        if SR:
            uc = tl.reshape(_uniforms(rc[:, None] * K + c[None, :], key, key2), [CH, 4, 32])
        code = tl.where(bad[:, :, None], 0, _e2m1_codes(v, uc, SR))
        byte = _fold_bytes_any(code, d, mc, count_ptr, CH)
        tl.store(codes_ptr + rc[:, None] * sc + c[None, :], tl.reshape(byte, [CH, 128]).to(tl.uint8), mask=mc[:, None])


@triton.jit
def _e2m1_sr_magnitude(ac, u):
    """Stochastic rounding of ``ac`` in [0, 6] onto the E2M1 grid, in float arithmetic: the grid point
    below, ``lo``, and up by the step with probability ``(ac - lo) / step`` (``u < that``) - the
    reference's rule and comparison. In the binade ``[2**k, 2**(k+1))`` the step is ``2**(max(k, 0) - 1)``;
    ``(ac + C) - C`` with ``C = 2**(max(k, 0) + 22)`` is ``ac`` to the nearest step, one step too high
    when it rounded up. Division by the step is an exact multiplication by its reciprocal."""
    kb = tl.maximum(ac.to(tl.int32, bitcast=True) & 0x7F800000, 127 << 23)  # 2**max(k, 0)
    cst = (kb + (22 << 23)).to(tl.float32, bitcast=True)
    step = (kb - (1 << 23)).to(tl.float32, bitcast=True)
    inv_step = ((254 << 23) - (kb - (1 << 23))).to(tl.float32, bitcast=True)  # 1 / step
    near = (ac + cst) - cst
    lo = tl.where(near > ac, near - step, near)
    return tl.where(u < (ac - lo) * inv_step, lo + step, lo)


@triton.jit
def _fold_rows_float(x, u, r, rmask, codes_ptr, scales_ptr, count_ptr, sc, ss,
                     CEIL: tl.constexpr, SR: tl.constexpr, RB: tl.constexpr, GR: tl.constexpr, REREAD: tl.constexpr = False):
    """A [RB, 128] tile of X (rows ``r``; uniforms ``u`` for stochastic rounding) quantized to MXFP4 along
    the rows (four 1x32 blocks) and folded into E4M3 + group scales, straight to the E4M3 value in float
    arithmetic; returns (whether the tile took the usual path, the group maximum). With block exponent ``e``,
    group maximum ``g`` and ``d = g - e``, the folded value is ``f = q * 2**(6 - d)`` where ``q`` is
    ``v = x * 2**-e`` rounded to E2M1. Scaling by a power of two commutes with rounding onto a
    scaled grid, so ``f`` is ``w = x * 2**(6 - g)`` (exact: a power-of-two product) rounded onto the
    E2M1 grid times ``2**(6 - d)``: a step of ``2**(k - 1)`` in the binade ``[2**k, 2**(k+1))`` of
    ``w``, and ``2**(5 - d)`` below ``2**(6 - d)`` (E2M1's 0, 0.5, 1), saturating at ``6 * 2**(6 - d)``.
    RTNE to that step is ``(|w| + C) - C`` with ``C = 2**(max(k, 6 - d) + 22)`` (its FP32 ulp is the
    step; the sum never leaves C's binade), and ties to even there are E2M1's ties to the even
    code. For ``d <= 14`` every ``f`` is an E4M3 number (down to its subnormal 2**-9), so the
    hardware cast to E4M3 is exact (in the interpreter too, which does not round as the GPU does).
    Tiles with a live block farther down, or with a group of FP32 subnormals (``2**(6 - g)`` past
    FP32's range), take the general path (E4M3 subnormals, the inexact count): :func:`_fold_store` here, or
    with ``REREAD`` only the scales here and the bytes by the caller (:func:`_fold_rows_reread`).
    The sign is ``x``'s, -0.0 included, as the reference's E2M1 code keeps it. Stochastic rounding
    (``SR``, uniforms ``u``) rounds ``v = x * 2**-e`` itself, as the reference does
    (:func:`_e2m1_sr_magnitude`), then scales by ``2**(6 - d)``. Bit for bit the codes path
    (tests/test_kernels.py)."""
    mb, bad, e, eb = _block_exponents(x, CEIL, RB)  # [RB, 4] each
    g, nan_g, d = _group_max(eb, bad, rmask, GR)
    live = (mb > 0) & ~bad  # blocks that may hold a nonzero code
    inv_e = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e: v = x * 2**-e is the reference's scaled element
    # the usual tile: live blocks within 14 binades of their group's top (every folded value exact in
    # E4M3, formats.fold.MAX_EXACT_SPAN), and 2**(6 - g) a normal float (not so for groups of FP32
    # subnormals, whose exponent is clamped at -127)
    near = tl.max(tl.reshape(tl.where(live, d, 0), [RB * 4]), axis=0) <= 14
    usual = near & (tl.min(tl.reshape(tl.where(live, eb, 0), [RB * 4]), axis=0) >= -121)
    if usual:
        floor_bits = (tl.minimum(tl.maximum(6 - d, -126), 127) + 127) << 23  # [RB, 4]: 2**(6 - d)
        if SR:
            v = tl.reshape(x, [RB, 4, 32]) * inv_e[:, :, None]
            q = _e2m1_sr_magnitude(tl.minimum(tl.abs(v), 6.0), tl.reshape(u, [RB, 4, 32]))
            f = _with_sign(q * floor_bits.to(tl.float32, bitcast=True)[:, :, None], v.to(tl.int32, bitcast=True) < 0)
        else:
            s_g = _pow2(tl.minimum(tl.maximum(6 - g, -126), 127))  # 2**(6 - g) (masked rows: any value)
            if GR == 1:
                w = tl.reshape(x, [RB, 4, 32]) * s_g[:, :, None]
            else:
                w = tl.reshape(x, [RB, 4, 32]) * s_g
            wb = w.to(tl.int32, bitcast=True)
            big = tl.maximum(wb & 0x7F800000, floor_bits[:, :, None]) + (22 << 23)
            cst = big.to(tl.float32, bitcast=True)
            sat = (floor_bits + (2 << 23) + 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2**2 * 2**(6 - d)
            q = tl.minimum((tl.abs(w) + cst) - cst, sat[:, :, None])
            f = (q.to(tl.int32, bitcast=True) | (wb & -0x80000000)).to(tl.float32, bitcast=True)
        byte = tl.where(bad[:, :, None], 0, f.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32))
        _store_folded(byte, g, nan_g, r, rmask, codes_ptr, scales_ptr, sc, ss, RB, GR)
    elif REREAD:  # the caller runs the general path from memory (_fold_rows_reread); the scales are stored here
        _store_group_scale(g, nan_g, r, rmask, scales_ptr, ss, RB, GR)
    else:
        v = tl.reshape(x, [RB, 4, 32]) * inv_e[:, :, None]
        code = tl.where(bad[:, :, None], 0, _e2m1_codes(v, tl.reshape(u, [RB, 4, 32]), SR))
        _fold_store(code, eb, bad, r, rmask, codes_ptr, scales_ptr, count_ptr, sc, ss, RB, GR)
    return usual, g


@triton.jit
def _fold_store(code, eb, bad, r, rmask, codes_ptr, scales_ptr, count_ptr, sc, ss, RB: tl.constexpr, GR: tl.constexpr,
                SCALE_PER_ROW: tl.constexpr = False):
    """Fold E2M1 codes [RB, 4, 32] with block exponents ``eb`` [RB, 4] into E4M3 bytes + group scale(s),
    store them for rows ``r`` and columns ``program_id(1) * 128 ..``, and add the inexact count.
    ``SCALE_PER_ROW`` with 128x128 groups: the group's scale stored on each of its rows (a 1x128-group
    A operand with the same values - see fp8_operands.Fp8Operands.fold_tiles)."""
    g, nan_g, d = _group_max(eb, bad, rmask, GR)
    live = tl.max(code & 7, axis=2) > 0  # blocks with a nonzero element (all-zero blocks fold to zeros either way)
    if tl.max(tl.reshape(tl.where(live, d, 0), [RB * 4]), axis=0) <= 11:  # the usual tile: within 11 binades of the top
        byte = _fold_bytes_near(code, d)
    else:
        byte = _fold_bytes_any(code, d, rmask, count_ptr, RB)
    _store_folded(byte, g, nan_g, r, rmask, codes_ptr, scales_ptr, sc, ss, RB, GR, SCALE_PER_ROW)


@triton.jit
def _group_max(eb, bad, rmask, GR: tl.constexpr):
    """``(g, nan_g, d)`` of block exponents ``eb`` [RB, 4] (NaN blocks already 128) and NaN flags
    ``bad``: the group maximum (per row for 1x128 groups, [RB, 1]; per tile for 128x128), whether the
    group holds a NaN block, and each block's distance ``d = g - eb`` >= 0. Rows past the end
    (``rmask`` False) take no part."""
    eb = tl.where(rmask[:, None], eb, -(1 << 20))
    if GR == 1:
        g = tl.max(eb, axis=1)[:, None]
        nan_g = tl.max(bad.to(tl.int32), axis=1)[:, None] > 0
    else:
        g = tl.max(tl.max(eb, axis=1), axis=0)
        nan_g = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0
    return g, nan_g, g - eb


@triton.jit
def _store_folded(byte, g, nan_g, r, rmask, codes_ptr, scales_ptr, sc, ss, RB: tl.constexpr, GR: tl.constexpr,
                  SCALE_PER_ROW: tl.constexpr = False):
    """Store the E4M3 bytes [RB, 4, 32] of rows ``r``, columns ``program_id(1) * 128 ..``, and the group
    scale (:func:`_store_group_scale`)."""
    c = tl.program_id(1) * 128 + tl.arange(0, 128)
    tl.store(codes_ptr + r[:, None] * sc + c[None, :], tl.reshape(byte, [RB, 128]).to(tl.uint8), mask=rmask[:, None])
    _store_group_scale(g, nan_g, r, rmask, scales_ptr, ss, RB, GR, SCALE_PER_ROW)


@triton.jit
def _fold_bytes_near(code, d):
    """E4M3 bytes of E2M1 codes [RB, 4, 32] shifted down by ``d`` [RB, 4] <= 11 binades: f = |q| * 2**(6 - d)
    is then a normal E4M3 number (or zero), exact, and its code is integer arithmetic on the E2M1 code -
    exponent field (mag >> 1) + 12 - d, mantissa bit 2 = E2M1's mantissa bit (0.5 = mag 1 is 2**-1 x 1.0).
    Equal to :func:`_fold_bytes_any` there (checked for every mag and d <= 11), at a fraction of its work."""
    mag = code & 7
    e = (mag >> 1) + 12 - d[:, :, None]
    m = (mag & 1) & (mag > 1).to(tl.int32)
    return tl.where(mag == 0, 0, (e << 3) | (m << 2)) | ((code & 8) << 4)  # E2M1 sign bit 3 -> E4M3 sign bit 7


@triton.jit
def _fold_bytes_any(code, d, rmask, count_ptr, RB: tl.constexpr):
    """E4M3 bytes of E2M1 codes [RB, NB, 32] shifted down by any ``d`` [RB, NB] >= 0 (E4M3 subnormals and
    underflow included, rounded to nearest even as the reference's cast), the inexact ones of rows
    ``rmask`` counted."""
    mag = code & 7
    q2 = tl.where(mag < 2, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0))  # 2*|q| as an integer: 0,1,2,3,4,6,8,12
    k = 5 - d[:, :, None]  # f = |q| * 2**(6 - d) = q2 * 2**k
    f = q2.to(tl.float32) * _pow2(tl.maximum(k, -149))
    f = tl.where(k < -149, 0.0, f)  # far below E4M3's range: rounds to zero either way
    ecode, _ = e4m3_rtne(tl.minimum(f, 448.0))
    # exact iff q2 * 2**k is a multiple of 2**-9 (E4M3's subnormal step; <= 384 always)
    sh = tl.maximum(-9 - k, 0)
    exact = (k >= -9) | (((q2 >> tl.minimum(sh, 30)) << tl.minimum(sh, 30)) == q2) & (sh < 30)
    inexact = (q2 != 0) & ~exact & rmask[:, None, None]
    n_inexact = tl.sum(tl.sum(tl.sum(inexact.to(tl.int32), axis=2), axis=1), axis=0)
    if n_inexact > 0:  # rare: no atomic from every program onto one address (they serialize)
        tl.atomic_add(count_ptr, n_inexact)
    return ecode | ((code & 8) << 4)


@triton.jit
def _spread_nibbles(w):
    """A 16-bit word of four packed E2M1 codes (element ``4j + i`` in nibble ``i``, uint32) -> the same
    codes one per byte (element ``4j + i`` in byte ``i``: little endian, the order of the E4M3 bytes stored
    as one 32-bit word). Bytes 0 and 1 move to bytes 0 and 2, then each byte's high nibble to the byte above."""
    t = (w | (w << 8)) & 0x00FF00FF
    return (t | (t << 4)) & 0x0F0F0F0F


@triton.jit
def _fold_words_near(t, d):
    """:func:`_fold_bytes_near` on four codes at once: ``t`` holds one E2M1 code per byte (uint32), ``d``
    (<= 11, broadcast) the blocks' shift. Per byte lane, with no carry or borrow between lanes (every lane
    value stays below 256): ``mag`` = code & 7; exponent field ``(mag >> 1) + 12 - d`` (1..15) at bit 3;
    mantissa bit ``mag & 1`` where ``mag > 1`` (bit 1 or 2 set) at bit 2; both kept only where ``mag != 0``
    (``mag + 0x7F`` reaches bit 7 exactly then; ``0x80 - 1`` is the lane's 7-bit mask); E2M1's sign bit 3
    to E4M3's bit 7 (so -0 stays 0x80, as the per-element rule keeps it)."""
    mag = t & 0x07070707
    hi = (mag >> 1) & 0x03030303
    m = mag & ((mag >> 1) | (mag >> 2)) & 0x01010101
    nz = (mag + 0x7F7F7F7F) & 0x80808080
    keep = nz - (nz >> 7)
    e = hi + ((12 - d) * 0x01010101).to(tl.uint32)
    return (((e << 3) | (m << 2)) & keep) | ((t & 0x08080808) << 4)


@triton.jit
def _word_bytes(t, MASK: tl.constexpr, LEAD: tl.constexpr, WORDS: tl.constexpr):
    """Words ``[LEAD, WORDS]`` (uint32) -> their bytes ``[LEAD, 4 * WORDS]`` (int32), each ANDed with ``MASK``:
    word ``j``, byte ``i`` is element ``4j + i`` (little endian). ``MASK`` 15: one-per-byte E2M1 codes
    (:func:`_spread_nibbles`); 0xFF: E4M3 bytes (:func:`_fold_words_near`)."""
    lane = (tl.arange(0, 4) * 8).to(tl.uint32)
    return tl.reshape(((t[:, :, None] >> lane[None, None, :]) & MASK).to(tl.int32), [LEAD, 4 * WORDS])


@triton.jit
def _bytes_to_words(byte, LEAD: tl.constexpr):
    """E4M3 bytes ``[LEAD, 32]`` (int32, 0..255) -> ``[LEAD, 8]`` words, byte ``i`` of word ``j`` = element
    ``4j + i`` (disjoint bit fields: the sum is an OR)."""
    lane = (tl.arange(0, 4) * 8).to(tl.uint32)
    return tl.sum(tl.reshape(byte.to(tl.uint32), [LEAD, 8, 4]) << lane[None, None, :], axis=2)


@triton.jit
def _store_group_scale(g, nan_g, r, rmask, scales_ptr, ss, RB: tl.constexpr, GR: tl.constexpr,
                       SCALE_PER_ROW: tl.constexpr = False):
    """The group scale ``2**(g - 6)`` (NaN for a group with a NaN block) of rows ``r``, columns
    ``program_id(1) * 128 ..``: per row (1x128 groups), per tile, or (``SCALE_PER_ROW``) the tile's on each row."""
    scale = tl.where(nan_g, float("nan"), _pow2(tl.minimum(tl.maximum(g - 6, -149), 127)))
    if GR == 1:
        tl.store(scales_ptr + r[:, None] * ss + tl.program_id(1), scale, mask=rmask[:, None])
    elif SCALE_PER_ROW:
        tl.store(scales_ptr + r * ss + tl.program_id(1), tl.zeros([RB], tl.float32) + scale, mask=rmask)
    else:
        tl.store(scales_ptr + tl.program_id(0) * ss + tl.program_id(1), scale)


@triton.jit
def _packed_fold_kernel(pc_ptr, ps_ptr, codes_ptr, scales_ptr, count_ptr, R, spw, sps, scw, ss,
                        TILE: tl.constexpr, GR: tl.constexpr, RB: tl.constexpr, CH: tl.constexpr):
    """Packed MXFP4 (codes [S_rows, S_cols / 2], two per byte, element 2j in the low nibble; E8M0
    scales per 1x32 block [S_rows, S_cols / 32], or with TILE per 32x32 tile [S_rows / 32, S_cols / 32])
    -> the same folded output as ``_fold_kernel``, for the operand [R, K] whose inner dim K is the stored
    columns. Program (i, j): rows i*RB .., columns j*128 .. . Four elements at a time: the codes are read
    as 16-bit words (``spw``: the row stride in words), spread one code per byte and folded lane-wise
    (:func:`_fold_words_near`) into one 32-bit word of four E4M3 bytes (``scw``: the output's row stride
    in words); a program with a block more than 11 binades below its group's top takes the
    per-element general path (:func:`_fold_bytes_any`, the inexact count) ``CH`` rows at a time. A tile's
    scale is the block exponent of each of its 1x32 row pieces."""
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = r < R
    blk = tl.program_id(1) * 4 + tl.arange(0, 4)  # the four 32-blocks of this program's 128 columns
    wj = tl.program_id(1) * 32 + tl.arange(0, 32)  # its 32 words (4 codes each)
    w = tl.load(pc_ptr.to(tl.pointer_type(tl.uint16)) + r[:, None] * spw + wj[None, :], mask=rmask[:, None], other=0)
    t = tl.reshape(_spread_nibbles(w.to(tl.uint32)), [RB, 4, 8])
    srow = r // 32 if TILE else r
    sb = tl.load(ps_ptr + srow[:, None] * sps + blk[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    bad = sb == 255
    g, nan_g, d = _group_max(sb - 127, bad, rmask, GR)
    live = tl.max(t & 0x07070707, axis=2) > 0  # blocks with a nonzero element
    out_w = codes_ptr.to(tl.pointer_type(tl.uint32))
    if tl.max(tl.reshape(tl.where(live, d, 0), [RB * 4]), axis=0) <= 11:  # the usual program
        out = tl.reshape(_fold_words_near(t, d[:, :, None]), [RB, 32])
        tl.store(out_w + r[:, None] * scw + wj[None, :], out, mask=rmask[:, None])
    else:  # CH rows x 32 columns at a time, re-read (a loop: the general path's registers do not weigh on the usual one)
        for c in range(RB // CH):
            rc = tl.program_id(0) * RB + c * CH + tl.arange(0, CH)
            mc = rc < R
            sbc = tl.load(ps_ptr + (rc // 32 if TILE else rc)[:, None] * sps + blk[None, :], mask=mc[:, None], other=0).to(tl.int32)
            if GR == 1:
                _, _, dc = _group_max(sbc - 127, sbc == 255, mc, GR)
            else:
                dc = g - tl.where(mc[:, None], sbc - 127, g)
            for b in range(4):
                wb = tl.program_id(1) * 32 + b * 8 + tl.arange(0, 8)
                tb = _spread_nibbles(tl.load(pc_ptr.to(tl.pointer_type(tl.uint16)) + rc[:, None] * spw + wb[None, :],
                                             mask=mc[:, None], other=0).to(tl.uint32))
                db = tl.sum(tl.where(tl.arange(0, 4)[None, :] == b, dc, 0), axis=1)  # [CH]
                byte = _fold_bytes_any(tl.reshape(_word_bytes(tb, 15, CH, 8), [CH, 1, 32]), db[:, None], mc, count_ptr, CH)
                tl.store(out_w + rc[:, None] * scw + wb[None, :], _bytes_to_words(tl.reshape(byte, [CH, 32]), CH), mask=mc[:, None])
    _store_group_scale(g, nan_g, r, rmask, scales_ptr, ss, RB, GR)


@triton.jit
def _packed_fold_t_kernel(pc_ptr, ps_ptr, codes_ptr, scales_ptr, count_ptr, spw, sps, sc, ss, SCALE_PER_ROW: tl.constexpr):
    """32x32-tile MXFP4 folded as the operand whose inner dim is the stored rows (the stored tensor
    transposed, read in place), 128x128 groups. Program (i, j): operand rows (stored columns)
    i*128 .., operand columns (stored rows) j*128 .. . The stored [128, 128] piece is read along its rows
    (16-bit words, coalesced) and folded in the stored orientation - a tile's bytes do not depend on
    the orientation: one scale per tile, one group for all 16 tiles - four codes at a time
    (:func:`_fold_words_near`), then its bytes are transposed in the program and stored along the
    operand's rows. ``SCALE_PER_ROW``: the group scale on each of the 128 rows (an A operand)."""
    k = tl.program_id(1) * 128 + tl.arange(0, 128)  # stored rows = operand columns
    wj = tl.program_id(0) * 32 + tl.arange(0, 32)  # stored words (4 stored columns = 4 operand rows each)
    w = tl.load(pc_ptr.to(tl.pointer_type(tl.uint16)) + k[:, None] * spw + wj[None, :])
    t = tl.reshape(_spread_nibbles(w.to(tl.uint32)), [4, 32, 4, 8])  # [k tile, k in tile, r tile, word in tile]
    ti = tl.program_id(1) * 4 + tl.arange(0, 4)  # stored tile rows
    tj = tl.program_id(0) * 4 + tl.arange(0, 4)  # stored tile columns
    sb = tl.load(ps_ptr + ti[:, None] * sps + tj[None, :]).to(tl.int32)  # [4, 4]
    g, nan_g, d = _group_max(sb - 127, sb == 255, tl.arange(0, 4) >= 0, 128)  # one group: all 16 tiles; d [4, 4]
    live = tl.max(tl.max(t & 0x07070707, axis=3), axis=1) > 0  # [4, 4] tiles with a nonzero element
    r = tl.program_id(0) * 128 + tl.arange(0, 128)  # operand rows
    if tl.max(tl.reshape(tl.where(live, d, 0), [16]), axis=0) <= 11:
        byte = _word_bytes(tl.reshape(_fold_words_near(t, d[:, None, :, None]), [128, 32]), 0xFF, 128, 32).to(tl.uint8)
        tl.store(codes_ptr + r[:, None] * sc + k[None, :], tl.trans(byte))
    else:  # 16 stored rows x 32 stored columns at a time, re-read (a loop: its registers do not weigh on the usual path)
        for c in range(8):
            kc = tl.program_id(1) * 128 + c * 16 + tl.arange(0, 16)
            for b in range(4):
                wb = tl.program_id(0) * 32 + b * 8 + tl.arange(0, 8)
                tb = _spread_nibbles(tl.load(pc_ptr.to(tl.pointer_type(tl.uint16)) + kc[:, None] * spw + wb[None, :]).to(tl.uint32))
                # the shift of tile (c // 2, b): one value for these 16 x 32 elements
                db = tl.sum(tl.sum(tl.where((tl.arange(0, 4)[:, None] == c // 2) & (tl.arange(0, 4)[None, :] == b), d, 0), axis=1), axis=0)
                byte = _fold_bytes_any(tl.reshape(_word_bytes(tb, 15, 16, 8), [16, 1, 32]), tl.zeros([16, 1], tl.int32) + db,
                                       kc >= 0, count_ptr, 16)
                rb = tl.program_id(0) * 128 + b * 32 + tl.arange(0, 32)
                tl.store(codes_ptr + rb[:, None] * sc + kc[None, :], tl.trans(tl.reshape(byte, [16, 32]).to(tl.uint8)))
    _store_group_scale(g, nan_g, r, r >= 0, scales_ptr, ss, 128, 128, SCALE_PER_ROW)


def fold_tiles_mxfp4(codes: torch.Tensor, tile_scales: torch.Tensor, *, transposed: bool, group_rows: int,
                     scale_per_row: bool = False, counter: torch.Tensor | None = None,
                     rows_per_program: int | None = None, num_warps: int | None = None) -> FoldedFP8:
    """Fold packed MXFP4 with 32x32 tiles (``codes`` uint8 [S_r, S_c / 2], E8M0 ``tile_scales``
    [S_r / 32, S_c / 32], both dims multiples of 128) into FP8 with ``group_rows`` x 128 groups, as the
    operand with the stored columns as inner dim, or (``transposed``) the stored rows - read in place,
    no transposed copy. ``scale_per_row`` (with 128x128 groups): each row carries its group's scale
    (the A-operand layout, 1x128 groups of equal scales). ``formats.fold`` of the tiles' 1x32 pieces,
    bit for bit, and the same inexact count. ``rows_per_program`` / ``num_warps``: launch tuning, as
    for :func:`fold_packed_mxfp4`."""
    s_r, s_c = codes.shape[0], codes.shape[1] * 2
    if codes.ndim != 2 or s_r % 128 or s_c % 128 or tile_scales.shape != (s_r // 32, s_c // 32):
        raise ValueError(f"fold_tiles_mxfp4: codes {tuple(codes.shape)} / scales {tuple(tile_scales.shape)} are not "
                         "32x32-tile MXFP4 with both dims multiples of 128")
    if group_rows not in (1, 128) or (scale_per_row and group_rows != 128):
        raise ValueError(f"group_rows must be 1 or 128 (scale_per_row only with 128), got {group_rows}, {scale_per_row}")
    R, K = (s_c, s_r) if transposed else (s_r, s_c)
    return _packed_fold(codes, tile_scales, R, K, group_rows, counter, tile=True, transposed=transposed,
                        scale_per_row=scale_per_row, launch=(rows_per_program, num_warps))


# (rows per program, warps) of the packed fold (fold_packed_mxfp4, fold_tiles_mxfp4) by group rows: the fastest
# measured on the H200 (16384 x 8192 tile-quantized MXFP4): 1x128 groups 16 rows, 2 warps (0.118 ms); 128x128 groups
# 4 warps (0.134 ms).
PACKED_FOLD_LAUNCH = {1: (16, 2), 128: (128, 4)}


def _packed_fold(codes, scales, R: int, K: int, group_rows: int, counter, *, tile: bool, transposed: bool = False,
                 scale_per_row: bool = False, launch: tuple[int | None, int | None] = (None, None)) -> FoldedFP8:
    """Launch :func:`_packed_fold_kernel` (or, ``transposed``, :func:`_packed_fold_t_kernel`) for the
    operand [R, K] (shapes checked by the caller), with ``launch`` = (rows per program, warps) overriding
    :data:`PACKED_FOLD_LAUNCH` (1x128 groups: any power of two; 128x128 groups take 128). Same bits
    whatever the launch."""
    codes, scales = codes.contiguous(), scales.contiguous()
    if codes.data_ptr() % 2:  # the kernels read the codes as 16-bit words (row strides are even: K % 128 == 0)
        codes = codes.clone()
    out, out_s = empty_folded(R, K, group_rows, device=codes.device, scale_per_row=scale_per_row)
    counter = torch.zeros((), dtype=torch.int32, device=codes.device) if counter is None else counter
    rb, warps = PACKED_FOLD_LAUNCH[group_rows]
    rb = (launch[0] or rb) if group_rows == 1 else 128
    warps = launch[1] or warps
    if rb < 1 or rb & (rb - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {launch[0]}")
    if not (R and K):
        return FoldedFP8(out, out_s, 1 if scale_per_row else group_rows, counter)
    if transposed:
        _packed_fold_t_kernel[(R // 128, K // 128)](codes, scales, out, out_s, counter, codes.stride(0) // 2, scales.stride(0),
                                                    out.stride(0), out_s.stride(0), SCALE_PER_ROW=scale_per_row, num_warps=warps)
    else:
        _packed_fold_kernel[(triton.cdiv(R, rb), K // 128)](codes, scales, out, out_s, counter, R, codes.stride(0) // 2,
                                                            scales.stride(0), out.stride(0) // 4, out_s.stride(0), TILE=tile,
                                                            GR=group_rows, RB=rb, CH=min(rb, 16), num_warps=warps)
    return FoldedFP8(out, out_s, 1 if scale_per_row else group_rows, counter)


# (rows per program, warps) of quantize_mxfp4_fp8 by (block dim strided, group rows) - whether the operand's block dim
# is read with a stride (blocks along dim 0 of a row-major x, or along dim 1 of a transposed view: the same reads,
# the same kernel call) or contiguously; the launch follows the reads, not the axis argument. The fastest measured
# on the H200 (16384 x 8192 BF16, nearest): contiguous, 1x128 groups 32 rows, 4 warps (0.196 ms, 51% of copy),
# 128x128 groups 16 warps (0.227 ms); strided 128 rows, 4 warps (0.346 ms for 1x128 groups, 0.375 ms for 128x128).
FOLD_LAUNCH = {(False, 1): (32, 4), (False, 128): (128, 16), (True, 1): (128, 4), (True, 128): (128, 4)}
# With a fused Hadamard transform (AdaHOP's IHT GEMMs, hadamard_mxfp4): (rows per program, warps, butterflies) by
# (block dim strided, group rows), the best per group over the fused calls of AdaHOP's own 1b training step on the
# H200 (their tensors are small: a table tuned on one 16384 x 8192 tensor made the step slower). Butterflies by sums
# lead only for contiguous reads with 1x128 groups; strided reads run them 4-16x slower than permutes.
FOLD_LAUNCH_HADAMARD = {(False, 1): (16, 4, "sums"), (False, 128): (128, 8, "permutes"),
                        (True, 1): (8, 4, "permutes"), (True, 128): (128, 16, "permutes")}


def fold_launch(strided: bool, group_rows: int, hadamard: bool) -> tuple[int, int, str | None]:
    """The default launch of :func:`quantize_mxfp4_fp8` for an operand whose block dim is read with a stride
    (``strided``) or contiguously: (rows per program - 128 for 128x128 groups -, warps, the fused transform's
    butterfly form or None without one), from :data:`FOLD_LAUNCH` / :data:`FOLD_LAUNCH_HADAMARD`."""
    rb, warps, form = FOLD_LAUNCH_HADAMARD[(strided, group_rows)] if hadamard else (*FOLD_LAUNCH[(strided, group_rows)], None)
    return (rb if group_rows == 1 else 128), warps, form


def block_dim_strided(strides: tuple[int, int], axis: int) -> bool:
    """Whether :func:`quantize_mxfp4_fp8` reads the block dim (``axis``) of an x with these ``strides`` with a stride:
    what its launch follows (a row-major x along dim 0 and a transposed view along dim 1 read memory alike)."""
    return strides[axis % 2] != 1


def quantize_mxfp4_fp8(x: torch.Tensor, *, group_rows: int, scale: str = "floor", rounding: str = "nearest",
                       seed: int | None = None, counter: torch.Tensor | None = None,
                       hadamard_block: int | None = None, hadamard_signs: torch.Tensor | None = None,
                       axis: int = -1, rows_per_program: int | None = None, num_warps: int | None = None,
                       butterfly: str | None = None) -> FoldedFP8:
    """MXFP4 (1x32 along the last dim) folded into FP8 with ``group_rows`` x 128 groups; see the module
    docstring. ``axis`` 0: blocks along x's dim 0 instead - the result is that of ``x.t()`` (codes
    ``[x.shape[1], x.shape[0]]``), read from x in place, without the transposed copy.
    ``rows_per_program`` (1x128 groups only; 128x128 groups take 128) and ``num_warps`` (defaults:
    :data:`FOLD_LAUNCH`, with a Hadamard :data:`FOLD_LAUNCH_HADAMARD`, by :func:`block_dim_strided`): launch tuning, the same bits
    whatever they are. ``counter``: an int32 device tensor that the
    inexact-element count is added to (one is made if None); :attr:`FoldedFP8.inexact` is that tensor. ``hadamard_block`` (a power of two up to
    128): the block Hadamard transform along the last dim first, with ``hadamard_signs`` (RHT) if given -
    ``fold(quantize(hadamard(x, block, seed), "mxfp4", ...))`` bit for bit, for float32 and bfloat16 ``x``.
    ``butterfly`` ("permutes" or "sums"; default :data:`FOLD_LAUNCH_HADAMARD`'s): how the fused transform's stages
    run, the same bits either way (sums are far slower along dim 0)."""
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"quantize_mxfp4_fp8: axis must be 0 or 1 (-2 or -1), got {axis}")
    along_0 = axis % 2 == 0
    if x.ndim != 2 or x.shape[0 if along_0 else 1] % 128 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_mxfp4_fp8 takes a 2D float tensor whose dim {axis} (the block dim) is a multiple of 128, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if group_rows not in (1, 128):
        raise ValueError(f"group_rows must be 1 or 128, got {group_rows}")
    had = hadamard_block or 0
    if had and (had < 2 or had > 128 or had & (had - 1) or x.dtype == torch.float16):
        raise ValueError(f"quantize_mxfp4_fp8: a fused Hadamard block must be a power of two in [2, 128] on float32/bfloat16 "
                         f"input, got block {had} on {x.dtype}")
    if butterfly not in (None, "permutes", "sums"):
        raise ValueError(f"quantize_mxfp4_fp8: butterfly must be 'permutes' or 'sums', got {butterfly!r}")
    d = None if hadamard_signs is None else hadamard_signs.to(device=x.device, dtype=torch.float32).contiguous()
    norm = float(torch.tensor(1.0 / math.sqrt(had), dtype=torch.float32)) if had else 1.0  # the reference's FP32 constant
    op = x.t() if along_0 else x  # the operand [R, K] with blocks along K: a view, read in place whatever its strides
    R, K = op.shape
    codes, scales = empty_folded(R, K, group_rows, device=x.device)
    counter = torch.zeros((), dtype=torch.int32, device=x.device) if counter is None else counter
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    rb_default, warps_default, form = fold_launch(block_dim_strided(x.stride(), axis), group_rows, had > 0)
    butterfly = butterfly or form
    rb = (rows_per_program or rb_default) if group_rows == 1 else 128
    if rb < 1 or rb & (rb - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    if R and K:
        _fold_kernel[(triton.cdiv(R, rb), K // 128)](x, d if d is not None else x, codes, scales, counter, R, K, op.stride(0),
                                                     op.stride(1), codes.stride(0), scales.stride(0), key, key2, CEIL=scale == "ceil", SR=sr,
                                                     GR=group_rows, RB=rb, num_warps=num_warps or warps_default, HAD=had,
                                                     LOG_HAD=max(had.bit_length() - 1, 0),
                                                     HAS_D=d is not None, NORM=norm, ROUND_BF16=had > 0 and x.dtype == torch.bfloat16,
                                                     KEYS_PTR=kp, SUMS=had > 0 and butterfly == "sums")
    return FoldedFP8(codes, scales, group_rows, counter)


def fold_packed_mxfp4(codes: torch.Tensor, scales: torch.Tensor, *, group_rows: int,
                      counter: torch.Tensor | None = None, rows_per_program: int | None = None,
                      num_warps: int | None = None) -> FoldedFP8:
    """Fold packed MXFP4 (``codes`` uint8 [R, K/2], E8M0 ``scales`` [R, K/32], blocks along the last
    dim, K % 128 == 0) into FP8 with ``group_rows`` x 128 groups: ``formats.fold`` bit for bit, one pass.
    ``rows_per_program`` (1x128 groups) / ``num_warps``: launch tuning (:data:`PACKED_FOLD_LAUNCH`), the
    same bits."""
    if codes.ndim != 2 or scales.shape != (codes.shape[0], codes.shape[1] // 16) or (2 * codes.shape[1]) % 128:
        raise ValueError(f"fold_packed_mxfp4: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} are not 1x32 MXFP4 with K % 128 == 0")
    if group_rows not in (1, 128):
        raise ValueError(f"group_rows must be 1 or 128, got {group_rows}")
    return _packed_fold(codes, scales, codes.shape[0], codes.shape[1] * 2, group_rows, counter, tile=False,
                        launch=(rows_per_program, num_warps))


def quantize_mxfp4_fp8_and_columns(
    x: torch.Tensor, *, scale: tuple[str, str] = ("floor", "floor"), rounding: tuple[str, str] = ("nearest", "nearest"),
    seed: tuple[int | None, int | None] = (None, None), counter: torch.Tensor | None = None,
) -> tuple[FoldedFP8, QuantizedTensor]:
    """X ``[M, K]`` for both GEMMs that use it: its fprop operand, MXFP4 along K folded into FP8 with
    1x128 groups (``quantize_mxfp4_fp8(x, group_rows=1, ...)``), and its wgrad operand, MXFP4 along M
    packed (``quantize(x, "mxfp4", axis=0, ...)``, bit for bit); ``scale``, ``rounding`` and ``seed``
    are (along K, along M) pairs. M must be a multiple of 32 and K of 128.

    Two kernels, two reads of X: a single kernel that read X once and wrote both took 1.64 ms on a
    16384 x 8192 BF16 X on the H200, these two 0.65 ms together (bench/quantize_speed.py,
    bench/results/quantize_speed-NVIDIA_H200-93647de.json) - its [32, 128] tiles, each quantized along
    both axes, cost more in registers and layout shuffles than the second read of X."""
    if x.ndim != 2 or x.shape[0] % 32 or x.shape[1] % 128 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_mxfp4_fp8_and_columns takes a 2D float tensor [M, K] with M % 32 == 0 and K % 128 == 0, "
                         f"got {x.dtype} {tuple(x.shape)}")
    folded = quantize_mxfp4_fp8(x, group_rows=1, scale=scale[0], rounding=rounding[0], seed=seed[0], counter=counter)
    cols = quantize_mxfp4_columns(x, scale=scale[1], rounding=rounding[1], seed=seed[1])
    return folded, cols
