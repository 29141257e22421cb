"""Preparing one GEMM operand as its :class:`~fp4train.recipes.QuantSpec` says.

``prepare`` = optional inner-dimension transform, then quantization along the GEMM's inner
dimension. Also the helpers that let the quantized linear save a prepared operand through
``ctx.save_for_backward`` (so saved-tensor hooks, offloading and memory accounting see the
packed bytes, not a hidden Python attribute).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import formats
from ..counter_rng import derive_seed, derived_keys_tensor
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from ..formats.quantize import FORMATS, geometry, kernels_usable_on, quantize, quantize_tensors, sr_keys
from ..formats.quantize import encode_blocks as _encode_reference
from ..formats.quantize import _raise_recompile_limit
from ..recipes.spec import QuantSpec, TransformSpec
from ..transforms.hadamard import hadamard

Operand = torch.Tensor | QuantizedTensor | ScaledBF16

#: salts for derive_seed: (gemm, operand); operand 2 is the GEMM's shared transform
FPROP, DGRAD, WGRAD = 0, 1, 2
OP_A, OP_B, OP_TRANSFORM = 0, 1, 2


def prepare(
    x: torch.Tensor,
    q: QuantSpec,
    *,
    axis: int,
    transform: TransformSpec | None,
    seed: int,
    gemm: int,
    operand: int,
    compute_dtype: torch.dtype,
) -> Operand:
    """Transform ``x`` along ``axis`` (if asked), then quantize it along ``axis``.

    ``seed`` is the layer call's base seed: the stochastic-rounding stream of this operand is
    ``derive_seed(seed, gemm, operand)`` and the transform's signs use
    ``derive_seed(seed, gemm, OP_TRANSFORM)``, the same for both operands of one GEMM (the
    inner transform must be identical on both sides to cancel).
    """
    x = _transform(x, transform, axis=axis, seed=seed, gemm=gemm)
    if not q.quantized:
        return x.to(compute_dtype)
    return quantize(x, q.format, axis=axis, seed=sr_seed(q, seed, gemm, operand), **q.quantize_kwargs())


def sr_seed(q: QuantSpec, seed: int | torch.Tensor, gemm: int, operand: int) -> int | torch.Tensor | None:
    """The stochastic-rounding seed of an operand: ``derive_seed(seed, gemm, operand)``, None for
    nearest rounding (or no quantization). A layer seed that lives on a device (a 0-d int64 tensor from
    :class:`~fp4train.counter_rng.DeviceSeedStream`) is derived there, and the operand gets its keys
    (``derived_keys_tensor``: what the kernels and the reference take in place of the int)."""
    return _derived(seed, gemm, operand) if q.quantized and q.stochastic else None


def _derived(seed: int | torch.Tensor, gemm: int, salt: int) -> int | torch.Tensor:
    """``derive_seed(seed, gemm, salt)``; from a layer seed that lives on a device, the derived seed's keys there."""
    return derived_keys_tensor(seed, gemm, salt) if isinstance(seed, torch.Tensor) else derive_seed(seed, gemm, salt)


def transform_seed(transform: TransformSpec, seed: int | torch.Tensor, gemm: int) -> int | torch.Tensor | None:
    """The seed of a GEMM's random Hadamard signs, ``derive_seed(seed, gemm, OP_TRANSFORM)`` (None for a plain
    transform); from a layer seed that lives on a device, its keys there (``derived_keys_tensor``, which
    :func:`~fp4train.transforms.hadamard.signs` takes in place of the int)."""
    return _derived(seed, gemm, OP_TRANSFORM) if transform.random_signs else None


def _transform(x: torch.Tensor, transform: TransformSpec | None, *, axis: int, seed: int | torch.Tensor, gemm: int) -> torch.Tensor:
    """The GEMM's inner transform of ``x`` (signs from ``derive_seed(seed, gemm, OP_TRANSFORM)``), or ``x``."""
    if transform is None:
        return x
    return hadamard(x, transform.block, axis=axis, seed=transform_seed(transform, seed, gemm))


