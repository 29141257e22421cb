"""The ``emulated`` GEMM backend: dequantize both operands, multiply in FP32.

Every FP4 x FP4 (and FP8 x FP8) product of element values is exact in FP32, and the
power-of-two MX scales are exact too, so the only roundings are FP32 accumulation and the
final cast - this is the numerical reference the fast backends are compared against. It
runs on any device PyTorch runs on.
"""

from __future__ import annotations

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


def _exact_bf16(op: Operand) -> torch.Tensor | None:
    """The operand in BF16 *if that is exact*: MX values (<= 4 significant bits times a power of
    two) and tensors that are BF16 already; else None."""
    if isinstance(op, QuantizedTensor):
        return op.dequantize(torch.bfloat16) if op.fmt in ("mxfp4", "mxfp8") else None
    return op if op.dtype == torch.bfloat16 else None


class EmulatedBackend:
    """``gemm(a, b) = a @ b.T`` with FP32 accumulation, on dequantized operands.

    On CUDA, when both operands are exact in BF16 (MX formats, BF16 tensors), the product runs
    on BF16 tensor cores with an FP32 output (``torch.mm(..., out_dtype=torch.float32)``): the
    same exact products and FP32 accumulation, in another summation order, ~15x faster than an
    FP32 (non-TF32) GEMM. Everything else - and every CPU GEMM - is an FP32 matmul.
    """

    name = "emulated"

    def gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        check_inner_blocks(a, "a")
        check_inner_blocks(b, "b")
        if a.device.type == "cuda":
            a16, b16 = _exact_bf16(a), _exact_bf16(b)
            if a16 is not None and b16 is not None:
                try:
                    return torch.mm(a16, b16.T, out_dtype=torch.float32).to(out_dtype)
                except (TypeError, RuntimeError):  # torch without the fp32-output BF16 GEMM
                    pass
        return (_to_fp32(a) @ _to_fp32(b).T).to(out_dtype)
