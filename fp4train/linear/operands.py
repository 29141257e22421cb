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

from ..counter_rng import derive_seed
from ..device_seeds import derived_keys
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from ..quantizer import Quantizer
from ..recipes.spec import QuantSpec, TransformSpec

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
    quantizer: Quantizer,
) -> Operand:
    """Transform ``x`` along ``axis`` (if asked), then quantize it along ``axis``, by ``quantizer``.

    ``seed`` is the layer call's base seed: the stochastic-rounding stream of this operand is
    ``derive_seed(seed, gemm, operand)`` and the transform's signs use
    ``derive_seed(seed, gemm, OP_TRANSFORM)``, the same for both operands of one GEMM (the
    inner transform must be identical on both sides to cancel).
    """
    x = _transform(x, transform, axis=axis, seed=seed, gemm=gemm, quantizer=quantizer)
    if not q.quantized:
        return x.to(compute_dtype)
    return quantizer.quantize(x, q.format, axis=axis, seed=sr_seed(q, seed, gemm, operand), **q.quantize_kwargs())


def sr_seed(q: QuantSpec, seed: int | torch.Tensor, gemm: int, operand: int) -> int | torch.Tensor | None:
    """The stochastic-rounding seed of an operand: ``derive_seed(seed, gemm, operand)``, None for
    nearest rounding (or no quantization). A layer seed that lives on a device (a 0-d int64 tensor from
    :class:`~fp4train.device_seeds.DeviceSeedStream`) is derived there, and the operand gets its keys
    (``derived_keys``: what the kernels and the reference take in place of the int)."""
    return _derived(seed, gemm, operand) if q.quantized and q.stochastic else None


def _derived(seed: int | torch.Tensor, gemm: int, salt: int) -> int | torch.Tensor:
    """``derive_seed(seed, gemm, salt)``; from a layer seed that lives on a device, the derived seed's keys there."""
    return derived_keys(seed, gemm, salt) if isinstance(seed, torch.Tensor) else derive_seed(seed, gemm, salt)


def transform_seed(transform: TransformSpec, seed: int | torch.Tensor, gemm: int) -> int | torch.Tensor | None:
    """The seed of a GEMM's random Hadamard signs, ``derive_seed(seed, gemm, OP_TRANSFORM)`` (None for a plain
    transform); from a layer seed that lives on a device, its keys there (``derived_keys``, which
    :func:`~fp4train.transforms.hadamard.signs` takes in place of the int)."""
    return _derived(seed, gemm, OP_TRANSFORM) if transform.random_signs else None


def _transform(x: torch.Tensor, transform: TransformSpec | None, *, axis: int, seed: int | torch.Tensor, gemm: int,
               quantizer: Quantizer) -> torch.Tensor:
    """The GEMM's inner transform of ``x`` (signs from ``derive_seed(seed, gemm, OP_TRANSFORM)``), or ``x``."""
    if transform is None:
        return x
    return quantizer.hadamard(x, transform.block, axis=axis, seed=transform_seed(transform, seed, gemm))


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
    quantizer: Quantizer,
    backend=None,
) -> Operand:
    """:func:`prepare` for an operand that a GEMM multiplies at once (nothing saves it).

    A ``backend`` that prepares operands of its own (``fp8_blockwise``, ``triton``: ``backend.operands``) is asked first: it may
    return the operand in its own form (MXFP4 folded into FP8 group scales), with the transform
    fused into the same pass where it can, else after the transform. Then the quantizer's
    :meth:`~fp4train.quantizer.Quantizer.values`: the BF16 values and factors of
    ``prepare(...).scaled_bf16()`` without the codes ever written (a fake-quantization kernel, or
    the compiled reference as one graph); the transform runs before it, on its own (Inductor
    compiles the butterflies slowly and badly; on a GPU a Triton kernel does them in one pass).
    Otherwise it is :func:`prepare`.
    """
    own = backend.operands.operand if backend is not None and backend.operands is not None else None
    common = dict(axis=axis, seed=seed, gemm=gemm, operand=operand, compute_dtype=compute_dtype, quantizer=quantizer)
    if not q.quantized or x.ndim != 2 or (quantizer.numerics == "eager" and own is None):
        return prepare(x, q, transform=transform, **common)
    op_seed = sr_seed(q, seed, gemm, operand)
    if own is not None and transform is not None:  # the backend may fuse the transform into its quantization
        t_seed = transform_seed(transform, seed, gemm)
        if (op := own(x, q, axis=axis, role=operand, seed=op_seed, transform=transform, transform_seed=t_seed)) is not None:
            return op
    x = _transform(x, transform, axis=axis, seed=seed, gemm=gemm, quantizer=quantizer)  # once, outside any graph
    if own is not None and (op := own(x, q, axis=axis, role=operand, seed=op_seed)) is not None:
        return op
    if (v := quantizer.values(x, q.format, q.quantize_kwargs(), axis=axis, seed=op_seed)) is not None:
        return v
    return prepare(x, q, transform=None, **common)


def shares_quantization(p: QuantSpec, tp: TransformSpec | None, q: QuantSpec, tq: TransformSpec | None) -> bool:
    """Can one quantization of a tensor serve two GEMMs that block it along different axes?

    Only with identical 2D tiles and no transform: a tile maps onto a tile under transposition
    (arXiv 2607.24953), while a 1D block or a one-axis transform does not.
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
