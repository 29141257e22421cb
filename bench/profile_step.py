"""Where a training step's GPU time goes, per recipe: the top kernels of one optimizer step.

Question: which kernels make a recipe slower than BF16, and by how much? Sets up the run as
``bench/train_speed.py`` does (its ``setup``: AdaHOP recipes calibrated first on
``--calibration-steps`` BF16 steps of the same synthetic batch), warms up, then records ``--steps`` steps
with ``torch.profiler`` and ranks kernels by total GPU time. BF16 is always profiled first.

    python bench/profile_step.py --model 60m --recipes bf16,mxfp4,nvfp4 --batch-size 32 --seq-len 1024 [--numerics triton]

Prints a table per recipe and writes ``--json`` (default ``bench/results/profile_step-<model>-<gpu>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import fp4train
from fp4train.timing import code_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import setup  # noqa: E402 - the same run as the speeds it explains

ROOT = Path(__file__).resolve().parent.parent


def profile(model_name, recipe_name, batch, seq, steps, warmup, compile_, calib_steps, top, device):
    model, _, step, strategies = setup(model_name, recipe_name, batch, seq, device, calibration_steps=calib_steps)
    fwd = torch.compile(model) if compile_ else model
    for _ in range(warmup):
        step(fwd)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda d: None)
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step(fwd)
        sync(device)
    wall = (time.perf_counter() - t0) / steps
    kern = defaultdict(lambda: [0.0, 0])
    # GPU: kernels by device time; CPU (for testing the script): operators by self CPU time
    for ev in prof.key_averages():
        ms = (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / 1e3 / steps
        if ms > 0 and (not cuda or ev.device_type == torch.autograd.DeviceType.CUDA):
            kern[ev.key[:120]][0] += ms
            kern[ev.key[:120]][1] += ev.count
    if cuda and not kern:  # profiler builds that do not tag kernel events: every event with device time
        for ev in prof.key_averages():
            if ev.self_device_time_total > 0:
                kern[ev.key[:120]][0] += ev.self_device_time_total / 1e3 / steps
                kern[ev.key[:120]][1] += ev.count
    gpu_ms = sum(v[0] for v in kern.values())
    ranked = sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "recipe": recipe_name, "tokens_per_s": batch * seq / wall, "wall_ms_per_step": wall * 1e3, "gpu_kernel_ms_per_step": gpu_ms,
        "kernels_per_step": sum(v[1] for v in kern.values()) / steps, "adahop_strategies": strategies,
        "top": [{"kernel": n, "ms_per_step": ms, "share": ms / gpu_ms, "launches_per_step": c / steps} for n, (ms, c) in ranked],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="60m")
    ap.add_argument("--recipes", default="bf16,mxfp4")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calibration-steps", type=int, default=3, help="AdaHOP: BF16 calibration steps before converting")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--numerics", default=None, choices=["eager", "compiled", "triton"],
                    help="how quantization runs (default: the backend's, as in train_speed - triton on a GPU; the "
                    "default was 'compiled' until 2026-12-01, which profiled Inductor's reference kernels instead)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.numerics is not None:
        fp4train.formats.set_numerics(args.numerics)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    recipes = [r for r in args.recipes.split(",") if r]
    recipes = ["bf16"] + [r for r in recipes if r != "bf16"]  # the baseline, measured first in the same run
    for r in recipes:
        res = profile(args.model, r, args.batch_size, args.seq_len, args.steps, args.warmup, args.compile,
                      args.calibration_steps, args.top, device)
        rows.append(res)
        print(f"\n== {r}: wall {res['wall_ms_per_step']:.1f} ms/step, GPU kernels {res['gpu_kernel_ms_per_step']:.1f} ms/step, "
              f"{res['kernels_per_step']:.0f} launches/step", flush=True)
        for k in res["top"]:
            print(f"  {k['ms_per_step']:8.2f} ms {k['share']:6.1%} x{k['launches_per_step']:<5.0f} {k['kernel'][:100]}", flush=True)
        out = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": code_commit(), "torch": torch.__version__,
               "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "compile": args.compile,
               "numerics": fp4train.formats.numerics(), "results": rows}
        path = args.json or ROOT / "bench/results" / f"profile_step-{args.model}-{gpu.replace(' ', '_')}-{fp4train.formats.numerics()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")  # after every recipe: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
