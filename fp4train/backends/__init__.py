"""GEMM backends: where a prepared pair of operands is multiplied.

A backend's ``gemm(a, b, out_dtype) -> a @ b.T`` only multiplies: plain tensors,
:class:`~fp4train.formats.QuantizedTensor` s blocked along the inner (last) dimension, or operands its
``operands`` made (None where it makes none: the layer's quantizer prepares every operand).
``emulated`` (dequantize + FP32 matmul) runs everywhere and is the reference;
``fp8_blockwise`` runs MXFP4 GEMMs on FP8 tensor cores (CUDA; emulated elsewhere); ``triton``
is that plus Triton-kernel quantization of every operand - the fast path. The two FP8 backends'
``operands`` (:class:`~fp4train.backends.fp8_operands.Fp8Operands`) fold MXFP4 for FP8 tensor cores.

``"auto"`` (recipes' default) is ``triton`` where a CUDA GPU is present, ``emulated`` elsewhere.
"""

from __future__ import annotations

import torch

from .emulated import EmulatedBackend
from .fp8_blockwise import Fp8BlockwiseBackend
from .triton import TritonBackend

_BACKENDS = {"emulated": EmulatedBackend(), "fp8_blockwise": Fp8BlockwiseBackend(), "triton": TritonBackend()}
AUTO = "auto"


def resolve(name: str) -> str:
    """A backend name with ``"auto"`` resolved: ``triton`` on a machine with a CUDA GPU, else ``emulated``."""
    if name == AUTO:
        return "triton" if torch.cuda.is_available() else "emulated"
    get(name)  # fail early on a bad name
    return name


def multiply(backend, a, b, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` by ``backend``'s GEMM, the operands first put in the form it multiplies by the backend's own
    operand preparation where it has one (packed MXFP4 folded for FP8 tensor cores)."""
    if (ops := backend.operands) is not None:
        a, b = ops.for_gemm(a, b, folded_gemm=backend.takes_folded())
    return backend.gemm(a, b, out_dtype)


def names() -> list[str]:
    return sorted(_BACKENDS)


def get(name: str):
    """The backend called ``name``."""
    if name in _BACKENDS:
        return _BACKENDS[name]
    raise ValueError(f"unknown GEMM backend {name!r}; available: {', '.join(names())} (or {AUTO!r})")


__all__ = ["AUTO", "EmulatedBackend", "Fp8BlockwiseBackend", "TritonBackend", "get", "multiply", "names", "resolve"]
