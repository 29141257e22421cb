"""AdaHOP's Outlier Extraction inside the quantized linear: one GEMM of the layer run as
:func:`~fp4train.linear.outlier_gemm.oe_gemm`, its residual prepared as the layer's other operands are."""

from __future__ import annotations

import torch

from ..backends import multiply
from ..quantizer import Quantizer
from ..recipes.spec import GemmSpec
from .operands import OP_A, OP_B, prepare_now
from .outlier_gemm import extraction_for, oe_gemm


def gemm_with_outliers(a, b, g: GemmSpec, *, seed: int, gemm: int, compute_dtype, backend, quantizer: Quantizer,
                       out_dtype) -> torch.Tensor:
    """GEMM ``a @ b.T`` (both ``[outer, inner]``, high precision) with AdaHOP outlier extraction.

    FOID picks the outliers ``g.outliers`` asks for; they stay in the operands' own precision
    and are multiplied in FP32; the residuals (outliers zeroed) are prepared as ``g`` says
    (transform + quantization along the inner dim) and multiplied by ``backend``.
    """
    o = g.outliers
    ext = extraction_for(a, b, o.a, o.b, o.k)
    common = dict(axis=1, transform=g.transform, seed=seed, gemm=gemm, compute_dtype=compute_dtype, quantizer=quantizer,
                  backend=backend)

    def residual(a_res, b_res):
        qa = prepare_now(a_res, g.a, operand=OP_A, **common)
        qb = prepare_now(b_res, g.b, operand=OP_B, **common)
        return multiply(backend, qa, qb, torch.float32)

    return oe_gemm(a, b, ext, residual).to(out_dtype)
