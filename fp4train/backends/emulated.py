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


class EmulatedBackend:
    """``gemm(a, b) = a @ b.T`` with FP32 accumulation, on dequantized operands."""

    name = "emulated"

    def gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        check_inner_blocks(a, "a")
        check_inner_blocks(b, "b")
        return (_to_fp32(a) @ _to_fp32(b).T).to(out_dtype)
