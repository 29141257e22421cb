"""Grouped GEMMs: many experts' ``A_e @ B_e^T`` in one call, their operands prepared per expert.

Two groupings, the two a mixture of experts' GEMMs take:

* :func:`grouped_rows` - ``A_e [m_e, k]``, ``B_e [n, k]`` -> ``[sum m_e, n]``, the experts' rows one after another
  (fprop and dgrad: each expert's tokens times its weight);
* :func:`grouped_inner` - ``A_e [n, m_e]``, ``B_e [k, m_e]`` -> ``[E, n, k]`` (wgrad: each expert's gradient summed
  over its own tokens).

Each operand is what the ``emulated`` backend multiplies (:mod:`fp4train.backends.emulated`): a BF16 tensor, a
:class:`~fp4train.formats.QuantizedTensor` or a :class:`~fp4train.formats.qtensor.ScaledBF16`, blocked along the
inner dimension. On CUDA, when every operand splits exactly into BF16 values and outer factors (MX formats, NVFP4,
FP8 rowwise, BF16), the values go through one ``torch._grouped_mm`` on BF16 tensor cores with FP32 accumulation and
each expert's factors are applied to its part of the output, in the order and with the roundings of the dense
GEMM's epilogue (:func:`~fp4train.backends.emulated.scale_output`). A BF16 output of unscaled values (MXFP4 and its
2D tiles under BF16 autocast) is then the dense GEMM's. An FP32 output (the weight gradient of FP32 parameters) or
one with factors (NVFP4's tensor scales, FP8's row scales) needs the grouped GEMM's FP32 output, which torch 2.11
does not have: there the output is rounded to BF16 once before the factors and the cast, one rounding (relative
2**-9) more than the dense GEMM's. Every CPU GEMM runs the ``emulated`` backend's GEMM once per expert: the dense
layer's result bit for bit (:func:`rows_of_splits` and :func:`inner_of_splits`, the grouped computation itself, run
anywhere ``torch._grouped_mm`` does: the tests check them on the CPU).
"""

from __future__ import annotations

import functools
import itertools

import torch

from .emulated import EmulatedBackend, _bf16_factors, _split_with_kernel, apply_factors

_EMULATED = EmulatedBackend()


def _splits(ops: list, kernels: bool):
    """Each operand's exact BF16 split ``(values, row_scale, divisor)``, or None if one has none."""
    out = []
    for op in ops:
        f = _bf16_factors(_split_with_kernel(op) if kernels else op)
        if f is None:
            return None
        out.append(f)
    return out


@functools.cache
def fp32_output(device: str) -> bool:
    """Does ``torch._grouped_mm`` give an FP32 output of BF16 operands on ``device`` (asked once, on a tiny GEMM)?"""
    a = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
    try:
        torch._grouped_mm(a, a[None], offs=torch.tensor([16], dtype=torch.int32, device=device), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype, scaled: bool):
    """``torch._grouped_mm`` with an FP32 output where the epilogue wants one (factors to apply, or an FP32 result)
    and this torch has it, else BF16 (see the module docstring)."""
    if (out_dtype != torch.bfloat16 or scaled) and fp32_output(a.device.type):
        return torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
    return torch._grouped_mm(a, b, offs=offs)


def _joined(parts: list, join=torch.stack):
    """Per-expert factors (all None, or all tensors of one kind: the experts share one spec) joined, or None."""
    if all(p is None for p in parts):
        return None
    return join([p.float() for p in parts])


def _epilogue(out, ra, rb, da, db, out_dtype: torch.dtype) -> torch.Tensor:
    """The factors (already broadcast to the output: each expert's rows have their own) applied as the dense GEMM's
    epilogue applies them, to an output taken to FP32 first where there are any (a BF16 grouped output)."""
    if any(f is not None for f in (ra, rb, da, db)):
        out = out.float()
    return apply_factors(out, ra, rb, da, db, out_dtype)


