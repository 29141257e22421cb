"""Where a training step's GPU time goes, per recipe: the top kernels of one optimizer step.

Question: which kernels make a recipe slower than BF16, and by how much? Sets up the run as
``bench/train_speed.py`` does (its ``setup``: AdaHOP recipes calibrated first on
``--calibration-steps`` BF16 steps of the same synthetic batch), warms up, then records ``--steps`` steps
with ``torch.profiler`` and ranks kernels by total GPU time. BF16 is always profiled first.

    python bench/profile_step.py --model 60m --recipes bf16,mxfp4,nvfp4 --batch-size 32 --seq-len 1024 [--numerics triton]

Prints a table per recipe and writes ``--json`` (default ``bench/results/profile_step-<model>-<gpu>.json``).
Each result also sums its kernels by kind (:func:`kernel_kind`: BF16 or FP8 GEMMs, attention,
fp4train's own Triton kernels, Inductor's fused kernels, ATen elementwise, the optimizer), and
``--explain FILE`` prints a committed result as that comparison with BF16 - kind by kind, how many
ms a step a recipe gains or loses::

    python bench/profile_step.py --explain bench/results/profile_step/1b-H200-triton-490b414.json

``--copies N`` adds the N heaviest ATen copies (``aten::copy_``: dtype casts, ``contiguous``, clones), each
charged to the fp4train line and ATen op that asked for it, with the shape copied - from a second profiled run
with Python stacks, so that the first run's wall time stays comparable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
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
KINDS = ("gemm bf16", "gemm fp8", "attention", "fp4train triton", "inductor", "aten elementwise", "optimizer", "other")


#: kernels of earlier commits under names the code no longer has, so that committed profiles keep their reading
#: (``_mxfp4_cols_kernel`` became ``_mx_cols_kernel`` when it took MXFP8 too, after 5703df7)
FORMER_KERNELS = frozenset({"_mxfp4_cols_kernel"})


def fp4train_kernels() -> frozenset[str]:
    """The names of fp4train's ``@triton.jit`` kernels (a profile lists a Triton kernel by its name), and
    :data:`FORMER_KERNELS`."""
    jit = re.compile(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(")
    return FORMER_KERNELS | frozenset(m for f in (ROOT / "fp4train/kernels").glob("*.py") for m in jit.findall(f.read_text()))


def kernel_kind(name: str, ours: frozenset[str]) -> str:
    """What a GPU kernel of a training step is, from its name (cuBLAS's nvjet kernels: ``qq`` = two FP8 operands)."""
    if name in ours:
        return "fp4train triton"
    if name.startswith("nvjet") or "gemm" in name.lower() or "xmma" in name or "cutlass" in name:
        return "gemm fp8" if "_qq" in name or "e4m3" in name else "gemm bf16"
    if "sdpa" in name or "flash" in name or "fmha" in name or name.startswith("void cudnn"):
        return "attention"
    if name.startswith("triton_"):
        return "inductor"
    if "multi_tensor_apply" in name:
        return "optimizer"
    if "at::native" in name:
        return "aten elementwise"
    return "other"


def is_annotation(name: str) -> bool:
    """A profiler range with device time that wraps kernels already counted (``Optimizer.step#AdamW.step``)."""
    return name.startswith("Optimizer.") or name.startswith("ProfilerStep")


def by_kind(kernels: dict[str, float], ours: frozenset[str]) -> dict[str, float]:
    """ms per step by :func:`kernel_kind`, annotations left out."""
    out = dict.fromkeys(KINDS, 0.0)
    for name, ms in kernels.items():
        if not is_annotation(name):
            out[kernel_kind(name, ours)] += ms
    return out


def explain(result: dict, ours: frozenset[str] | None = None) -> dict:
    """A committed profile as kind-by-kind ms per step against its BF16 (the first result). A result
    with only its top kernels (written before the kinds were) puts the rest under "not ranked"."""
    ours = fp4train_kernels() if ours is None else ours

    def kinds(r):
        if "kinds" in r:
            return dict(r["kinds"])
        k = by_kind({t["kernel"]: t["ms_per_step"] for t in r["top"]}, ours)
        ranked = sum(t["ms_per_step"] for t in r["top"] if not is_annotation(t["kernel"]))
        annot = sum(t["ms_per_step"] for t in r["top"] if is_annotation(t["kernel"]))
        k["not ranked"] = r["gpu_kernel_ms_per_step"] - annot - ranked
        return k

    base = kinds(result["results"][0])
    rows = {}
    for r in result["results"]:
        k = kinds(r)
        rows[r["recipe"]] = {kind: {"ms": ms, "vs_bf16_ms": ms - base.get(kind, 0.0)} for kind, ms in k.items()}
    return rows


COPY_OPS = ("aten::copy_",)  # every ATen copy (to, contiguous, clone, indexed assignment) ends in copy_


def _frame_of(ev) -> tuple[str, str]:
    """(the ATen op that asked for a copy, the innermost fp4train or bench frame above it) from a profiler
    event's parents: Python frames are events named ``path(line): function`` when the stack is recorded."""
    op, frame, p = "", "", ev.cpu_parent
    while p is not None and not frame:
        name = p.name
        if not op and name.startswith("aten::") and name not in ("aten::clone", "aten::_to_copy", "aten::copy_"):
            op = name
        for root in ("fp4train/", "bench/"):
            if root in name and "(" in name:
                frame = root + name.split(root, 1)[1]
        p = p.cpu_parent
    return op or "aten::clone/_to_copy", frame or "(no fp4train frame)"


def copies(events, steps: int, top: int, cuda: bool) -> list[dict]:
    """The ATen copies of a profiled step, by where they come from: device ms per step (CPU ms off a GPU),
    launches, the shapes copied and the ATen op and fp4train line that asked for them - heaviest first."""
    acc = defaultdict(lambda: [0.0, 0])
    for ev in events:
        if ev.name in COPY_OPS:
            op, frame = _frame_of(ev)
            dst = ev.input_shapes[0] if ev.input_shapes else None  # copy_(dst, src): the shape written
            shapes = "?" if dst is None else "x".join(str(d) for d in dst) if dst else "scalar"
            ms = (ev.device_time_total if cuda else ev.self_cpu_time_total) / 1e3 / steps
            a = acc[(frame, op, shapes)]
            a[0] += ms
            a[1] += 1
    ranked = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"frame": f, "op": o, "shape": sh, "ms_per_step": ms, "calls_per_step": n / steps} for (f, o, sh), (ms, n) in ranked]


