"""One summary of the speed benchmarks, and issue #5's targets checked against it.

Question: where does the fast path stand against BF16 on this GPU, in one file? Reads the JSON
results the benchmark scripts wrote (``train_speed`` end to end at 1b/3b, ``gemm_speed``,
``linear_speed``, ``quantize_speed``) and writes ``bench/results/summary.json``::

    {"gpu", "date", "commit", "e2e": {model: {recipe: {"tokens_per_s", "peak_mem_gib"}}},
     "gemm", "linear", "quantize", "targets": [...]}

Each target names the measured figure, the goal, whether it is met and, if not, by how much it
falls short (``measured / goal - 1``). Missing inputs leave their targets out ("not measured")
rather than guessing.

    python bench/summary.py --e2e bench/results/train_speed-1b-*.json bench/results/train_speed-3b-*.json \\
        --gemm bench/results/gemm_speed-NVIDIA_H200.json --linear OLDER.json NEWER.json \\
        --quantize bench/results/quantize_speed-NVIDIA_H200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAST_RECIPES = ("adahop", "tib2d")  # the end-to-end targets are set for these
E2E_GOAL = {"1b": 1.15, "3b": 1.25}
PEER = "torchao_fp8_rowwise"


def _load(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths or []]


def _target(name: str, measured: float | None, goal: float, *, at_least: bool = True, note: str = "",
            verdict: bool = True) -> dict:
    """One target: its figure against its goal, met or by how much not. ``verdict=False``: the figure with no verdict
    (``met`` None; ``note`` says why, e.g. a comparison that is not like for like)."""
    if measured is None:
        return {"target": name, "goal": goal, "measured": None, "met": None, "note": "not measured" + (f"; {note}" if note else "")}
    if not verdict:
        return {"target": name, "goal": goal, "measured": measured, "met": None, "note": note}
    met = measured >= goal if at_least else measured <= goal
    t = {"target": name, "goal": goal, "measured": measured, "met": met}
    if not met:
        t["short_by_pct"] = (measured / goal - 1) * 100
    if note:
        t["note"] = note
    return t


def e2e_table(runs: list[dict]) -> dict:
    """{model: {recipe: {"tokens_per_s", "peak_mem_gib", "speedup_vs_bf16", "commit"}}}. A model may come
    from several runs (the recipes split over two GPUs or two calls); each recipe's speedup is then
    against the BF16 baseline of its own run, and a later run's entry replaces an earlier one's."""
    table: dict = {}
    for run in runs:
        m = table.setdefault(run["model"], {})
        bf16 = next((r for r in run["results"] if r["recipe"] == "bf16" and "error" not in r), None)
        # a run compiled with CUDA graphs (train_speed --compile-mode reduce-overhead) has entries of its own,
        # "<recipe>+cudagraphs", each against the BF16 of that run
        tag = "+cudagraphs" if run.get("compile_mode") == "reduce-overhead" else ""
        for r in run["results"]:
            if "error" in r:
                m[r["recipe"] + tag] = {"error": r["error"], "commit": run.get("commit")}
                continue
            m[r["recipe"] + tag] = {"tokens_per_s": r["tokens_per_s"], "peak_mem_gib": r.get("peak_mem_gib"),
                              "speedup_vs_bf16": r["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None,
                              "bf16_peak_mem_gib": bf16.get("peak_mem_gib") if bf16 else None, "commit": run.get("commit")}
    return table


def merge_linear(runs: list[dict]) -> dict | None:
    """Several ``linear_speed`` runs as one: rows by (model, layer, tokens); a later run's variant replaces an
    earlier one's (a rerun of some variants after a kernel change). Each variant keeps the speedup over the BF16
    of its own run, and says which run (``commit``, ``bf16_ms``)."""
    if not runs:
        return None
    if len({run["gpu"] for run in runs}) > 1:
        raise SystemExit(f"bench/summary.py: linear runs from different GPUs {sorted({run['gpu'] for run in runs})}")
    rows: dict = {}
    for run in runs:
        for r in run["results"]:
            row = rows.setdefault((r["model"], r["layer"], r.get("tokens")), {**r, "variants": {}})
            for name, v in r["variants"].items():
                row["variants"][name] = {**v, "commit": run.get("commit"), "bf16_ms": r.get("bf16_ms")}
    return {**runs[-1], "results": list(rows.values()), "commits": [run.get("commit") for run in runs]}


def build(e2e: list[dict], gemm: dict | None, linear: dict | None, quantize: dict | None) -> dict:
    first = next(iter(e2e), None) or gemm or linear or quantize
    if first is None:
        raise SystemExit("bench/summary.py: no benchmark results given (see --help)")
    sources = [d for d in (*e2e, gemm, linear, quantize) if d]
    gpus = {d["gpu"] for d in sources}
    if len(gpus) > 1:
        raise SystemExit(f"bench/summary.py: results from different GPUs {sorted(gpus)}; summarize one GPU at a time")
    commits = sorted({c or "unknown" for d in sources for c in d.get("commits", [d.get("commit")])})  # merged runs: all
    out = {"gpu": first["gpu"], "date": max(d["date"] for d in sources), "commit": commits[0] if len(commits) == 1 else commits,
           "e2e": e2e_table(e2e), "gemm": gemm["results"] if gemm else None, "linear": linear["results"] if linear else None,
           "quantize": quantize["results"] if quantize else None, "targets": []}
    targets = out["targets"]

    if quantize:
        res = quantize["results"]
        for name, r in res.items():
            if name.startswith("triton") and "fraction_of_copy" in r:
                targets.append(_target(f"quantize {name}: fraction of copy bandwidth", r["fraction_of_copy"], 0.60))
    else:
        targets.append(_target("quantize kernels: fraction of copy bandwidth", None, 0.60))

    square = next((r for r in gemm["results"] if r["layer"] == "8192^3"), None) if gemm else None
    targets.append(_target("FP4 GEMM at 8192^3 vs cuBLAS BF16", square and square["speedup_vs_bf16"], 1.4))

    if linear:
        rows8b = [r for r in linear["results"] if r["model"].lower() == "llama-3-8b"]
        variants = sorted({v for r in rows8b for v in r["variants"]})
        for v in variants:
            sp = [r["variants"][v]["speedup_vs_bf16"] for r in rows8b if v in r["variants"]]
            targets.append(_target(f"linear fwd+bwd at the Llama-3-8B shapes, {v}: speedup vs BF16 (geometric mean)",
                                   statistics.geometric_mean(sp), 1.25))
            saved = [r["bf16_saved_bytes"] / r["variants"][v]["saved_bytes"] for r in rows8b
                     if v in r["variants"] and r["variants"][v]["saved_bytes"]]
            targets.append(_target(f"saved activation bytes, {v}: BF16 / quantized (min over the 8B shapes)",
                                   min(saved) if saved else None, 3.5))
    else:
        targets.append(_target("linear fwd+bwd at the Llama-3-8B shapes vs BF16", None, 1.25))

    for model, goal in E2E_GOAL.items():
        table = out["e2e"].get(model, {})
        # each recipe as compiled by default, and with CUDA graphs where a run measured that (+cudagraphs)
        for recipe in [r for base in FAST_RECIPES for r in (base, base + "+cudagraphs") if r == base or r in table]:
            r = table.get(recipe, {})
            speed = r.get("speedup_vs_bf16")  # against the BF16 of the recipe's own run
            targets.append(_target(f"end to end {model}, {recipe}: tokens/s vs BF16", speed, goal, note=r.get("error", "")))
            # the peer in the same mode where measured; a figure in CUDA graphs against torchao compiled by default is
            # not like for like, and the target says so
            _, plus, mode = recipe.partition("+")
            tag = plus + mode  # "" or "+cudagraphs"
            peer, unlike = (table[PEER + tag], False) if PEER + tag in table else (table.get(PEER, {}), bool(tag))
            vs_peer = speed / peer["speedup_vs_bf16"] if speed and peer.get("speedup_vs_bf16") else None  # each over its run's BF16
            note = (peer.get("error", "") if vs_peer is None else
                    f"not like for like: {PEER} was not run in CUDA graphs; against its run compiled by default" if unlike else "")
            targets.append(_target(f"end to end {model}, {recipe}: tokens/s vs {PEER}", vs_peer, 1.0, note=note, verdict=not unlike))
            mem = r["bf16_peak_mem_gib"] / r["peak_mem_gib"] if r.get("peak_mem_gib") and r.get("bf16_peak_mem_gib") else None
            note = ""
            if mem is not None and (fixed := optimizer_state_gib(model)) is not None:
                above = (r["bf16_peak_mem_gib"] - fixed) / (r["peak_mem_gib"] - fixed)
                note = (f"above the {fixed:.1f} GiB of FP32 weights, gradients and AdamW states (16 B/parameter, the same "
                        f"in every recipe): {above:.2f}x")
            targets.append(_target(f"end to end {model}, {recipe}: peak memory BF16 / recipe (same batch)", mem, 1.3, note=note))
    return out


def optimizer_state_gib(model: str) -> float | None:
    """GiB of the FP32 weights, gradients and two AdamW moments of ``model`` (16 bytes per parameter):
    the part of a training step's peak memory that no recipe changes. None for an unknown model."""
    import torch

    from fp4train import models

    try:
        with torch.device("meta"):
            m = models.build(model)
    except (KeyError, ValueError):
        return None
    return sum(p.numel() for p in m.parameters()) * 16 / 2**30


