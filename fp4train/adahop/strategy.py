"""AdaHOP's per-GEMM strategies and the rule table that picks one from a pattern pair.

* ``plain``: MXFP4 (1x32 along the inner dim, floor scales, RTNE) on both operands.
* ``iht``: block-32 Walsh-Hadamard along the inner dim of both operands, then MXFP4.
* ``oe``: outlier extraction (FOID picks the top-k outlier rows / inner channels, they run in
  high precision, see :mod:`fp4train.linear.outlier_gemm`), the residual goes through ``iht``.

AdaHOP (arXiv 2604.02525) chooses between ``iht`` and ``oe`` only (:data:`PAPER_STRATEGIES`, the ``adahop``
presets); ``plain`` as a third choice is ours (:data:`WITH_PLAIN`, the ``adahop_plain`` preset). The rule table maps
the pair of operand patterns *relative to the GEMM* (inner / outer / none, see :mod:`.patterns`) to a strategy. The paper's table is not in our copy, so the
default below is derived from measurement: ``bench/adahop_pattern_pairs.py`` measures the
relative GEMM error of every strategy for every pair (our Figure 3) and picks the lowest;
its results are in ``bench/results/adahop_pattern_pairs.json`` and ``docs/adahop.md``.
"""

from __future__ import annotations

import enum

import torch

from ..formats.quantize import quantize
from ..linear.outlier_gemm import extraction_for, oe_gemm
from ..transforms.hadamard import hadamard
from ..recipes.spec import CALIBRATION_STRATEGIES, check_calibration_strategies
from .patterns import Relative

DEFAULT_K = 16  # outlier rows/channels taken out per operand
HADAMARD_BLOCK = 32


class Strategy(str, enum.Enum):
    PLAIN = "plain"
    IHT = "iht"
    OE = "oe"


def _q(t: torch.Tensor) -> torch.Tensor:
    return quantize(t, "mxfp4", axis=-1).dequantize(torch.float32)


def plain_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _q(a) @ _q(b).T


def iht_gemm(a: torch.Tensor, b: torch.Tensor, block: int = HADAMARD_BLOCK) -> torch.Tensor:
    return _q(hadamard(a.float(), block)) @ _q(hadamard(b.float(), block)).T


def strategy_gemm(a, b, strategy: Strategy, rel_a: Relative = Relative.NONE, rel_b: Relative = Relative.NONE, k: int = DEFAULT_K):
    """``A B^T`` (FP32) computed with ``strategy`` (the emulated reference of each path)."""
    s = Strategy(strategy)
    if s is Strategy.PLAIN:
        return plain_gemm(a, b)
    if s is Strategy.IHT:
        return iht_gemm(a, b)
    return oe_gemm(a, b, extraction_for(a, b, Relative(rel_a).value, Relative(rel_b).value, k), iht_gemm)


def relative_error(a, b, strategy: Strategy, rel_a=Relative.NONE, rel_b=Relative.NONE, k: int = DEFAULT_K) -> float:
    """``||C - A B^T||_F / ||A B^T||_F`` with the reference in float64."""
    ref = a.double() @ b.double().T
    c = strategy_gemm(a, b, strategy, rel_a, rel_b, k).double()
    return float((c - ref).norm() / ref.norm())


#: Cost order: plain < iht (one extra pass per operand) < oe (FOID + a high-precision slice GEMM).
COST_ORDER = (Strategy.PLAIN, Strategy.IHT, Strategy.OE)
RULE_TOLERANCE = 0.10
#: the strategies AdaHOP's paper chooses between
PAPER_STRATEGIES = ("iht", "oe")
#: ours: plain MXFP4 as a third choice where neither transform pays (the ``adahop_plain`` preset)
WITH_PLAIN = CALIBRATION_STRATEGIES




def derive_rules(rows: list[dict], tolerance: float = RULE_TOLERANCE,
                 strategies=PAPER_STRATEGIES) -> dict[tuple[Relative, Relative], Strategy]:
    """The rule table from a measured pattern-pair table: per pair, the cheapest of ``strategies`` whose
    mean relative error is within ``(1 + tolerance)`` of the best of them."""
    allowed = [Strategy(s) for s in check_calibration_strategies(strategies)]
    rules = {}
    for r in rows:
        best = min(r[f"err_{s.value}"] for s in allowed)
        pick = next(s for s in allowed if r[f"err_{s.value}"] <= best * (1 + tolerance))
        rules[(Relative(r["a"]), Relative(r["b"]))] = pick
    return rules


MIN_REAL_GEMMS = 10  # a real-tensor pair needs this many measured GEMMs to set its rule


def merge_rules(real_rows: list[dict], synthetic_rows: list[dict], tolerance: float = RULE_TOLERANCE,
                min_gemms: int = MIN_REAL_GEMMS, strategies=PAPER_STRATEGIES) -> dict[tuple[Relative, Relative], Strategy]:
    """Rules from real tensors where a pair was seen often enough, planted patterns elsewhere."""
    rules = derive_rules(synthetic_rows, tolerance, strategies)
    rules.update(derive_rules([r for r in real_rows if r.get("n", 0) >= min_gemms], tolerance, strategies))
    return rules


_N, _I, _O = Relative.NONE, Relative.INNER, Relative.OUTER
#: merge_rules() over AdaHOP's two strategies of the real-tensor pattern pairs of `fp4train analyze` on `60m` trained on enwiki
#: (2x200 steps, H200: bench/results/analyze-60m-enwiki/analysis.json) and, for pairs seen in
#: fewer than 10 GEMMs there, the planted-pattern table (bench/results/adahop_pattern_pairs.json).
#: tests/test_adahop.py checks that this literal still equals merge_rules() of those files.
DEFAULT_RULES: dict[tuple[Relative, Relative], Strategy] = {
    (_N, _N): Strategy.IHT,  # real: IHT equals OE (nothing to extract), cheaper
    (_I, _N): Strategy.IHT,  # real: IHT within 10% of OE, cheaper
    (_O, _N): Strategy.IHT,  # real
    (_N, _O): Strategy.OE,  # real
    (_I, _O): Strategy.OE,  # real
    (_O, _O): Strategy.OE,  # real
    (_N, _I): Strategy.OE,  # not seen on real tensors: planted table
    (_I, _I): Strategy.OE,  # 2 real GEMMs only: planted table
    (_O, _I): Strategy.OE,  # not seen on real tensors: planted table
}


#: the same with plain MXFP4 allowed (:data:`WITH_PLAIN`): where no pattern is seen, plain is within 10% of IHT
PLAIN_RULES: dict[tuple[Relative, Relative], Strategy] = {**DEFAULT_RULES, (_N, _N): Strategy.PLAIN}


def rules_for(strategies) -> dict[tuple[Relative, Relative], Strategy]:
    """The committed rule table over ``strategies`` (:data:`PAPER_STRATEGIES` or :data:`WITH_PLAIN`)."""
    tables = {PAPER_STRATEGIES: DEFAULT_RULES, WITH_PLAIN: PLAIN_RULES}
    key = check_calibration_strategies(strategies)
    if key not in tables:
        raise ValueError(f"calibrate='rules' has rule tables for {PAPER_STRATEGIES} and {WITH_PLAIN}, not {key!r}; "
                         "use calibrate='measured' for another set")
    return tables[key]


def choose(rel_a: Relative, rel_b: Relative, rules: dict | None = None) -> Strategy:
    rules = rules if rules is not None else DEFAULT_RULES
    return rules[(Relative(rel_a), Relative(rel_b))]
