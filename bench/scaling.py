"""Training on N GPUs against one GPU at the same global batch: the loss curves and the throughput.

Question: does a run spread over N GPUs (``torchrun``, ``--parallel ddp|fsdp``) learn what the one-GPU run learns,
and how much faster is it? Each recipe trains twice through ``fp4train train`` with the same model, data order,
seed, global batch and compile mode (``default``: CUDA graphs do not take the N-GPU run's collectives): once as
one process on the first GPU, once under ``torchrun --nproc-per-node N`` on the first N. Reported per recipe (``one``, ``many``): both runs' ``tokens_per_s`` (the trainer's own figure, over its steady steps) and
their ratio, the largest and the last-ten-steps mean relative difference of the two loss curves, and the two
final validation losses. With ``--gpus 1`` the second run is one process under ``torchrun`` with
``--parallel``: the distributed engine's overhead at world size 1 (FSDP2's all-gather and reduce-scatter still
run, over one process).

    python bench/scaling.py --model 1b --recipes adahop,bf16 --gpus 2 --parallel ddp --data ../shared/data/enwiki

Writes ``bench/results/scaling-<model>-<N>gpu-<device>.json`` (or ``--json``), the run's settings inside; the
runs themselves go to ``--runs`` (their checkpoints and metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import data_label, results_path, write_results


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _train(run: Path, args: list[str], gpus: int, parallel: str | None, log) -> dict:
    """One ``fp4train train`` run on the first ``gpus`` GPUs; its summary."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)] if parallel
              else [sys.executable])
    cmd = launch + ["-m", "fp4train", "train", *args, "--out", str(run), "--overwrite", "--no-progress"]
    cmd += ["--parallel", parallel] if parallel else []
    log(f"scaling: {' '.join(cmd[1:])}")
    with open(run.parent / f"{run.name}.log", "w") as f:
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{run.name} failed (exit {r.returncode}); its output is in {run.parent / (run.name + '.log')}")
    return json.loads((run / "summary.json").read_text())


def compare_runs(one: Path, many: Path) -> dict:
    """How far the N-GPU run's loss curve is from the one-GPU run's."""
    a, b = _losses(one), _losses(many)
    steps = sorted(a.keys() & b.keys())
    rel = [abs(a[s] - b[s]) / abs(a[s]) for s in steps]
    last = rel[-10:]
    return {"steps_compared": len(steps), "loss_rel_diff_max": max(rel), "loss_rel_diff_last10": sum(last) / len(last)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--recipes", default="adahop,bf16")
    ap.add_argument("--gpus", type=int, default=2, help="the N of the N-GPU run")
    ap.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"))
    ap.add_argument("--data", default=None, help="training text (fp4train train --data); default: tinyshakespeare")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16, help="the global batch (split over the N GPUs)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4: at the trainer's 3e-3 a 1b "
                    "model spikes in its first steps, which amplifies any rounding difference between the two runs)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--runs", default="runs/scaling", help="where the runs go")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.batch_size % a.gpus:
        sys.exit(f"--batch-size {a.batch_size} does not split over --gpus {a.gpus}: give a multiple of {a.gpus}")
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    path = Path(a.json) if a.json else results_path("scaling", a.model, f"{a.gpus}gpu")
    common = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--max-steps", str(a.steps),
              "--lr", str(a.lr), "--warmup-steps", str(a.warmup_steps), "--log-every", "1", "--eval-every", "0", "--ckpt-every", "0",
              "--compile-mode", "default"] + (["--data", a.data] if a.data else [])
    settings = {"model": a.model, "gpus": a.gpus, "parallel": a.parallel, "seq_len": a.seq_len, "global_batch": a.batch_size,
                "steps": a.steps, "lr": a.lr, "warmup_steps": a.warmup_steps, "data": data_label(a.data)}
    results = {}
    for recipe in [r.strip() for r in a.recipes.split(",") if r.strip()]:
        args = common + ["--recipe", recipe]
        one_dir, many_dir = runs / f"{recipe}-one", runs / f"{recipe}-{a.gpus}x-{a.parallel}"
        one = _train(one_dir, args, 1, None, print)
        many = _train(many_dir, args, a.gpus, a.parallel, print)
        res = {"one": {k: one[k] for k in ("tokens_per_s", "final_val_loss", "peak_mem_gib")},
               "many": {k: many[k] for k in ("tokens_per_s", "final_val_loss", "peak_mem_gib", "processes")},
               "scaling": many["tokens_per_s"] / one["tokens_per_s"], **compare_runs(one_dir, many_dir)}
        results[recipe] = res
        print(f"scaling: {recipe}: {res['scaling']:.2f}x on {a.gpus} GPUs ({a.parallel}); loss curves within "
              f"{res['loss_rel_diff_max']:.2%} (last 10 steps {res['loss_rel_diff_last10']:.2%})", flush=True)
        write_results(path, results, **settings)
    print(f"scaling: wrote {path}")


if __name__ == "__main__":
    main()
