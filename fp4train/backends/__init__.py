"""GEMM backends: where a prepared pair of operands is multiplied.

A backend has one method, ``gemm(a, b, out_dtype) -> a @ b.T``, taking plain tensors or
:class:`~fp4train.formats.QuantizedTensor` s blocked along the inner (last) dimension.
``emulated`` (dequantize + FP32 matmul) runs everywhere and is the reference;
``fp8_blockwise`` runs MXFP4 GEMMs on FP8 tensor cores (CUDA; emulated elsewhere). A backend
may also prepare its own operands (``operand(x, q, axis=, role=, seed=)``).
"""

from __future__ import annotations

from .emulated import EmulatedBackend
from .fp8_blockwise import Fp8BlockwiseBackend

_BACKENDS = {"emulated": EmulatedBackend(), "fp8_blockwise": Fp8BlockwiseBackend()}


def names() -> list[str]:
    return sorted(_BACKENDS)


def get(name: str):
    """The backend called ``name``."""
    if name in _BACKENDS:
        return _BACKENDS[name]
    raise ValueError(f"unknown GEMM backend {name!r}; available: {', '.join(names())}")


__all__ = ["EmulatedBackend", "Fp8BlockwiseBackend", "get", "names"]
