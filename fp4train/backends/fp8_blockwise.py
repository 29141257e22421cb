"""The ``fp8_blockwise`` GEMM backend: MXFP4 GEMMs on Hopper's FP8 tensor cores.

:meth:`Fp8BlockwiseBackend.gemm` multiplies prepared operands and nothing else: two folded MXFP4 operands
(:mod:`fp4train.backends.fp8_operands`: FP8 E4M3 codes with 1x128 groups for A, 128x128 for B) as one
blockwise-scaled FP8 GEMM (``torch.nn.functional.scaled_mm`` with 1x128 x 128x128 scaling, FP32
accumulation promoted per 128-deep K block, BF16/FP32 output); two FP8 rowwise operands as one
rowwise-scaled FP8 GEMM (:func:`rowwise_fp8_mm`); anything else - and every CPU GEMM - on the
``emulated`` backend (a folded operand is exact in BF16 there). Its operands come from
:attr:`Fp8BlockwiseBackend.operands`, which the quantized linear asks first.
"""

from __future__ import annotations

import warnings

import torch

from ..formats.fold import FoldedFP8
from ..formats.qtensor import QuantizedTensor
from .emulated import EmulatedBackend
from .fp8_operands import FoldedOperand, Fp8Operands


def _scaling(*names):
    from torch.nn.functional import ScalingType

    for n in names:  # the enum's spelling differs across torch versions
        if hasattr(ScalingType, n):
            return getattr(ScalingType, n)
    raise AttributeError(f"torch.nn.functional.ScalingType has none of {names}")


_FP32_OUT: bool | None = None  # does this torch's blockwise scaled_mm give FP32 output? learnt on first use
_BLOCKWISE_OK: bool | None = None  # does blockwise scaled_mm run here at all? learnt on first use
_ROWWISE_FP32_OUT: bool | None = None  # the same two for rowwise-scaled FP8 (fp8_rowwise)
_ROWWISE_OK: bool | None = None


def _rowwise(op) -> bool:
    """An FP8 rowwise operand as an FP8 GEMM takes it: E4M3 codes stored [rows, K] with K (the
    scaled axis) last - which the logical view with block axis 1 always is - and scales [rows, 1]."""
    return isinstance(op, QuantizedTensor) and op.fmt == "fp8" and op.ndim == 2 and op.block_axis == 1


