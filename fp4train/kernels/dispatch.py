"""Which Triton kernel covers a request: the kernel's result, or None where none does (the caller then
takes the reference path). Every kernel returns the reference's bits; docs/formats.md lists them."""

from __future__ import annotations

import torch

from ..formats.qtensor import QuantizedTensor, ScaledBF16
from . import fp8_values, mx_quantize, mx_values, nvfp4_quantize, nvfp4_tiles
from .nvfp4_values import nvfp4_values  # the package re-exports the function under the module's name

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, block, axis, scale: str, rounding: str, four_over_six: bool):
    """The kernel that quantizes a checked request (``block``/``axis`` as :func:`fp4train.formats.quantize.geometry`
    gives them) for a tensor of ``shape`` and ``dtype``: a function ``(x, seed) -> QuantizedTensor``, or None where
    none covers it. Covered: 2D tensors, MXFP4/MXFP8 in 1x32 blocks or 32x32 tiles, NVFP4 (4/6 too) in 1x16 blocks or
    16x16 tiles, FP8 rowwise with nearest rounding.

    1D blocks along dim 1 run the row kernels; along dim 0 the column kernels, which read the
    row-major tensor as it is (no transposed copy) and write the reference's canonical layout
    (``x.T``'s codes) with its stochastic-rounding indices ``k * M + m``.
    """
    if len(shape) != 2 or dtype not in _KERNEL_DTYPES or 0 in shape or (four_over_six and fmt != "nvfp4"):
        return None
    if fmt == "fp8":  # rowwise: one scale per row along the axis (0 or 1 here: geometry() normalized it)
        return (lambda x, seed: fp8_values.quantize_fp8_rowwise(x, axis=axis)) if rounding == "nearest" else None
    if fmt in ("mxfp4", "mxfp8") and block == (32, 32):
        tiles = mx_quantize.quantize_mxfp4_2d if fmt == "mxfp4" else mx_quantize.quantize_mxfp8_2d
        return lambda x, seed: tiles(x, scale=scale, rounding=rounding, seed=seed)
    if fmt == "nvfp4" and block == (16, 16):
        return lambda x, seed: nvfp4_tiles.quantize_nvfp4_2d(x, rounding=rounding, seed=seed, four_over_six=four_over_six)
    b = {"mxfp4": 32, "mxfp8": 32, "nvfp4": 16}.get(fmt)
    if b is None or block != (b,) or shape[axis] % b or (fmt == "nvfp4" and scale != "floor"):
        return None
    kw = dict(rounding=rounding)
    if fmt != "nvfp4":
        kw["scale"] = scale
    elif four_over_six:
        kw["four_over_six"] = True
    if axis == 0:  # along dim 0 from the row-major layout, without a transposed copy
        columns = {"mxfp4": mx_quantize.quantize_mxfp4_columns, "mxfp8": mx_quantize.quantize_mxfp8_columns,
                   "nvfp4": nvfp4_quantize.quantize_nvfp4_columns}[fmt]
        return lambda x, seed: columns(x, seed=seed, **kw)
    rows = {"mxfp4": mx_quantize.quantize_mxfp4, "mxfp8": mx_quantize.quantize_mxfp8, "nvfp4": nvfp4_quantize.quantize_nvfp4}[fmt]
    return lambda x, seed: rows(x, seed=seed, **kw)  # along dim 1: the row kernels' layout is the reference's


def quantize(x: torch.Tensor, fmt: str, block, axis, scale: str, rounding: str, seed, four_over_six: bool) -> QuantizedTensor | None:
    """The kernel's :class:`QuantizedTensor` for a checked request, or None where none covers it
    (:func:`quantize_kernel`)."""
    kernel = quantize_kernel(tuple(x.shape), x.dtype, fmt, block, axis, scale, rounding, four_over_six)
    return kernel(x.detach(), seed) if kernel is not None else None


def values_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int):
    """The fake-quantization kernel for a tensor of ``shape`` and ``dtype``: a function ``(x, seed) -> ScaledBF16``
    (what ``quantize(...).scaled_bf16()`` gives, without writing codes), or None where none covers the request:
    MXFP4/MXFP8 1x32 along either axis or 32x32 tiles; NVFP4 (4/6 too) 1x16 along either axis or 16x16 tiles; FP8 rowwise
    with nearest rounding. ``kw``: the operand's ``QuantSpec.quantize_kwargs()``."""
    four = kw.get("four_over_six", False)
    if dtype not in _KERNEL_DTYPES or (four and fmt != "nvfp4"):
        return None
    block, rounding = kw.get("block"), kw.get("rounding", "nearest")
    if fmt in ("mxfp4", "mxfp8"):
        if isinstance(block, (tuple, list)):
            if tuple(block) != (32, 32):
                return None
            kaxis = None
        elif block in (None, 32) and shape[axis] % 32 == 0:
            kaxis = axis % 2
        else:
            return None
        values = mx_values.mxfp4_values if fmt == "mxfp4" else mx_values.mxfp8_values
        scale = kw.get("scale", "floor")
        return lambda x, seed: values(x, axis=kaxis, scale=scale, rounding=rounding, seed=seed)
    if fmt == "nvfp4" and isinstance(block, (tuple, list)):
        if tuple(block) != (16, 16):
            return None
        return lambda x, seed: nvfp4_tiles.nvfp4_tile_values(x, rounding=rounding, seed=seed, four_over_six=four)
    if fmt == "nvfp4" and block in (None, 16) and shape[axis] % 16 == 0:
        return lambda x, seed: nvfp4_values(x, axis=axis % 2, rounding=rounding, seed=seed, four_over_six=four)
    if fmt == "fp8" and rounding == "nearest":
        return lambda x, seed: fp8_values.fp8_rowwise_values(x, axis=axis % 2)
    return None


def hadamard_quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int, transform_block: int,
                             packed: bool):
    """The kernel that quantizes an operand together with its GEMM's block Hadamard transform (the transformed
    tensor never written): a function ``(x, seed, signs) -> QuantizedTensor`` (``packed``) or ``ScaledBF16``, or None
    where none covers the request. Covered: NVFP4 (4/6 too) in 1x16 blocks along dim 0 of a 2D float32/bfloat16 tensor
    under a 16-point transform - NVIDIA's recipe's RHT on the wgrad GEMM's operands."""
    if (len(shape) != 2 or fmt != "nvfp4" or transform_block != 16 or axis % 2 != 0
            or kw.get("block") not in (None, 16) or kw.get("scale", "floor") != "floor" or shape[0] % 16 or 0 in shape
            or dtype not in (torch.float32, torch.bfloat16)):
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
