"""GEMM backends: which GEMMs multiply a layer's prepared operands.

A backend's ``gemm(a, b, out_dtype) -> a @ b.T`` only multiplies: plain tensors,
:class:`~fp4train.formats.QuantizedTensor` s blocked along the inner (last) dimension, BF16 splits, or folded
operands. How each operand is prepared - by the reference, compiled cores or Triton kernels - is the layer's
``numerics``, and which implementation serves each operand is decided once in the layer's operand plan
(:mod:`fp4train.linear.plan`).

* ``emulated``: BF16 tensor cores with FP32 accumulation on exact BF16 splits (CUDA), or an FP32 matmul of
  dequantized operands (anywhere) - the numerical reference.
* ``fp8_blockwise``: MXFP4 GEMMs on Hopper's FP8 tensor cores (operands folded into FP8 with power-of-two group
  scales), FP8 rowwise GEMMs on FP8 tensor cores, everything else as ``emulated``.

``"auto"`` (recipes' default) is ``fp8_blockwise`` where a CUDA GPU is present, ``emulated`` elsewhere. The
name ``triton`` - once a backend, now the ``fp8_blockwise`` GEMMs with Triton numerics - is accepted for
``fp8_blockwise``.
"""

from __future__ import annotations

import torch

from .emulated import EmulatedBackend
from .fp8_blockwise import Fp8BlockwiseBackend

_BACKENDS = {"emulated": EmulatedBackend(), "fp8_blockwise": Fp8BlockwiseBackend()}
AUTO = "auto"
#: former backend names and what they mean now
ALIASES = {"triton": "fp8_blockwise"}


def resolve(name: str) -> str:
    """A backend name with ``"auto"`` resolved (``fp8_blockwise`` on a machine with a CUDA GPU, else ``emulated``)
    and a former name replaced by its backend."""
    if name == AUTO:
        return "fp8_blockwise" if torch.cuda.is_available() else "emulated"
    name = ALIASES.get(name, name)
    get(name)  # fail early on a bad name
    return name


def multiply(backend, a, b, out_dtype: torch.dtype, how=None) -> torch.Tensor:
    """``a @ b.T`` by ``backend``'s GEMM as the layer's plan says (``how``: a :class:`~fp4train.linear.plan.Gemm`:
    packed MXFP4 operands folded first by the kernel or the reference; splits and epilogue by kernels or torch);
    without a plan, the operands as they are, by PyTorch ops."""
    if how is not None and how.fold is not None and backend.takes_folded():
        a, b = backend.operands.for_gemm(a, b, how.fold)
    return backend.gemm(a, b, out_dtype, kernels=how is not None and how.kernels)


def names() -> list[str]:
    return sorted(_BACKENDS)


def get(name: str):
    """The backend called ``name`` (a former name: the backend it stands for)."""
    name = ALIASES.get(name, name)
    if name in _BACKENDS:
        return _BACKENDS[name]
    raise ValueError(f"unknown GEMM backend {name!r}; available: {', '.join(names())} (or {AUTO!r})")


__all__ = ["ALIASES", "AUTO", "EmulatedBackend", "Fp8BlockwiseBackend", "get", "multiply", "names", "resolve"]
