"""Analysis tools: outlier-pattern maps and per-GEMM quantization error of every recipe."""

from .analyze import analyze, gemm_error

__all__ = ["analyze", "gemm_error"]
