"""Pick a learning rate at which BF16 is stable across seeds (before comparing recipes).

Question: at a given model, data and token budget, which peak learning rates give a low BF16
validation loss *and* a small seed-to-seed spread? Trains ``--recipe`` (default bf16) for
every lr x seed, several runs per GPU at once, and writes ``lr_sweep.json`` to ``--out``.

    python bench/lr_sweep.py --model 60m --data .data/enwiki --lrs 6e-4,1.5e-3,3e-3 --seeds 0,1 \\
        --max-steps 640 --seq-len 1024 --batch-size 32 --slots 0,0,0,1,1,1 --out runs/lr_sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from fp4train.data import load_splits, load_tokenizer
from fp4train.train import TrainConfig
from fp4train.train.compare import run_parallel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="60m")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--data", default=None)
    ap.add_argument("--lrs", default="6e-4,1.5e-3,3e-3")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--max-steps", type=int, default=640)
    ap.add_argument("--warmup-steps", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=64)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--slots", default="0", help="GPU id per concurrent run, e.g. 0,0,1,1")
    ap.add_argument("--numerics", default="eager", choices=["eager", "compiled", "triton"],
                    help="how quantization runs (same bits): eager, compiled or triton")
    ap.add_argument("--out", default="runs/lr_sweep")
    args = ap.parse_args(argv)
    out = Path(args.out)
    base = TrainConfig(model=args.model, recipe=args.recipe, data=args.data, max_steps=args.max_steps,
                       warmup_steps=args.warmup_steps, seq_len=args.seq_len, batch_size=args.batch_size,
                       eval_every=args.eval_every, eval_batches=args.eval_batches, ckpt_every=0, keep_checkpoints=1,
                       numerics=args.numerics)
    load_splits(base.data, None, load_tokenizer(), verbose=True)  # tokenize once, before the runs share the cache
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    cfgs = {(lr, s): dataclasses.replace(base, lr=lr, seed=s, out=str(out / f"lr{lr:g}-seed{s}")) for lr in lrs for s in seeds}
    run_parallel(cfgs, [int(g) for g in args.slots.split(",")])
    rows = []
    for lr in lrs:
        losses = [json.loads((Path(cfgs[(lr, s)].out) / "summary.json").read_text())["final_val_loss"] for s in seeds]
        spread = (max(losses) - min(losses)) / statistics.mean(losses) * 100
        rows.append({"lr": lr, "val_loss_per_seed": losses, "val_loss_mean": statistics.mean(losses), "seed_spread_pct": spread})
        print(f"lr {lr:g}: val loss {statistics.mean(losses):.4f} (per seed {', '.join(f'{v:.4f}' for v in losses)}), seed spread {spread:.2f}%")
    summ = json.loads((Path(cfgs[(lrs[0], seeds[0])].out) / "summary.json").read_text())
    (out / "lr_sweep.json").write_text(json.dumps({"config": dataclasses.asdict(base), "gpu": summ.get("gpu"),
                                                   "tokens_per_run": summ["tokens"], "results": rows}, indent=1))


if __name__ == "__main__":
    main()
