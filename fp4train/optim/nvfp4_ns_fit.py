"""Fitting Newton-Schulz coefficients for NVFP4 products: per-step ``(a, b, c)`` found with the quantized iteration in
the loop.

NVFP4's rounding moves every product of the iteration by about a tenth of its size, so coefficients made for exact
(or BF16) products land it far from the orthogonal factor or make it diverge. The fit runs the iteration of
:func:`fp4train.optim.newton_schulz.newton_schulz` (``matmul="nvfp4"``: start scaled by the Gram matrix, the RMS
singular value renormalized to at most 1 after each step, the largest bounded before each later step) on a batch of candidate coefficient sets at once and keeps
the ones that land nearest the orthogonal factor, relative to BF16 Muon on the same matrix:

* matrices: of each spectrum class (Gaussian, rank 8 plus noise, a power law from 1 to 1e-3), two draws, at the
  shape's aspect ratio with the smaller side :data:`PROXY` (the NVFP4 error of a product of matrices with orthonormal
  rows depends on the aspect ratio, not on the size), plus one rank-8-plus-noise matrix with twice that side (its
  largest singular values overshoot more at larger sizes);
* score per candidate: the worst over the matrices of (distance after the best scalar fit / BF16 Muon's), plus half
  their mean, plus 10 x how far the largest singular value (after the same fit) exceeds 1.4;
* search: the cross-entropy method from the best-scoring of a fixed start and the given ones (other shapes' fits), a
  fixed seed: the same coefficients on the same machine.

About two to four minutes per shape on a 2-core CPU: the presets' shapes come from a committed table
(:data:`fp4train.optim.ns_coefficients.NVFP4_TABLE`, written by ``bench/ns_coefficients.py --nvfp4``); another shape
takes the table's entry of the nearest aspect ratio, or a fit of its own (:func:`fit`).
"""

from __future__ import annotations

import torch

from ..formats import e2m1, nvfp4
from ..formats.ieee import true_div
from .newton_schulz import nvfp4_iteration

#: the smaller side of the matrices the fit runs on
PROXY = 128
#: the start: Muon's triple for the first three steps, then two contracting steps
START = ((3.4445, -4.775, 2.0315),) * 3 + ((2.0, -1.5, 0.5), (1.5, -0.5, 0.0))


def fake_nvfp4_rows(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 (1x16 blocks along the last dim, E4M3 block scales, one FP32 tensor scale per matrix of the batch),
    rounded to nearest and dequantized: :func:`fp4train.quantize`'s values on each matrix, bit for bit, batched (the
    format's own scale rules and roundings, with the tensor scale shaped per matrix; inputs finite)."""
    s = nvfp4.scale_from_amax(x.abs().amax((-2, -1), keepdim=True)).unsqueeze(-1)  # [..., 1, 1, 1]
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    _, sb = nvfp4.block_scales(xb.abs().amax(-1, keepdim=True), s)
    v = true_div(xb * s, sb)
    v = torch.where(sb == 0, torch.zeros_like(v), v)
    return true_div(e2m1.decode(e2m1.encode_nearest(v)) * sb, s).reshape(x.shape)


def _mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return fake_nvfp4_rows(x) @ fake_nvfp4_rows(y.transpose(-2, -1)).transpose(-2, -1)


def spectrum_classes(m: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    """One ``[m, n]`` matrix (``m <= n``) of each spectrum class, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    return {
        "gaussian": torch.randn(m, n, generator=g),
        "rank8+noise": torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g) + 0.1 * torch.randn(m, n, generator=g),
        "power-law": ((u * torch.logspace(0, -3, m, dtype=torch.float64)) @ v.T).float(),
    }


def polar(x: torch.Tensor) -> torch.Tensor:
    """``U V^T`` of ``x`` (float64 SVD), in FP32."""
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return (u @ vh).float()


def fitted_distance(x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(distance, alpha)``: ``min_alpha ||alpha x - target|| / ||target||`` over the last two dims, and that alpha."""
    alpha = (x * target).sum((-2, -1)) / (x * x).sum((-2, -1)).clamp(min=1e-30)
    return (alpha[..., None, None] * x - target).norm(dim=(-2, -1)) / target.norm(), alpha


def _problems(m: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """The fit's matrices for an ``[m, n]`` shape: ``(x normalized, U V^T, BF16 Muon's fitted distance)``."""
    from .newton_schulz import BF16_COEFFICIENTS, newton_schulz

    lo, hi = min(m, n), max(m, n)
    p = min(PROXY, lo)
    q = max(16, round(p * hi / lo / 16) * 16)
    mats = [x for seed in (0, 1) for x in spectrum_classes(p, q, seed).values()]
    if 2 * p <= lo:
        mats.append(spectrum_classes(2 * p, max(16, round(2 * p * hi / lo / 16) * 16), 2)["rank8+noise"])
    out = []
    for x in mats:
        target = polar(x)
        out.append((x / x.norm(), target, float(fitted_distance(newton_schulz(x, BF16_COEFFICIENTS).float(), target)[0])))
    return out


def score(candidates: torch.Tensor, problems) -> torch.Tensor:
    """Each candidate's score (lower is better; see the module docstring): ``candidates`` ``[c, steps, 3]``."""
    worst = torch.zeros(candidates.shape[0])
    mean = torch.zeros(candidates.shape[0])
    top = torch.zeros(candidates.shape[0])
    for x, target, muon in problems:
        out = nvfp4_iteration(x.expand(candidates.shape[0], *x.shape), candidates, _mm)
        d, alpha = fitted_distance(out, target)
        s = torch.linalg.matrix_norm(out.double(), ord=2).float() * alpha.abs()
        r = torch.nan_to_num(d / muon, nan=1e3, posinf=1e3)
        worst, mean, top = torch.maximum(worst, r), mean + r / len(problems), torch.maximum(top, torch.nan_to_num(s, nan=1e3, posinf=1e3))
    return worst + 0.5 * mean + 10 * torch.relu(top - 1.4)


def fit(m: int, n: int, steps: int = 5, *, generations: int = 30, population: int = 48, elite: int = 8, seed: int = 0,
        starts=()) -> tuple[tuple[float, float, float], ...]:
    """Per-step NVFP4 Newton-Schulz coefficients for ``[m, n]`` matrices (either orientation), deterministic (see the
    module docstring). The search starts from the best-scoring of :data:`START` and ``starts`` (other shapes' fits,
    each cut or extended to ``steps``)."""
    if m < 16 or n < 16 or m % 16 or n % 16 or steps < 1:
        raise ValueError(f"fit needs both dims multiples of 16 and steps >= 1, got {m} x {n}, {steps} steps")
    problems = _problems(m, n)
    firsts = torch.tensor([(tuple(s) + tuple(s)[-1:] * steps)[:steps] for s in (START, *starts)], dtype=torch.float32)
    with torch.no_grad():
        start = firsts[int(score(firsts, problems).argmin())]
    g = torch.Generator().manual_seed(seed)
    mean = start.clone()
    spread = torch.full_like(mean, 0.5)
    best, best_score = mean.clone(), float("inf")
    with torch.no_grad():
        for _ in range(generations):
            cands = mean + spread * torch.randn(population, *mean.shape, generator=g)
            cands[0] = best
            s = score(cands, problems)
            order = s.argsort()[:elite]
            if float(s[order[0]]) < best_score:
                best_score, best = float(s[order[0]]), cands[order[0]].clone()
            mean, spread = cands[order].mean(0), cands[order].std(0).clamp(min=0.02)
    return tuple(tuple(round(float(v), 4) for v in step) for step in best)