def markdown(summary: dict) -> str:
    """The targets as a table for the README / docs."""
    lines = [f"Targets of issue #5 on {summary['gpu']} ({summary['date']}, commit {summary['commit']}):", "",
             "| target | goal | measured | met |", "|---|---:|---:|---|"]
    for t in summary["targets"]:
        meas = "—" if t["measured"] is None else f"{t['measured']:.2f}"
        if t["met"] is None:  # no verdict: nothing measured, or a figure that is not like for like (its note says why)
            met = "not measured" if t["measured"] is None else "not like for like"
        else:
            met = "yes" if t["met"] else f"no ({t['short_by_pct']:+.0f}%)"
        lines.append(f"| {t['target']} | {t['goal']:.2f} | {meas} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--e2e", nargs="*", default=[], help="train_speed JSON files (the 1b and 3b runs)")
    ap.add_argument("--gemm", help="gemm_speed JSON")
    ap.add_argument("--linear", nargs="*", default=[], help="linear_speed JSON files (later runs' variants win)")
    ap.add_argument("--quantize", help="quantize_speed JSON")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/summary.json")
    args = ap.parse_args(argv)
    one = lambda p: json.loads(Path(p).read_text()) if p else None  # noqa: E731
    summary = build(_load(args.e2e), one(args.gemm), merge_linear(_load(args.linear)), one(args.quantize))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))


if __name__ == "__main__":
    main()
