"""FP8 rowwise fake quantization in Triton: E4M3 values as exact BF16 plus the FP32 row scales.

``quantize(x, "fp8", axis=axis).scaled_bf16()`` (nearest rounding): the per-row scale comes from
one pass over x (:func:`.amax.finite_amax_along`: the reference's finite amax, ``s = amax / 448``
rounded once, ``s = 1`` for an all-zero row), then one pass writes ``e4m3(x / s)`` - IEEE division
(``div_rn``), E4M3 round-to-nearest-even in integer arithmetic (:mod:`.e4m3`), saturating at
448, NaN/Inf elements to NaN - as BF16 (every E4M3 value is exact in BF16). A row holding
NaN/Inf gets a NaN scale, as in the reference. ``axis=1``: one scale per row; ``axis=0``: one per
column (the values stay in ``x``'s layout).

:func:`quantize_fp8_rowwise_both` makes both layouts of one tensor (X for fprop and wgrad, dY for
dgrad and wgrad) from two reads instead of four: one pass for the row and the column amax together
(per-tile maxima merged with integer atomic max on the FP32 bit patterns, exact in any order for
non-negative values), one pass that writes both code layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import fp8_rowwise as ref_fp8
from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from .amax import finite_abs, finite_amax_along
from .e4m3 import e4m3_rtne
from .mx_quantize import _with_sign


@triton.jit
def _e4m3_byte(v):
    """The E4M3 byte of scaled values ``v``: round to nearest even, saturating at 448, sign in bit 7,
    NaN/Inf -> the NaN code 0x7F (the reference's encode)."""
    code, mag = e4m3_rtne(tl.minimum(tl.abs(v), 448.0))
    negative = v.to(tl.int32, bitcast=True) < 0
    return tl.where(tl.abs(v) < float("inf"), code | tl.where(negative, 0x80, 0), 0x7F).to(tl.uint8)


@triton.jit
def _fp8_values_kernel(x_ptr, s_ptr, y_ptr, M, K, sx, sy_r, sy_c, PER_ROW: tl.constexpr, CODES: tl.constexpr,
                       RB: tl.constexpr, BK: tl.constexpr):
    """``e4m3(x / s)`` of a [RB, BK] tile of x [M, K] (s per row or per column), stored at
    ``y_ptr + r * sy_r + c * sy_c``: the E4M3 value (BF16 ``y``) or, with CODES, the E4M3 byte
    (sign bit 7, NaN/Inf elements -> the NaN code 0x7F, as the reference's encode)."""
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (r < M)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        s = tl.load(s_ptr + r, mask=r < M, other=1.0)[:, None]
    else:
        s = tl.load(s_ptr + c, mask=c < K, other=1.0)[None, :]
    v = tl.math.div_rn(x, s)
    if CODES:
        out = _e4m3_byte(v)
    else:
        code, mag = e4m3_rtne(tl.minimum(tl.abs(v), 448.0))
        negative = v.to(tl.int32, bitcast=True) < 0
        out = tl.where(tl.abs(v) < float("inf"), _with_sign(mag, negative), float("nan")).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r[:, None] * sy_r + c[None, :] * sy_c, out, mask=mask)


