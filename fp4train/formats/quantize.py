"""``quantize()``: the one entry point from a float tensor to a :class:`QuantizedTensor`.

It validates the request, arranges the tensor into blocks (:mod:`.layout`), draws the
stochastic-rounding uniforms (:mod:`fp4train.counter_rng`), and hands the blocks to the
format's encoder (:mod:`.mx`, :mod:`.nvfp4`, :mod:`.fp8_rowwise`). Everything is plain
PyTorch and runs on any device; the Triton kernels promise the same codes and scales.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import counter_rng
from . import e2m1, fp8_rowwise, mx, nvfp4
from .layout import BlockLayout
from .qtensor import QuantizedTensor
from .scales import ScaleRule


@dataclass(frozen=True)
class FormatInfo:
    """Static facts about a format."""

    name: str
    element: str  # "e2m1" | "e4m3"
    default_block: int | None  # None: one scale per row (fp8)
    scale: str  # "e8m0" | "e4m3+fp32" | "fp32"
    description: str

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, scales included (1D blocks of the default size)."""
        elem = 4 if self.element == "e2m1" else 8
        if self.default_block is None:
            return float(elem)
        return elem + 8 / self.default_block


FORMATS: dict[str, FormatInfo] = {
    f.name: f
    for f in (
        FormatInfo("mxfp4", "e2m1", 32, "e8m0", "E2M1 elements, 32-element blocks, E8M0 (power-of-two) scales"),
        FormatInfo("nvfp4", "e2m1", 16, "e4m3+fp32", "E2M1 elements, 16-element blocks, E4M3 scales + FP32 tensor scale"),
        FormatInfo("mxfp8", "e4m3", 32, "e8m0", "E4M3 elements, 32-element blocks, E8M0 scales"),
        FormatInfo("fp8", "e4m3", None, "fp32", "E4M3 elements, one FP32 scale per row (along the axis)"),
    )
}