def rowwise_fp8_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` for FP8 rowwise operands (scales per row of ``a`` and of ``b``): E4M3 products on
    FP8 tensor cores, FP32 accumulation, the row scales applied to the output - the reference's
    values up to summation order."""
    from torch.nn.functional import scaled_mm

    global _ROWWISE_FP32_OUT
    a8, b8 = a.codes.view(torch.float8_e4m3fn), b.codes.view(torch.float8_e4m3fn)
    rw = _scaling("RowWise", "Rowwise")
    args = (a8, b8.t(), a.scales.reshape(-1, 1), rw, b.scales.reshape(1, -1), rw)
    if out_dtype == torch.float32 and _ROWWISE_FP32_OUT is not False:
        try:
            y = scaled_mm(*args, output_dtype=torch.float32)
            _ROWWISE_FP32_OUT = True
            return y
        except (RuntimeError, ValueError, TypeError):
            _ROWWISE_FP32_OUT = False
    return scaled_mm(*args, output_dtype=torch.bfloat16).to(out_dtype)


def blockwise_scale_b(scales: torch.Tensor) -> torch.Tensor:
    """B's 128x128 group scales ``[N/128, K/128]`` as blockwise ``scaled_mm`` takes them:
    ``[round_up(K/128, 4), N/128]`` with the K-groups contiguous (strides ``(1, round_up(K/128, 4))``).
    The padding groups lie past K and are never read (set to 1). Found on the H200 (torch 2.11): with
    K/128 not a multiple of 4 (K = 128, 256, 384, ...) scaled_mm refuses the unpadded scales; the rule
    is ATen's ``_scaled_block1x128_block128x128`` check (A's scales: ``[M, K/128]``, strides ``(1, M)``)."""
    nb, kb = scales.shape
    kp = -(-kb // 4) * 4
    if kp == kb:
        return scales.contiguous().t()  # no copy for the usual K (a multiple of 512)
    padded = scales.new_ones(nb, kp)
    padded[:, :kb] = scales
    return padded.t()


def blockwise_fp8_mm(a: FoldedFP8, b: FoldedFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` for folded operands: ``a`` with 1x128 groups, ``b`` with 128x128 groups."""
    from torch.nn.functional import scaled_mm

    global _FP32_OUT
    a8, b8 = a.codes.view(torch.float8_e4m3fn), b.codes.view(torch.float8_e4m3fn)
    args = (a8, b8.t(), a.scales.t().contiguous().t(), _scaling("BlockWise1x128", "Blockwise_1x128"),
            blockwise_scale_b(b.scales), _scaling("BlockWise128x128", "Blockwise_128x128"))
    if out_dtype == torch.float32 and _FP32_OUT is not False:
        try:  # FP32 output where the kernel offers it (AdaHOP adds the outlier product to it)
            y = scaled_mm(*args, output_dtype=torch.float32)
            _FP32_OUT = True
            return y
        except (RuntimeError, ValueError, TypeError):
            _FP32_OUT = False  # asked once, not on every GEMM
    return scaled_mm(*args, output_dtype=torch.bfloat16).to(out_dtype)


class Fp8BlockwiseBackend:
    """MXFP4 GEMMs as blockwise-scaled FP8 GEMMs on CUDA; the emulated backend for the rest. Its operands
    are prepared by :attr:`operands` (:class:`~fp4train.backends.fp8_operands.Fp8Operands`); :meth:`gemm` only
    multiplies them."""

    name = "fp8_blockwise"
    fp8_gemms = True  #: folded MXFP4 and FP8 rowwise pairs run on FP8 tensor cores (CUDA)
    numerics = "triton"  #: the numerics convert() gives this backend's layers on a GPU by default

    def __init__(self) -> None:
        self.fallback = EmulatedBackend()
        self.operands = Fp8Operands()

    def takes_folded(self) -> bool:
        """Does :meth:`gemm` multiply folded operands on FP8 tensor cores here (not known to fail)?"""
        return _BLOCKWISE_OK is not False

    @staticmethod
    def _rowwise_pair(a, b) -> bool:
        """Do ``a`` and ``b`` make the rowwise-scaled FP8 GEMM's operands (on CUDA; FP8 GEMMs want K
        and N multiples of 16)?"""
        return (_rowwise(a) and _rowwise(b) and a.device.type == "cuda" and a.shape[1] % 16 == 0
                and b.shape[0] % 16 == 0)

    @staticmethod
    def _blockwise(a, b) -> bool:
        """Do ``a`` and ``b`` make the FP8 blockwise GEMM's operands (1x128 A, 128x128 B, on CUDA)?"""
        return (isinstance(a, FoldedOperand) and isinstance(b, FoldedOperand) and a.block_axis == 1 and b.block_axis == 1
                and a.data.group_rows == 1 and b.data.group_rows == 128 and a.device.type == "cuda")

    def gemm(self, a, b, out_dtype: torch.dtype, *, kernels: bool = False) -> torch.Tensor:
        """``a @ b.T`` of two prepared operands (blocked along their inner, last dim); what is not an FP8 pair runs on
        the emulated backend's BF16 split (``kernels``: its split and epilogue by Triton kernels)."""
        global _BLOCKWISE_OK, _ROWWISE_OK
        if _ROWWISE_OK is not False and self._rowwise_pair(a, b):
            try:
                y = rowwise_fp8_mm(a, b, out_dtype)
                _ROWWISE_OK = True
                return y
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, AttributeError, TypeError) as e:
                if _ROWWISE_OK:
                    raise
                _ROWWISE_OK = False
                warnings.warn(f"fp4train: this PyTorch/GPU cannot run rowwise-scaled FP8 GEMMs ({type(e).__name__}: {e}); "
                              "FP8 rowwise GEMMs run on BF16 tensor cores instead (same values, slower)", RuntimeWarning, stacklevel=2)
        if _BLOCKWISE_OK is not False and self._blockwise(a, b):
            try:
                y = blockwise_fp8_mm(a.data, b.data, out_dtype)
                _BLOCKWISE_OK = True
                return y
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError, AttributeError, TypeError) as e:
                if _BLOCKWISE_OK:  # it ran before: a real error, not a missing feature
                    raise
                _BLOCKWISE_OK = False
                warnings.warn(f"fp4train: this PyTorch/GPU cannot run blockwise-scaled FP8 GEMMs ({type(e).__name__}: {e}); "
                              "MXFP4 GEMMs run on BF16 tensor cores instead (same values, slower)", RuntimeWarning, stacklevel=2)
        a = a.scaled_bf16() if isinstance(a, FoldedOperand) else a  # exact in BF16
        b = b.scaled_bf16() if isinstance(b, FoldedOperand) else b
        return self.fallback.gemm(a, b, out_dtype, kernels=kernels)

