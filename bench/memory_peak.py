"""What is alive at a training step's memory peak, per recipe: which code allocated it.

Question: why does a recipe's peak memory differ from BF16's (AdaHOP's 1b peak sat 9 GiB above
mxfp4's while its saved activations were about the same)? The model is built and converted, a training step
on one synthetic batch (AdaHOP calibrated first) is warmed up (compiled with ``--compile``), then one
more step runs under the CUDA allocator's history recorder. Replaying the recorded allocations and
frees gives the moment of the step's peak and the blocks alive then; each block is charged to the
innermost Python frame that says where it came from - fp4train's own code, Inductor's generated
code (the compiled graph's buffers), autograd or the optimizer - and the groups are ranked by bytes.

    python bench/memory_peak.py --model 1b --seq-len 2048 --batch-size 8 --compile --recipes bf16,mxfp4,adahop

Also reports, per recipe, each warm-up step's own peak (compilation in the first; a rise from step
to step would be a leak) and the recorded step's. Needs a GPU; writes ``--json``.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

import torch

import fp4train
from fp4train import models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import results_path, write_results  # noqa: E402
from train_speed import TORCHAO, torchao_fp8_rowwise  # noqa: E402

GIB = 2**30


def convert(model, recipe: str, backend: str | None):
    """fp4train's ``convert``, or torchao's float8 rowwise training for ``torchao_fp8_rowwise``."""
    if recipe == TORCHAO:
        torchao_fp8_rowwise(model)
        return
    fp4train.convert(model, recipe, backend=backend, calibrating=bool(fp4train.recipes.get(recipe).calibrate))


class Run(NamedTuple):
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step: Callable  # step(fwd=model) -> loss: one AdamW step on the run's batch
    strategies: dict | None  # AdaHOP's strategy mix after calibration, else None


def setup(model_name: str, recipe: str, batch: int, seq: int, device, backend: str | None = None,
          calibration_steps: int = 3) -> Run:
    """The run whose step is recorded: the model built (seed 0) and converted; ``step(fwd=model)`` is one AdamW
    step on one synthetic batch (BF16 autocast and fused AdamW on a GPU); an AdaHOP recipe is calibrated on
    ``calibration_steps`` BF16 steps first. The allocations of a step depend on shapes, not on the tokens."""
    torch.manual_seed(0)
    model = models.build(model_name, max_seq_len=max(seq, 512)).to(device)
    convert(model, recipe, backend)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    idx = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step(fwd=model):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    strategies = None
    rec = fp4train.recipes.get(recipe) if recipe != TORCHAO else None
    if rec is not None and rec.calibrate:
        from fp4train.adahop.calibration import calibrate_in_place

        strategies = calibrate_in_place(model, rec, step, calibration_steps, backend=backend).strategy_counts()
    return Run(model, opt, step, strategies)


def peak_of_trace(events, start_bytes: int = 0):
    """Replay allocator events (dicts with ``action``, ``addr``, ``size``, optional ``frames``) from
    ``start_bytes`` already allocated: (peak bytes, the blocks alive at the peak as ``[(size,
    frames)]``). A block counts from its ``alloc`` to its ``free_completed`` (a free on another
    stream completes later than it is requested); segment events are the allocator's own and are
    not blocks. Blocks alive before recording started are in ``start_bytes`` only."""
    live, cur, peak, peak_at = {}, start_bytes, start_bytes, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = i
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            del live[e["addr"]]
            cur -= e["size"]
    alive = {}  # replay again up to the peak: what is alive then
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    return peak, [(e["size"], e.get("frames", [])) for e in alive.values()]


def origin(frames) -> str:
    """Where a block came from, by the innermost telling Python frame: ``fp4train/<file>:<function>``,
    ``inductor:<function>`` (a compiled graph's buffers), or else the innermost frame's
    ``<file>:<function>``; ``?`` without frames."""
    for f in frames:
        name = f.get("filename", "")
        if "/fp4train/" in name and "/bench/" not in name:
            return "fp4train/" + name.split("/fp4train/")[-1] + ":" + f.get("name", "?")
        if "torchinductor" in name or "/_inductor/" in name:
            return "inductor:" + f.get("name", "?")
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py"):
            return Path(name).name + ":" + f.get("name", "?")
    return "?"


def breakdown(blocks, top: int = 25) -> list[dict]:
    """Blocks grouped by :func:`origin`, largest first."""
    groups = defaultdict(lambda: [0, 0])
    for size, frames in blocks:
        g = groups[origin(frames)]
        g[0] += size
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"origin": k, "gib": v[0] / GIB, "blocks": v[1]} for k, v in rows]


def measure(model_name, recipe, batch, seq, warmup, compile_, backend, top):
    model, _, step, strategies = setup(model_name, recipe, batch, seq, torch.device("cuda"), backend)
    fwd = torch.compile(model) if compile_ else model
    per_step = []  # each warm-up step's own peak: growth from step to step would be a leak
    for _ in range(warmup):
        torch.cuda.reset_peak_memory_stats()
        step(fwd)
        torch.cuda.synchronize()
        per_step.append(torch.cuda.max_memory_allocated() / GIB)
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(fwd)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    step_peak = torch.cuda.max_memory_allocated()
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, blocks = peak_of_trace(events, start)
    return {"recipe": recipe, "warmup_peak_gib": max(per_step, default=0.0), "step_peak_gib": step_peak / GIB,
            "start_gib": start / GIB, "replayed_peak_gib": peak / GIB,
            "warmup_step_peaks_gib": per_step, "events": len(events),
            "alive_at_peak": breakdown(blocks, top), **({"adahop_strategies": strategies} if strategies else {})}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="60m")
    ap.add_argument("--recipes", default="bf16,mxfp4,adahop")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory_peak.py reads the CUDA allocator's history: it needs a GPU")
    import fp4train

    backend = fp4train.backends.resolve(args.backend or "auto")
    rows = []
    for r in args.recipes.split(","):
        try:
            res = measure(args.model, r, args.batch_size, args.seq_len, args.warmup, args.compile, args.backend, args.top)
        except Exception as e:  # noqa: BLE001 - an OOM or compile failure is a result here
            res = {"recipe": r, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]}
        finally:
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        rows.append(res)
        if "error" in res:
            print(f"{r}: FAILED - {res['error']}", flush=True)
        else:
            print(f"{r}: warm-up step peaks {', '.join(f'{p:.2f}' for p in res['warmup_step_peaks_gib'])} GiB, step peak {res['step_peak_gib']:.2f} GiB "
                  f"(replayed {res['replayed_peak_gib']:.2f}; {res['start_gib']:.2f} alive before the step)", flush=True)
            for g in res["alive_at_peak"][:12]:
                print(f"    {g['gib']:8.3f} GiB {g['blocks']:6d} blocks  {g['origin']}", flush=True)
        write_results(args.json or results_path("memory_peak", args.model), rows, model=args.model, batch_size=args.batch_size,
                      seq_len=args.seq_len, compile=args.compile, backend=backend)


if __name__ == "__main__":
    main()
