"""``quantize()``: the one entry point from a float tensor to a :class:`QuantizedTensor`.

It validates the request, arranges the tensor into blocks (:mod:`.layout`), draws the
stochastic-rounding uniforms (:mod:`fp4train.counter_rng`), and hands the blocks to the
format's encoder (:mod:`.mx`, :mod:`.nvfp4`, :mod:`.fp8_rowwise`). Everything is plain
PyTorch and runs on any device; the Triton kernels promise the same codes and scales.
"""

from __future__ import annotations

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
    block, axis = check_request(x, fmt, axis=axis, block=block, scale=scale, rounding=rounding, seed=seed,
                                four_over_six=four_over_six)
    keys = sr_keys(seed) if rounding == "stochastic" else None
    return quantize_tensors(x, keys, fmt=fmt, block=block, axis=axis, scale=scale, four_over_six=four_over_six)


def check_request(x, fmt: str, *, axis: int, block, scale: str, rounding: str, seed, four_over_six: bool):
    """Validate a :func:`quantize` request (a one-line error naming the culprit otherwise) and return its
    ``(block, axis)`` as :func:`geometry` normalizes them."""
    info = _check(x, fmt, axis, block, scale, rounding, seed, four_over_six)
    return geometry(x, info, axis, block)


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
    traces. ``encode``: the numerical core, :func:`encode_blocks` unless given (a compiled copy of it)."""
    fmt_info = FORMATS[fmt]
    if block is None:  # fp8 rowwise: the whole row (at least 1, so an empty axis still works)
        block = (max(x.shape[axis], 1),)
    layout = BlockLayout(tuple(x.shape), block, axis)
    xc = layout.to_canonical(x.detach().to(torch.float32))  # quantization is not differentiable
    xb = layout.blockify(xc)
    encode = encode_blocks if encode is None else encode  # not `or`: Dynamo does not branch on a function's truth
    codes_b, scales, tensor_scale = encode(xb, keys, fmt, fmt_info.element, scale, four_over_six)
    codes = layout.unblockify(codes_b)
    if fmt_info.element == "e2m1":
        codes = e2m1.pack(codes)
    return QuantizedTensor(fmt, codes.contiguous(), scales.contiguous(), tensor_scale, layout, x.dtype)


def encode_blocks(xb, keys, fmt: str, element: str, scale: str, four_over_six: bool):
    """Blocked float32 ``(*scale_shape, n)`` -> (element codes, scales, tensor scale or None).

    The whole numerical core of :func:`quantize` (layout work aside) in one function of tensors,
    so that a fused path can hand it to ``torch.compile``; ``keys`` (int64 ``[2]``, see
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
