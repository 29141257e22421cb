"""FOID - fast outlier index detection (AdaHOP).

The variance of the first 64 elements of each row (or column) stands in for its magnitude;
the ``k`` rows (columns) with the largest such variance are the outliers. It reads 64
elements per row instead of the whole tensor, which is what makes it cheap enough to run on
every step. (Variance, not mean square: a constant offset is not an outlier pattern.)
"""

from __future__ import annotations

import torch

PROBE = 64


def foid(t: torch.Tensor, k: int, *, axis: int = 0, probe: int = PROBE) -> torch.Tensor:
    """Indices (int64, sorted) of the ``k`` outlier rows (``axis=0``) or columns (``axis=1``) of a 2D tensor."""
    if t.ndim != 2:
        raise ValueError(f"foid needs a 2D tensor, got shape {tuple(t.shape)}")
    lines = t if axis == 0 else t.T
    k = max(0, min(int(k), lines.shape[0]))
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=t.device)
    sample = lines[:, :probe].float()
    score = sample.var(dim=1, unbiased=False)
    return torch.topk(score, k).indices.sort().values
