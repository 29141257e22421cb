"""Newton-Schulz coefficients for NVFP4 matmuls: which (a, b, c) orthogonalize best when every product is NVFP4?

Question: Muon's quintic coefficients were chosen for BF16 products; with NVFP4 operands the products carry ~10%
element error, and where the iteration lands moves. For gradient-like matrices (Gaussian, and low rank plus
noise, at Llama-like aspect ratios) this measures, for each (a, b, c) of a grid around Muon's, the error of 5
NVFP4 Newton-Schulz steps against the exact orthogonal factor ``U V^T`` of the matrix (float64 SVD),
``||X - U V^T||_F / ||U V^T||_F``, and the spread of the singular values of ``X``; BF16 with Muon's coefficients
is the reference row. Runs on the CPU (reference numerics). Writes ``bench/results/ns_coefficients.json``;
:data:`fp4train.optim.newton_schulz.NVFP4_COEFFICIENTS` is the best mean error of that file.

    python bench/ns_coefficients.py [--seeds 2]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from common import results_path, write_results
from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, newton_schulz

SHAPES = ((256, 256), (256, 1024), (1024, 256))
GRID = {"a": (3.0, 3.2, 3.4445, 3.7), "b": (-4.3, -4.775, -5.2), "c": (1.7, 2.0315, 2.3)}


def matrices(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, n in SHAPES:
        out.append((f"gaussian {m}x{n}", torch.randn(m, n, generator=g)))
        low = torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g)
        out.append((f"rank8+noise {m}x{n}", low + 0.1 * torch.randn(m, n, generator=g)))
    return out


def errors(x: torch.Tensor, polar: torch.Tensor) -> tuple[float, float]:
    """(relative distance to the orthogonal factor, largest |singular value - 1|)."""
    x = x.double()
    if not torch.isfinite(x).all():  # the iteration diverged
        return float("inf"), float("inf")
    s = torch.linalg.svdvals(x)
    return float((x - polar).norm() / polar.norm()), float((s - 1).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=results_path("ns_coefficients", per_device=False))
    args = ap.parse_args(argv)
    cases = []
    for seed in range(args.seeds):
        for name, g in matrices(seed):
            u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
            cases.append((name, g, u @ vh))
    rows = []
    candidates = [("bf16", BF16_COEFFICIENTS)] + [("nvfp4", abc) for abc in itertools.product(*GRID.values())]
    for matmul, abc in candidates:
        errs = [errors(newton_schulz(g, abc, args.steps, matmul=matmul), polar) for _, g, polar in cases]
        finite = all(e < 1e3 for e, _ in errs)  # a diverged run (values past 1e3 or not finite) is recorded as such
        row = {"matmul": matmul, "coefficients": list(abc), "diverged": not finite,
               "mean_error": sum(e for e, _ in errs) / len(errs) if finite else None,
               "worst_error": max(e for e, _ in errs) if finite else None,
               "worst_singular_gap": max(s for _, s in errs) if finite else None}
        rows.append(row)
        what = "diverged" if row["diverged"] else (f"mean {row['mean_error']:.4f} worst {row['worst_error']:.4f} "
                                                    f"max|s-1| {row['worst_singular_gap']:.3f}")
        print(f"{matmul:>5} a={abc[0]:<7} b={abc[1]:<7} c={abc[2]:<7} {what}", flush=True)
    best = min((r for r in rows if r["matmul"] == "nvfp4" and not r["diverged"]), key=lambda r: r["mean_error"])
    muon = next(r for r in rows if r["matmul"] == "nvfp4" and tuple(r["coefficients"]) == BF16_COEFFICIENTS)
    print(f"best for nvfp4: {best['coefficients']} (mean {best['mean_error']:.4f}); Muon's coefficients in nvfp4: "
          f"{'diverged' if muon['diverged'] else round(muon['mean_error'], 4)}; in bf16: {rows[0]['mean_error']:.4f}")
    write_results(args.json, rows, steps=args.steps, seeds=args.seeds, shapes=[list(s) for s in SHAPES],
                  best_nvfp4=best["coefficients"])


if __name__ == "__main__":
    main()
