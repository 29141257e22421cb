"""Fused NVFP4 quantization in Triton (16-element blocks, E4M3 block scales, FP32 tensor scale).

Bit-identical to ``fp4train.quantize(x, "nvfp4", ...)`` along the last dim of a 2D tensor whose
last dim is a multiple of 16. The tensor scale ``s_enc`` is the reference's
(``formats.nvfp4.scale_from_amax``) of the finite amax, taken in one pass and left on the device
(:func:`device_tensor_scale`) - no host sync; the kernel then does the per-block work in the
reference's float order::

    sb = e4m3((amax_b / 6) * s_enc)      q = e2m1((x * s_enc) / sb)

with IEEE divisions (``div_rn``) and E4M3 rounding in integer arithmetic (:mod:`.e4m3`); under
stochastic rounding a block whose largest element would scale past 6 takes the next E4M3 scale up
(``formats.nvfp4.block_scales``), so SR stays unbiased.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import nvfp4 as ref_nvfp4
from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor
from .amax import finite_amax_along, hadamard_finite_amax
from .hadamard import cols_as_rows, norm
from .e4m3 import e4m3_rtne, e4m3_value
from .mx_quantize import _e2m1_codes, _kernel_keys, _keys, _uniforms
from .mx_values import _e2m1_value


@triton.jit
def _nvfp4_blocks(x, s_enc, SR: tl.constexpr, FOUR_SIX: tl.constexpr = False):
    """Per 16-element block, one block per row of ``x`` ``[n, 16]`` (float32): the scaled elements
    ``v = (x * s_enc) / sb`` ready for E2M1 rounding, the E4M3 block scale (code and value) and the
    NaN/Inf flag, in the reference's float order (non-finite elements count as 0 in the amax). ``FOUR_SIX``:
    the scale that maps the block's largest element to 6 or to 4, whichever errs less (:func:`_four_over_six`)."""
    finite = tl.abs(x) < float("inf")
    nan_block = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    x = tl.where(finite, x, 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    sb_code, sb = _nvfp4_scale(amax, s_enc, SR, 6.0)
    if FOUR_SIX:
        sb_code, sb = _four_over_six(x, amax, s_enc, sb_code, sb, SR)
    return _nvfp4_scaled(x, s_enc, sb[:, None]), sb_code, sb, nan_block


@triton.jit
def _nvfp4_scale(amax, s_enc, SR: tl.constexpr, TARGET: tl.constexpr = 6.0):
    """The E4M3 block scale (code, value) of a block's finite amax: ``e4m3((amax / TARGET) * s_enc)``; with SR
    one code up where the block's largest element would scale past 6 (``(amax * s_enc) / sb > 6``, the
    same float as that element's ``v``), never past 448 (code 126)."""
    code, sb = e4m3_rtne(tl.minimum(tl.math.div_rn(amax, TARGET) * s_enc, 448.0))
    if SR:
        over = (sb > 0.0) & (tl.math.div_rn(amax * s_enc, tl.where(sb > 0.0, sb, 1.0)) > 6.0) & (code < 126)
        code = tl.where(over, code + 1, code)
        sb = tl.where(over, e4m3_value(code), sb)
    return code, sb


@triton.jit
def _four_over_six(x, amax, s_enc, code6, sb6, SR: tl.constexpr):
    """4/6 block scaling of blocks ``x`` ``[n, 16]`` (finite float32) with their amaxes and the 6-scales
    ``(code6, sb6)``: the 4-scale (``amax / 4``) where its round-to-nearest encoding's squared error is smaller
    - the reference's choice (:func:`fp4train.formats.nvfp4.encode_blocks`): errors of the nearest encodings,
    under SR too, summed in its fixed tree. Launch with ``enable_fp_fusion=False`` (:func:`four_six`)."""
    code4, sb4, near4, near6 = _four_six_candidates(amax, s_enc, sb6, SR)
    err4 = _pairwise_sum16(_squared_errors(x, s_enc, near4[:, None]))
    err6 = _pairwise_sum16(_squared_errors(x, s_enc, near6[:, None]))
    use4 = err4 < err6
    return tl.where(use4, code4, code6), tl.where(use4, sb4, sb6)


@triton.jit
def _four_six_candidates(amax, s_enc, sb6, SR: tl.constexpr):
    """4/6's candidates for blocks with amaxes ``amax`` and 6-scale ``sb6``: the 4-scale ``(code4, sb4)`` (bumped
    under SR as the 6-scale is), and the two nearest scales ``(near4, near6)`` the choice is made on - SR's bump may
    have moved the scales the blocks are encoded with."""
    code4, sb4 = _nvfp4_scale(amax, s_enc, SR, 4.0)
    if SR:
        _, near6 = _nvfp4_scale(amax, s_enc, False, 6.0)
        _, near4 = _nvfp4_scale(amax, s_enc, False, 4.0)
    else:
        near6 = sb6
        near4 = sb4
    return code4, sb4, near4, near6


@triton.jit
def _squared_errors(x, s_enc, sb):
    """Per element of blocks ``x`` (any shape; ``sb`` broadcast to it), the squared error of its round-to-nearest
    NVFP4 value: ``((e2m1(v) * sb) / s_enc - x) ** 2``, the reference's float order."""
    v = _nvfp4_scaled(x, s_enc, sb)
    d = tl.math.div_rn(_e2m1_value(_e2m1_codes(v, v, False)) * sb, s_enc) - x
    return d * d


@triton.jit
def _pairwise_sum16(t):
    """The sum of each row of ``t`` ``[n, 16]`` in :func:`fp4train.formats.nvfp4.pairwise_sum`'s tree: neighbours
    first (each level a sum over an axis of two, which is one addition whatever the order)."""
    n: tl.constexpr = t.shape[0]
    t = tl.sum(tl.reshape(t, [n, 8, 2]), axis=2)
    t = tl.sum(tl.reshape(t, [n, 4, 2]), axis=2)
    t = tl.sum(tl.reshape(t, [n, 2, 2]), axis=2)
    return tl.sum(t, axis=1)


@triton.jit
def _nvfp4_scaled(x, s_enc, sb):
    """Finite elements ``x`` scaled for E2M1 rounding, ``(x * s_enc) / sb`` (``sb`` broadcast to
    ``x``), 0 in a block whose scale is 0."""
    return tl.where(sb == 0.0, 0.0, tl.math.div_rn(x * s_enc, tl.where(sb == 0.0, 1.0, sb)))


@triton.jit(do_not_specialize=["key", "key2"])
def _nvfp4_kernel(
    x_ptr, s_enc_ptr, codes_ptr, scales_ptr,
    n_blocks_row, stride_x, stride_c, stride_s, key, key2,
    SR: tl.constexpr, BLOCKS: tl.constexpr,
    KEYS_PTR: tl.constexpr = False, FOUR_SIX: tl.constexpr = False,
):
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 16)
    bmask = blk < n_blocks_row
    offs = blk[:, None] * 16 + j[None, :]
    x = tl.load(x_ptr + row * stride_x + offs, mask=bmask[:, None], other=0.0).to(tl.float32)
    v, sb_code, sb, nan_block = _nvfp4_blocks(x, tl.load(s_enc_ptr), SR, FOUR_SIX)
    u = v
    if SR:
        u = _uniforms((row * n_blocks_row + blk)[:, None] * 16 + j[None, :], key, key2)
    code = _e2m1_codes(v, u, SR)
    code = tl.where(nan_block[:, None], 0, code)
    lo, hi = tl.split(tl.reshape(code, [BLOCKS, 8, 2]))
    poffs = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(codes_ptr + row * stride_c + poffs, (lo | (hi << 4)).to(tl.uint8), mask=bmask[:, None])
    tl.store(scales_ptr + row * stride_s + blk, tl.where(nan_block, 0x7F, sb_code).to(tl.uint8), mask=bmask)


