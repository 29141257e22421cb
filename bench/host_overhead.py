"""Host (CPU) time of one training step per recipe, and where it goes.

Question: the 1b step of tib2d and AdaHOP on the H200 is slower than BF16 although their GPU kernels take
no longer than BF16's (`docs/fast_path.md`) - how much host time does a step cost, and which Python
functions spend it? The run is that of ``bench/train_speed.py`` (its ``setup``), at a batch so small
(``--batch-size 1 --seq-len 128`` by default) that the GPU finishes each kernel before the host has
launched the next: the step's wall time is then its host time. Each recipe is timed over ``--steps``
steps (median, wall clock, synchronised), then ``--profile-steps`` steps run under ``cProfile``; the
functions that spend the most time themselves (``tottime``) and in total (``cumtime``) are recorded per
step. BF16 is measured first, in the same run.

    python bench/host_overhead.py --model 1b --recipes bf16,tib2d,adahop,mxfp4 [--compile]

Writes ``--json`` (default ``bench/results/host_overhead-<model>-<gpu>.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from fp4train.timing import code_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import setup  # noqa: E402 - the same run as the speeds it explains

ROOT = Path(__file__).resolve().parent.parent


def _where(key) -> str:
    """``file:line(function)`` with the path shortened to what follows site-packages or the repo."""
    file, line, fn = key
    for cut in ("site-packages/", str(ROOT) + "/"):
        if cut in file:
            file = file.split(cut, 1)[1]
    return f"{file}:{line}({fn})"


def _top(stats: pstats.Stats, field: int, n: int, steps: int) -> list[dict]:
    """The ``n`` functions with the largest ``field`` (2: tottime, 3: cumtime), in ms per step."""
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][field], reverse=True)[:n]
    return [{"function": _where(k), "calls_per_step": v[1] / steps, "tottime_ms": 1e3 * v[2] / steps,
             "cumtime_ms": 1e3 * v[3] / steps} for k, v in rows]


def measure(args, recipe: str, device) -> dict:
    run = setup(args.model, recipe, args.batch_size, args.seq_len, device)
    fwd = torch.compile(run.model) if args.compile else run.model
    for _ in range(args.warmup):
        run.step(fwd)
    torch.cuda.synchronize()
    walls, enqueue = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run.step(fwd)
        t1 = time.perf_counter()  # the host has launched the whole step
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        enqueue.append(t1 - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_steps):
        run.step(fwd)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    out = {"recipe": recipe, "wall_ms_per_step": 1e3 * statistics.median(walls),
           "enqueue_ms_per_step": 1e3 * statistics.median(enqueue),
           "profiled_ms_per_step": 1e3 * stats.total_tt / args.profile_steps,
           "top_tottime": _top(stats, 2, args.top, args.profile_steps),
           "top_cumtime": _top(stats, 3, args.top, args.profile_steps)}
    del run, fwd
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--recipes", default="bf16,tib2d,adahop,mxfp4")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead needs a CUDA GPU (its question is the host time beside a GPU's)")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    path = args.json or ROOT / "bench/results" / f"host_overhead-{args.model}-{gpu.replace(' ', '_')}.json"
    out = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": code_commit() or "unknown",
           "torch": torch.__version__, "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
           "compile": args.compile, "results": []}
    recipes = ["bf16"] + [r for r in args.recipes.split(",") if r != "bf16"]
    for recipe in recipes:
        try:
            r = measure(args, recipe, device)
        except Exception as e:  # noqa: BLE001 - recorded, the other recipes still run
            r = {"recipe": recipe, "error": repr(e)[:300]}
        out["results"].append(r)
        path.write_text(json.dumps(out, indent=1) + "\n")
        if "error" in r:
            print(f"{recipe}: {r['error']}", flush=True)
            continue
        print(f"{recipe:>8}: wall {r['wall_ms_per_step']:7.1f} ms/step, host enqueue {r['enqueue_ms_per_step']:7.1f} ms, "
              f"under cProfile {r['profiled_ms_per_step']:7.1f} ms", flush=True)
        for f in r["top_tottime"][:12]:
            print(f"      {f['tottime_ms']:7.2f} ms self {f['cumtime_ms']:7.2f} ms total {f['calls_per_step']:7.0f} calls  "
                  f"{f['function'][:110]}", flush=True)


if __name__ == "__main__":
    main()