def _grouped(a_ops: list, b_ops: list, out_dtype: torch.dtype, kernels: bool, join, of_splits) -> torch.Tensor:
    """``of_splits`` of both sides' exact BF16 splits where the grouped GEMM can take them (CUDA, every operand
    split); else the ``emulated`` backend's GEMM per expert, its outputs joined by ``join``."""
    if not a_ops:
        raise ValueError("a grouped GEMM needs at least one expert")
    if a_ops[0].device.type == "cuda":
        splits_a, splits_b = _splits(a_ops, kernels), _splits(b_ops, kernels)
        if splits_a is not None and splits_b is not None:
            return of_splits(splits_a, splits_b, out_dtype)
    return join([_EMULATED.gemm(a, b, out_dtype, kernels=kernels) for a, b in zip(a_ops, b_ops)])


def _offsets(sizes: list[int], device) -> torch.Tensor:
    """The grouped GEMM's group ends (int32), from the groups' sizes."""
    return torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)


def grouped_rows(a_ops: list, b_ops: list, out_dtype: torch.dtype, *, kernels: bool = False) -> torch.Tensor:
    """``cat_e(A_e @ B_e^T)``: ``A_e [m_e, k]`` (each ``m_e`` a multiple of 16 on CUDA), ``B_e [n, k]``."""
    return _grouped(a_ops, b_ops, out_dtype, kernels, torch.cat, rows_of_splits)


def rows_of_splits(splits_a: list, splits_b: list, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_rows` of operands given as their BF16 splits ``(values, row_scale, divisor)``: one grouped GEMM
    of the values, each expert's factors applied to its rows."""
    va = torch.cat([s[0] for s in splits_a])
    vb = torch.stack([s[0] for s in splits_b]).transpose(-2, -1)
    sizes = [s[0].shape[0] for s in splits_a]
    ra = _joined([s[1] for s in splits_a], torch.cat)  # A's row scales: one per output row
    da, rb, db = (_joined([s[i] for s in splits]) for splits, i in ((splits_a, 2), (splits_b, 1), (splits_b, 2)))
    out = _grouped_mm(va, vb, _offsets(sizes, va.device), out_dtype, any(f is not None for f in (ra, da, rb, db)))
    rows = torch.tensor(sizes, device=va.device)

    def per_row(f):  # each expert's factor on each of its rows
        return f.repeat_interleave(rows, dim=0, output_size=out.shape[0])

    return _epilogue(out, ra[:, None] if ra is not None else None, per_row(rb) if rb is not None else None,
                     per_row(da)[:, None] if da is not None else None, per_row(db)[:, None] if db is not None else None,
                     out_dtype)


def grouped_inner(a_ops: list, b_ops: list, out_dtype: torch.dtype, *, kernels: bool = False) -> torch.Tensor:
    """``stack_e(A_e @ B_e^T)``: ``A_e [n, m_e]``, ``B_e [k, m_e]`` (each ``m_e`` a multiple of 16 on CUDA)."""
    return _grouped(a_ops, b_ops, out_dtype, kernels, torch.stack, inner_of_splits)


def inner_of_splits(splits_a: list, splits_b: list, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`grouped_inner` of operands given as their BF16 splits ``(values, row_scale, divisor)``: one grouped GEMM
    of the values, each expert's factors applied to its output."""
    va = torch.cat([s[0] for s in splits_a], dim=1)
    vb = torch.cat([s[0] for s in splits_b], dim=1).T
    sizes = [s[0].shape[1] for s in splits_a]
    ra, da, rb, db = (_joined([s[i] for s in splits]) for splits in (splits_a, splits_b) for i in (1, 2))
    out = _grouped_mm(va, vb, _offsets(sizes, va.device), out_dtype, any(f is not None for f in (ra, da, rb, db)))
    return _epilogue(out, ra[:, :, None] if ra is not None else None, rb[:, None, :] if rb is not None else None,
                     da[:, None, None] if da is not None else None, db[:, None, None] if db is not None else None, out_dtype)
