"""Root's Newton-Schulz per layer shape: how near the exact orthogonal factor do Muon's coefficients and Root's
shape-fitted ones land, with BF16 and with NVFP4 products?

Question: Root (arXiv 2511.20626) fits the quintic's coefficients to each weight shape; Full-Stack FP4 runs the
iteration on NVFP4 operands. For the hidden-matrix shapes of a model preset (q/o: dim x dim, k/v: kv_dim x dim,
gate/up: ffn x dim, down: dim x ffn) and two kinds of update-like matrices (Gaussian; rank 8 plus noise), this
measures 5 Newton-Schulz steps against ``U V^T`` of the matrix (float64 SVD): ``||X - U V^T||_F / ||U V^T||_F``.
Columns: in BF16, Muon's coefficients, Root's by shape (the released ones where the shape has them, Muon's
elsewhere: :func:`fp4train.optim.ns_coefficients.shape_coefficients`) and the fitted ones
(:func:`~fp4train.optim.ns_coefficients.fitted_coefficients`); NVFP4 products with fp4train's NVFP4 coefficients and
with the fitted ones. Runs on the CPU (reference numerics).

    python bench/root_orthogonality.py [--model 20m] [--seeds 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import results_path, write_results
from fp4train.models import PRESETS
from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, NVFP4_COEFFICIENTS, newton_schulz
from fp4train.optim.ns_coefficients import fitted_coefficients, shape_coefficients


def shapes(model: str) -> list[tuple[str, tuple[int, int]]]:
    """The distinct hidden-matrix shapes of a preset, named by their layers."""
    c = PRESETS[model]
    kv = c.dim // c.n_heads * c.n_kv_heads
    named = {"q_proj, o_proj": (c.dim, c.dim), "k_proj, v_proj": (kv, c.dim), "gate_proj, up_proj": (c.ffn_dim, c.dim),
             "down_proj": (c.dim, c.ffn_dim)}
    return list(named.items())


def distance(x: torch.Tensor, polar: torch.Tensor) -> float | None:
    x = x.double()
    return float((x - polar).norm() / polar.norm()) if torch.isfinite(x).all() else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m", choices=sorted(PRESETS))
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    path = args.json or results_path("root_orthogonality", args.model, per_device=False)
    rows = []
    for layers, (m, n) in shapes(args.model):
        fitted, released = fitted_coefficients(m, n), shape_coefficients(m, n)
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            cases = {"gaussian": torch.randn(m, n, generator=g),
                     "rank8+noise": torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g) + 0.1 * torch.randn(m, n, generator=g)}
            for kind, x in cases.items():
                u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
                polar = u @ vh
                row = {"layers": layers, "shape": [m, n], "matrix": kind, "seed": seed, "fitted": list(fitted),
                       "by_shape": list(released),
                       "bf16_muon": distance(newton_schulz(x, BF16_COEFFICIENTS), polar),
                       "bf16_by_shape": distance(newton_schulz(x, released), polar),
                       "bf16_fitted": distance(newton_schulz(x, fitted), polar),
                       "nvfp4_nvfp4_coefficients": distance(newton_schulz(x, NVFP4_COEFFICIENTS, matmul="nvfp4"), polar),
                       "nvfp4_fitted": distance(newton_schulz(x, fitted, matmul="nvfp4"), polar)}
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                write_results(path, rows, model=args.model, seeds=args.seeds, steps=5)


if __name__ == "__main__":
    main()