def prepare_now(
    x: torch.Tensor,
    q: QuantSpec,
    *,
    axis: int,
    transform: TransformSpec | None,
    seed: int,
    gemm: int,
    operand: int,
    compute_dtype: torch.dtype,
    backend=None,
) -> Operand:
    """:func:`prepare` for an operand that a GEMM multiplies at once (nothing saves it).

    A ``backend`` with an ``operand`` method (``fp8_blockwise``, ``triton``) is asked first: it may
    return the operand in its own form (MXFP4 folded into FP8 group scales), with the transform
    fused into the same pass where it can, else after the transform.

    Under ``set_numerics("compiled")`` the quantization and the split into BF16 values and
    factors (:meth:`QuantizedTensor.scaled_bf16`) run as one compiled graph, which never
    writes the codes to memory: the result is that :class:`ScaledBF16`, equal bit for bit to
    ``prepare(...).scaled_bf16()``. The transform runs before it, on its own (Inductor
    compiles the butterflies slowly and badly; on a GPU a Triton kernel does them in one pass).
    Under ``set_numerics("triton")`` a Triton fake-quantization kernel writes the BF16 values
    directly where one covers the request (MXFP4 1x32 along either axis, 32x32 tiles; NVFP4
    1x16 along either axis, 16x16 tiles; FP8 rowwise), and
    the compiled graph does the rest on a GPU (the eager reference on a CPU).
    Otherwise it is :func:`prepare`.
    """
    mode = formats.numerics()
    own = getattr(backend, "operand", None)
    if not q.quantized or x.ndim != 2 or (mode == "eager" and own is None):
        return prepare(x, q, axis=axis, transform=transform, seed=seed, gemm=gemm, operand=operand,
                       compute_dtype=compute_dtype)
    op_seed = sr_seed(q, seed, gemm, operand)
    if own is not None and transform is not None:  # the backend may fuse the transform into its quantization
        t_seed = transform_seed(transform, seed, gemm)
        if (op := own(x, q, axis=axis, role=operand, seed=op_seed, transform=transform, transform_seed=t_seed)) is not None:
            return op
    # transformed once, outside any graph: a Triton kernel on GPUs (fp4train.transforms.hadamard.set_kernel)
    x = _transform(x, transform, axis=axis, seed=seed, gemm=gemm)
    if own is not None and (op := own(x, q, axis=axis, role=operand, seed=op_seed)) is not None:
        return op
    kw = q.quantize_kwargs()
    if mode == "triton" and kernels_usable_on(x) and (v := _kernel_values(x, q, kw, axis, op_seed)) is not None:
        return v
    if not (mode == "compiled" or (mode == "triton" and x.is_cuda)):
        return prepare(x, q, axis=axis, transform=None, seed=seed, gemm=gemm, operand=operand, compute_dtype=compute_dtype)
    block, ax = geometry(x, FORMATS[q.format], axis, kw.get("block"))
    values, scale, divisor = _fused()(
        x.detach(), sr_keys(op_seed) if q.stochastic else None, fmt=q.format,
        block=block, block_axis=ax, scale=kw.get("scale", "floor"), four_over_six=kw.get("four_over_six", False),
    )
    return ScaledBF16(values, scale, divisor, ax)


def _kernel_values(x, q: QuantSpec, kw: dict, axis: int, seed: int | None) -> ScaledBF16 | None:
    """The Triton fake-quantization kernel's result, or None where none covers the request
    (MXFP4/MXFP8 1x32 along either axis or 32x32 tiles; NVFP4 1x16 along either axis or 16x16
    tiles; FP8 rowwise with nearest rounding)."""
    if kw.get("four_over_six") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    block, rounding = kw.get("block"), kw.get("rounding", "nearest")
    if q.format in ("mxfp4", "mxfp8"):
        if isinstance(block, (tuple, list)):
            if tuple(block) != (32, 32):
                return None
            kaxis = None
        elif block in (None, 32) and x.shape[axis] % 32 == 0:
            kaxis = axis % 2
        else:
            return None
        from ..kernels import mx_values

        values = mx_values.mxfp4_values if q.format == "mxfp4" else mx_values.mxfp8_values
        return values(x.detach(), axis=kaxis, scale=kw.get("scale", "floor"), rounding=rounding, seed=seed)
    if q.format == "nvfp4" and isinstance(block, (tuple, list)):
        if tuple(block) != (16, 16):
            return None
        from ..kernels.nvfp4_tiles import nvfp4_tile_values

        return nvfp4_tile_values(x.detach(), rounding=rounding, seed=seed)
    if q.format == "nvfp4" and block in (None, 16) and x.shape[axis] % 16 == 0:
        from ..kernels.nvfp4_values import nvfp4_values

        return nvfp4_values(x.detach(), axis=axis % 2, rounding=rounding, seed=seed)
    if q.format == "fp8" and not q.stochastic:
        from ..kernels.fp8_values import fp8_rowwise_values

        return fp8_rowwise_values(x.detach(), axis=axis % 2)
    return None


