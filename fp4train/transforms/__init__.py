"""Orthogonal transforms applied to GEMM operands along their inner dimension."""

from .hadamard import hadamard, hadamard_matrix, signs

__all__ = ["hadamard", "hadamard_matrix", "signs"]
