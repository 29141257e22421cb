"""Newton-Schulz orthogonalization (Muon's update), with its matmuls in BF16 or on NVFP4 operands.

For ``G`` ``[m, n]`` (transposed first if ``m > n``), ``X = G / ||G||_F`` and ``ns_steps`` times

    A = X X^T          B = b A + c A A          X = a X + B X

which pushes every singular value of ``X`` towards 1 (the quintic ``a s + b s^3 + c s^5``). ``matmul="bf16"`` is
``torch.optim.Muon``'s iteration, bit for bit. ``matmul="nvfp4"`` is Full-Stack FP4's native NVFP4 Newton-Schulz:
both operands of every product NVFP4 along the product's inner dimension (1x16 blocks, E4M3 block scales, an FP32
tensor scale, nearest rounding), multiplied exactly with FP32 accumulation (on a GPU on BF16 tensor cores - an E2M1
value times an E4M3 scale fits BF16 - the tensor scales applied to the FP32 output; elsewhere an FP32 matmul of the
dequantized values, the same products), the additions in FP32. NVFP4's rounding moves each product by about a tenth
of its size, so the NVFP4 iteration differs from the BF16 one in four ways, each measured
(``bench/root_orthogonality.py``):

* per-step coefficients fitted with the quantized products in the loop (:mod:`.nvfp4_ns_fit`; by shape,
  :func:`fp4train.optim.ns_coefficients.nvfp4_coefficients`), as Polar Express does for exact products;
* the start scaled by ``||A||_F^(1/2) = (sum s^4)^(1/4)`` of the first Gram matrix (times :data:`GRAM_MARGIN`)
  instead of ``||G||_F``: still at least the largest singular value, but up to ``m^(1/4)`` times nearer it, which
  saves a step of growth (the first product is the one the first step needs anyway);
* after each step ``X`` divided by its RMS singular value ``||X||_F / sqrt(m)`` where that exceeds 1, so that
  rounding cannot carry the spectrum into the quintic's divergent range;
* before each later step, ``X`` divided by its largest singular value over :data:`TOP_LIMIT` where it exceeds that
  (estimated from the step's Gram matrix by :data:`POWER_ITERATIONS` power iterations: a few matrix-vector products).
  The RMS bound leaves a few directions free: on low-rank matrices of shapes off the fitted table, one rounded spike
  can leave the quintic's basin and grow to a largest singular value of 3-12; the bound, set above the overshoot the
  fitted coefficients use, leaves the other matrices' iteration as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..formats.quantize import quantize
from ..quantizer import kernels_usable_on

#: torch.optim.Muon's (a, b, c)
BF16_COEFFICIENTS = (3.4445, -4.775, 2.0315)
#: the NVFP4 iteration's start divides by the first Gram matrix's sqrt(Frobenius norm) times this (its NVFP4
#: products can round the norm down by a few percent, and the start must not exceed 1)
GRAM_MARGIN = 1.05
#: the NVFP4 iteration's largest singular value before a step is brought down to this where it exceeds it
TOP_LIMIT = 1.6
#: power iterations on the Gram matrix that estimate the largest singular value (a separated spike, the case the
#: bound is for, is found in one or two)
POWER_ITERATIONS = 3


def top_singular_value(gram: torch.Tensor, iterations: int = POWER_ITERATIONS) -> torch.Tensor:
    """An estimate (from below) of the largest singular value of ``X`` from its Gram matrix ``X X^T``
    ``[..., m, m]``: power iterations from ``gram``'s row sums, shaped ``[..., 1, 1]``."""
    v = gram.sum(-1, keepdim=True)
    for _ in range(iterations):
        v = gram @ v
        v = v / v.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30)
    lam = (gram @ v).norm(dim=(-2, -1), keepdim=True) / v.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30)
    return lam.sqrt()


def _is_batched(x: torch.Tensor) -> bool:
    """Is ``x`` a ``torch.vmap`` batched tensor (which the FP32-output BF16 GEMM does not take)?"""
    check = getattr(torch._C._functorch, "is_batchedtensor", None)
    return bool(check is not None and check(x))