def prepared_scaled_tensors(x, keys, *, fmt, block, block_axis, scale, four_over_six):
    """Quantize and split one operand: a function of tensors (the input and the stochastic-
    rounding keys) that ``torch.compile`` fuses. Returns ``(values, scale, divisor)`` of
    :class:`ScaledBF16`."""
    qt = quantize_tensors(x, keys, fmt=fmt, block=block, axis=block_axis, scale=scale, four_over_six=four_over_six,
                          encode=_encode_reference)
    s = qt.scaled_bf16()
    return s.values, s.scale, s.divisor


_COMPILED = None


def _fused():
    global _COMPILED
    if _COMPILED is None:
        _raise_recompile_limit()
        _COMPILED = torch.compile(prepared_scaled_tensors, dynamic=True)
    return _COMPILED


def gemm_with_outliers(a, b, g, *, seed: int, gemm: int, compute_dtype, backend, out_dtype) -> torch.Tensor:
    """GEMM ``a @ b.T`` (both ``[outer, inner]``, high precision) with AdaHOP outlier extraction.

    FOID picks the outliers ``g.outliers`` asks for; they stay in the operands' own precision
    and are multiplied in FP32; the residuals (outliers zeroed) are prepared as ``g`` says
    (transform + quantization along the inner dim) and multiplied by ``backend``.
    """
    from ..adahop.outlier_gemm import oe_gemm
    from ..adahop.strategy import extraction_for

    o = g.outliers
    ext = extraction_for(a, b, o.a, o.b, o.k)

    def residual(a_res, b_res):
        qa = prepare_now(a_res, g.a, axis=1, transform=g.transform, seed=seed, gemm=gemm, operand=OP_A, compute_dtype=compute_dtype,
                         backend=backend)
        qb = prepare_now(b_res, g.b, axis=1, transform=g.transform, seed=seed, gemm=gemm, operand=OP_B, compute_dtype=compute_dtype,
                         backend=backend)
        return backend.gemm(qa, qb, torch.float32)

    return oe_gemm(a, b, ext, residual).to(out_dtype)


def shares_quantization(p: QuantSpec, tp: TransformSpec | None, q: QuantSpec, tq: TransformSpec | None) -> bool:
    """Can one quantization of a tensor serve two GEMMs that block it along different axes?

    Only with identical 2D tiles and no transform: a tile maps onto a tile under transposition
    (paper 004), while a 1D block or a one-axis transform does not.
    """
    return p.quantized and p.is_2d and p == q and tp is None and tq is None


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim 0 to a multiple of ``multiple`` (token padding; exact for an inner dim)."""
    extra = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def pack_operand(op: Operand) -> tuple[tuple[torch.Tensor, ...], QuantizedTensor | None]:
    """Split an operand into tensors for ``save_for_backward`` and metadata."""
    if isinstance(op, QuantizedTensor):
        return op.tensors(), dataclasses.replace(op, codes=None, scales=None, tensor_scale=None)
    return (op,), None


def unpack_operand(tensors: tuple[torch.Tensor, ...], meta: QuantizedTensor | None) -> Operand:
    """Inverse of :func:`pack_operand`."""
    return tensors[0] if meta is None else meta.with_tensors(tuple(tensors))
