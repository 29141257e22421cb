"""Operands for Hopper's FP8 tensor cores: MXFP4 folded into FP8 with power-of-two group scales.

Every E2M1 value is exact in E4M3 and MX scales are powers of two, so an MXFP4 operand folds
into FP8 with one power-of-two scale per 1x128 (A operand) or 128x128 (B operand) group
(:mod:`fp4train.formats.fold`, docs/methods.md, Hopper execution), exact while the block exponents in a group
span at most 14 binades; the elements that are not exact are counted (:attr:`Fp8Operands.inexact`, a device
counter, no host synchronisation). :mod:`fp4train.backends.fp8_blockwise` multiplies what this module makes.

:class:`Fp8Operands` prepares them, each in one Triton pass bit-identical to quantize-then-fold of the
reference:

* :meth:`~Fp8Operands.operand`: MXFP4 requests with 1x32 blocks along the GEMM's inner dimension (a multiple
  of 128), floor or ceil scales, nearest or stochastic rounding, an inner block Hadamard fused where it fits
  (:func:`fp4train.kernels.quantize_mxfp4_fp8`); 32x32 tiles quantized once and kept packed; FP8 rowwise
  operands as E4M3 codes with the inner dimension last (the rowwise-scaled FP8 GEMM's layout).
* :meth:`~Fp8Operands.operand_pair`: one read of X for fprop (along K, folded) and wgrad (along M, packed).
* :meth:`~Fp8Operands.for_gemm`: packed operands folded just before their GEMM - the X that forward saved for
  wgrad (:meth:`~Fp8Operands.fold_saved`, one pass over its codes) and 32x32 tiles for either orientation
  (:meth:`~Fp8Operands.fold_tiles`).

Everything else returns None, and the layer prepares the operand by its quantizer (reference or kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..formats.fold import FoldedFP8, fold
from ..formats.layout import BlockLayout
from ..formats.qtensor import QuantizedTensor, ScaledBF16
from ..kernel_coverage import KERNEL_DTYPES
from ..quantizer import kernels_usable_on
from ..recipes.spec import QuantSpec, TransformSpec

# What the kernels below take, as predicates on the specs and shapes: a layer's operand plan
# (fp4train.linear.plan) decides by them before anything runs.

def folds_1x32(q: QuantSpec) -> bool:
    """Is ``q`` MXFP4 in 1x32 blocks (what the fold kernel quantizes, optionally with a fused transform)?"""
    return (q.quantized and q.format == "mxfp4" and not q.is_2d and not q.four_over_six
            and q.quantize_kwargs().get("block") in (None, 32))


def fuses(q: QuantSpec, transform: TransformSpec | None) -> bool:
    """Does the fold kernel fuse ``transform`` into its pass for ``q`` (a block Hadamard up to 128)?"""
    return folds_1x32(q) and transform is not None and transform.block <= 128


def fold_fits(shape: tuple, dtype: torch.dtype, axis: int, transform: TransformSpec | None = None) -> bool:
    """Can the fold kernel take a tensor of ``shape`` (blocks along ``axis`` a multiple of 128; with a fused
    transform float32/bfloat16)? ``axis`` -1: X ``[..., K]`` along its last dim."""
    return (len(shape) >= 2 and shape[axis] % 128 == 0
            and (transform is None or dtype in (torch.float32, torch.bfloat16)))


def pair_kind(qa: QuantSpec, qb: QuantSpec) -> str | None:
    """Which pair the pair kernels make for two specs of one tensor (``qa`` along its last dim, ``qb`` along
    its first): ``"fp8"`` (both FP8 rowwise, nearest rounding), ``"mxfp4"`` (both MXFP4 in 1x32 blocks), or None."""
    if all(q.quantized and q.format == "fp8" and not q.stochastic for q in (qa, qb)):
        return "fp8"
    if folds_1x32(qa) and folds_1x32(qb):
        return "mxfp4"
    return None


def pair_fits(kind: str | None, shape: tuple, dtype: torch.dtype, b_role: int = 1) -> bool:
    """Can the pair kernels make pair ``kind`` of a tensor of ``shape`` ``[..., K]`` (M = its rows, flattened) for
    the along-M half's GEMM operand ``b_role``? FP8 rowwise: any float input, either role; MXFP4:
    M % 32 == 0, K % 128 == 0, B only (its along-M half is packed for wgrad's B)."""
    if len(shape) < 2 or dtype not in KERNEL_DTYPES:
        return False
    if kind == "fp8":
        return True
    k, m = shape[-1], 1
    for d in shape[:-1]:
        m *= d
    return kind == "mxfp4" and b_role == 1 and k % 128 == 0 and m % 32 == 0


@dataclass(frozen=True)
class FoldedOperand:
    """A GEMM operand as FP8 E4M3 + group scales, stored with its blocks along the last dim
    (``data`` ``[rows, K]``); ``transposed`` flips the logical view like ``QuantizedTensor.t()``."""

    data: FoldedFP8
    transposed: bool = False

    @property
    def block_axis(self) -> int:
        return 0 if self.transposed else 1

    @property
    def shape(self) -> torch.Size:
        s = self.data.codes.shape
        return torch.Size((s[1], s[0]) if self.transposed else s)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.data.codes.device

    def t(self) -> FoldedOperand:
        return replace(self, transposed=not self.transposed)

    def scaled_bf16(self) -> ScaledBF16:
        """Exact BF16 values (E4M3 value x power-of-two scale has <= 4 significant bits)."""
        v = self.data.dequantize().to(torch.bfloat16)
        return ScaledBF16(v.mT if self.transposed else v, None, None, self.block_axis)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        v = self.data.dequantize()
        return (v.mT if self.transposed else v).to(dtype)


class Fp8Operands:
    """Prepares GEMM operands in the forms the FP8 GEMMs take (see the module docstring); keeps the device
    counter of inexact folded elements."""

    def __init__(self) -> None:
        self.inexact: torch.Tensor | None = None  # int32 count of inexact folded elements, on the device

    def counter(self, device) -> torch.Tensor:
        """The inexact-element counter on ``device`` (made there on first use)."""
        if self.inexact is None or self.inexact.device != device:
            self.inexact = torch.zeros((), dtype=torch.int32, device=device)
        return self.inexact

    def allocate_state(self, device) -> None:
        """Allocate now the device state kept across calls (the inexact counter) for ``device``.
        QuantizedLinear calls this when its weight arrives on a device: made lazily inside the first
        call of a model compiled with ``mode="reduce-overhead"``, the counter would live in the CUDA-graph
        memory pool without being a graph output, which cudagraph trees refuse ("Detected 1 tensor(s)
        in the cudagraph pool not tracked as outputs": AdaHOP's first compiled step on the H200)."""
        self.counter(torch.device(device))

    def operand(self, x: torch.Tensor, q, *, axis: int, role: int, seed: int | None, transform=None, transform_seed=None):
        """``x`` quantized to MXFP4 in 1x32 blocks along ``axis`` and folded for GEMM operand ``role`` (0: A, 1x128
        groups; 1: B, 128x128) in one Triton pass; ``transform`` (a block Hadamard along ``axis``, signs from
        ``transform_seed``) fused into it. None where the kernel does not take ``x`` (the plan checks first:
        :func:`fold_fits`)."""
        if x.ndim != 2 or not kernels_usable_on(x) or not folds_1x32(q) or not fold_fits(tuple(x.shape), x.dtype, axis, transform):
            return None
        if transform is not None and not fuses(q, transform):
            return None
        from ..kernels.mx_fold import quantize_mxfp4_fp8

        kw = q.quantize_kwargs()
        had = {}
        if transform is not None:
            from ..transforms.hadamard import signs

            had = dict(hadamard_block=transform.block,
                       hadamard_signs=signs(transform_seed, transform.block, device=x.device) if transform_seed is not None else None)
        # blocks along dim 0 (W along N for dgrad, dY along M for wgrad): the kernel reads x in place as x^T
        folded = quantize_mxfp4_fp8(x.detach(), axis=axis, group_rows=1 if role == 0 else 128, scale=kw.get("scale", "floor"),
                                    rounding=kw.get("rounding", "nearest"), seed=seed, counter=self.counter(x.device), **had)
        return FoldedOperand(folded, transposed=axis % 2 == 0)

    def operand_pair(self, x: torch.Tensor, qa, qb, *, seeds: tuple[int | None, int | None], b_role: int = 1):
        """A tensor ``[M, K]`` read once for its two GEMMs: (the A operand along K, the operand along M
        for GEMM operand ``b_role`` - 1: B, X for wgrad; 0: A, dY for wgrad), or None where the specs,
        the shape or the role do not allow it (:func:`pair_fits`):

        * both MXFP4 with 1x32 blocks, M % 32 == 0, K % 128 == 0, ``b_role`` 1: (folded into FP8, packed
          MXFP4 along M - what the layer saves for wgrad, folded there as a B operand);
        * both FP8 rowwise with nearest rounding, either role: the two QuantizedTensors, from two reads
          instead of four."""
        kind = pair_kind(qa, qb)
        if x.ndim != 2 or not kernels_usable_on(x) or not pair_fits(kind, tuple(x.shape), x.dtype, b_role):
            return None
        if kind == "fp8":
            from ..kernels.fp8_values import quantize_fp8_rowwise_both

            return quantize_fp8_rowwise_both(x.detach())
        kws = [qa.quantize_kwargs(), qb.quantize_kwargs()]
        from ..kernels.mx_fold import quantize_mxfp4_fp8_and_columns

        folded, cols = quantize_mxfp4_fp8_and_columns(
            x.detach(), scale=tuple(k.get("scale", "floor") for k in kws), rounding=tuple(k.get("rounding", "nearest") for k in kws),
            seed=seeds, counter=self.counter(x.device))
        return FoldedOperand(folded), cols

    def fold_saved(self, q: QuantizedTensor, group_rows: int = 128) -> FoldedOperand:
        """A packed 1x32 MXFP4 operand (the X that forward saved for wgrad) folded in one pass over its codes,
        with ``group_rows`` (128: a B operand)."""
        from ..kernels.mx_fold import fold_packed_mxfp4

        return FoldedOperand(fold_packed_mxfp4(q.codes, q.scales, group_rows=group_rows, counter=self.counter(q.device)))

    def fold_tiles(self, q: QuantizedTensor, role: int) -> FoldedOperand:
        """A packed MXFP4 operand with 32x32 tiles folded for GEMM operand ``role`` (0: A, 1x128
        groups; 1: B, 128x128), whichever way it is viewed (both dims multiples of 128).

        A tile's scale is the scale of each 1x32 row (or column) piece in it, so the stored codes are
        1x32 MXFP4 along either stored dim: :func:`~fp4train.kernels.mx_fold.fold_tiles_mxfp4` folds
        them along the stored columns, or - viewed transposed, the inner dim being the stored rows -
        reads them in place as the transposed operand with 128x128 groups (a group maps onto a group
        under transposition); as an A operand the group's scale is then stored on each row (1x128
        groups with equal scales: the same values, a wider span for the exactness rule)."""
        from ..kernels.mx_fold import fold_tiles_mxfp4

        counter = self.counter(q.device)
        if not q.transposed:  # inner dim = the stored columns
            return FoldedOperand(fold_tiles_mxfp4(q.codes, q.scales, transposed=False, group_rows=1 if role == 0 else 128,
                                                  counter=counter))
        # inner dim = the stored rows: read in place; 128x128 groups (a group maps onto a group), as an A
        # operand with the group's scale on each row
        return FoldedOperand(fold_tiles_mxfp4(q.codes, q.scales, transposed=True, group_rows=128, scale_per_row=role == 0,
                                              counter=counter))

    def fold_reference(self, q: QuantizedTensor, role: int) -> FoldedOperand:
        """A packed 1x32 MXFP4 operand, blocked along its logical inner (last) dim, folded for GEMM operand ``role``
        by the reference (:func:`fp4train.formats.fold.fold` on its stored, canonical layout: no kernel); its
        inexact elements added to the device counter."""
        lay = q.layout
        if q.fmt != "mxfp4" or q.ndim != 2 or lay.is_2d or q.block_axis != 1:
            raise ValueError(f"fp4train: only 1x32 MXFP4 blocked along the inner dim folds by the reference, not {q!r}")
        rows, k = lay.canonical_shape
        stored = QuantizedTensor(q.fmt, q.codes, q.scales, None, BlockLayout((rows, k), lay.block, 1), q.dtype)
        folded = fold(stored, 1 if role == 0 else 128, count_on_device=True)
        counter = self.counter(q.device)
        counter.add_(folded.inexact.to(counter.dtype))
        return FoldedOperand(replace(folded, inexact=counter))  # as the kernels' operands: the device counter

    def fold(self, op, role: int, how: str) -> FoldedOperand:
        """``op`` as the FP8 blockwise GEMM's operand ``role``, folded by ``how`` (``"kernel"`` or ``"reference"``)."""
        if isinstance(op, FoldedOperand):
            return op
        if not isinstance(op, QuantizedTensor):
            raise TypeError(f"fp4train: a {type(op).__name__} does not fold for the FP8 blockwise GEMM")
        if how == "reference":
            return self.fold_reference(op, role)
        if op.layout.is_2d:
            return self.fold_tiles(op, role)
        return self.fold_saved(op, 1 if role == 0 else 128)

    def for_gemm(self, a, b, fold: str):
        """``(a, b)`` as the FP8 blockwise GEMM takes them: folded for roles A and B by ``fold``."""
        return self.fold(a, 0, fold), self.fold(b, 1, fold)
