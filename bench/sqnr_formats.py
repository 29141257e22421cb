"""SQNR (dB) of every format x scale rule x rounding on three input distributions.

Question: how much signal does each quantization keep, and on what kind of tensor?
Runs on the CPU (reference numerics; no timing). Prints a Markdown table, writes
``bench/results/sqnr_formats.json`` and, with ``--update-docs``, refreshes the table in
``docs/formats.md`` between its markers.

    python bench/sqnr_formats.py [--rows 2048 --cols 2048 --seed 0] [--update-docs]

SQNR = 10 log10(sum x^2 / sum (x - q(x))^2), blocks along the last dim (the GEMM's inner
dim). Distributions: ``gaussian`` N(0, 1); ``student_t`` Student-t with 3 degrees of freedom
(heavy tails); ``outlier_channels`` N(0, 1) with 1% of columns (channels) scaled by 50, as
in LLM activations. The ``+ H32`` rows apply a block-32 Hadamard before quantizing and its
inverse after (the error a GEMM with an inner Hadamard transform sees).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import ROOT, results_path, write_results
from fp4train import hadamard, quantize

# (label, format, kwargs, hadamard block or None)
VARIANTS = [
    ("mxfp4 1x32 floor", "mxfp4", dict(scale="floor"), None),
    ("mxfp4 1x32 ceil", "mxfp4", dict(scale="ceil"), None),
    ("mxfp4 32x32 floor", "mxfp4", dict(scale="floor", block=(32, 32)), None),
    ("mxfp4 32x32 ceil", "mxfp4", dict(scale="ceil", block=(32, 32)), None),
    ("mxfp4 1x32 floor + H32", "mxfp4", dict(scale="floor"), 32),
    ("mxfp4 1x32 ceil + H32", "mxfp4", dict(scale="ceil"), 32),
    ("nvfp4 1x16", "nvfp4", {}, None),
    ("nvfp4 1x16 4/6", "nvfp4", dict(four_over_six=True), None),
    ("nvfp4 16x16", "nvfp4", dict(block=(16, 16)), None),
    ("nvfp4 1x16 + H16", "nvfp4", {}, 16),
    ("mxfp8 1x32 floor", "mxfp8", dict(scale="floor"), None),
    ("mxfp8 1x32 ceil", "mxfp8", dict(scale="ceil"), None),
    ("fp8 rowwise", "fp8", {}, None),
]
ROUNDINGS = ("nearest", "stochastic")
DISTRIBUTIONS = ("gaussian", "student_t", "outlier_channels")


def make_input(dist: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "gaussian":
        return torch.randn(rows, cols, generator=g)
    if dist == "student_t":
        z = torch.randn(rows, cols, generator=g)
        chi2 = torch.randn(3, rows, cols, generator=g).pow(2).sum(0)  # chi-squared, 3 dof
        return z / (chi2 / 3).sqrt()
    if dist == "outlier_channels":
        x = torch.randn(rows, cols, generator=g)
        idx = torch.randperm(cols, generator=g)[: max(1, cols // 100)]
        x[:, idx] *= 50.0
        return x
    raise ValueError(dist)


def sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - q).pow(2).sum()))


def measure(rows: int, cols: int, seed: int) -> list[dict]:
    results = []
    inputs = {d: make_input(d, rows, cols, seed) for d in DISTRIBUTIONS}
    for label, fmt, kw, hb in VARIANTS:
        for rounding in ROUNDINGS:
            row = {"variant": label, "format": fmt, "rounding": rounding, **{k: str(v) for k, v in kw.items()}}
            for d, x in inputs.items():
                xt = hadamard(x, hb) if hb else x
                q = quantize(xt, fmt, rounding=rounding, seed=seed, **kw).dequantize()
                back = hadamard(q, hb, inverse=True) if hb else q
                row[d] = round(sqnr_db(x, back), 2)
            results.append(row)
    return results


def markdown(results: list[dict]) -> str:
    head = "| variant | rounding | " + " | ".join(DISTRIBUTIONS) + " |"
    sep = "|---|---|" + "---:|" * len(DISTRIBUTIONS)
    lines = [head, sep]
    for r in results:
        lines.append(f"| {r['variant']} | {r['rounding']} | " + " | ".join(f"{r[d]:.2f}" for d in DISTRIBUTIONS) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=results_path("sqnr_formats", per_device=False))
    ap.add_argument("--update-docs", action="store_true", help="rewrite the table in docs/formats.md")
    args = ap.parse_args(argv)

    results = measure(args.rows, args.cols, args.seed)
    table = markdown(results)
    print(table)
    out = write_results(args.json, results, shape=[args.rows, args.cols], seed=args.seed)
    if args.update_docs:
        from tables import replace_blocks  # bench/tables.py: the docs' generated blocks

        doc = ROOT / "docs/formats.md"
        text = doc.read_text()
        if "<!-- table:sqnr -->" not in text:
            raise SystemExit("docs/formats.md has no <!-- table:sqnr --> ... <!-- /table --> markers")
        body = (f"_Produced by `python bench/sqnr_formats.py --update-docs` ({args.rows}x{args.cols}, seed {args.seed}, "
                f"{out['date']}, torch {out['torch']})._\n\n{table}")
        doc.write_text(replace_blocks(text, {"sqnr": body}))


if __name__ == "__main__":
    main()