def _nvfp4_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` with both operands NVFP4 along the inner dim (x's rows, y's columns), FP32 accumulation; a stack of
    matrices ``[n, m, k] @ [n, k, n']`` quantizes each matrix with its own tensor scale."""
    if x.is_cuda and not _is_batched(x) and kernels_usable_on(x):
        return nvfp4_kernel_mm(x, y)  # quantized by Triton kernels in one opaque op: a compiled step traces none of it
    if x.ndim == 3:
        return torch.stack([_nvfp4_mm(a, b) for a, b in zip(x.unbind(), y.unbind())])
    qx = quantize(x.float(), "nvfp4", axis=1)
    return _reference_product(x, qx, quantize(y.T.float(), "nvfp4", axis=1))  # y's columns as rows: blocks along K


def _reference_product(x: torch.Tensor, qx, qy) -> torch.Tensor:
    """``qx @ qy^T`` of two 2D NVFP4 operands blocked along the inner dim (``qy`` may be ``qx``: a Gram matrix): their
    exact BF16 values on BF16 tensor cores where ``x`` is a CUDA tensor, FP32 values elsewhere."""
    if x.is_cuda and not _is_batched(x):
        sx = qx.scaled_bf16()
        return _scaled_mm(sx, (sx if qy is qx else qy.scaled_bf16()).t())
    dx = qx.dequantize(torch.float32)
    return dx @ (dx if qy is qx else qy.dequantize(torch.float32)).T


def _scaled_mm(sx, sy) -> torch.Tensor:
    """The product of two NVFP4 operands' exact BF16 values (:class:`~fp4train.formats.qtensor.ScaledBF16`, ``sy``
    ``[k, n]``) on BF16 tensor cores with FP32 accumulation, the tensor scales applied to the output (elsewhere than on
    a GPU an FP32 matmul of the values: the same products)."""
    return _values_mm(sx.values, sy.values) / sx.divisor / sy.divisor


def _values_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of exact BF16 values (2D or stacked 3D) with FP32 accumulation and output."""
    if a.is_cuda:
        return (torch.mm if a.ndim == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@torch.library.custom_op("fp4train::nvfp4_kernel_mm", mutates_args=())
def nvfp4_kernel_mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`_nvfp4_mm` of CUDA tensors, its operands quantized by the Triton kernels with the reference's bits
    (``y`` in its own layout, blocks down its columns: the blocks of ``y.T``'s rows); a stack of matrices in one
    launch per pass, each matrix with its own tensor scale."""
    from ..kernels import nvfp4_values
    from ..kernels.nvfp4_values import nvfp4_stacked_values

    if x.ndim == 2:
        return _scaled_mm(nvfp4_values(x.float(), axis=1), nvfp4_values(y.float(), axis=0))
    vx, sx = nvfp4_stacked_values(x.float(), axis=2)
    vy, sy = nvfp4_stacked_values(y.float(), axis=1)
    return _values_mm(vx, vy) / sx[:, None, None] / sy[:, None, None]


@nvfp4_kernel_mm.register_fake
def _(x, y):
    return x.new_empty(*x.shape[:-1], y.shape[-1], dtype=torch.float32)


def _nvfp4_gram(x: torch.Tensor) -> torch.Tensor:
    """``_nvfp4_mm(x, x^T)``: both operands are ``x`` in blocks along its rows, so ``x`` is quantized once."""
    if x.is_cuda and not _is_batched(x) and kernels_usable_on(x):
        return nvfp4_kernel_gram(x)
    if x.ndim == 3:
        return torch.stack([_nvfp4_gram(a) for a in x.unbind()])
    q = quantize(x.float(), "nvfp4", axis=1)
    return _reference_product(x, q, q)


@torch.library.custom_op("fp4train::nvfp4_kernel_gram", mutates_args=())
def nvfp4_kernel_gram(x: torch.Tensor) -> torch.Tensor:
    """:func:`nvfp4_kernel_mm` ``(x, x^T)`` (2D or a stack) with ``x`` quantized once: ``x^T``'s blocks down its columns
    are ``x``'s along its rows, the same values, multiplied transposed (no copy)."""
    from ..kernels import nvfp4_values
    from ..kernels.nvfp4_values import nvfp4_stacked_values

    if x.ndim == 2:
        v = nvfp4_values(x.float(), axis=1)
        return _values_mm(v.values, v.values.T) / v.divisor / v.divisor
    vx, sx = nvfp4_stacked_values(x.float(), axis=2)
    return _values_mm(vx, vx.mT) / sx[:, None, None] / sx[:, None, None]


@nvfp4_kernel_gram.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-2], dtype=torch.float32)


def as_triples(coefficients) -> tuple:
    """One ``(a, b, c)`` or per-step triples as float tuples (hashable: compiled steps specialize on them; a
    checkpoint's JSON lists come back as tuples)."""
    if len(coefficients) == 3 and all(isinstance(v, (int, float)) for v in coefficients):
        return tuple(float(v) for v in coefficients)
    return tuple(tuple(float(v) for v in t) for t in coefficients)


def per_step(coefficients, steps: int) -> tuple[tuple[float, float, float], ...]:
    """``coefficients`` as one ``(a, b, c)`` per step: a single triple repeated, or a sequence of ``steps`` triples."""
    triples = as_triples(coefficients)
    if isinstance(triples[0], float):
        return (triples,) * steps
    if len(triples) != steps or any(len(t) != 3 for t in triples):
        raise ValueError(f"Newton-Schulz coefficients: one (a, b, c) or {steps} of them (one per step), got {coefficients!r}")
    return triples


def nvfp4_iteration(x: torch.Tensor, coefficients, mm, *, gram_mm=None, eps: float = 0.0,
                    rows: int | None = None) -> torch.Tensor:
    """The NVFP4 iteration of :func:`newton_schulz` on ``x`` ``[..., m, n]`` (``m <= n``,
    any scale) with per-step ``coefficients``: ``[..., steps, 3]`` (a batch of candidates broadcast against ``x``) or
    one ``(a, b, c)`` of floats per step - the one loop the optimizer runs and the fit
    (:mod:`.nvfp4_ns_fit`) scores; ``mm``: the NVFP4 product. ``eps`` floors the Gram matrix's norm; ``rows``: the rows
    before zero padding (the renormalization's ``m``), ``x``'s own by default; ``gram_mm``: ``mm(x, x^T)`` made
    cheaper, if given."""
    gram_mm = gram_mm or (lambda x: mm(x, x.transpose(-2, -1)))
    gram = gram_mm(x)
    f = gram.norm(dim=(-2, -1), keepdim=True).sqrt().clamp(min=eps) * GRAM_MARGIN
    x, gram = x / f, gram / (f * f)
    root_rows = math.sqrt(x.shape[-2] if rows is None else rows)
    if isinstance(coefficients, torch.Tensor):
        coefficients = [[coefficients[..., k, i, None, None] for i in range(3)] for k in range(coefficients.shape[-2])]
    for k, (a, b, c) in enumerate(coefficients):
        if k:
            gram = gram_mm(x)
            over = (top_singular_value(gram) / TOP_LIMIT).clamp(min=1)
            x, gram = x / over, gram / (over * over)
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
        x = x / (x.norm(dim=(-2, -1), keepdim=True) / root_rows).clamp(min=1)
    return x


def newton_schulz(g: torch.Tensor, coefficients: Sequence = BF16_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, *, matmul: str = "bf16") -> torch.Tensor:
    """The orthogonalized ``g`` (2D): BF16 for ``matmul="bf16"``, FP32 for ``"nvfp4"`` (see the module docstring),
    which also takes a stack of same-shape matrices ``[n, m, k]``, each orthogonalized on its own in one iteration.
    ``coefficients``: one ``(a, b, c)`` for every step, or one per step."""
    if g.ndim != 2 and not (g.ndim == 3 and matmul == "nvfp4"):
        raise ValueError(f"newton_schulz takes a 2D matrix (with matmul='nvfp4' also a stack [n, m, k]), got shape "
                         f"{tuple(g.shape)}")
    if matmul not in ("bf16", "nvfp4"):
        raise ValueError(f"matmul must be bf16 or nvfp4, got {matmul!r}")
    coefficients = per_step(coefficients, steps)
    if matmul == "bf16":  # torch.optim.Muon's _zeropower_via_newtonschulz, in its order
        x = g.bfloat16()
        if g.size(0) > g.size(1):
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for a, b, c in coefficients:
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
        return x.T if g.size(0) > g.size(1) else x
    x = g.float()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    rows, cols = x.shape[-2:]
    # zeros up to whole NVFP4 blocks: they stay zero through every product (an all-zero block quantizes to zeros, and
    # a partial block's scale is its own elements'), so the matrix's iteration is unchanged; cut off at the end
    x = torch.nn.functional.pad(x, (0, -cols % 16, 0, -rows % 16))
    x = x / (x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)).clamp(min=eps)
    x = nvfp4_iteration(x, coefficients, _nvfp4_mm, gram_mm=_nvfp4_gram, eps=eps, rows=rows)
    x = x[..., :rows, :cols]
    return x.mT if tall else x
