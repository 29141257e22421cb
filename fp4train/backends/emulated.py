"""The ``emulated`` GEMM backend: dequantize both operands, multiply with FP32 accumulation.

Every FP4 x FP4 (and FP8 x FP8) product of element values is exact in FP32, and the
power-of-two MX scales are exact too, so the only roundings are FP32 accumulation and the
final cast - this is the numerical reference the fast backends are compared against. It
runs on any device PyTorch runs on.
"""

from __future__ import annotations

import torch

from ..formats.qtensor import QuantizedTensor, ScaledBF16

Operand = torch.Tensor | QuantizedTensor | ScaledBF16


def check_inner_blocks(op: Operand, which: str) -> None:
    """A GEMM operand's 1D blocks must run along its last (inner) dimension."""
    if not isinstance(op, torch.Tensor) and op.block_axis not in (None, op.ndim - 1):
        raise ValueError(
            f"GEMM operand {which} of shape {tuple(op.shape)} has its blocks along axis {op.block_axis}; "
            "blocks must run along the inner (last) dimension"
        )


def _to_fp32(op: Operand) -> torch.Tensor:
    return op.to(torch.float32) if isinstance(op, torch.Tensor) else op.dequantize(torch.float32)


def _bf16_factors(op: Operand):
    """The operand as ``(values, row_scale, divisor)``: ``values`` exactly in BF16 and
    ``op = row_scale[:, None] * values / divisor`` (factors optional); ``None`` when no such
    split exists (see :meth:`QuantizedTensor.scaled_bf16`). BF16 tensors are their own values.
    """
    if isinstance(op, QuantizedTensor):
        if op.ndim != 2:
            return None
        op = op.scaled_bf16()
    if isinstance(op, ScaledBF16):
        if op.scale is not None and op.block_axis != 1:
            return None
        return op.values, op.scale, op.divisor
    return (op, None, None) if op.dtype == torch.bfloat16 else None


_FP32_MM: bool | None = None  # does this torch have torch.mm(..., out_dtype=float32) for BF16? learnt on first use


def apply_factors(out: torch.Tensor, ra, rb, da, db, out_dtype: torch.dtype) -> torch.Tensor:
    """``out`` times ``ra`` and ``rb``, divided by ``da`` and ``db`` (each optional and broadcast against ``out``), one
    rounding each, in that order, cast to ``out_dtype``: the epilogue of every BF16-split GEMM, dense
    (:func:`scale_output`) or grouped (:mod:`fp4train.backends.grouped`, each expert's factors on its rows)."""
    for f in (ra, rb):
        if f is not None:
            out = out * f
    for f in (da, db):
        if f is not None:
            out = out / f
    return out.to(out_dtype)


def scale_output(out: torch.Tensor, ra, rb, da, db, out_dtype: torch.dtype) -> torch.Tensor:
    """A BF16-split GEMM's FP32 output with its operands' factors applied - ``A``'s row scales ``ra``, ``B``'s
    ``rb`` (the output's columns), the divisors ``da`` and ``db`` (each optional), one rounding each, in that order -
    and cast to ``out_dtype``. (Under ``triton`` numerics the same runs in one pass:
    :func:`fp4train.kernels.gemm_epilogue.scale_output`.)"""
    return apply_factors(out, None if ra is None else ra[:, None], None if rb is None else rb[None, :], da, db, out_dtype)


def _bf16_gemm(a, b, out_dtype: torch.dtype, epilogue=scale_output) -> torch.Tensor | None:
    """``a @ b.T`` on BF16 tensor cores with FP32 accumulation, the factors applied to the output by ``epilogue``
    (:func:`scale_output`'s signature); None if an operand has no exact BF16 split or this torch lacks the
    FP32-output BF16 GEMM."""
    fa, fb = _bf16_factors(a), _bf16_factors(b)
    if fa is None or fb is None:
        return None
    (va, ra, da), (vb, rb, db) = fa, fb
    if out_dtype == torch.bfloat16 and ra is None and rb is None and da is None and db is None:
        return torch.mm(va, vb.T)  # FP32 accumulation, rounded once to BF16 (no FP32 round trip)
    global _FP32_MM
    if _FP32_MM is False:
        return None
    try:
        out = torch.mm(va, vb.T, out_dtype=torch.float32)
        _FP32_MM = True
    except TypeError:  # torch without the out_dtype argument: asked once
        _FP32_MM = False
        return None
    except RuntimeError:  # e.g. a device without the FP32-output BF16 GEMM: the FP32 reference
        return None
    # The products of element values are exact and accumulate in FP32; the factors follow, one
    # rounding each (the reference rounds each dequantized element instead).
    return epilogue(out, ra, rb, da, db, out_dtype)


def _split_with_kernel(op):
    """A packed 2D CUDA operand as its BF16 split by the decode kernel (:func:`fp4train.kernels.scaled_decode.decode_scaled_bf16`,
    the reference's :meth:`~fp4train.formats.QuantizedTensor.scaled_bf16` bit for bit); anything else as it is."""
    if isinstance(op, QuantizedTensor) and op.ndim == 2 and op.codes.is_cuda:
        from ..kernels.scaled_decode import decode_scaled_bf16

        if (split := decode_scaled_bf16(op)) is not None:
            return split
    return op


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
    fp8_gemms = False  #: no FP8 tensor-core GEMMs: packed operands are multiplied on BF16 tensor cores (CUDA) or in FP32
    operands = None  #: no operand kernels of its own (the FP8 backend's folds and pairs)

    def gemm(self, a: Operand, b: Operand, out_dtype: torch.dtype, *, kernels: bool = False) -> torch.Tensor:
        """``a @ b.T``. ``kernels``: on CUDA, packed operands are split into BF16 values by the decode kernel and the
        output's factors applied by the epilogue kernel (:mod:`fp4train.kernels.gemm_epilogue`) - the same bits as the
        PyTorch ops that do it otherwise."""
        check_inner_blocks(a, "a")
        check_inner_blocks(b, "b")
        if a.device.type == "cuda":
            epilogue = scale_output
            if kernels:
                from ..kernels.gemm_epilogue import scale_output as epilogue

                a, b = _split_with_kernel(a), _split_with_kernel(b)
            out = _bf16_gemm(a, b, out_dtype, epilogue if out_dtype in (torch.float32, torch.bfloat16) else scale_output)
            if out is not None:
                return out.to(out_dtype)
        return (_to_fp32(a) @ _to_fp32(b).T).to(out_dtype)
