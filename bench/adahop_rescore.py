"""Re-score an ``fp4train analyze`` result with the current AdaHOP rule table.

Question: what is AdaHOP's mean relative GEMM error on the captured real tensors when its
strategies come from the *current* ``DEFAULT_RULES`` (which may have been derived from that very
analysis)? The analysis stores every layer's per-GEMM error under each strategy, so this needs
no GPU: each GEMM takes the error of the strategy the rules pick for its majority patterns.

    python bench/adahop_rescore.py bench/results/analyze-60m-enwiki/analysis.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from pathlib import Path

from fp4train.adahop.patterns import GEMM_OPERANDS, Pattern, relative
from fp4train.adahop.strategy import choose


def rescore(analysis: dict) -> dict:
    errs, picks = [], Counter()
    for layer, pats in analysis["patterns"].items():
        maj = {t: Pattern(Counter(p).most_common(1)[0][0]) for t, p in pats.items()}
        for gemm, ((ta, tra), (tb, trb)) in GEMM_OPERANDS.items():
            s = choose(relative(maj[ta], tra), relative(maj[tb], trb))
            picks[s.value] += 1
            errs.append(analysis["gemm_errors"][layer][gemm][f"strategy:{s.value}"])
    mean = statistics.mean(errs)
    table = {m: v for m, v in analysis["mean_relative_error"].items() if m not in ("adahop",)}
    table["adahop (current rules)"] = mean
    return {"source": analysis.get("model"), "strategy_counts": dict(picks), "mean_relative_error": table,
            "mean_sqnr_db": {m: -20 * math.log10(v) for m, v in table.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("analysis", type=Path)
    ap.add_argument("--json", type=Path, help="default: rescored.json beside the analysis")
    args = ap.parse_args(argv)
    res = rescore(json.loads(args.analysis.read_text()))
    print("| method | mean relative error | SQNR dB |\n|---|---:|---:|")
    for m, v in sorted(res["mean_relative_error"].items(), key=lambda kv: kv[1]):
        print(f"| {m} | {v:.4f} | {res['mean_sqnr_db'][m]:.2f} |")
    print(f"strategies picked: {res['strategy_counts']}")
    (args.json or args.analysis.parent / "rescored.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
