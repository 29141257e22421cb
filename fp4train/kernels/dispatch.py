"""The Triton kernel a name of :mod:`fp4train.kernel_coverage` stands for, run: the kernel's result, or None where
none covers the request (the caller then takes the reference path). The coverage - which request a kernel takes -
is decided there, without Triton; this module only runs it. Every kernel returns the reference's bits;
docs/formats.md lists them."""

from __future__ import annotations

import torch

from .. import kernel_coverage as coverage
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from . import fp8_values, mx_quantize, mx_values, nvfp4_quantize, nvfp4_tiles
from .nvfp4_values import nvfp4_values  # the package re-exports the function under the module's name

#: packed kernels by name: ``(x, seed, axis, scale, rounding, four_over_six) -> QuantizedTensor`` (1D blocks along
#: dim 0 read the row-major tensor in place and write the reference's canonical layout, ``x.T``'s codes, with its
#: stochastic-rounding indices ``k * M + m``; along dim 1 the row kernels' layout is the reference's)
_PACKED = {
    "fp8 rowwise": lambda x, seed, axis, scale, rounding, four: fp8_values.quantize_fp8_rowwise(x, axis=axis),
    "mxfp4 tiles": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp4_2d(x, scale=scale, rounding=rounding,
                                                                                            seed=seed),
    "mxfp8 tiles": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp8_2d(x, scale=scale, rounding=rounding,
                                                                                            seed=seed),
    "nvfp4 tiles": lambda x, seed, axis, scale, rounding, four: nvfp4_tiles.quantize_nvfp4_2d(x, rounding=rounding, seed=seed,
                                                                                            four_over_six=four),
    "mxfp4 rows": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp4(x, seed=seed, scale=scale,
                                                                                        rounding=rounding),
    "mxfp8 rows": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp8(x, seed=seed, scale=scale,
                                                                                        rounding=rounding),
    "nvfp4 rows": lambda x, seed, axis, scale, rounding, four: nvfp4_quantize.quantize_nvfp4(x, seed=seed, rounding=rounding,
                                                                                           **_four(four)),
    "mxfp4 columns": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp4_columns(x, seed=seed, scale=scale,
                                                                                                  rounding=rounding),
    "mxfp8 columns": lambda x, seed, axis, scale, rounding, four: mx_quantize.quantize_mxfp8_columns(x, seed=seed, scale=scale,
                                                                                                  rounding=rounding),
    "nvfp4 columns": lambda x, seed, axis, scale, rounding, four: nvfp4_quantize.quantize_nvfp4_columns(
        x, seed=seed, rounding=rounding, **_four(four)),
}


def _four(four_over_six: bool) -> dict:
    return {"four_over_six": True} if four_over_six else {}


def quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, block, axis, scale: str, rounding: str, four_over_six: bool):
    """The kernel that quantizes a checked request (:func:`fp4train.kernel_coverage.quantize_kernel`): a function
    ``(x, seed) -> QuantizedTensor``, or None where none covers it."""
    k = coverage.quantize_kernel(shape, dtype, fmt, block, axis, scale, rounding, four_over_six)
    if k is None:
        return None
    run = _PACKED[k.name]
    return lambda x, seed: run(x, seed, k.axis, scale, rounding, four_over_six)


def quantize(x: torch.Tensor, fmt: str, block, axis, scale: str, rounding: str, seed, four_over_six: bool) -> QuantizedTensor | None:
    """The kernel's :class:`QuantizedTensor` for a checked request, or None where none covers it
    (:func:`quantize_kernel`)."""
    kernel = quantize_kernel(tuple(x.shape), x.dtype, fmt, block, axis, scale, rounding, four_over_six)
    return kernel(x.detach(), seed) if kernel is not None else None


def values_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int):
    """The fake-quantization kernel (:func:`fp4train.kernel_coverage.values_kernel`): a function ``(x, seed) ->
    ScaledBF16`` (what ``quantize(...).scaled_bf16()`` gives, without writing codes), or None where none covers the
    request. ``kw``: the operand's ``QuantSpec.quantize_kwargs()``."""
    k = coverage.values_kernel(shape, dtype, fmt, kw, axis)
    if k is None:
        return None
    rounding, four = kw.get("rounding", "nearest"), kw.get("four_over_six", False)
    if k.name in ("mxfp4 values", "mxfp8 values"):
        values = mx_values.mxfp4_values if fmt == "mxfp4" else mx_values.mxfp8_values
        scale = kw.get("scale", "floor")
        return lambda x, seed: values(x, axis=k.axis, scale=scale, rounding=rounding, seed=seed)
    if k.name == "nvfp4 values" and k.axis is None:
        return lambda x, seed: nvfp4_tiles.nvfp4_tile_values(x, rounding=rounding, seed=seed, four_over_six=four)
    if k.name == "nvfp4 values":
        return lambda x, seed: nvfp4_values(x, axis=k.axis, rounding=rounding, seed=seed, four_over_six=four)
    return lambda x, seed: fp8_values.fp8_rowwise_values(x, axis=k.axis)  # "fp8 rowwise values"


def hadamard_quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int, transform_block: int,
                             packed: bool):
    """The kernel that quantizes an operand together with its GEMM's block Hadamard transform
    (:func:`fp4train.kernel_coverage.hadamard_quantize_kernel`): a function ``(x, seed, signs) -> QuantizedTensor``
    (``packed``) or ``ScaledBF16``, or None where none covers the request."""
    if coverage.hadamard_quantize_kernel(shape, dtype, fmt, kw, axis, transform_block, packed) is None:
        return None
    rounding, four = kw.get("rounding", "nearest"), kw.get("four_over_six", False)
    if packed:
        return lambda x, seed, signs: nvfp4_quantize.quantize_nvfp4_columns(x, rounding=rounding, seed=seed, hadamard=True,
                                                                            signs=signs, four_over_six=four)
    return lambda x, seed, signs: nvfp4_values(x, axis=0, rounding=rounding, seed=seed, hadamard=True, signs=signs,
                                               four_over_six=four)


def fake_quantize_values(x: torch.Tensor, fmt: str, kw: dict, axis: int, seed) -> ScaledBF16 | None:
    """The fake-quantization kernel's :class:`ScaledBF16` for ``x``, or None where none covers the request
    (:func:`values_kernel`)."""
    kernel = values_kernel(tuple(x.shape), x.dtype, fmt, kw, axis)
    return kernel(x.detach(), seed) if kernel is not None else None
