"""Each recipe's gap to BF16 against model size, from several finished comparisons (``fp4train compare --across``).

Every folder is one :func:`~fp4train.train.compare.compare` (its ``report.json``), at one model size; the sizes
are the BF16 runs' parameter counts. The report (``across_sizes.md``, ``.json``, ``gap_vs_size.png`` in ``out``) gives
per recipe and size the mean gap with its 95% interval (paired over seeds, as each comparison computed it), a
sentence on the trend - the gap at the largest size against the smallest: it grows or shrinks only where the two
intervals do not overlap, else it holds within the noise - and whether the recipes rank the same at every size.
"""

from __future__ import annotations

import json
from pathlib import Path

from .compare import BASELINE, REORDERED
from .run_dir import write_text


def _load(folder: Path) -> dict:
    f = folder / "report.json"
    if not f.is_file():
        raise ValueError(f"--across {folder}: no report.json (a finished fp4train compare folder has one)")
    rep = json.loads(f.read_text())
    params = {r["params"] for r in rep.get("runs", []) if r.get("recipe") == BASELINE and r.get("params")}
    if len(params) != 1:
        raise ValueError(f"--across {folder}: its report names no single BF16 parameter count (re-run fp4train compare "
                         "there to refresh it)")
    return {"folder": str(folder), "model": rep["model"], "params": params.pop(), "tokens": rep["tokens_per_run"],
            "seeds": rep["seeds"], "recipes": rep["recipes"]}


def _trend(points: list[dict]) -> str:
    """The gap at the largest size against the smallest (``points`` by size, each with ``mean`` and ``ci95``)."""
    if len(points) < 2:
        return "measured at one size only"
    first, last = points[0], points[-1]
    if first["ci95"] is None or last["ci95"] is None:
        return "no interval at one of the ends (one seed): no trend can be read"
    if last["ci95"][0] > first["ci95"][1]:
        return f"grows ({first['mean']:+.2f}% → {last['mean']:+.2f}%, the intervals apart)"
    if last["ci95"][1] < first["ci95"][0]:
        return f"shrinks ({first['mean']:+.2f}% → {last['mean']:+.2f}%, the intervals apart)"
    return f"holds within the noise ({first['mean']:+.2f}% → {last['mean']:+.2f}%, the intervals overlap)"


def size_report(folders: list[str | Path], out: str | Path) -> dict:
    """Read the comparisons in ``folders`` (two or more sizes) and write the report to ``out``; returns it."""
    if len(folders) < 2:
        raise ValueError("--across takes two or more comparison folders (one per model size), comma-separated")
    sizes = sorted((_load(Path(f)) for f in folders), key=lambda s: s["params"])
    recipes = [r for s in sizes for r in s["recipes"] if r not in (BASELINE, REORDERED)]
    recipes = list(dict.fromkeys(recipes))
    table = {}
    for r in recipes:
        pts = [{"model": s["model"], "params": s["params"], "mean": x["gap_pct_mean"], "ci95": x.get("gap_pct_ci95"),
                "baseline": x.get("baseline", BASELINE)} for s in sizes if (x := s["recipes"].get(r))]
        table[r] = {"points": pts, "trend": _trend(pts)}
    ranks = {s["model"]: sorted((r for r in recipes if r in s["recipes"]), key=lambda r: s["recipes"][r]["gap_pct_mean"])
             for s in sizes}
    common = [r for r in recipes if all(r in s["recipes"] for s in sizes)]
    orders = {m: [r for r in order if r in common] for m, order in ranks.items()}
    same = len({tuple(o) for o in orders.values()}) == 1
    rep = {"sizes": [{k: s[k] for k in ("folder", "model", "params", "tokens", "seeds")} for s in sizes], "recipes": table,
           "ranking": ranks, "same_ranking": same}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "across_sizes.json", json.dumps(rep, indent=1))
    write_text(out / "across_sizes.md", _markdown(rep))
    _plot(out / "gap_vs_size.png", rep)
    return rep


def _markdown(rep: dict) -> str:
    sizes = rep["sizes"]
    head = " | ".join(f"{s['model']} ({s['params'] / 1e6:.1f}M, {s['tokens'] / 1e6:.1f}M tokens, {len(s['seeds'])} seeds)"
                      for s in sizes)
    lines = ["# Gap to BF16 against model size", "",
             "Each cell: the mean gap of the validation loss to the recipe's BF16 baseline over the seeds, % (its 95% "
             "interval, paired over seeds); the trend sets the largest size against the smallest.", "",
             f"| recipe | {head} | trend |", "|---|" + "---:|" * len(sizes) + "---|"]
    for r, x in rep["recipes"].items():
        by = {p["model"]: p for p in x["points"]}
        cells = []
        for s in sizes:
            p = by.get(s["model"])
            ci = f" [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}]" if p and p["ci95"] else ""
            cells.append(f"{p['mean']:+.2f}{ci}" if p else "—")
        lines.append(f"| {r} | {' | '.join(cells)} | {x['trend']} |")
    ratios = [s["tokens"] / s["params"] for s in sizes]
    lines += ["", "Ranking (smallest gap first): " + "; ".join(f"{m}: {', '.join(o)}" for m, o in rep["ranking"].items()) + ".",
              "The recipes measured at every size rank " + ("the same at every size." if rep["same_ranking"] else
                                                             "differently across sizes (where two recipes' intervals "
                                                             "overlap, their order is within the noise)."),
              "Tokens per parameter: " + ", ".join(f"{s['model']} {r:.2f}" for s, r in zip(sizes, ratios))
              + (". The budgets differ by more than 2x between sizes, so a trend here mixes model size with training "
                 "budget." if max(ratios) > 2 * min(ratios) else ".")]
    return "\n".join(lines) + "\n"


def _plot(path: Path, rep: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, x in rep["recipes"].items():
        pts = x["points"]
        xs, ys = [p["params"] for p in pts], [p["mean"] for p in pts]
        err = [[p["mean"] - p["ci95"][0] if p["ci95"] else 0 for p in pts], [p["ci95"][1] - p["mean"] if p["ci95"] else 0 for p in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=r)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("gap of the validation loss to BF16, %")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
