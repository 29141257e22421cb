"""Outlier patterns of a 2D tensor: Row-wise, Column-wise or None (AdaHOP, docs/methods.md, AdaHOP).

Statistic (cheap: two reductions): with row norms ``r_i = ||T[i, :]||_2`` and column norms
``c_j = ||T[:, j]||_2``,

    row_ratio = max_i r_i / median_i r_i        col_ratio = max_j c_j / median_j c_j

A tensor is **Row-wise** when ``row_ratio >= threshold`` and ``row_ratio >= dominance *
col_ratio``, **Column-wise** when the same holds with rows and columns swapped, else **None**.
The dominance test matters: a few huge single entries (heavy tails) inflate a row *and* a
column norm alike (Student-t(3) 512x512: both ratios ~7.6) and are no row/column pattern.
Defaults ``threshold=4``, ``dominance=2`` separate the planted patterns of the tests from
Gaussian and Student-t tensors; both are recipe fields.

Tensors are classified in their natural layout: W ``[N out, K in]``, X ``[M tokens, K]``,
dY ``[M, N]``. Relative to a GEMM ``C = A B^T`` an operand's pattern is **inner** when its
outliers lie along the GEMM's inner dimension (specific inner channels: block scales along
the inner dim see one huge value per block - what an inner Hadamard spreads out) and
**outer** when whole rows of the operand (as the GEMM sees it) are large.
"""

from __future__ import annotations

import enum

import torch

DEFAULT_THRESHOLD = 4.0
DEFAULT_DOMINANCE = 2.0


class Pattern(str, enum.Enum):
    ROW = "row"
    """A few rows are much larger than the rest."""
    COLUMN = "column"
    """A few columns are much larger than the rest."""
    NONE = "none"
    """No dominant rows or columns."""


class Relative(str, enum.Enum):
    """An operand's pattern relative to one GEMM."""

    INNER = "inner"
    OUTER = "outer"
    NONE = "none"


def outlier_ratios(t: torch.Tensor) -> tuple[float, float]:
    """(row_ratio, col_ratio) of a 2D tensor (see the module docstring)."""
    if t.ndim != 2:
        raise ValueError(f"outlier patterns are defined for 2D tensors, got shape {tuple(t.shape)}")
    x = t.detach().float()
    eps = torch.finfo(torch.float32).tiny
    r = x.norm(dim=1)
    c = x.norm(dim=0)
    return float(r.max() / r.median().clamp(min=eps)), float(c.max() / c.median().clamp(min=eps))


def classify(t: torch.Tensor, threshold: float = DEFAULT_THRESHOLD, dominance: float = DEFAULT_DOMINANCE) -> Pattern:
    """The outlier pattern of a 2D tensor."""
    rr, cr = outlier_ratios(t)
    if rr >= threshold and rr >= dominance * cr:
        return Pattern.ROW
    if cr >= threshold and cr >= dominance * rr:
        return Pattern.COLUMN
    return Pattern.NONE


#: For each GEMM, (tensor, is the tensor transposed as operand?) for operands a and b:
#: fprop a = X, b = W; dgrad a = dY, b = W^T; wgrad a = dY^T, b = X^T.
GEMM_OPERANDS = {
    "fprop": (("X", False), ("W", False)),
    "dgrad": (("dY", False), ("W", True)),
    "wgrad": (("dY", True), ("X", True)),
}


def relative(pattern: Pattern, transposed: bool) -> Relative:
    """A tensor's pattern as seen by a GEMM that uses it (transposed or not) as ``[outer, inner]``."""
    pattern = Pattern(pattern)
    if pattern is Pattern.NONE:
        return Relative.NONE
    inner_is_column = not transposed
    return Relative.INNER if (pattern is Pattern.COLUMN) == inner_is_column else Relative.OUTER


def gemm_pair(patterns: dict[str, Pattern], gemm: str) -> tuple[Relative, Relative]:
    """(a, b) relative patterns of ``gemm`` from the layer's tensor patterns ``{"W", "X", "dY"}``."""
    (ta, tra), (tb, trb) = GEMM_OPERANDS[gemm]
    return relative(patterns[ta], tra), relative(patterns[tb], trb)


def gemm_operands(tensors: dict[str, torch.Tensor], patterns: dict[str, Pattern], pad_to: int = 32):
    """For each GEMM of a layer: ``(gemm, a, b, rel_a, rel_b)``, operands as ``[outer, inner]``.

    ``tensors`` and ``patterns`` are keyed ``"W"``, ``"X"``, ``"dY"``. The inner dimension is
    zero-padded to a multiple of ``pad_to`` (the IHT needs whole blocks; the layer pads its
    token dimension the same way, and zero padding leaves every product unchanged).
    """
    for gemm, ((ta, tra), (tb, trb)) in GEMM_OPERANDS.items():
        a = tensors[ta].T if tra else tensors[ta]
        b = tensors[tb].T if trb else tensors[tb]
        pad = -a.shape[1] % pad_to
        if pad:
            a, b = torch.nn.functional.pad(a, (0, pad)), torch.nn.functional.pad(b, (0, pad))
        yield gemm, a, b, relative(patterns[ta], tra), relative(patterns[tb], trb)
