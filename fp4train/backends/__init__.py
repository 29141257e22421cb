"""GEMM backends: where a prepared pair of operands is multiplied.

A backend has one method, ``gemm(a, b, out_dtype) -> a @ b.T``, taking plain tensors or
:class:`~fp4train.formats.QuantizedTensor` s blocked along the inner (last) dimension.
``emulated`` (dequantize + FP32 matmul) runs everywhere and is the reference; faster
backends plug in here with the same signature.
"""

from __future__ import annotations

from .emulated import EmulatedBackend

_BACKENDS = {"emulated": EmulatedBackend()}


def names() -> list[str]:
    return sorted(_BACKENDS)


def get(name: str):
    """The backend called ``name``."""
    if name in _BACKENDS:
        return _BACKENDS[name]
    raise ValueError(f"unknown GEMM backend {name!r}; available: {', '.join(names())}")


__all__ = ["EmulatedBackend", "get", "names"]
