"""Newton-Schulz coefficients for NVFP4 products, fitted per aspect ratio of the presets' hidden matrices.

Question: which per-step (a, b, c) take the native NVFP4 iteration (every product's operands NVFP4) nearest the
orthogonal factor? For one shape of each aspect ratio (max/min) among the presets' hidden matrices, this runs
:func:`fp4train.optim.nvfp4_ns_fit.fit` (the quantized iteration in the loop, Gaussian, rank-8-plus-noise and
power-law matrices, scored against BF16 Muon on the same matrices; deterministic; each search also starts
from the shapes fitted before it) and writes the table to
``bench/results/ns_coefficients.json``; :data:`fp4train.optim.ns_coefficients.NVFP4_TABLE` is that table
(``tests/test_optim.py`` checks they agree). ``bench/root_orthogonality.py`` measures the result on every shape.
A few minutes per shape on the CPU; ``--shapes`` fits others.

    python bench/ns_coefficients.py [--shapes 384x384,256x512]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import results_path, write_results
from fp4train.models import PRESETS
from fp4train.optim.nvfp4_ns_fit import PROXY, fit
from root_orthogonality import shapes


def by_aspect_ratio() -> list[tuple[int, int]]:
    """One hidden-matrix shape (smaller side first) per aspect ratio among the presets: the first with both sides
    at least twice the fit's :data:`PROXY` (so that the fit's larger rank-8 matrix is in), else the largest."""
    found: dict[float, list[tuple[int, int]]] = {}
    for model in PRESETS:
        for _, (m, n) in shapes(model):
            lo, hi = min(m, n), max(m, n)
            found.setdefault(round(hi / lo, 2), []).append((lo, hi))
    out = []
    for _, cands in sorted(found.items()):
        cands = sorted(set(cands))
        big = [c for c in cands if c[0] >= 2 * PROXY]
        out.append(big[0] if big else cands[-1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help="comma-separated MxN (default: one per aspect ratio of the presets)")
    ap.add_argument("--json", type=Path, default=results_path("ns_coefficients", per_device=False))
    args = ap.parse_args(argv)
    todo = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else by_aspect_ratio())
    rows = []
    for m, n in todo:  # each search also starts from the shapes fitted before it (the best-scoring start is taken)
        t = time.perf_counter()
        coefficients = fit(m, n, starts=[r["coefficients"] for r in rows])
        rows.append({"shape": [m, n], "aspect_ratio": round(max(m, n) / min(m, n), 3),
                     "coefficients": [list(c) for c in coefficients], "seconds": round(time.perf_counter() - t, 1)})
        print(f"{m}x{n}: {coefficients} ({rows[-1]['seconds']} s)", flush=True)
        write_results(args.json, rows, steps=5, proxy=PROXY)


if __name__ == "__main__":
    main()
