"""Where one training step's GPU time goes, per recipe: GEMMs against the preparation of their operands.

Question: how far is a recipe from the speed of its GEMMs, and which kernels hold it there? Each recipe runs
through the trainer itself (its data, its conversion, AdaHOP's calibration steps, the optimizer), compiled in
``default`` mode (no CUDA graphs, so that every kernel is visible to the profiler); after ``--warmup`` steps
(compilation, autotuning) ``torch.profiler`` records ``--steps`` steps, and every GPU kernel is put in one class:

* ``gemm``: the tensor-core GEMMs (cuBLAS/cuBLASLt ``nvjet``/``sm90``/``cutlass`` kernels, ``scaled_mm``);
* ``attention``: flash/efficient attention (or fp4train's NVFP4 attention kernels);
* ``optimizer``: the optimizer's step (fused/foreach Adam, multi-tensor kernels);
* ``other``: everything else - quantization, transforms, decodes, casts, scale products, norms, activations.

A BF16 step's ``other`` is what any step costs besides GEMMs and attention; a quantized recipe's ``other``
above that is the price of preparing its operands. Reports per recipe the milliseconds per step of each class
and the top kernels (name, milliseconds and calls per step), and, timed with CUDA events over as many unprofiled steps,
the step's wall time and the optimizer step's share of it.

    python bench/profile_step.py --model 1b --seq-len 2048 --batch-size 8 --data ../shared/data/enwiki \\
        --recipes bf16,fp8_rowwise,mxfp4,nvfp4,tib2d,adahop

Writes ``bench/results/profile_step-<model>-<device>.json`` (or ``--json``), the run's settings inside.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from common import data_label, kernel_times, results_path, write_results

import fp4train
from fp4train.train import TrainConfig, Trainer

CLASSES = (
    ("gemm", re.compile(r"nvjet|gemm|sm90_xmma|sm80_xmma|cutlass|scaled_mm|Kernel2|cublas", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|_attn_", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor|FusedOpti|_adam|adamw", re.IGNORECASE)),  # not Inductor's triton_*_fused_* kernels
)


def kernel_class(name: str) -> str:
    """The class of a GPU kernel's name (see the module docstring)."""
    return next((c for c, pat in CLASSES if pat.search(name)), "other")


def _timed_steps(t, steps: int) -> tuple[float, float]:
    """Milliseconds per step, and of them the optimizer's step, over ``steps`` unprofiled steps (CUDA events).

    A step whose wall time is far above its kernels' time is held by the host (launches, Python), not the GPU.
    """
    step = t.opt.step
    spans = []

    def timed_step(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(*a, **k)
        end.record()
        spans.append((start, end))
        return out

    t.opt.step = timed_step
    try:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            t.train_step()
        end.record()
        torch.cuda.synchronize()
    finally:
        t.opt.step = step
    return start.elapsed_time(end) / steps, sum(s.elapsed_time(e) for s, e in spans) / steps


def host_ops(t, steps: int, top: int) -> dict:
    """Where the host's time goes over ``steps`` steps: the ``top`` operations (PyTorch ops, compiled regions, the
    optimizer's step, custom ops) by total and by self CPU milliseconds per step, with their calls per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t.train_step()
        torch.cuda.synchronize()
    rows = [(e.key, e.cpu_time_total / 1e3 / steps, e.self_cpu_time_total / 1e3 / steps, e.count // steps)
            for e in prof.key_averages()]

    def ranked(i):
        return [{"name": r[0][:160], "ms": round(r[i], 3), "calls": r[3]} for r in sorted(rows, key=lambda r: -r[i])[:top]]

    return {"by_total": ranked(1), "by_self": ranked(2)}


def profile(recipe: str, *, model: str, data: str | None, batch: int, seq: int, warmup: int, steps: int, out: Path, top: int,
            host: bool = False) -> dict:
    rec = fp4train.recipes.get(recipe)
    calib = rec.calibration_steps if rec.calibrate else 0
    runs = 3 if host else 2  # timed, profiled (and the host's profile)
    cfg = TrainConfig(model=model, recipe=recipe, data=data, seq_len=seq, batch_size=batch,
                      max_steps=calib + warmup + runs * steps + 1,
                      warmup_steps=0, eval_every=0, eval_batches=1, out=str(out / recipe), progress=False, tensorboard=False,
                      compile=True, compile_mode="default")
    t = Trainer(cfg, log=lambda m: print(f"  [{recipe}] {m}", flush=True), checkpoints=False)
    try:
        for _ in range(calib + warmup):
            t.train_step()
        wall_ms, opt_ms = _timed_steps(t, steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                t.train_step()
            torch.cuda.synchronize()
        hosted = host_ops(t, steps, top) if host else None
    finally:
        t.close()
    kernels = kernel_times(prof, steps)
    classes = defaultdict(float)
    for name, (ms, _) in kernels.items():
        classes[kernel_class(name)] += ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"recipe": recipe, "wall_ms": wall_ms, "optimizer_wall_ms": opt_ms,
            "total_ms": sum(ms for ms, _ in kernels.values()), **{f"{c}_ms": classes[c] for c in
            ("gemm", "attention", "optimizer", "other")},
            "top_kernels": [{"name": n[:160], "class": kernel_class(n), "ms": ms, "calls": calls} for n, (ms, calls) in ranked],
            "kernels": {n[:160]: [round(ms, 3), calls] for n, (ms, calls) in kernels.items() if ms >= 0.05},
            **({"host_ops": hosted} if hosted else {})}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipes", default="bf16,nvfp4")
    ap.add_argument("--data", default=None, help="training text, as fp4train train takes it (default: tiny-shakespeare)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the profile (compilation, autotuning)")
    ap.add_argument("--steps", type=int, default=2, help="steps profiled (the figures are per step)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per recipe")
    ap.add_argument("--host", action="store_true", help="also profile the host (CPU) side: its top operations")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py profiles GPU kernels: it needs a CUDA GPU")
    recipes = ["bf16"] + [r for r in args.recipes.split(",") if r and r != "bf16"]
    path = args.json or results_path("profile_step", args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in recipes:
            try:
                row = profile(r, model=args.model, data=args.data, batch=args.batch_size, seq=args.seq_len, warmup=args.warmup,
                              steps=args.steps, out=Path(tmp), top=args.top, host=args.host)
            except Exception as e:  # noqa: BLE001 - an OOM or a compile error is a result here
                row = {"recipe": r, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
            finally:
                torch.cuda.empty_cache()
                torch._dynamo.reset()
            rows.append(row)
            if "error" in row:
                print(f"{r:>14}: FAILED - {row['error']}", flush=True)
            else:
                print(f"{r:>14}: {row['wall_ms']:7.1f} ms per step (optimizer {row['optimizer_wall_ms']:.1f}), "
                      f"{row['total_ms']:7.1f} ms of kernels: gemm {row['gemm_ms']:.1f}, attention "
                      f"{row['attention_ms']:.1f}, optimizer {row['optimizer_ms']:.1f}, other {row['other_ms']:.1f}", flush=True)
                for k in row["top_kernels"][:8]:
                    print(f"{'':16}{k['ms']:7.2f} ms {k['calls']:5d}x [{k['class']}] {k['name'][:90]}", flush=True)
                for k in row.get("host_ops", {}).get("by_total", [])[:15]:
                    print(f"{'':16}{k['ms']:7.2f} ms {k['calls']:5d}x [host] {k['name'][:90]}", flush=True)
            write_results(path, rows, model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, data=data_label(args.data),
                          warmup=args.warmup, steps=args.steps, compile_mode="default")


if __name__ == "__main__":
    main()
