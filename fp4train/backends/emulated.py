"""The ``emulated`` GEMM backend: dequantize both operands, multiply with FP32 accumulation.

Every FP4 x FP4 (and FP8 x FP8) product of element values is exact in FP32, and the
power-of-two MX scales are exact too, so the only roundings are FP32 accumulation and the
final cast - this is the numerical reference the fast backends are compared against. It
runs on any device PyTorch runs on.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..formats.qtensor import QuantizedTensor

Operand = torch.Tensor | QuantizedTensor


def check_inner_blocks(op: Operand, which: str) -> None:
    """A GEMM operand's 1D blocks must run along its last (inner) dimension."""
    if isinstance(op, QuantizedTensor) and op.block_axis not in (None, op.ndim - 1):
        raise ValueError(
            f"GEMM operand {which} of shape {tuple(op.shape)} has its blocks along axis {op.block_axis}; "
            "blocks must run along the inner (last) dimension"
        )


def _to_fp32(op: Operand) -> torch.Tensor:
    return op.dequantize(torch.float32) if isinstance(op, QuantizedTensor) else op.to(torch.float32)


def _bf16_factors(op: Operand):
    """The operand as ``(values, row_scale, divisor)`` with ``values`` *exactly* in BF16 and
    ``op = row_scale[:, None] * values / divisor`` (either factor may be ``None``); ``None``
    when no such split exists.

    * MX formats: element x power-of-two scale has <= 4 significant bits -> exact in BF16.
    * FP8 rowwise: the E4M3 element values (<= 4 significant bits) and the per-row FP32 scale.
    * NVFP4: ``q * sb`` (<= 2 + 4 significant bits) and the FP32 tensor scale ``s_enc``.
    * BF16 tensors as they are.
    """
    if isinstance(op, QuantizedTensor):
        if op.fmt in ("mxfp4", "mxfp8"):
            return op.dequantize(torch.bfloat16), None, None
        if op.fmt == "fp8" and op.ndim == 2:
            unit = replace(op, scales=torch.ones_like(op.scales))
            return unit.dequantize(torch.bfloat16), op.scales.reshape(-1), None
        if op.fmt == "nvfp4" and op.tensor_scale is not None:
            unit = replace(op, tensor_scale=torch.ones_like(op.tensor_scale))
            return unit.dequantize(torch.bfloat16), None, op.tensor_scale
        return None
    return (op, None, None) if op.dtype == torch.bfloat16 else None


def _bf16_gemm(a, b) -> torch.Tensor | None:
    """``a @ b.T`` on BF16 tensor cores with FP32 output, scales applied to the output; None if
    an operand has no exact BF16 split or this torch lacks the FP32-output BF16 GEMM."""
    fa, fb = _bf16_factors(a), _bf16_factors(b)
    if fa is None or fb is None:
        return None
    (va, ra, da), (vb, rb, db) = fa, fb
    try:
        out = torch.mm(va, vb.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without the fp32-output BF16 GEMM
        return None
    # The products of element values are exact and accumulate in FP32; the factors follow, one
    # rounding each (the reference rounds each dequantized element instead).
    if ra is not None:
        out = out * ra[:, None]
    if rb is not None:
        out = out * rb[None, :]
    if da is not None:
        out = out / da
    if db is not None:
        out = out / db
    return out


class EmulatedBackend:
    """``gemm(a, b) = a @ b.T`` with FP32 accumulation, on dequantized operands.

    On CUDA the product runs on BF16 tensor cores with an FP32 output (``torch.mm(...,
    out_dtype=torch.float32)``) whenever both operands split exactly into BF16 values and
    outer factors (:func:`_bf16_factors`: MX, FP8 rowwise, NVFP4, BF16): the same exact
    element products and FP32 accumulation, in another summation order, with the row and
    tensor scales applied to the output - ~15x faster than an FP32 (non-TF32) GEMM. MX
    operands give the reference's values up to summation order; FP8 rowwise and NVFP4 up to
    one FP32 rounding of the scale factors. Everything else - and every CPU GEMM - is the
    reference: an FP32 matmul of dequantized operands.
    """

    name = "emulated"

    def gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        check_inner_blocks(a, "a")
        check_inner_blocks(b, "b")
        if a.device.type == "cuda":
            out = _bf16_gemm(a, b)
            if out is not None:
                return out.to(out_dtype)
        return (_to_fp32(a) @ _to_fp32(b).T).to(out_dtype)