@triton.jit
def _scale_from_amaxes_kernel(amax_ptr, n, out_ptr, TOP: tl.constexpr, FP32_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: ``formats.nvfp4.scale_from_amax`` of the largest of the ``n`` finite amaxes from ``amax_ptr + i * n``
    (one tensor's, of a stack of tensors), into ``out_ptr + i``: ``TOP / amax`` rounded once, at most the largest
    FP32, 1 where the amax is 0 (none, or all zero)."""
    amax = tl.zeros([BLOCK], tl.float32)
    first = tl.program_id(0) * n
    for i in range(0, n, BLOCK):
        o = i + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.load(amax_ptr + first + o, mask=o < n, other=0.0))
    a = tl.max(amax, axis=0)
    s = tl.minimum(tl.math.div_rn(TOP, tl.where(a == 0, 1.0, a)), FP32_MAX)
    tl.store(out_ptr + tl.program_id(0), tl.where(a == 0, 1.0, s))


def device_tensor_scale(x: torch.Tensor, hadamard: bool = False, signs: torch.Tensor | None = None,
                        four_over_six: bool = False, tensors: int = 1) -> torch.Tensor:
    """NVFP4's ``s_enc`` of ``x`` (``formats.nvfp4.scale_from_amax`` of the finite amax, taken in one
    pass by :func:`.amax.finite_amax_along`) as a 1-element FP32 tensor on ``x``'s device, which the kernels
    load: no host synchronisation, and two launches (the amax, then the scale from it). ``hadamard``: of
    ``x``'s 16-row block Hadamard transform with ``signs`` (:func:`.amax.hadamard_finite_amax`: the transform
    recomputed, not written). ``four_over_six``: the tensor scale of 4/6 block scaling, ``(448 * 4) / amax``.
    ``tensors``: ``x``'s rows are that many tensors stacked (equal row counts), each with its own scale: ``[tensors]``."""
    if hadamard:
        amaxes = hadamard_finite_amax(x, signs, 16).reshape(1)
    else:
        amaxes = finite_amax_along(x, 1)[0] if x.numel() else x.new_zeros(0, dtype=torch.float32)
    s_enc = torch.empty(tensors, dtype=torch.float32, device=x.device)
    _scale_from_amaxes_kernel[(tensors,)](amaxes, amaxes.numel() // tensors, s_enc, TOP=448.0 * (4.0 if four_over_six else 6.0),
                                          FP32_MAX=ref_nvfp4._FP32_MAX, BLOCK=1024, num_warps=4)
    return s_enc


