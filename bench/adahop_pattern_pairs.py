"""AdaHOP's Figure 3 on planted patterns: GEMM error of plain / IHT / OE for every pattern pair.

Question: for each pair of operand outlier patterns relative to a GEMM (inner / outer / none
for A and for B), which strategy gives the lowest relative GEMM error? Operands are Gaussian
with, when planted, ``--n-outliers`` inner channels (inner) or rows (outer) scaled by
``--scale``. Runs on the CPU (reference numerics). Writes ``bench/results/adahop_pattern_pairs.json``
and prints a Markdown table; the real-tensor version of this table comes from ``fp4train analyze``.

    python bench/adahop_pattern_pairs.py [--m 512 --n 512 --k 1024 --scale 50 --seeds 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch

from fp4train.adahop.patterns import Relative
from common import results_path, write_results
from fp4train.adahop.strategy import DEFAULT_K, Strategy, relative_error

RELS = (Relative.NONE, Relative.INNER, Relative.OUTER)


def planted(rows: int, inner: int, rel: Relative, n_out: int, scale: float, g: torch.Generator) -> torch.Tensor:
    t = torch.randn(rows, inner, generator=g)
    if rel is Relative.INNER:
        t[:, torch.randperm(inner, generator=g)[:n_out]] *= scale
    elif rel is Relative.OUTER:
        t[torch.randperm(rows, generator=g)[:n_out]] *= scale
    return t


def measure(m: int, n: int, k: int, n_out: int, scale: float, seeds: int, topk: int) -> list[dict]:
    rows = []
    for ra, rb in itertools.product(RELS, RELS):
        errs = {s: [] for s in Strategy}
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            a = planted(m, k, ra, n_out, scale, g)
            b = planted(n, k, rb, n_out, scale, g)
            for s in Strategy:
                errs[s].append(relative_error(a, b, s, ra, rb, topk))
        mean = {s.value: statistics.mean(v) for s, v in errs.items()}
        best = min(mean, key=mean.get)
        rows.append({"a": ra.value, "b": rb.value, **{f"err_{s}": v for s, v in mean.items()}, "best": best,
                     "iht_improvement_pct": (1 - mean["iht"] / mean["plain"]) * 100,
                     "oe_improvement_pct": (1 - mean["oe"] / mean["plain"]) * 100})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| A pattern | B pattern | plain | IHT | OE | IHT vs plain | OE vs plain | best |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['a']} | {r['b']} | {r['err_plain']:.4f} | {r['err_iht']:.4f} | {r['err_oe']:.4f} | "
                   f"{r['iht_improvement_pct']:+.1f}% | {r['oe_improvement_pct']:+.1f}% | **{r['best']}** |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n-outliers", type=int, default=4)
    ap.add_argument("--scale", type=float, default=50.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--topk", type=int, default=DEFAULT_K)
    ap.add_argument("--json", type=Path, default=results_path("adahop_pattern_pairs", per_device=False))
    args = ap.parse_args(argv)
    rows = measure(args.m, args.n, args.k, args.n_outliers, args.scale, args.seeds, args.topk)
    print(markdown(rows))
    write_results(args.json, rows, **{k: v for k, v in vars(args).items() if k != "json"})


if __name__ == "__main__":
    main()
