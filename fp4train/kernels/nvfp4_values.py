"""NVFP4 fake quantization in Triton: the dequantized values as exact BF16 plus the tensor scale.

``quantize(x, "nvfp4", axis=...).scaled_bf16()`` in one pass over ``x`` after the reference's
tensor-scale reduction: per 16-element block the same float order as the reference
(:mod:`fp4train.formats.nvfp4`)::

    sb = e4m3((amax_b / 6) * s_enc)     q = e2m1((x * s_enc) / sb)     value = q * sb   (exact in BF16)

with IEEE divisions (``div_rn``), E4M3 rounding in integer arithmetic (:mod:`.e4m3`) and the
stochastic-rounding uniforms at the reference's blocked indices. The GEMM divides its output by
``s_enc`` (:class:`~fp4train.formats.qtensor.ScaledBF16`). Blocks of 16 along the last dim
(``axis=1``) or down dim 0 (``axis=0``; the values stay in ``x``'s layout). Subnormal inputs:
see :mod:`.mx_values`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.qtensor import ScaledBF16
from .mx_quantize import _e2m1_codes, _kernel_keys, _keys, _uniforms
from .mx_values import _e2m1_value
from .hadamard import cols_as_rows, norm
from .nvfp4_quantize import _nvfp4_blocks, check_hadamard, device_tensor_scale, four_six


@triton.jit(do_not_specialize=["key", "key2"])
def _rows_kernel(x_ptr, s_enc_ptr, y_ptr, M, K, sx, sy, key, key2, rows_per_scale, SR: tl.constexpr, RB: tl.constexpr,
                 NB: tl.constexpr, KEYS_PTR: tl.constexpr = False, FOUR_SIX: tl.constexpr = False):
    """Tile [RB rows, NB*16 columns]: 1x16 blocks along the columns; the tensor scale of the rows' tensor (a stack's
    tensors hold ``rows_per_scale`` rows each, a multiple of RB)."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    BK: tl.constexpr = NB * 16
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (r < M)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    s_enc = tl.load(s_enc_ptr + (tl.program_id(0) * RB) // rows_per_scale)
    v, _, sb, nan_block = _nvfp4_blocks(tl.reshape(x, [RB * NB, 16]), s_enc, SR, FOUR_SIX)
    u = v
    if SR:
        u = tl.reshape(_uniforms(r[:, None] * K + c[None, :], key, key2), [RB * NB, 16])
    val = tl.where(nan_block[:, None], float("nan"), _e2m1_value(_e2m1_codes(v, u, SR)) * sb[:, None])
    tl.store(y_ptr + r[:, None] * sy + c[None, :], tl.reshape(val, [RB, BK]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["key", "key2"])
def _cols_kernel(x_ptr, s_enc_ptr, y_ptr, M, K, sx, sy, key, key2, rows_per_scale, SR: tl.constexpr, BK: tl.constexpr,
                 KEYS_PTR: tl.constexpr = False, d_ptr=None, H: tl.constexpr = False, HAS_D: tl.constexpr = False,
                 NORM: tl.constexpr = 0.25, ROUND_BF16: tl.constexpr = False, FOUR_SIX: tl.constexpr = False):
    """Tile [16 rows, BK columns]: 16x1 blocks down each column; ``H``: of the tile's 16-row Hadamard transform
    (signs at ``d_ptr`` if ``HAS_D``), computed here. The tensor scale: as :func:`_rows_kernel`'s."""
    key, key2 = _kernel_keys(key, key2, KEYS_PTR)  # host ints, or a device seed's keys (CUDA graphs)
    r = tl.program_id(0) * 16 + tl.arange(0, 16)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0)
    xt = cols_as_rows(x, d_ptr, H, HAS_D, 16, BK, 4, NORM, ROUND_BF16)
    s_enc = tl.load(s_enc_ptr + (tl.program_id(0) * 16) // rows_per_scale)
    v, _, sb, nan_block = _nvfp4_blocks(xt, s_enc, SR, FOUR_SIX)  # [BK, 16]: one block per row
    u = v
    if SR:
        u = _uniforms(c[:, None] * M + r[None, :], key, key2)  # blocked index along axis 0: k * M + m
    val = tl.where(nan_block[:, None], float("nan"), _e2m1_value(_e2m1_codes(v, u, SR)) * sb[:, None])
    tl.store(y_ptr + r[:, None] * sy + c[None, :], tl.trans(val).to(y_ptr.dtype.element_ty), mask=mask)


def nvfp4_values(x: torch.Tensor, *, axis: int, rounding: str = "nearest", seed: int | None = None,
                 hadamard: bool = False, signs: torch.Tensor | None = None, four_over_six: bool = False) -> ScaledBF16:
    """``quantize(x, "nvfp4", axis=axis, rounding=..., seed=..., four_over_six=...).scaled_bf16()`` for a 2D
    tensor whose ``axis`` is a multiple of 16 (1x16 blocks). ``hadamard`` (``axis=0``,
    float32/bfloat16): of ``fp4train.hadamard(x, 16, axis=0)`` with random ``signs`` (float32 ``[16]``;
    None: the plain transform), recomputed in registers by the amax pass and the quantization pass instead
    of written (see :func:`.nvfp4_quantize.quantize_nvfp4_columns`)."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_values takes a 2D float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}")
    if axis % 2 not in (0, 1) or x.shape[axis] % 16:
        raise ValueError(f"nvfp4_values: dim {axis} of {tuple(x.shape)} must be a multiple of 16")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"bad rounding {rounding!r}")
    if hadamard and axis % 2 != 0:
        raise ValueError("nvfp4_values: the fused Hadamard transform runs along axis 0 only")
    x = x.contiguous()
    M, K = x.shape
    d = check_hadamard("nvfp4_values", x, signs) if hadamard else None
    s_enc = device_tensor_scale(x, hadamard, signs, four_over_six)
    y = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
    sr, key, key2, kp = _keys(rounding, seed, x.device)
    if M and K:
        _launch(x, s_enc, y, along_rows=axis % 2 == 1, rows_per_scale=M, sr=sr, key=key, key2=key2, kp=kp, d=d,
                hadamard=hadamard, has_signs=signs is not None, four_over_six=four_over_six)
    return ScaledBF16(y, None, s_enc.reshape(()), axis % 2)


def _launch(x, s_enc, y, *, along_rows: bool, rows_per_scale: int, sr: bool = False, key=0, key2=0, kp: bool = False,
            d=None, hadamard: bool = False, has_signs: bool = False, four_over_six: bool = False) -> None:
    """The values kernel over a contiguous 2D ``x`` (a stack's matrices one below the other, ``rows_per_scale`` rows
    each under its own tensor scale) into ``y``: 1x16 blocks along the rows, or down the columns."""
    M, K = x.shape
    if along_rows:
        rb, nb = 16, 8
        _rows_kernel[(triton.cdiv(M, rb), triton.cdiv(K, 16 * nb))](x, s_enc, y, M, K, x.stride(0), y.stride(0), key, key2,
                                                                     rows_per_scale, SR=sr, RB=rb, NB=nb, KEYS_PTR=kp,
                                                                     **four_six(four_over_six))
    else:
        bk = 64  # 64 columns on two warps: 1.3-1.8x faster than on four on the H200 (16384 x 2048/8192 BF16)
        _cols_kernel[(M // 16, triton.cdiv(K, bk))](x, s_enc, y, M, K, x.stride(0), y.stride(0), key, key2, rows_per_scale,
                                                    SR=sr, BK=bk, KEYS_PTR=kp, d_ptr=d, H=hadamard, HAS_D=has_signs,
                                                    NORM=norm(16), ROUND_BF16=x.dtype == torch.bfloat16, num_warps=2,
                                                    **four_six(four_over_six))


def nvfp4_stacked_values(x: torch.Tensor, *, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a stack of matrices ``x`` ``[n, M, K]`` (float32/bfloat16/float16), each matrix's
    ``quantize(x[i], "nvfp4", axis=axis - 1).scaled_bf16()`` with nearest rounding: the values ``[n, M, K]`` (exact
    BF16) and the tensor scales ``[n]`` (each matrix's own, the divisors), in one launch per pass for the whole stack.
    1x16 blocks along ``axis`` 2 (the rows) or 1 (down the columns); ``M`` and that axis multiples of 16."""
    if x.ndim != 3 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_stacked_values takes a 3D float32/bfloat16/float16 stack, got {x.dtype} {tuple(x.shape)}")
    if axis % 3 not in (1, 2) or x.shape[1] % 16 or x.shape[axis] % 16:
        raise ValueError(f"nvfp4_stacked_values: blocks along axis 1 or 2 of {tuple(x.shape)}, whose dim 1 and that axis "
                         f"are multiples of 16")
    n, rows, K = x.shape
    flat = x.contiguous().reshape(n * rows, K)
    s_enc = device_tensor_scale(flat, tensors=n) if n else x.new_ones(0, dtype=torch.float32)
    y = torch.empty(n * rows, K, dtype=torch.bfloat16, device=x.device)
    if flat.numel():
        _launch(flat, s_enc, y, along_rows=axis % 3 == 2, rows_per_scale=rows)
    return y.reshape(n, rows, K), s_enc
