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
from ..formats.qtensor import QuantizedTensor
from ..formats.quantize import quantize
from ..recipes.spec import QuantSpec, TransformSpec
from ..transforms.hadamard import hadamard

Operand = torch.Tensor | QuantizedTensor

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
    if transform is not None:
        t_seed = derive_seed(seed, gemm, OP_TRANSFORM) if transform.random_signs else None
        x = hadamard(x, transform.block, axis=axis, seed=t_seed)
    if not q.quantized:
        return x.to(compute_dtype)
    sr_seed = derive_seed(seed, gemm, operand) if q.stochastic else None
    return quantize(x, q.format, axis=axis, seed=sr_seed, **q.quantize_kwargs())


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
        qa = prepare(a_res, g.a, axis=1, transform=g.transform, seed=seed, gemm=gemm, operand=OP_A, compute_dtype=compute_dtype)
        qb = prepare(b_res, g.b, axis=1, transform=g.transform, seed=seed, gemm=gemm, operand=OP_B, compute_dtype=compute_dtype)
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
