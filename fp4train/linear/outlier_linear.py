"""AdaHOP's Outlier Extraction inside the quantized linear: one GEMM of the layer run as
:func:`~fp4train.linear.outlier_gemm.oe_gemm`, its residual prepared as the layer's plan says."""

from __future__ import annotations

import torch

from ..backends import multiply
from ..recipes.spec import GemmSpec
from .operands import OP_A, OP_B, make
from .outlier_gemm import extraction_for, oe_gemm
from .plan import Prep, Where, immediate


def reference_residual(g: GemmSpec, a: torch.Tensor, b: torch.Tensor) -> tuple[Prep, Prep]:
    """The residual preparations of the reference (the quantizer's eager numerics, an FP32 GEMM): what a caller
    outside a converted layer (the analysis) uses."""
    where = Where("eager", False, a.is_cuda, False)
    return tuple(immediate(q, g.transform, tuple(t.shape), t.dtype, 1, where) for q, t in ((g.a, a), (g.b, b)))


def gemm_with_outliers(a, b, g: GemmSpec, residual: tuple[Prep, Prep] | None = None, how=None, *, seed: int,
                       gemm: int, compute_dtype, backend, out_dtype, operands=None) -> torch.Tensor:
    """GEMM ``a @ b.T`` (both ``[outer, inner]``, high precision) with AdaHOP outlier extraction.

    FOID picks the outliers ``g.outliers`` asks for; they stay in the operands' own precision
    and are multiplied in FP32; the residuals (outliers zeroed) are prepared by ``residual`` (the layer plan's
    preparations of the two operands; default: the reference's) with the GEMM's transform, and multiplied by
    ``backend`` as ``how`` (the plan's :class:`~fp4train.linear.plan.Gemm`) says.
    """
    o = g.outliers
    ext = extraction_for(a, b, o.a, o.b, o.k)
    residual = residual if residual is not None else reference_residual(g, a, b)
    common = dict(axis=1, transform=g.transform, seed=seed, gemm=gemm, compute_dtype=compute_dtype, operands=operands)
    inner_how = how.residual if how is not None else None

    def residual_gemm(a_res, b_res):
        qa = make(a_res, residual[0], g.a, operand=OP_A, **common)
        qb = make(b_res, residual[1], g.b, operand=OP_B, **common)
        return multiply(backend, qa, qb, torch.float32, inner_how)

    return oe_gemm(a, b, ext, residual_gemm).to(out_dtype)


__all__ = ["gemm_with_outliers", "reference_residual"]
