"""Shape-specific Newton-Schulz coefficients (Root, arXiv 2511.20626) for the quintic ``a s + b s^3 + c s^5``.

Root tunes the coefficients to each weight shape. Two sources here:

* :func:`shape_coefficients` - the Root authors' released coefficients for the four shapes they give
  (:data:`ROOT_RELEASE_COEFFICIENTS`: a 2048-wide model's square, 2048 x 3072, 2048 x 8192 and 2048 x 16384
  matrices), Muon's for any other shape, as their release falls back. What :class:`~fp4train.optim.QRoot` uses.
* :func:`fitted_coefficients` - fitted for any shape: after ``X = G / ||G||_F`` the singular values of an
  ``[m, n]`` matrix with independent entries follow the Marchenko-Pastur law of ratio ``min/max`` scaled by
  ``1 / sqrt(min)``; the fit takes 256 of its quantiles and, with the same weight, 64 log-spaced values from
  ``1e-4`` to 1 (an update's small singular values sit far below its largest), and minimizes the mean squared
  distance from 1 after ``steps`` iterations, plus the same over 1 to 1.1 and a penalty on values leaving
  ``[-1.3, 1.3]``; a grid search over ``a in [2, 4.5], b in [-7, -2], c in [0.5, 3.5]`` starts it, Adam refines it.
  Measured (``bench/root_orthogonality.py``): Gaussian matrices land 1.1-5x nearer their orthogonal factor than with
  Muon's coefficients, but rank-8-plus-noise matrices - closer to what a momentum is - land 1.1-1.3x farther
  (no quintic of 5 steps lifts both a spread spectrum and values 1e-3 under the largest). Hence not the default.
* :func:`nvfp4_coefficients` - per-step coefficients for the NVFP4 iteration (Full-Stack FP4's native NVFP4
  Newton-Schulz), fitted with the quantized products in the loop (:mod:`.nvfp4_ns_fit`) for each aspect ratio of
  the presets' hidden matrices (:data:`NVFP4_TABLE`, written by ``bench/ns_coefficients.py --nvfp4``).
"""

from __future__ import annotations

import functools
import math

import torch

#: torch.optim.Muon's (a, b, c), the start and the fallback
MUON_COEFFICIENTS = (3.4445, -4.775, 2.0315)
#: the Root authors' released coefficients, by (smaller, larger) dimension
ROOT_RELEASE_COEFFICIENTS = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}


#: per-step NVFP4 Newton-Schulz coefficients (5 steps) by the aspect ratio max/min of the matrix, fitted by
#: fp4train.optim.nvfp4_ns_fit.fit on the shape named (bench/ns_coefficients.py --nvfp4 rewrites this table)
NVFP4_TABLE: dict[tuple[int, int], tuple[tuple[float, float, float], ...]] = {
    (384, 384): ((3.1515, -5.3514, 2.3024), (4.0007, -5.6098, 2.3578), (4.7017, -4.3073, 1.4055),
                 (2.6553, -1.4234, 0.2321), (1.6861, -0.6535, 0.0813)),
    (256, 512): ((3.2998, -5.6445, 2.2619), (4.0804, -5.329, 2.3994), (4.9709, -3.8466, 1.0481),
                 (3.0536, -1.4142, 0.206), (1.522, -0.7031, 0.1139)),
    (384, 1024): ((3.2968, -5.8305, 2.2602), (4.0232, -5.2574, 2.4005), (5.0093, -3.8594, 1.0298),
                 (3.1178, -1.4376, 0.1971), (1.517, -0.7097, 0.1173)),
    (256, 768): ((3.3313, -6.1806, 2.2307), (3.945, -5.175, 2.4477), (5.0328, -3.8407, 0.9883),
                 (3.0989, -1.4163, 0.1981), (1.4986, -0.7286, 0.1283)),
    (512, 2048): ((3.4517, -6.7116, 2.2541), (3.9564, -5.168, 2.4675), (5.0369, -3.8257, 1.0125),
                 (2.9236, -1.3632, 0.1886), (1.4573, -0.6743, 0.1122)),
}


def nvfp4_coefficients(m: int, n: int, steps: int = 5) -> tuple[tuple[float, float, float], ...]:
    """Per-step coefficients for the NVFP4 iteration on an ``[m, n]`` matrix (either orientation): the table's entry
    of the nearest aspect ratio (log scale) for 5 steps; for other step counts a fit of this shape
    (:func:`fp4train.optim.nvfp4_ns_fit.fit`, minutes on a CPU, memoized in the process)."""
    if steps != 5:
        return _fit(min(m, n), max(m, n), steps)
    ratio = math.log(max(m, n) / min(m, n))
    key = min(NVFP4_TABLE, key=lambda k: (abs(math.log(k[1] / k[0]) - ratio), k))
    return NVFP4_TABLE[key]


