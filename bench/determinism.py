"""Does one seed, trained twice with ``--deterministic``, give the same loss bits at every step - and what does it cost?

Each recipe trains three times through the trainer with the same config and seed: twice with
``deterministic=True`` and once without. The two deterministic runs must agree exactly on every step's
training loss and on the final validation loss; the third shows how far the default (atomic
reductions, autotuned kernels) drifts from them. Speed is the trainer's ``tokens_per_s`` (median steady step),
deterministic against default in the same call.

    python bench/determinism.py --model 20m --data ../shared/data/enwiki --recipes bf16,fullstack --steps 60

Writes ``bench/results/determinism-<model>-<device>.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from common import data_label, results_path, write_results

from fp4train.train import TrainConfig, Trainer


def losses(run: Path) -> list[tuple[int, float]]:
    """Every logged step's training loss (``log_every=1``: every step)."""
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def train_once(recipe: str, deterministic: bool, out: Path, args) -> dict:
    cfg = TrainConfig(model=args.model, recipe=recipe, data=args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                      max_steps=args.steps, warmup_steps=min(10, args.steps), lr=args.lr, eval_every=0, eval_batches=4,
                      log_every=1, ckpt_every=0, out=str(out), progress=False, tensorboard=False, seed=args.seed,
                      deterministic=deterministic)
    s = Trainer(cfg, log=lambda m: print(f"  [{recipe} det={deterministic}] {m}", flush=True), checkpoints=False).run()
    torch._dynamo.reset()
    return {"summary": s, "losses": losses(out)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipes", default="bf16")
    ap.add_argument("--data", default=None)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    path = args.json or results_path("determinism", args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in [r for r in args.recipes.split(",") if r]:
            try:
                a = train_once(recipe, True, Path(tmp) / f"{recipe}-det-a", args)
                b = train_once(recipe, True, Path(tmp) / f"{recipe}-det-b", args)
                c = train_once(recipe, False, Path(tmp) / f"{recipe}-default", args)
            except Exception as e:  # noqa: BLE001 - an op without a deterministic kernel is a result here
                import traceback

                rows.append({"recipe": recipe, "error": f"{type(e).__name__}: {e}"[:500],
                             "traceback": traceback.format_exc().splitlines()[-16:]})
                print(f"{args.model} {recipe}: FAILED - {rows[-1]['error']}", flush=True)
                torch._dynamo.reset()
                continue
            same = [x == y for x, y in zip(a["losses"], b["losses"])]
            drift = [abs(x[1] - y[1]) for x, y in zip(a["losses"], c["losses"])]
            row = {"recipe": recipe, "steps": len(a["losses"]),
                   "deterministic_repeat_identical_steps": sum(same),
                   "deterministic_repeat_identical": all(same) and len(a["losses"]) == len(b["losses"]) == args.steps
                   and a["summary"]["final_val_loss"] == b["summary"]["final_val_loss"],
                   "first_differing_step": next((x[0] for x, ok in zip(a["losses"], same) if not ok), None),
                   "final_val_loss": [a["summary"]["final_val_loss"], b["summary"]["final_val_loss"], c["summary"]["final_val_loss"]],
                   "default_vs_deterministic_max_loss_diff": max(drift) if drift else None,
                   "default_vs_deterministic_first_differing_step": next((x[0] for x, y in zip(a["losses"], c["losses"]) if x != y), None),
                   "tokens_per_s_deterministic": a["summary"]["tokens_per_s"], "tokens_per_s_default": c["summary"]["tokens_per_s"]}
            if row["tokens_per_s_deterministic"] and row["tokens_per_s_default"]:
                row["deterministic_speed_ratio"] = row["tokens_per_s_deterministic"] / row["tokens_per_s_default"]
            rows.append(row)
            print(f"{args.model} {recipe}: deterministic repeat identical at {row['deterministic_repeat_identical_steps']}/"
                  f"{row['steps']} steps; default run's largest loss difference {row['default_vs_deterministic_max_loss_diff']}; "
                  f"speed x{row.get('deterministic_speed_ratio', float('nan')):.3f} of default", flush=True)
            write_results(path, rows, model=args.model, data=data_label(args.data), seq_len=args.seq_len,
                          batch_size=args.batch_size, steps=args.steps, lr=args.lr, seed=args.seed)


if __name__ == "__main__":
    main()