def profile(model_name, recipe_name, batch, seq, steps, warmup, compile_, calib_steps, top, device, copies_top=0):
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
    # a profiler range such as Optimizer.step#AdamW.step carries the device time of the kernels it wraps
    kern = {k: v for k, v in kern.items() if not is_annotation(k)}
    gpu_ms = sum(v[0] for v in kern.values())
    ranked = sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]
    copy_rows = None
    if copies_top:  # a second profiled run with Python stacks (slower on the host: its wall time is not reported)
        with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=True) as prof2:
            for _ in range(steps):
                step(fwd)
            sync(device)
        copy_rows = copies(prof2.events(), steps, copies_top, cuda)
    return {
        **({"copies": copy_rows} if copy_rows is not None else {}),
        "recipe": recipe_name, "tokens_per_s": batch * seq / wall, "wall_ms_per_step": wall * 1e3, "gpu_kernel_ms_per_step": gpu_ms,
        "kernels_per_step": sum(v[1] for v in kern.values()) / steps, "adahop_strategies": strategies,
        "kinds": by_kind({k: v[0] for k, v in kern.items()}, fp4train_kernels()) if cuda else None,
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
    ap.add_argument("--copies", type=int, default=0, metavar="N",
                    help="also list the N heaviest ATen copies by the fp4train line that asked for them (a second "
                    "profiled run with Python stacks)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--explain", type=Path, help="print a committed result kind by kind against its BF16, and exit")
    args = ap.parse_args(argv)
    if args.explain:
        rows = explain(json.loads(args.explain.read_text()))
        kinds = list(next(iter(rows.values())))
        print(f"{'ms per step (vs bf16)':<22}" + "".join(f"{r:>20}" for r in rows))
        for k in kinds:
            print(f"{k:<22}" + "".join(f"{v[k]['ms']:>9.1f} ({v[k]['vs_bf16_ms']:>+6.1f}) " for v in rows.values()))
        tot = {r: sum(x["ms"] for x in v.values()) for r, v in rows.items()}
        print(f"{'total':<22}" + "".join(f"{t:>9.1f} ({t - tot[next(iter(tot))]:>+6.1f}) " for t in tot.values()))
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.numerics is not None:
        fp4train.formats.set_numerics(args.numerics)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    recipes = [r for r in args.recipes.split(",") if r]
    recipes = ["bf16"] + [r for r in recipes if r != "bf16"]  # the baseline, measured first in the same run
    # said first: the defaults (batch 32 x 1024) are not train_speed's end-to-end batch (8 x 2048 for 1b/3b), and a
    # profile at another batch is not comparable with those runs (docs/LOG.md, session 19)
    print(f"{args.model}: batch {args.batch_size} x sequence {args.seq_len} = {args.batch_size * args.seq_len:,} tokens a step, "
          f"{args.steps} profiled steps", flush=True)
    for r in recipes:
        res = profile(args.model, r, args.batch_size, args.seq_len, args.steps, args.warmup, args.compile,
                      args.calibration_steps, args.top, device, args.copies)
        rows.append(res)
        print(f"\n== {r}: wall {res['wall_ms_per_step']:.1f} ms/step, GPU kernels {res['gpu_kernel_ms_per_step']:.1f} ms/step, "
              f"{res['kernels_per_step']:.0f} launches/step", flush=True)
        for k in res["top"]:
            print(f"  {k['ms_per_step']:8.2f} ms {k['share']:6.1%} x{k['launches_per_step']:<5.0f} {k['kernel'][:100]}", flush=True)
        for c in res.get("copies") or []:
            print(f"  copy {c['ms_per_step']:8.2f} ms x{c['calls_per_step']:<5.0f} {c['shape']:>16} {c['op']:<18} {c['frame'][:90]}", flush=True)
        out = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": code_commit(), "torch": torch.__version__,
               "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "compile": args.compile,
               "numerics": fp4train.formats.numerics(), "results": rows}
        path = args.json or ROOT / "bench/results" / f"profile_step-{args.model}-{gpu.replace(' ', '_')}-{fp4train.formats.numerics()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")  # after every recipe: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