@functools.lru_cache(maxsize=None)
def _fit(m: int, n: int, steps: int):
    from .nvfp4_ns_fit import fit

    return fit(m, n, steps)


def shape_coefficients(m: int, n: int, steps: int = 5) -> tuple[float, float, float]:
    """Root's coefficients for an ``[m, n]`` weight (either orientation): the released ones where the shape has them
    (for 5 steps), else Muon's."""
    if steps != 5:
        return MUON_COEFFICIENTS
    return ROOT_RELEASE_COEFFICIENTS.get((min(m, n), max(m, n)), MUON_COEFFICIENTS)


def marchenko_pastur_singular_values(m: int, n: int, k: int = 256) -> torch.Tensor:
    """``k`` quantiles (FP64) of the singular values of ``G / ||G||_F`` for an ``[m, n]`` matrix with independent
    entries (the Marchenko-Pastur law of ratio ``min/max``, scaled by ``1 / sqrt(min(m, n))``)."""
    m, n = min(m, n), max(m, n)
    lam = m / n
    lo, hi = (1 - math.sqrt(lam)) ** 2, (1 + math.sqrt(lam)) ** 2
    x = torch.linspace(lo, hi, 20001, dtype=torch.float64)
    density = torch.sqrt(torch.clamp((hi - x) * (x - lo), min=0)) / (2 * math.pi * lam * x.clamp(min=1e-12))
    cdf = torch.cumsum(density, 0)
    cdf = cdf / cdf[-1]
    eig = x[torch.searchsorted(cdf, (torch.arange(k, dtype=torch.float64) + 0.5) / k).clamp(max=x.numel() - 1)]
    return torch.sqrt(eig / (m * eig.mean())).clamp(min=1e-4)


def iterate(s: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    """Singular values ``s`` after ``steps`` quintic iterations (broadcasting over leading coefficient dims)."""
    a, b, c = coefficients
    for _ in range(steps):
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return s


def _loss(s: torch.Tensor, guard: torch.Tensor, coefficients, steps: int) -> torch.Tensor:
    out, g = iterate(s, coefficients, steps), iterate(guard, coefficients, steps)
    loss = (((out - 1) ** 2).mean(-1) + ((g - 1) ** 2).mean(-1)
            + 10 * (torch.relu(out.abs() - 1.3).pow(2).mean(-1) + torch.relu(g.abs() - 1.3).pow(2).mean(-1)))
    return torch.where(torch.isfinite(loss), loss, torch.full_like(loss, float("inf")))


@functools.lru_cache(maxsize=None)
def fitted_coefficients(m: int, n: int, steps: int = 5) -> tuple[float, float, float]:
    """Newton-Schulz coefficients ``(a, b, c)`` fitted for ``[m, n]`` matrices and ``steps`` iterations (see the
    module docstring); the same for ``[n, m]``. Memoized: fitted once per shape in a process."""
    if m < 1 or n < 1 or steps < 1:
        raise ValueError(f"fitted_coefficients needs a positive shape and steps, got {m} x {n}, {steps} steps")
    s = torch.cat([marchenko_pastur_singular_values(m, n), torch.logspace(-4, 0, 64, dtype=torch.float64)])
    guard = torch.linspace(1.0, 1.1, 8, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(torch.linspace(2, 4.5, 26, dtype=torch.float64), torch.linspace(-7, -2, 26, dtype=torch.float64),
                                      torch.linspace(0.5, 3.5, 26, dtype=torch.float64), indexing="ij"), -1).reshape(-1, 3)
    losses = _loss(s, guard, [grid[:, i, None] for i in range(3)], steps)
    best = grid[int(torch.argmin(losses))].clone()
    best_loss = float(losses.min())
    with torch.enable_grad():  # an optimizer's step runs under no_grad
        best, best_loss = _refine(s, guard, best, best_loss, steps)
    return tuple(round(float(v), 4) for v in best)


def _refine(s, guard, best, best_loss, steps):
    """A few hundred Adam steps from the grid's best, keeping the best finite point."""
    p = best.clone().requires_grad_(True)
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(400):
        opt.zero_grad()
        loss = _loss(s, guard, p, steps)
        if not torch.isfinite(loss):
            break
        if float(loss.detach()) < best_loss:
            best_loss, best = float(loss.detach()), p.detach().clone()
        loss.backward()
        opt.step()
    return best, best_loss