ROUNDINGS = ("nearest", "stochastic")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    block: int | tuple[int, int] | None = None,
    scale: str = "floor",
    rounding: str = "nearest",
    seed: int | None = None,
    four_over_six: bool = False,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` and return a :class:`QuantizedTensor`.

    Args:
        x: a floating-point tensor (float32, bfloat16, float16 or float64), any device.
        fmt: ``"mxfp4"``, ``"nvfp4"``, ``"mxfp8"`` or ``"fp8"`` (E4M3, per-row FP32 scale).
        axis: the axis the 1D blocks run along (a GEMM's inner dimension). Ignored for 2D tiles.
        block: ``None`` for the format's default (32, 16, 32, per-row), an int for 1D blocks,
            or ``(b, b)`` for 2D square tiles over the last two dims.
        scale: MX scale rule, ``"floor"`` (OCP) or ``"ceil"`` (truncation-free). NVFP4 and FP8
            have one rule each, selected by the default ``"floor"``.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"``.
        seed: stochastic-rounding seed; ``None`` draws one from torch's default generator,
            so ``torch.manual_seed`` makes the result reproducible.
        four_over_six: NVFP4 only: per block, pick max->6 or max->4, whichever errs less.

    Dimensions that are not a multiple of the block are zero-padded and cropped on
    :meth:`QuantizedTensor.dequantize`. Blocks holding NaN/Inf dequantize to all-NaN.
    """
    info = _check(x, fmt, axis, block, scale, rounding, seed, four_over_six)
    block, axis = geometry(x, info, axis, block)
    if _KERNELS and (q := _kernel_quantize(x, fmt, block, axis, scale, rounding, seed, four_over_six)) is not None:
        return q
    keys = sr_keys(seed) if rounding == "stochastic" else None
    return quantize_tensors(x, keys, fmt=fmt, block=block, axis=axis, scale=scale, four_over_six=four_over_six)


def geometry(x: torch.Tensor, info: FormatInfo, axis: int, block) -> tuple[tuple[int, ...] | None, int | None]:
    """``(block, axis)`` of a checked request: ``((b, b), None)`` for 2D tiles, ``((b,), axis)``
    for 1D blocks, ``(None, axis)`` for fp8 rowwise (the whole row: :func:`quantize_tensors`
    takes it from ``x``'s shape, which stays symbolic when traced)."""
    if block is None:
        block = info.default_block
    if isinstance(block, (tuple, list)):
        return (int(block[0]), int(block[1])), None
    return ((int(block),) if block is not None else None), axis % x.ndim


def sr_keys(seed: int | torch.Tensor | None) -> torch.Tensor:
    """Stochastic-rounding keys (int64 ``[2]``) for ``seed`` (``None``: a fresh one), on the CPU
    so that no host-to-device copy is needed; a seed given as its keys already (an int64 ``[2]`` tensor,
    :func:`~fp4train.counter_rng.seed_keys_tensor`, e.g. on a device) is returned as it is."""
    if isinstance(seed, torch.Tensor):
        return counter_rng.check_keys(seed)
    if seed is None:
        seed = counter_rng.fresh_seed()
    return torch.tensor(counter_rng.seed_keys(seed), dtype=torch.int64)


def quantize_tensors(x, keys, *, fmt: str, block: tuple[int, ...] | None, axis: int | None, scale: str,
                     four_over_six: bool, encode=None) -> QuantizedTensor:
    """The whole quantization as a function of tensors (``x``, stochastic-rounding ``keys`` or
    None) and static settings (:func:`geometry`'s ``block`` and ``axis``) - what a fused path
    traces. ``encode``: the numerical core (default: the compiled one if :func:`set_compiled` is on)."""
    fmt_info = FORMATS[fmt]
    if block is None:  # fp8 rowwise: the whole row (at least 1, so an empty axis still works)
        block = (max(x.shape[axis], 1),)
    layout = BlockLayout(tuple(x.shape), block, axis)
    xc = layout.to_canonical(x.detach().to(torch.float32))  # quantization is not differentiable
    xb = layout.blockify(xc)
    codes_b, scales, tensor_scale = (encode or _ENCODE)(xb, keys, fmt, fmt_info.element, scale, four_over_six)
    codes = layout.unblockify(codes_b)
    if fmt_info.element == "e2m1":
        codes = e2m1.pack(codes)
    return QuantizedTensor(fmt, codes.contiguous(), scales.contiguous(), tensor_scale, layout, x.dtype)


def encode_blocks(xb, keys, fmt: str, element: str, scale: str, four_over_six: bool):
    """Blocked float32 ``(*scale_shape, n)`` -> (element codes, scales, tensor scale or None).

    The whole numerical core of :func:`quantize` (layout work aside) in one function of tensors,
    so that :func:`set_compiled` can hand it to ``torch.compile``; ``keys`` (int64 ``[2]``, see
    :func:`fp4train.counter_rng.seed_keys`) selects stochastic rounding.
    """
    u = None if keys is None else counter_rng.uniform_keys(keys, xb.shape, xb.device)
    if fmt in ("mxfp4", "mxfp8"):
        codes, scales = mx.encode_blocks(xb, element=element, rule=ScaleRule(scale), u=u)
        return codes, scales, None
    if fmt == "nvfp4":
        ts = nvfp4.tensor_scale(xb, four_over_six=four_over_six)  # zero padding never changes the amax
        codes, scales = nvfp4.encode_blocks(xb, ts, u=u, four_over_six=four_over_six)
        return codes, scales, ts
    codes, scales = fp8_rowwise.encode_rows(xb, u=u)  # fp8 rowwise: xb is (*rows, 1, n)
    return codes, scales.squeeze(-1), None  # (*rows, 1) == layout.scale_shape


_ENCODE = encode_blocks
_KERNELS = False


def set_kernels(enabled: bool = True) -> None:
    """Route the requests a Triton kernel covers to it (see :func:`fp4train.formats.set_numerics`)."""
    global _KERNELS
    if enabled:
        import fp4train.kernels  # noqa: F401 - fail here, clearly, if Triton is missing
    _KERNELS = enabled


def kernels_usable_on(t: torch.Tensor) -> bool:
    """Can fp4train's Triton kernels take ``t``? CUDA tensors always; CPU tensors only under
    Triton's interpreter (tests). Elsewhere a CPU tensor takes the reference path whatever the
    numerics mode - a model converted on a GPU sets ``triton`` numerics for the whole process."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_quantize(x, fmt, block, axis, scale, rounding, seed, four_over_six):
    """The Triton kernel's result for this request, or None when no kernel covers it: 2D tensors,
    MXFP4/MXFP8 in 1x32 blocks or 32x32 tiles, NVFP4 (no 4/6) in 1x16 blocks or 16x16 tiles, FP8
    rowwise with nearest rounding.

    1D blocks along dim 1 run the row kernels; along dim 0 the column kernels, which read the
    row-major tensor as it is (no transposed copy) and write the reference's canonical layout
    (``x.T``'s codes) with its stochastic-rounding indices ``k * M + m``.
    """
    if x.ndim != 2 or four_over_six or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or 0 in x.shape:
        return None
    from .. import kernels

    if not kernels_usable_on(x):
        return None
    if fmt == "fp8":  # rowwise: one scale per row along the axis (0 or 1 here: geometry() normalized it)
        if rounding != "nearest":
            return None
        return kernels.fp8_values.quantize_fp8_rowwise(x.detach(), axis=axis)
    if fmt in ("mxfp4", "mxfp8") and block == (32, 32):
        tiles = kernels.quantize_mxfp4_2d if fmt == "mxfp4" else kernels.quantize_mxfp8_2d
        return tiles(x.detach(), scale=scale, rounding=rounding, seed=seed)
    if fmt == "nvfp4" and block == (16, 16):
        return kernels.quantize_nvfp4_2d(x.detach(), rounding=rounding, seed=seed)
    b = {"mxfp4": 32, "mxfp8": 32, "nvfp4": 16}.get(fmt)
    if b is None or block != (b,) or x.shape[axis] % b or (fmt == "nvfp4" and scale != "floor"):
        return None
    kw = dict(rounding=rounding, seed=seed)
    if fmt != "nvfp4":
        kw["scale"] = scale
    if axis == 0:  # along dim 0 from the row-major layout, without a transposed copy
        columns = {"mxfp4": kernels.mx_quantize.quantize_mxfp4_columns, "mxfp8": kernels.mx_quantize.quantize_mxfp8_columns,
                   "nvfp4": kernels.nvfp4_quantize.quantize_nvfp4_columns}[fmt]
        return columns(x.detach(), **kw)
    rows = {"mxfp4": kernels.quantize_mxfp4, "mxfp8": kernels.quantize_mxfp8, "nvfp4": kernels.quantize_nvfp4}[fmt]
    return rows(x.detach(), **kw)  # along dim 1: the row kernels' layout is the reference's


def set_compiled(enabled: bool = True) -> None:
    """Run the numerical core of :func:`quantize` through ``torch.compile`` (fused kernels).

    Same results bit for bit (tested against eager on the CPU; on the GPU by tests/test_cuda.py):
    the arithmetic is exact or IEEE-rounded in a fixed order, which the compiler preserves. Off by
    default; the trainer's ``--numerics compiled`` turns it on.
    """
    global _ENCODE
    if enabled:
        _raise_recompile_limit()
    _ENCODE = torch.compile(encode_blocks, dynamic=True) if enabled else encode_blocks


def _raise_recompile_limit(n: int = 64) -> None:
    """One compiled graph per (format, scale rule, rounding, dtype) combination in use: more than
    dynamo's default limit of 8 in a model that mixes recipes' formats (AdaHOP, tib2d's MXFP8)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Function form of :meth:`QuantizedTensor.dequantize`."""
    return q.dequantize(dtype)


def fake_quantize(x: torch.Tensor, fmt: str, **kwargs) -> torch.Tensor:
    """``quantize(x, fmt, **kwargs).dequantize()``: the values a GEMM would see."""
    return quantize(x, fmt, **kwargs).dequantize()


def _check(x, fmt, axis, block, scale, rounding, seed, four_over_six) -> FormatInfo:
    """Every bad-input case ends here with a message that says what to do."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"quantize expects a floating-point tensor (float32, bfloat16, float16 or float64), "
            f"got {x.dtype}; convert it first, e.g. x.float()"
        )
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {sorted(FORMATS)}")
    info = FORMATS[fmt]
    if x.ndim == 0:
        raise ValueError("quantize needs a tensor with at least one dimension, got a 0-d tensor; use x.reshape(1)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose 'nearest' or 'stochastic'")
    if scale not in ("floor", "ceil"):
        raise ValueError(f"unknown scale rule {scale!r}; choose 'floor' or 'ceil'")
    if scale == "ceil" and info.scale != "e8m0":
        raise ValueError(
            f"scale='ceil' applies to power-of-two (E8M0) scales of the MX formats; {fmt} "
            f"uses {info.scale} scales, so leave scale='floor'"
        )
    if four_over_six and fmt != "nvfp4":
        raise ValueError(f"four_over_six is an NVFP4 option, not available for {fmt}")
    if isinstance(seed, torch.Tensor):  # a seed's keys, made where the seed lives (counter_rng.seed_keys_tensor)
        sr_keys(seed)  # checks them
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int, its keys as an int64 [2] tensor, or None, got {type(seed).__name__}")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for a tensor with {x.ndim} dims")
    if isinstance(block, (tuple, list)):
        if fmt == "fp8":
            raise ValueError("fp8 is scaled per row; it has no 2D tiles (use block=None)")
        if len(block) != 2 or block[0] != block[1]:
            raise ValueError(f"2D blocks must be square, like (32, 32); got {tuple(block)}")
        if x.ndim < 2:
            raise ValueError(f"2D tiles {tuple(block)} need a tensor with >= 2 dims, got shape {tuple(x.shape)}")
        b = block[0]
    elif block is not None:
        if fmt == "fp8":
            raise ValueError("fp8 is scaled per row; pass block=None (or use mxfp8 for 32-element blocks)")
        b = block
    else:
        return info
    if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b % 2:
        raise ValueError(f"block size must be an even int >= 2, got {b!r}")
    return info
