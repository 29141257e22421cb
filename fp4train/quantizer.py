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

from . import kernel_coverage as coverage
from .formats.qtensor import QuantizedTensor, ScaledBF16
from .formats.quantize import FORMATS, check_request, encode_blocks, geometry, quantize_tensors, sr_keys
from .transforms.hadamard import block_transform, hadamard_tensors, signs
from .transforms.hadamard import check_request as check_hadamard

NUMERICS = ("eager", "compiled", "triton")


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
def compiled(fn, dynamic: bool | None = False):
    """``torch.compile(fn, dynamic=dynamic)``, made once per function (a cache, not a switch). By default one graph
    per shape. ``dynamic=None`` (sizes that change between calls become symbolic) only for functions whose inputs
    come split into their blocks (:func:`split_blocks`): a symbolic width ``n`` split inside the graph into blocks
    of 16 gives sizes ``(n // 16, n // (n // 16))`` that Inductor's GPU code generation cannot split (``CantSplit``:
    a compiled Full-Stack FP4 step on an H100 stopped there), while ``16 * s`` splits exactly."""
    raise_recompile_limit()
    return torch.compile(fn, dynamic=dynamic)


def capturing() -> bool:
    """Is a CUDA graph being captured on the current stream?"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def run_compiled(fn, *args, dynamic: bool | None = False, **kwargs):
    """``compiled(fn, dynamic)(*args, **kwargs)``. Inside a CUDA-graph capture a call that would compile runs ``fn``
    eagerly instead - the same ops, which the capture records, and the same bits - while a graph compiled before
    still runs: compiling launches work a capture refuses (Inductor's constant folding reads a value back to the
    host), and a capture can meet inputs no warm-up call had (another dispatch key set, a dtype)."""
    f = compiled(fn, dynamic)
    if capturing():
        with torch.compiler.set_stance("eager_on_recompile"):
            return f(*args, **kwargs)
    return f(*args, **kwargs)


def operand_values(x, keys, *, fmt, block, block_axis, scale, four_over_six):
    """Quantize and split one operand: a function of tensors (the input and the stochastic-rounding
    keys) that ``torch.compile`` fuses without writing the codes. Returns ``(values, scale, divisor)``
    of :class:`ScaledBF16`, bit for bit ``quantize(...).scaled_bf16()``."""
    qt = quantize_tensors(x, keys, fmt=fmt, block=block, axis=block_axis, scale=scale, four_over_six=four_over_six)
    s = qt.scaled_bf16()
    return s.values, s.scale, s.divisor


def split_blocks(x: torch.Tensor, block: tuple[int, ...] | None, axis: int | None) -> torch.Tensor | None:
    """A view of the 2D ``x`` with its blocks in the last dimension: ``(r, k // b, b)`` for 1D blocks along the last
    axis, ``(k, r // b, b)`` (of ``x.mT``) along the first, ``(r // b, b, k // b, b)`` for 2D tiles; None where a
    blocked dimension is not a multiple of the block (it would be padded) or the block is a whole row (FP8)."""
    if block is None or any(x.shape[a] % block[0] for a in ((0, 1) if len(block) == 2 else (axis,))):
        return None
    b = block[0]
    if len(block) == 2:
        xs = x.unflatten(1, (x.shape[1] // b, b)).unflatten(0, (x.shape[0] // b, b))
    else:
        x = x.mT if axis == 0 else x
        xs = x.unflatten(1, (x.shape[1] // b, b))
    for d in range(1 if len(block) == 2 else 2, xs.ndim, 2):  # a block's size is a constant of the graph, whatever
        torch._dynamo.mark_static(xs, d)  # other block sizes the function met (MXFP4's 32 after NVFP4's 16)
    return xs


def split_operand_values(xs, keys, *, fmt, along, scale, four_over_six):
    """:func:`operand_values` of an operand :func:`split_blocks` split into 1D blocks along its ``"rows"`` (the last
    axis) or ``"columns"`` (the first). The block's size is ``xs``'s last size, a constant of the graph like every
    argument here: an integer argument that changed between calls (the block size, the axis) would be symbolic."""
    b = xs.shape[-1]
    x = xs.flatten(1, 2)
    return operand_values(x.mT if along == "columns" else x, keys, fmt=fmt, block=(b,),
                          block_axis=0 if along == "columns" else 1, scale=scale, four_over_six=four_over_six)


def split_tile_values(xs, keys, *, fmt, scale, four_over_six):
    """:func:`operand_values` of an operand :func:`split_blocks` split into 2D tiles (a graph of its own: its
    inputs have another rank)."""
    b = xs.shape[-1]
    return operand_values(xs.flatten(2, 3).flatten(0, 1), keys, fmt=fmt, block=(b, b), block_axis=None, scale=scale,
                          four_over_six=four_over_six)


# The rules that pick an implementation: one place, for a Quantizer (below) and a layer's operand plan
# (fp4train.linear.plan), which decides them before a call from shapes and dtypes alone.

def compiled_cores(numerics: str, cuda: bool) -> bool:
    """Do compiled reference cores quantize where no kernel covers a request (``"compiled"`` numerics, or
    ``"triton"`` on a GPU)?"""
    return numerics == "compiled" or (numerics == "triton" and cuda)


def hadamard_impl(numerics: str, cuda: bool, ndim: int, dtype: torch.dtype) -> str:
    """How a block Hadamard transform runs: ``"kernel"`` (2D CUDA tensors, numerics other than eager),
    ``"compiled"`` or ``"reference"``."""
    if numerics != "eager" and cuda and ndim == 2 and dtype in coverage.KERNEL_DTYPES:
        return "kernel"
    return "compiled" if compiled_cores(numerics, cuda) else "reference"


def quantize_impl(numerics: str, cuda: bool, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, block, axis,
                  scale: str, rounding: str, four_over_six: bool) -> str:
    """How a checked request (``block``/``axis`` as :func:`~fp4train.formats.quantize.geometry` gives them) is quantized
    and packed: ``"kernel"`` where a Triton kernel covers it under ``"triton"`` numerics, else ``"compiled"`` or
    ``"reference"``."""
    if numerics == "triton" and kernels_usable and coverage.quantize_kernel(shape, dtype, fmt, block, axis, scale, rounding,
                                                                             four_over_six):
        return "kernel"
    return "compiled" if compiled_cores(numerics, cuda) else "reference"


def values_impl(numerics: str, cuda: bool, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, kw: dict,
                axis: int) -> str | None:
    """How an operand multiplied at once is quantized straight into BF16 values and factors: ``"values kernel"``,
    ``"compiled values"``, or None where these numerics have no such path (eager: the packed reference)."""
    if numerics == "triton" and kernels_usable and coverage.values_kernel(shape, dtype, fmt, kw, axis):
        return "values kernel"
    return "compiled values" if compiled_cores(numerics, cuda) else None


def fuses_hadamard(numerics: str, kernels_usable: bool, shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int,
                   transform_block: int, packed: bool) -> bool:
    """Does a Triton kernel quantize the operand together with its GEMM's block Hadamard transform (``"triton"``
    numerics; :func:`fp4train.kernel_coverage.hadamard_quantize_kernel`)?"""
    return (numerics == "triton" and kernels_usable
            and coverage.hadamard_quantize_kernel(shape, dtype, fmt, kw, axis, transform_block, packed) is not None)


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
    encode = functools.partial(run_compiled, encode_blocks) if impl == "compiled" else encode_blocks
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
    keys = sr_keys(seed) if stochastic else None
    scale, four = kw.get("scale", "floor"), kw.get("four_over_six", False)
    xs = split_blocks(x.detach(), block, ax)
    if xs is None:  # padded blocks or FP8's rows: a graph per shape
        out = run_compiled(operand_values, x.detach(), keys, fmt=fmt, block=block, block_axis=ax, scale=scale,
                           four_over_six=four)
    elif len(block) == 2:
        out = run_compiled(split_tile_values, xs, keys, dynamic=None, fmt=fmt, scale=scale, four_over_six=four)
    else:
        out = run_compiled(split_operand_values, xs, keys, dynamic=None, fmt=fmt,
                           along="columns" if ax == 0 else "rows", scale=scale, four_over_six=four)
    values, scale, divisor = out
    return ScaledBF16(values, scale, divisor, ax)


def hadamard_with(impl: str, x: torch.Tensor, block: int, *, axis: int, seed=None) -> torch.Tensor:
    """The block Hadamard transform of ``x`` along ``axis`` (random signs from ``seed``, if given) by ``impl``:
    ``"kernel"`` (Triton, 2D CUDA tensors), ``"compiled"`` or ``"reference"``."""
    check_hadamard(x, block, axis)
    d = signs(seed, block, device=x.device) if seed is not None else None
    if impl == "kernel":
        from .kernels.hadamard import block_hadamard

        return block_hadamard(x, d, block=block, axis=axis)
    core = functools.partial(run_compiled, block_transform) if impl == "compiled" else None
    return hadamard_tensors(x, d, block=block, axis=axis, core=core)
