"""What :func:`fp4train.convert` did to each weight-bearing module of a model: converted (and how), kept in high
precision (and why), or skipped because fp4train has no quantized layer for it.

The report is made before anything is swapped, so ``convert(..., strict=True)`` can refuse a model with a
skipped layer before changing it; after a conversion it is ``model.fp4train_conversion`` and goes to the
``fp4train`` logger, and skipped layers also raise a warning: nothing is left in high precision silently.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.nn as nn

from .recipes.spec import LinearSpec, QuantSpec

CONVERTED, HIGH_PRECISION, SKIPPED = "converted", "high precision", "skipped"


@dataclass(frozen=True)
class Entry:
    """One module: its qualified name, class, status (``converted``, ``high precision``, ``skipped``) and the detail
    (the spec it runs, or the reason)."""

    name: str
    kind: str
    status: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name or '<model>'} ({self.kind}): {self.status} - {self.detail}"


@dataclass
class ConversionReport:
    """Every weight-bearing module of a converted model, in module order (see the module docstring)."""

    recipe: str
    entries: list[Entry] = field(default_factory=list)

    def of(self, status: str) -> list[Entry]:
        return [e for e in self.entries if e.status == status]

    def summary(self) -> str:
        """One line: how many modules each way, and the skipped ones by class."""
        n = Counter(e.status for e in self.entries)
        line = (f"fp4train.convert({self.recipe!r}): {n[CONVERTED]} layers converted, {n[HIGH_PRECISION]} kept in high "
                f"precision, {n[SKIPPED]} skipped")
        skipped = Counter(e.kind for e in self.of(SKIPPED))
        if skipped:
            line += " (" + ", ".join(f"{k} x{c}" for k, c in skipped.items()) + ")"
        return line

    def __str__(self) -> str:
        return "\n".join([self.summary(), *(f"  {e}" for e in self.entries)])


def describe_spec(spec: LinearSpec) -> str:
    """A linear spec in one line: each GEMM's operands (format, tile, stochastic rounding) and transform."""

    def op(q: QuantSpec) -> str:
        if not q.quantized:
            return "bf16"
        tile = "x".join(map(str, q.block)) if isinstance(q.block, tuple) and len(q.block) == 2 else ""
        return q.format + (f"[{tile}]" if tile else "") + ("/sr" if q.stochastic else "") + ("/4-6" if q.four_over_six else "")

    parts = []
    for name in ("fprop", "dgrad", "wgrad"):
        g = getattr(spec, name)
        extra = f" +H{g.transform.block}" if g.transform is not None else ""
        extra += " +outliers" if g.outliers is not None else ""
        parts.append(f"{name} {op(g.a)} x {op(g.b)}{extra}")
    return ", ".join(parts)


def weight_bearing(module: nn.Module) -> bool:
    """Does ``module`` hold a weight of its own (a parameter of two or more dims)?"""
    return any(p.ndim >= 2 for p in module.parameters(recurse=False))


def unhandled_reason(module: nn.Module) -> str:
    """Why fp4train leaves a weight-bearing module that is not a linear layer as it is."""
    if isinstance(module, nn.Embedding):
        return "an embedding (fp4train quantizes the GEMMs of linear layers; embeddings are lookups)"
    kind = type(module).__name__
    if isinstance(module, nn.modules.conv._ConvNd):
        return (f"a convolution ({kind}): fp4train quantizes the GEMMs of linear layers (nn.Linear, transformers' Conv1D); "
                "convolutions stay in high precision")
    if isinstance(module, nn.Bilinear):
        return f"a bilinear layer ({kind}, x1^T W x2): fp4train has no quantized layer for it"
    if isinstance(module, nn.MultiheadAttention):
        return (f"PyTorch's {kind}, whose projections are not nn.Linear calls: fp4train has no quantized layer for it; "
                "write the attention with nn.Linear projections to quantize them")
    if any(p.ndim >= 3 for p in module.parameters(recurse=False)):
        return (f"a {kind} with weights of 3 or more dims that fp4train does not recognise as a mixture of experts' "
                "stacked expert weights (it knows transformers' experts modules and fp4train's own)")
    return f"a {kind}: fp4train has no quantized layer for it"
