"""Which Triton kernel covers a quantization request - plain Python over the formats' definitions, importable without
Triton or a GPU.

A plan (:mod:`fp4train.linear.plan`, through :mod:`fp4train.quantizer`) asks these functions which kernel would
quantize an operand, and gets the kernel's name or None (the reference, or compiled cores, then). Only executing a
plan imports the kernels: :mod:`fp4train.kernels.dispatch` runs the kernel a name stands for. Every kernel returns the
reference's bits; docs/formats.md lists them.

Names, by what a kernel makes:

* packed codes and scales (:func:`quantize_kernel`): ``"<fmt> tiles"`` (32x32 MX, 16x16 NVFP4), ``"<fmt> rows"``
  (1D blocks along dim 1), ``"<fmt> columns"`` (along dim 0, read in place), ``"fp8 rowwise"``;
* BF16 values and factors (:func:`values_kernel`): ``"<fmt> values"`` with ``axis`` None for tiles, ``"fp8 rowwise
  values"``;
* NVFP4 with the 16-point Hadamard transform fused (:func:`hadamard_quantize_kernel`): ``"nvfp4 hadamard columns"``
  (packed) and ``"nvfp4 hadamard values"``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .formats.quantize import FORMATS

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the block-scaled formats' kernels: 1D blocks of the format's block size, and square tiles of it
BLOCK = {f: FORMATS[f].default_block for f in ("mxfp4", "mxfp8", "nvfp4")}
TILE = {f: (b, b) for f, b in BLOCK.items()}


class Kernel(NamedTuple):
    """A kernel's name and the axis it quantizes along (None: 2D tiles)."""

    name: str
    axis: int | None


def quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, block, axis, scale: str, rounding: str,
                    four_over_six: bool) -> Kernel | None:
    """The kernel that quantizes and packs a checked request (``block``/``axis`` as
    :func:`fp4train.formats.quantize.geometry` gives them) for a tensor of ``shape`` and ``dtype``, or None. Covered:
    2D tensors; MXFP4/MXFP8 in 1x32 blocks or 32x32 tiles; NVFP4 (4/6 too) in 1x16 blocks or 16x16 tiles, floor scales
    for 1D; FP8 rowwise with nearest rounding."""
    if len(shape) != 2 or dtype not in KERNEL_DTYPES or 0 in shape or (four_over_six and fmt != "nvfp4"):
        return None
    if fmt == "fp8":
        return Kernel("fp8 rowwise", axis) if rounding == "nearest" else None
    if fmt in TILE and block == TILE[fmt]:
        return Kernel(f"{fmt} tiles", None)
    b = BLOCK.get(fmt)
    if b is None or block != (b,) or shape[axis] % b or (fmt == "nvfp4" and scale != "floor"):
        return None
    return Kernel(f"{fmt} columns" if axis == 0 else f"{fmt} rows", axis)


def values_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int) -> Kernel | None:
    """The kernel that quantizes an operand straight into BF16 values and factors (``quantize(...).scaled_bf16()``
    without codes written), or None. Covered: MXFP4/MXFP8 1x32 along either axis or 32x32 tiles; NVFP4 (4/6 too) 1x16
    along either axis or 16x16 tiles; FP8 rowwise with nearest rounding. ``kw``: the operand's
    ``QuantSpec.quantize_kwargs()``."""
    if dtype not in KERNEL_DTYPES or (kw.get("four_over_six", False) and fmt != "nvfp4"):
        return None
    block = kw.get("block")
    if fmt in TILE and isinstance(block, (tuple, list)):
        return Kernel(f"{fmt} values", None) if tuple(block) == TILE[fmt] else None
    if fmt in BLOCK and block in (None, BLOCK[fmt]) and shape[axis] % BLOCK[fmt] == 0:
        return Kernel(f"{fmt} values", axis % 2)
    if fmt == "fp8" and kw.get("rounding", "nearest") == "nearest":
        return Kernel("fp8 rowwise values", axis % 2)
    return None


def hadamard_quantize_kernel(shape: tuple, dtype: torch.dtype, fmt: str, kw: dict, axis: int, transform_block: int,
                             packed: bool) -> Kernel | None:
    """The kernel that quantizes an operand together with its GEMM's block Hadamard transform (the transformed tensor
    never written): packed codes (``packed``) or BF16 values, or None. Covered: NVFP4 (4/6 too) in 1x16 blocks along
    dim 0 of a 2D float32/bfloat16 tensor under a 16-point transform - NVIDIA's recipe's RHT on the wgrad GEMM's
    operands."""
    if (len(shape) != 2 or fmt != "nvfp4" or transform_block != 16 or axis % 2 != 0
            or kw.get("block") not in (None, 16) or kw.get("scale", "floor") != "floor" or shape[0] % 16 or 0 in shape
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    return Kernel("nvfp4 hadamard columns" if packed else "nvfp4 hadamard values", 0)
