"""The quantizer: how a converted layer turns a tensor into the operand a GEMM needs.

Three numerics, the same bits in each (tested): ``"eager"`` runs the plain-PyTorch reference
(:mod:`fp4train.formats`, :mod:`fp4train.transforms`) op by op; ``"compiled"`` runs the reference's
numerical cores through ``torch.compile`` (fused; on a GPU the block Hadamard transform of 2D tensors
runs as a Triton kernel); ``"triton"`` runs fp4train's Triton kernels wherever one covers the request
(:mod:`fp4train.kernels.dispatch`) and the compiled cores elsewhere on a GPU (the reference on a CPU,
where Triton runs interpreted, for tests).

A :class:`Quantizer` is plain data stored on each converted layer (``convert(..., numerics=)``): nothing
here is a process-wide switch, and :func:`fp4train.quantize` is the reference whatever a layer chose.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch

from .formats.qtensor import QuantizedTensor, ScaledBF16
from .formats.quantize import FORMATS, check_request, encode_blocks, geometry, quantize_tensors, sr_keys
from .transforms.hadamard import block_transform, hadamard_tensors, signs
from .transforms.hadamard import check_request as check_hadamard

NUMERICS = ("eager", "compiled", "triton")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: Triton is an optional dependency: PyTorch's CUDA builds for Linux bring it, and a CPU needs it only for the tests
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def kernels_usable_on(t: torch.Tensor) -> bool:
    """Can fp4train's Triton kernels take ``t``? CUDA tensors where Triton is installed; CPU tensors only under
    Triton's interpreter (``TRITON_INTERPRET=1``: tests). Without Triton the reference runs (the same bits), and a
    GPU run says so."""
    if not TRITON_INSTALLED:
        if t.is_cuda:
            warnings.warn("fp4train: Triton is not installed, so the quantizers run as PyTorch reference ops (the same "
                          "bits, slower): pip install 'fp4train[triton]'", stacklevel=2)
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def raise_recompile_limit(n: int = 64) -> None:
    """One compiled graph per (format, scale rule, rounding, dtype) combination in use: more than
    dynamo's default limit of 8 in a model that mixes recipes' formats (AdaHOP, tib2d's MXFP8)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))


@functools.cache
def compiled(fn):
    """``torch.compile(fn)``, made once per function (a cache, not a switch). Shapes become symbolic where they
    change between calls (a layer's rows, another layer's width) and nothing else: a block's size and every other
    integer argument stay constants of the graph. (With every size symbolic, the block size among them, a compiled
    Full-Stack FP4 step on a GPU stopped in Inductor's code generation: ``CantSplit`` on sizes like ``n // block``.)"""
    raise_recompile_limit()
    return torch.compile(fn, dynamic=None)


def operand_values(x, keys, *, fmt, block, block_axis, scale, four_over_six):
    """Quantize and split one operand: a function of tensors (the input and the stochastic-rounding
    keys) that ``torch.compile`` fuses without writing the codes. Returns ``(values, scale, divisor)``
    of :class:`ScaledBF16`, bit for bit ``quantize(...).scaled_bf16()``."""
    qt = quantize_tensors(x, keys, fmt=fmt, block=block, axis=block_axis, scale=scale, four_over_six=four_over_six)
    s = qt.scaled_bf16()
    return s.values, s.scale, s.divisor


# The rules that pick an implementation: one place, for a Quantizer (below) and a layer's operand plan
# (fp4train.linear.plan), which decides them before a call from shapes and dtypes alone.

def compiled_cores(numerics: str, cuda: bool) -> bool:
    """Do compiled reference cores quantize where no kernel covers a request (``"compiled"`` numerics, or
    ``"triton"`` on a GPU)?"""
    return numerics == "compiled" or (numerics == "triton" and cuda)


def hadamard_impl(numerics: str, cuda: bool, ndim: int, dtype: torch.dtype) -> str:
    """How a block Hadamard transform runs: ``"kernel"`` (2D CUDA tensors, numerics other than eager),
    ``"compiled"`` or ``"reference"``."""
    if numerics != "eager" and cuda and ndim == 2 and dtype in _KERNEL_DTYPES:
        return "kernel"
    return "compiled" if compiled_cores(numerics, cuda) else "reference"


def quantize_impl(numerics: str, cuda: bool, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, block, axis,
                  scale: str, rounding: str, four_over_six: bool) -> str:
    """How a checked request (``block``/``axis`` as :func:`~fp4train.formats.quantize.geometry` gives them) is quantized
    and packed: ``"kernel"`` where a Triton kernel covers it under ``"triton"`` numerics, else ``"compiled"`` or
    ``"reference"``."""
    if numerics == "triton" and kernels_usable:
        from .kernels import dispatch

        if dispatch.quantize_kernel(shape, dtype, fmt, block, axis, scale, rounding, four_over_six) is not None:
            return "kernel"
    return "compiled" if compiled_cores(numerics, cuda) else "reference"


def values_impl(numerics: str, cuda: bool, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, kw: dict,
                axis: int) -> str | None:
    """How an operand multiplied at once is quantized straight into BF16 values and factors: ``"values kernel"``,
    ``"compiled values"``, or None where these numerics have no such path (eager: the packed reference)."""
    if numerics == "triton" and kernels_usable:
        from .kernels import dispatch

        if dispatch.values_kernel(shape, dtype, fmt, kw, axis) is not None:
            return "values kernel"
    return "compiled values" if compiled_cores(numerics, cuda) else None


def fuses_hadamard(numerics: str, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int,
                   transform_block: int, packed: bool) -> bool:
    """Does a Triton kernel quantize the operand together with its GEMM's block Hadamard transform (``"triton"``
    numerics; :func:`fp4train.kernels.dispatch.hadamard_quantize_kernel`)?"""
    if numerics != "triton" or not kernels_usable:
        return False
    from .kernels import dispatch

    return dispatch.hadamard_quantize_kernel(shape, dtype, fmt, kw, axis, transform_block, packed) is not None


@dataclass(frozen=True)
class Quantizer:
    """Reference, compiled or Triton-kernel quantization (``numerics``), one result bit for bit."""

    numerics: str = "eager"

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {self.numerics!r}; choose one of {', '.join(NUMERICS)}")

    @staticmethod
    def _outside_graphs(impl: str | None) -> str | None:
        """``impl``, or the reference (None for values) in place of compiled cores while tracing (the reference
        then inlines into the caller's graph)."""
        if impl in ("compiled", "compiled values") and torch.compiler.is_compiling():
            return "reference" if impl == "compiled" else None
        return impl

    def quantize(self, x: torch.Tensor, fmt: str, *, axis: int = -1, block=None, scale: str = "floor",
                 rounding: str = "nearest", seed=None, four_over_six: bool = False) -> QuantizedTensor:
        """:func:`fp4train.formats.quantize`'s result, by a kernel where one covers the request."""
        block, axis = check_request(x, fmt, axis=axis, block=block, scale=scale, rounding=rounding, seed=seed,
                                    four_over_six=four_over_six)
        impl = self._outside_graphs(quantize_impl(self.numerics, x.is_cuda, kernels_usable_on(x), tuple(x.shape), x.dtype,
                                                  fmt, block, axis, scale, rounding, four_over_six))
        return quantize_with(impl, x, fmt, block=block, axis=axis, scale=scale, rounding=rounding, seed=seed,
                             four_over_six=four_over_six)

    def hadamard(self, x: torch.Tensor, block: int, *, axis: int, seed=None) -> torch.Tensor:
        """:func:`fp4train.hadamard`'s result (forward transform), by the Triton kernel for 2D CUDA tensors
        unless the numerics are ``"eager"``."""
        impl = self._outside_graphs(hadamard_impl(self.numerics, x.is_cuda, x.ndim, x.dtype))
        return hadamard_with(impl, x, block, axis=axis, seed=seed)

    def values(self, x: torch.Tensor, fmt: str, kw: dict, *, axis: int, seed) -> ScaledBF16 | None:
        """``quantize(x, fmt, axis=axis, seed=seed, **kw).scaled_bf16()`` for a 2D operand that a GEMM
        multiplies at once (the codes are never written): by a fake-quantization kernel, or the compiled
        reference fused into one graph; None where this quantizer has no faster way (eager numerics)."""
        impl = self._outside_graphs(values_impl(self.numerics, x.is_cuda, kernels_usable_on(x), tuple(x.shape), x.dtype,
                                                fmt, kw, axis))
        return values_with(impl, x, fmt, kw, axis=axis, seed=seed) if impl is not None else None


# Each implementation once: what a quantizer (above) or a layer's operand plan (fp4train.linear.plan) chose runs here.

def quantize_with(impl: str, x: torch.Tensor, fmt: str, *, block, axis, scale: str, rounding: str, seed,
                  four_over_six: bool) -> QuantizedTensor:
    """Quantize ``x`` (a checked request: ``block``/``axis`` as :func:`~fp4train.formats.quantize.geometry` gives
    them) by ``impl``: ``"reference"`` (op by op), ``"compiled"`` (the compiled encode) or ``"kernel"`` (Triton)."""
    if impl == "kernel":
        from .kernels import dispatch

        q = dispatch.quantize(x, fmt, block, axis, scale, rounding, seed, four_over_six)
        if q is None:
            raise RuntimeError(f"fp4train: no Triton kernel quantizes {fmt} {block} along axis {axis} for "
                               f"{tuple(x.shape)} {x.dtype} (an operand plan chose one)")
        return q
    keys = sr_keys(seed) if rounding == "stochastic" else None
    encode = compiled(encode_blocks) if impl == "compiled" else encode_blocks
    return quantize_tensors(x, keys, fmt=fmt, block=block, axis=axis, scale=scale, four_over_six=four_over_six,
                            encode=encode)


def values_with(impl: str, x: torch.Tensor, fmt: str, kw: dict, *, axis: int, seed) -> ScaledBF16:
    """``quantize(...).scaled_bf16()`` of a 2D ``x`` without the codes written, by ``impl``: ``"values kernel"``
    (a Triton fake-quantization kernel) or ``"compiled values"`` (the reference's cores compiled as one graph)."""
    if impl == "values kernel":
        from .kernels import dispatch

        v = dispatch.fake_quantize_values(x, fmt, kw, axis, seed)
        if v is None:
            raise RuntimeError(f"fp4train: no Triton kernel fake-quantizes {fmt} {kw} along axis {axis} for "
                               f"{tuple(x.shape)} {x.dtype} (an operand plan chose one)")
        return v
    block, ax = geometry(x, FORMATS[fmt], axis, kw.get("block"))
    stochastic = kw.get("rounding", "nearest") == "stochastic"
    values, scale, divisor = compiled(operand_values)(
        x.detach(), sr_keys(seed) if stochastic else None, fmt=fmt, block=block, block_axis=ax,
        scale=kw.get("scale", "floor"), four_over_six=kw.get("four_over_six", False))
    return ScaledBF16(values, scale, divisor, ax)


def hadamard_with(impl: str, x: torch.Tensor, block: int, *, axis: int, seed=None) -> torch.Tensor:
    """The block Hadamard transform of ``x`` along ``axis`` (random signs from ``seed``, if given) by ``impl``:
    ``"kernel"`` (Triton, 2D CUDA tensors), ``"compiled"`` or ``"reference"``."""
    check_hadamard(x, block, axis)
    d = signs(seed, block, device=x.device) if seed is not None else None
    if impl == "kernel":
        from .kernels.hadamard import block_hadamard

        return block_hadamard(x, d, block=block, axis=axis)
    core = compiled(block_transform) if impl == "compiled" else None
    return hadamard_tensors(x, d, block=block, axis=axis, core=core)