def _fp8_rows(name: str, x: torch.Tensor, axis: int, codes: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The shared work of both wrappers: (E4M3 output, FP32 scales with NaN for a row holding NaN/Inf,
    the dim the scales run over). ``codes``: E4M3 bytes stored with the scaled axis last (x^T for
    axis 0); else BF16 values in x's layout."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or axis % 2 not in (0, 1):
        raise ValueError(f"{name} takes a 2D float32/bfloat16/float16 tensor and axis 0 or 1, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    M, K = x.shape
    red = axis % 2  # the scale runs over this dim: one scale per index of the other
    amax, bad = finite_amax_along(x, red)  # one pass: max |x| over the finite elements, any NaN/Inf
    s = ref_fp8.scale_from_amax(amax).contiguous()
    if codes:
        y = torch.empty((M, K) if red == 1 else (K, M), dtype=torch.uint8, device=x.device)
        sy_r, sy_c = (y.stride(0), 1) if red == 1 else (1, y.stride(0))  # axis 0: element (r, c) at [c, r]
    else:
        y = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
        sy_r, sy_c = y.stride(0), 1
    if M and K:
        rb, bk = 16, 128
        _fp8_values_kernel[(triton.cdiv(M, rb), triton.cdiv(K, bk))](x, s, y, M, K, x.stride(0), sy_r, sy_c,
                                                                    PER_ROW=red == 1, CODES=codes, RB=rb, BK=bk)
    return y, _nan_where(bad, s), red


def _nan_where(bad: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The scales with NaN for each row that holds a NaN/Inf (as the reference's)."""
    return torch.where(bad.bool(), torch.full_like(s, float("nan")), s)


def _fp8_qtensor(codes: torch.Tensor, s: torch.Tensor, x: torch.Tensor, red: int) -> QuantizedTensor:
    """``quantize(x, "fp8", axis=red)``'s QuantizedTensor over the kernel's codes (the scaled axis last)
    and FP32 scales (one per row of that layout)."""
    return QuantizedTensor("fp8", codes, s.reshape(-1, 1), None, BlockLayout(tuple(x.shape), (x.shape[red],), red), x.dtype)


def fp8_rowwise_values(x: torch.Tensor, *, axis: int) -> ScaledBF16:
    """``quantize(x, "fp8", axis=axis).scaled_bf16()`` for a 2D tensor (nearest rounding)."""
    y, s, red = _fp8_rows("fp8_rowwise_values", x, axis, codes=False)
    return ScaledBF16(y, s, None, red)


def quantize_fp8_rowwise(x: torch.Tensor, *, axis: int) -> QuantizedTensor:
    """``quantize(x, "fp8", axis=axis)`` (nearest rounding) for a 2D tensor: the same codes, scales and
    layout - E4M3 bytes stored with the scaled axis last (x's layout for axis 1, x^T for axis 0, written
    transposed by the kernel) and one FP32 scale per row of that layout (NaN for a row holding NaN/Inf).
    That stored layout is what an FP8 tensor-core GEMM takes: row-major A, and B as the transposed view."""
    codes, s, red = _fp8_rows("quantize_fp8_rowwise", x, axis, codes=True)
    return _fp8_qtensor(codes, s, x, red)


@triton.jit
def _amax_both_kernel(x_ptr, ramax_ptr, camax_ptr, rbad_ptr, cbad_ptr, M, K, sx, RB: tl.constexpr, BK: tl.constexpr,
                      CHUNK: tl.constexpr):
    """Row and column finite amax of rows ``program_id(0) * CHUNK .. + CHUNK`` (in RB-row steps) and columns
    ``program_id(1) * BK .. + BK`` of x [M, K], merged into int32 buffers (the FP32 bits of non-negative values
    order like the integers, so atomic max is exact in any order): each row's maximum over the tile's columns
    at every step, each column's over the whole chunk once at the end."""
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    cm = c < K
    camax = tl.zeros([BK], tl.float32)
    cbad = tl.zeros([BK], tl.int32)
    for i in range(0, CHUNK, RB):
        r = tl.program_id(0) * CHUNK + i + tl.arange(0, RB)
        rm = r < M
        af, bad = finite_abs(tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=rm[:, None] & cm[None, :], other=0.0))
        tl.atomic_max(ramax_ptr + r, tl.max(af, axis=1).to(tl.int32, bitcast=True), mask=rm)
        tl.atomic_max(rbad_ptr + r, tl.max(bad, axis=1), mask=rm)
        camax = tl.maximum(camax, tl.max(af, axis=0))
        cbad = tl.maximum(cbad, tl.max(bad, axis=0))
    tl.atomic_max(camax_ptr + c, camax.to(tl.int32, bitcast=True), mask=cm)
    tl.atomic_max(cbad_ptr + c, cbad, mask=cm)


@triton.jit
def _fp8_both_kernel(x_ptr, rs_ptr, cs_ptr, yr_ptr, yc_ptr, M, K, sx, RB: tl.constexpr, BK: tl.constexpr):
    """E4M3 codes of a [RB, BK] tile of x [M, K] scaled per row (stored at ``yr[r, c]``, [M, K]) and per
    column (stored transposed at ``yc[c, r]``, [K, M], from the tile transposed in registers so that the
    store runs along r), from one read; as ``_fp8_values_kernel`` with CODES."""
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (r < M)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    rs = tl.load(rs_ptr + r, mask=r < M, other=1.0)[:, None]
    cs = tl.load(cs_ptr + c, mask=c < K, other=1.0)[None, :]
    tl.store(yr_ptr + r[:, None] * K + c[None, :], _e4m3_byte(tl.math.div_rn(x, rs)), mask=mask)
    yc = tl.trans(_e4m3_byte(tl.math.div_rn(x, cs)))
    tl.store(yc_ptr + c[:, None] * M + r[None, :], yc, mask=(c < K)[:, None] & (r < M)[None, :])


def quantize_fp8_rowwise_both(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(quantize(x, "fp8", axis=1), quantize(x, "fp8", axis=0))`` (nearest rounding) of a 2D tensor,
    bit for bit :func:`quantize_fp8_rowwise` of each axis, from two reads of ``x`` instead of four."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_fp8_rowwise_both takes a 2D float32/bfloat16/float16 tensor, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    M, K = x.shape
    if M == 0 or K == 0:
        return quantize_fp8_rowwise(x, axis=1), quantize_fp8_rowwise(x, axis=0)
    bufs = torch.zeros(2 * (M + K), dtype=torch.int32, device=x.device)
    ramax, camax, rbad, cbad = bufs.split((M, K, M, K))
    rb, bk, chunk = 32, 128, 256  # a program: 256 rows x 128 columns, one column atomic per chunk (not per 32 rows)
    _amax_both_kernel[(triton.cdiv(M, chunk), triton.cdiv(K, bk))](x, ramax, camax, rbad, cbad, M, K, x.stride(0), RB=rb, BK=bk,
                                                                  CHUNK=chunk)
    rb, bk = 64, 64
    grid = (triton.cdiv(M, rb), triton.cdiv(K, bk))
    rs, cs = (ref_fp8.scale_from_amax(a.view(torch.float32)).contiguous() for a in (ramax, camax))
    yr = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    yc = torch.empty(K, M, dtype=torch.uint8, device=x.device)
    _fp8_both_kernel[grid](x, rs, cs, yr, yc, M, K, x.stride(0), RB=rb, BK=bk)
    return _fp8_qtensor(yr, _nan_where(rbad, rs), x, 1), _fp8_qtensor(yc, _nan_where(cbad, cs), x, 0)