def four_six(four_over_six: bool) -> dict:
    """Launch options of an NVFP4 kernel with or without 4/6 block scaling: its choice compares sums of squares,
    which must not fuse into multiply-adds (the reference rounds each product)."""
    return dict(FOUR_SIX=True, enable_fp_fusion=False) if four_over_six else {}


def check_hadamard(name: str, x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """The signs as the fused transform loads them (float32 ``[16]`` on ``x``'s device, or ``x`` as an unused
    pointer), after checking that the fused transform takes ``x`` (float32/bfloat16: the transform rounds to it)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: the fused Hadamard transform takes float32/bfloat16, got {x.dtype}")
    if signs is None:
        return x
    if signs.numel() != 16:
        raise ValueError(f"{name}: the fused Hadamard transform takes 16 signs, got {signs.numel()}")
    return signs.to(device=x.device, dtype=torch.float32).contiguous()


def _check(name: str, x: torch.Tensor, dim: int, rounding: str) -> torch.Tensor:
    """``x`` contiguous, after checking a 2D float tensor whose ``dim`` holds whole 16-element blocks."""
    if x.ndim != 2 or x.shape[dim] % 16:
        what = "last dim" if dim == 1 else "dim 0"
        raise ValueError(f"{name} needs a 2D tensor whose {what} is a multiple of 16, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} takes float32/bfloat16/float16, got {x.dtype}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad rounding {rounding!r}")
    return x.contiguous()


def quantize_nvfp4(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None,
                   blocks_per_program: int = 8, four_over_six: bool = False) -> QuantizedTensor:
    """NVFP4 along the last dim of a 2D tensor (last dim a multiple of 16), fused; see the module docstring.
    ``four_over_six``: 4/6 block scaling (:func:`fp4train.formats.nvfp4.encode_blocks`)."""
    x = _check("quantize_nvfp4", x, 1, rounding)
    rows, k = x.shape
    nb = k // 16
    s_enc = device_tensor_scale(x, four_over_six=four_over_six)
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, nb, dtype=torch.uint8, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    if rows and nb:
        grid = (rows, triton.cdiv(nb, blocks_per_program))
        _nvfp4_kernel[grid](x, s_enc, codes, scales, nb, x.stride(0), codes.stride(0), scales.stride(0), key, key2,
                            SR=sr, BLOCKS=blocks_per_program, KEYS_PTR=kp, **four_six(four_over_six))
    return QuantizedTensor("nvfp4", codes, scales, s_enc.reshape(()), BlockLayout(tuple(x.shape), (16,), 1), x.dtype)


@triton.jit(do_not_specialize=["key", "key2"])
def _nvfp4_cols_kernel(x_ptr, s_enc_ptr, cc_ptr, cs_ptr, M, K, stride_x, stride_cc, stride_cs, key, key2,
                       SR: tl.constexpr, BK: tl.constexpr, KEYS_PTR: tl.constexpr = False, d_ptr=None,
                       H: tl.constexpr = False, HAS_D: tl.constexpr = False, NORM: tl.constexpr = 0.25,
                       ROUND_BF16: tl.constexpr = False, FOUR_SIX: tl.constexpr = False):
    """A [16, BK] tile of X -> NVFP4 along M (16x1 blocks down the columns), stored as X^T packed; ``H``: of
    the tile's 16-row Hadamard transform (signs at ``d_ptr`` if ``HAS_D``), computed here."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    pm = tl.program_id(0)
    m = pm * 16 + tl.arange(0, 16)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    kmask = kk < K
    x = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=kmask[None, :], other=0.0)
    xt = cols_as_rows(x, d_ptr, H, HAS_D, 16, BK, 4, NORM, ROUND_BF16)
    v, sb_code, sb, nan_block = _nvfp4_blocks(xt, tl.load(s_enc_ptr), SR, FOUR_SIX)  # [BK, 16]: one block per row
    u = v
    if SR:
        u = _uniforms(kk[:, None] * M + m[None, :], key, key2)  # blocked index along axis 0: k * M + m
    code = tl.where(nan_block[:, None], 0, _e2m1_codes(v, u, SR))
    lo, hi = tl.split(tl.reshape(code, [BK, 8, 2]))
    pc = pm * 8 + tl.arange(0, 8)
    tl.store(cc_ptr + kk[:, None] * stride_cc + pc[None, :], (lo | (hi << 4)).to(tl.uint8), mask=kmask[:, None])
    tl.store(cs_ptr + kk * stride_cs + pm, tl.where(nan_block, 0x7F, sb_code).to(tl.uint8), mask=kmask)


