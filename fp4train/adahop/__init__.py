"""AdaHOP: outlier-pattern-aware choice between inner Hadamard and outlier extraction per GEMM."""

from ..linear.foid import foid
from ..linear.outlier_gemm import Extraction, oe_gemm, split
from .patterns import (
    DEFAULT_DOMINANCE,
    DEFAULT_THRESHOLD,
    GEMM_OPERANDS,
    Pattern,
    Relative,
    classify,
    gemm_pair,
    outlier_ratios,
    relative,
)
from .strategy import (DEFAULT_K, DEFAULT_RULES, PAPER_STRATEGIES, PLAIN_RULES, WITH_PLAIN, Strategy, choose, derive_rules,
                       relative_error, rules_for, strategy_gemm)

__all__ = [
    "DEFAULT_DOMINANCE", "DEFAULT_K", "DEFAULT_RULES", "DEFAULT_THRESHOLD", "Extraction", "GEMM_OPERANDS", "PAPER_STRATEGIES", "PLAIN_RULES",
    "Pattern", "Relative", "Strategy", "WITH_PLAIN", "choose", "classify", "derive_rules", "foid", "gemm_pair", "oe_gemm", "outlier_ratios", "relative", "relative_error",
    "rules_for", "split", "strategy_gemm",
]
