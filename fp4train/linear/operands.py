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
from ..formats.quantize import check_request
from ..quantizer import Quantizer, hadamard_with, quantize_with, values_with
from ..recipes.spec import QuantSpec, TransformSpec
from ..transforms.hadamard import signs
from .plan import Prep, shares_quantization  # noqa: F401 - shares_quantization: re-exported

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


def make(
    x: torch.Tensor,
    prep: Prep,
    q: QuantSpec,
    *,
    axis: int,
    transform: TransformSpec | None,
    seed: int,
    gemm: int,
    operand: int,
    compute_dtype: torch.dtype,
    operands=None,
) -> Operand:
    """The operand ``x`` prepared as the layer's plan says (``prep``, :mod:`fp4train.linear.plan`): the GEMM's
    transform by the plan's implementation (or fused into the fold), then quantization by the plan's
    implementation - packed codes + scales, BF16 values + factors, or folded FP8 (``operands``: the FP8 backend's
    :class:`~fp4train.backends.fp8_operands.Fp8Operands`). Seeds as :func:`prepare` derives them."""
    op_seed = sr_seed(q, seed, gemm, operand)
    if prep.how == "fold kernel":
        t_seed = transform_seed(transform, seed, gemm) if prep.transform == "fused" else None
        fused = transform if prep.transform == "fused" else None
        if fused is None:
            x = _transform_with(prep, x, transform, axis=axis, seed=seed, gemm=gemm)
        op = operands.operand(x, q, axis=axis, role=operand, seed=op_seed, transform=fused, transform_seed=t_seed)
        if op is None:
            raise RuntimeError(f"fp4train: the fold kernel does not take {tuple(x.shape)} {x.dtype} along axis {axis} "
                               "(the layer's operand plan chose it)")
        return op
    kw = q.quantize_kwargs()
    if prep.transform == "fused":  # NVFP4 with its Hadamard in one kernel (the transformed tensor never written)
        from ..kernels import dispatch

        kernel = dispatch.hadamard_quantize_kernel(tuple(x.shape), x.dtype, q.format, kw, axis, transform.block,
                                                   packed=prep.how == "kernel")
        if kernel is None:
            raise RuntimeError(f"fp4train: no Triton kernel quantizes {q.format} with a fused Hadamard for "
                               f"{tuple(x.shape)} {x.dtype} along axis {axis} (the layer's operand plan chose one)")
        t_seed = transform_seed(transform, seed, gemm)
        return kernel(x.detach(), op_seed, signs(t_seed, transform.block, device=x.device) if t_seed is not None else None)
    x = _transform_with(prep, x, transform, axis=axis, seed=seed, gemm=gemm)
    if prep.how == "bf16":
        return x.to(compute_dtype)
    if prep.how in ("values kernel", "compiled values"):
        return values_with(prep.how, x, q.format, kw, axis=axis, seed=op_seed)
    block, ax = check_request(x, q.format, axis=axis, block=kw["block"], scale=kw["scale"], rounding=kw["rounding"],
                              seed=op_seed, four_over_six=kw.get("four_over_six", False))
    return quantize_with(prep.how, x, q.format, block=block, axis=ax, scale=kw["scale"], rounding=kw["rounding"],
                         seed=op_seed, four_over_six=kw.get("four_over_six", False))


def _transform_with(prep: Prep, x: torch.Tensor, transform: TransformSpec | None, *, axis: int, seed, gemm: int):
    """The GEMM's inner transform of ``x`` by the plan's implementation (signs as :func:`prepare` draws them)."""
    if transform is None:
        return x
    return hadamard_with(prep.transform, x, transform.block, axis=axis, seed=transform_seed(transform, seed, gemm))


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
