"""Outlier Extraction (OE): a GEMM whose outlier rows/channels run in high precision.

For ``C = A B^T`` (A ``[m, K]``, B ``[n, K]``, inner dim K) take out

* ``a_rows``: outlier rows of A (outer pattern of A) -> output rows,
* ``b_rows``: outlier rows of B (outer pattern of B) -> output columns,
* ``inner``: outlier inner channels (inner pattern of A or B),

zero them in the residuals ``A_r``, ``B_r``, and compute, exactly in the decomposition

    C = Q(A_r) Q(B_r)^T                          # residual: inner Hadamard + MXFP4 (any prepare)
      + A[:, S] B[:, S]^T                        # rank-|S| update over the inner channels S
    C[a_rows, :] = A[a_rows, :] B_hp^T           # scatter: exact rows
    C[:, b_rows] = A_hp B[b_rows, :]^T           # scatter: exact columns

The high-precision slices (``A[a_rows]``, ``A[:, S]``, ...) are copied as they are (no
rounding), the products are FP32. For entries outside the extracted rows/columns the
residual and the rank-|S| update add up to the full product because ``A_r`` and ``B_r`` are
zero on S (cross terms vanish).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .foid import foid


@dataclass
class Extraction:
    """Which rows and inner channels a GEMM takes out of quantization."""

    a_rows: torch.Tensor | None = None
    b_rows: torch.Tensor | None = None
    inner: torch.Tensor | None = None
    #: bool per ``inner`` index: True where it repeats the one before (``inner`` is then sorted), so that its
    #: rank-1 term is added once - a union of two index sets made without ``torch.unique``'s host sync
    inner_repeat: torch.Tensor | None = None


def split(t: torch.Tensor, rows: torch.Tensor | None, inner: torch.Tensor | None):
    """(residual with ``rows`` and ``inner`` columns zeroed, row slice, column slice) - slices exact."""
    res = t.clone()
    row_slice = t[rows] if rows is not None else None
    col_slice = t[:, inner] if inner is not None else None
    # index_fill_, not `res[rows] = 0`: indexed assignment of a Python number copies it to the device first,
    # which a CUDA-graph capture refuses (AdaHOP with mode="reduce-overhead" on the H200)
    if rows is not None:
        res.index_fill_(0, rows, 0.0)
    if inner is not None:
        res.index_fill_(1, inner, 0.0)
    return res, row_slice, col_slice


def oe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    ext: Extraction,
    residual_gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``A B^T`` with the extracted parts in high precision; ``residual_gemm(A_r, B_r)`` does the rest (FP32 out)."""
    a_res, a_row, a_col = split(a, ext.a_rows, ext.inner)
    b_res, b_row, b_col = split(b, ext.b_rows, ext.inner)
    c = residual_gemm(a_res, b_res).float()
    if ext.inner is not None:  # rank-|S| update, added by the GEMM itself (C += A_S B_S^T): no extra pass over C
        a_col, b_col = a_col.float(), b_col.float()
        if ext.inner_repeat is not None:  # a repeated channel's columns set to zero (not multiplied: 0 * Inf)
            a_col, b_col = a_col.masked_fill(ext.inner_repeat, 0.0), b_col.masked_fill(ext.inner_repeat, 0.0)
        c.addmm_(a_col, b_col.T)
    if ext.a_rows is not None:
        c.index_copy_(0, ext.a_rows, a_row.float() @ b.float().T)
    if ext.b_rows is not None:
        c.index_copy_(1, ext.b_rows, a.float() @ b_row.float().T)
    return c


def extraction_for(a: torch.Tensor, b: torch.Tensor, rel_a: str, rel_b: str, k: int) -> Extraction:
    """FOID on whichever operand has a pattern relative to the GEMM (``"outer"``, ``"inner"`` or ``"none"``, as
    :class:`~fp4train.recipes.spec.OutlierSpec` names them): outer -> its ``k`` rows, inner -> ``k`` inner channels."""
    inner = []
    if rel_a == "inner":
        inner.append(foid(a, k, axis=1))
    if rel_b == "inner":
        inner.append(foid(b, k, axis=1))
    repeat = None
    if len(inner) == 2:  # both operands' channels: their sorted union, without torch.unique (a host sync,
        # which a CUDA-graph capture refuses): an index found by both is kept twice and marked as a repeat
        joined = torch.cat(inner).sort().values
        repeat = torch.zeros_like(joined, dtype=torch.bool)
        repeat[1:] = joined[1:] == joined[:-1]
        inner = [joined]
    return Extraction(
        a_rows=foid(a, k, axis=0) if rel_a == "outer" else None,
        b_rows=foid(b, k, axis=0) if rel_b == "outer" else None,
        inner=inner[0] if inner else None,  # one operand's channels: foid's indices are sorted and distinct
        inner_repeat=repeat,
    )
