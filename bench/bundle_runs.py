"""One results file for a folder of training runs: each run's summary, settings and loss curves.

Question: what did these runs measure, with which settings? ``fp4train train`` writes a folder per run
(checkpoints, metrics, settings); the evidence a result needs from it fits in one file, which is what gets
committed (the run folders stay with whoever trained them). ``bench/tables.py`` reads it.

    python bench/bundle_runs.py bench/results/moe-20m-enwiki-short runs runs-compiled

Writes ``<folder>/runs.json``: per run (``<subfolder>/<run>``) its ``summary.json``, ``config.json`` and the
validation and training loss curves of its ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fp4train.train.compare import run_curve  # the curves a comparison's report.json keeps, read the same way


def bundle(folder: Path, subfolders: list[str]) -> dict:
    """The runs under ``folder/<subfolder>/*/`` that finished (have a summary), by ``<subfolder>/<run>``."""
    runs = {}
    for sub in subfolders:
        found = sorted(p.parent for p in (folder / sub).glob("*/summary.json"))
        if not found:
            raise FileNotFoundError(f"no finished run (a */summary.json) under {folder / sub}")
        for run in found:
            runs[f"{sub}/{run.name}"] = {"summary": json.loads((run / "summary.json").read_text()),
                                         "config": json.loads((run / "config.json").read_text()),
                                         "curve": run_curve(run), "train_curve": run_curve(run, "loss")}
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("subfolders", nargs="+", help="the folders of runs inside it (e.g. runs runs-compiled)")
    args = ap.parse_args(argv)
    runs = bundle(args.folder, args.subfolders)
    (args.folder / "runs.json").write_text(json.dumps({"runs": runs}, indent=1))
    print(f"{args.folder / 'runs.json'}: {len(runs)} runs")


if __name__ == "__main__":
    main()
