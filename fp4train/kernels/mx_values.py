"""MXFP4 / MXFP8 fake quantization in Triton: BF16/FP32 in, the dequantized values out as BF16.

What a GEMM on BF16 tensor cores multiplies (an E2M1 or E4M3 value x a power-of-two scale has at
most two / four significant bits, so BF16 holds it exactly): ``quantize(x, "mxfp4" | "mxfp8",
...).dequantize(bfloat16)``
in one pass - read each element once, write two bytes - with the reference's scale rule,
rounding (RTNE thresholds, or the counter-hash uniforms of stochastic rounding at the same
blocked indices) and NaN/Inf rule (a block holding one becomes all NaN). Bit-identical to the
reference; the codes themselves never reach memory.

Known difference (seen under Triton's CPU interpreter; not yet checked on a GPU): in blocks whose
amax is below about 2**-124 - where the scale 2**e or the scaled elements are FP32 subnormals -
these kernels return 0 where the reference keeps subnormal values. The tests exclude such blocks.

Three geometries, each a kernel: 1x32 blocks along the last dim (``axis=1``), 32x1 blocks along
dim 0 (``axis=0``; the values stay in ``x``'s layout), and 32x32 tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.qtensor import ScaledBF16
from .e4m3 import e4m3_codes, e4m3_value
from .mx_quantize import E2M1, E4M3, _e2m1_codes, _kernel_keys, _keys, _mx_exponent, _pow2, _uniforms, _with_sign


@triton.jit
def _e2m1_value(code):
    """The E2M1 value of a code (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    big = (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + 0.5 * m)
    v = tl.where(e == 0, 0.5 * m, big)
    return _with_sign(v, (code & 8) != 0)


@triton.jit
def _mx_values(v, u, e, SR: tl.constexpr, ELEM: tl.constexpr):
    """Dequantized values of scaled elements ``v`` (block exponents ``e``, broadcast): the element
    rounded onto its grid (E2M1 or E4M3), times 2**e."""
    if ELEM == 0:
        q = _e2m1_value(_e2m1_codes(v, u, SR))
    else:
        code = e4m3_codes(v, u, SR)
        mag = e4m3_value(code & 127)
        q = _with_sign(mag, (code & 128) != 0)
    return q * _pow2(e)


@triton.jit(do_not_specialize=["key", "key2"])
def _rows_kernel(x_ptr, y_ptr, M, K, sx, sy, key, key2,
                 CEIL: tl.constexpr, SR: tl.constexpr, RB: tl.constexpr, NB: tl.constexpr, ELEM: tl.constexpr,
                 KEYS_PTR: tl.constexpr = False):
    """Tile [RB rows, NB*32 columns]: 1x32 blocks along the columns."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    BK: tl.constexpr = NB * 32
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (r < M)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    x3 = tl.reshape(x, [RB, NB, 32])
    amax = tl.max(tl.reshape(tl.where(finite, a, 0.0), [RB, NB, 32]), axis=2)
    bad = tl.max(tl.reshape(tl.where(finite, 0, 1), [RB, NB, 32]), axis=2) > 0
    e = _mx_exponent(amax, CEIL, ELEM)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = x3 * inv[:, :, None]
    u = v
    if SR:
        idx = r[:, None] * K + c[None, :]  # the reference's blocked index along the last axis
        u = tl.reshape(_uniforms(idx, key, key2), [RB, NB, 32])
    val = _mx_values(v, u, e[:, :, None], SR, ELEM)
    val = tl.where(bad[:, :, None], float("nan"), val)
    tl.store(y_ptr + r[:, None] * sy + c[None, :], tl.reshape(val, [RB, BK]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["key", "key2"])
def _cols_kernel(x_ptr, y_ptr, M, K, sx, sy, key, key2,
                 CEIL: tl.constexpr, SR: tl.constexpr, BK: tl.constexpr, ELEM: tl.constexpr,
                 KEYS_PTR: tl.constexpr = False):
    """Tile [32 rows, BK columns]: 32x1 blocks down each column."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    r = tl.program_id(0) * 32 + tl.arange(0, 32)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    amax = tl.max(tl.where(finite, a, 0.0), axis=0)
    bad = tl.max(tl.where(finite, 0, 1), axis=0) > 0
    e = _mx_exponent(amax, CEIL, ELEM)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = x * inv[None, :]
    u = v
    if SR:
        u = _uniforms(c[None, :] * M + r[:, None], key, key2)  # blocked index along axis 0: k * M + m
    val = _mx_values(v, u, e[None, :], SR, ELEM)
    val = tl.where(bad[None, :], float("nan"), val)
    tl.store(y_ptr + r[:, None] * sy + c[None, :], val.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["key", "key2"])
def _tiles_kernel(x_ptr, y_ptr, R, C, n_tc, sx, sy, key, key2, CEIL: tl.constexpr, SR: tl.constexpr, ELEM: tl.constexpr,
                  KEYS_PTR: tl.constexpr = False):
    """One 32x32 tile (zero padding outside the tensor, like the reference's canonical layout)."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    tr = tl.program_id(0)
    tc = tl.program_id(1)
    i = tl.arange(0, 32)
    r = tr * 32 + i
    c = tc * 32 + i
    mask = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")
    amax = tl.max(tl.max(tl.where(finite, a, 0.0), axis=1), axis=0)
    bad = tl.max(tl.max(tl.where(finite, 0, 1), axis=1), axis=0) > 0
    e = _mx_exponent(amax, CEIL, ELEM)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = x * inv
    u = v
    if SR:
        u = _uniforms((tr * n_tc + tc) * 1024 + i[:, None] * 32 + i[None, :], key, key2)
    val = _mx_values(v, u, e, SR, ELEM)
    val = tl.where(bad, float("nan"), val)
    tl.store(y_ptr + r[:, None] * sy + c[None, :], val.to(y_ptr.dtype.element_ty), mask=mask)


def mxfp4_values(x: torch.Tensor, *, axis: int | None, scale: str = "floor", rounding: str = "nearest",
                 seed: int | None = None) -> ScaledBF16:
    """``quantize(x, "mxfp4", axis=axis, scale=..., rounding=..., seed=...)`` as :class:`ScaledBF16`
    (BF16 values; MX needs no outer factors). ``axis`` 1 or 0 for 1x32 blocks (that dim a
    multiple of 32), ``None`` for 32x32 tiles (any shape)."""
    return _mx_values_call("mxfp4", E2M1, x, axis, scale, rounding, seed)


def mxfp8_values(x: torch.Tensor, *, axis: int | None, scale: str = "floor", rounding: str = "nearest",
                 seed: int | None = None) -> ScaledBF16:
    """:func:`mxfp4_values` for MXFP8 (E4M3 elements): ``quantize(x, "mxfp8", ...)`` as BF16 values."""
    return _mx_values_call("mxfp8", E4M3, x, axis, scale, rounding, seed)


def _mx_values_call(fmt, elem, x, axis, scale, rounding, seed) -> ScaledBF16:
    name = f"{fmt}_values"
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} takes a 2D float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}")
    if axis is not None and (axis % 2 not in (0, 1) or x.shape[axis] % 32):
        raise ValueError(f"{name}: dim {axis} of {tuple(x.shape)} must be a multiple of 32")
    if scale not in ("floor", "ceil") or rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad scale {scale!r} or rounding {rounding!r}")
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    ceil = scale == "ceil"
    if M and K:
        if axis is None:
            n_tc = triton.cdiv(K, 32)
            _tiles_kernel[(triton.cdiv(M, 32), n_tc)](x, y, M, K, n_tc, x.stride(0), y.stride(0), key, key2, CEIL=ceil, SR=sr,
                                                     ELEM=elem, KEYS_PTR=kp)
        elif axis % 2 == 1:
            rb, nb = 16, 4
            _rows_kernel[(triton.cdiv(M, rb), triton.cdiv(K, 32 * nb))](x, y, M, K, x.stride(0), y.stride(0), key, key2,
                                                                         CEIL=ceil, SR=sr, RB=rb, NB=nb, ELEM=elem, KEYS_PTR=kp)
        else:
            bk = 64
            _cols_kernel[(M // 32, triton.cdiv(K, bk))](x, y, M, K, x.stride(0), y.stride(0), key, key2,
                                                         CEIL=ceil, SR=sr, BK=bk, ELEM=elem, KEYS_PTR=kp)
    return ScaledBF16(y, None, None, None if axis is None else axis % 2)