def quantize_nvfp4_columns(x: torch.Tensor, *, rounding: str = "nearest", seed: int | None = None,
                           block_cols: int = 64, hadamard: bool = False, signs: torch.Tensor | None = None,
                           four_over_six: bool = False) -> QuantizedTensor:
    """NVFP4 along dim 0 of a 2D tensor (``quantize(x, "nvfp4", axis=0, ...)`` bit for bit; dim 0 a
    multiple of 16) straight from ``x``'s row-major layout - no transposed copy of ``x``. ``hadamard``: of
    ``fp4train.hadamard(x, 16, axis=0)`` with random ``signs`` (float32 ``[16]``; None: the plain transform),
    computed in the kernel's registers - the tensor scale's amax and the quantization each recompute it, so the
    transformed tensor is never written (float32/bfloat16 ``x``). ``four_over_six``: 4/6 block scaling. Two warps a program: 2x faster than four on the
    H200 (16384 x 2048/8192 BF16)."""
    x = _check("quantize_nvfp4_columns", x, 0, rounding)
    M, K = x.shape
    d = check_hadamard("quantize_nvfp4_columns", x, signs) if hadamard else None
    s_enc = device_tensor_scale(x, hadamard, signs, four_over_six)
    cc = torch.empty(K, M // 2, dtype=torch.uint8, device=x.device)
    cs = torch.empty(K, M // 16, dtype=torch.uint8, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    if M and K:
        _nvfp4_cols_kernel[(M // 16, triton.cdiv(K, block_cols))](x, s_enc, cc, cs, M, K, x.stride(0), cc.stride(0), cs.stride(0),
                                                                   key, key2, SR=sr, BK=block_cols, KEYS_PTR=kp,
                                                                   d_ptr=d, H=hadamard, HAS_D=signs is not None, NORM=norm(16),
                                                                   ROUND_BF16=x.dtype == torch.bfloat16, num_warps=2,
                                                                   **four_six(four_over_six))
    return QuantizedTensor("nvfp4", cc, cs, s_enc.reshape(()), BlockLayout((M, K), (16,), 0), x.dtype)
