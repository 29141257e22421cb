"""The fold kernel on a training step's own calls: which form and launch is fastest there?

Question: ``bench/fold_sweep.py`` times the MXFP4 -> FP8 fold on one 16384 x 8192 BF16 tensor, but a
training step calls it on its own shapes, dtypes (FP32 master weights under autocast), axes, group
sizes and rounding - and a launch table chosen on that one tensor made AdaHOP's 1b step slower end
to end (`docs/fast_path.md`). This script runs one eager training step of
``bench/train_speed.py``'s run (the same model, recipe, batch and calibration) and records every call
of ``quantize_mxfp4_fp8`` (with ``--hadamard-only``, those with a fused Hadamard transform). Each
distinct call is then timed with CUDA events (median of ``--repeats``) under every candidate - the
fused transform's butterflies by permutes or sums, times (rows per program, warps) - after checking
that the candidate gives the default's bits. Per (block dim read with a stride or not, group rows, fused transform)
it sums ms per step (calls per step x median) for each candidate and sets the best against the
launch in use (``FOLD_LAUNCH`` / ``FOLD_LAUNCH_HADAMARD``).

    python bench/fold_calls.py [--model 1b --recipe adahop --batch-size 8 --seq-len 2048 --repeats 10 --json F]

Writes ``bench/results/fold_calls-<model>-<recipe>-<gpu>.json`` (or ``--json``), with the GPU's copy bandwidth
measured in the same run; each call is then set against its memory floor (the bytes it must move at that
bandwidth), also for a committed file without a GPU::

    python bench/fold_calls.py --explain FILE [--copy-from bench/results/quantize_speed-....json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from fp4train.timing import code_commit, median_time

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import setup  # noqa: E402 - the same run as the speeds this explains

ROOT = Path(__file__).resolve().parent.parent

#: the launches tried per group size: (rows per program, warps); 128x128 groups take 128 rows
LAUNCHES = {1: [(rb, nw) for rb in (8, 16, 32) for nw in (4, 8)], 128: [(128, nw) for nw in (4, 8, 16, 32)]}
#: and, without a fused transform, taller programs for 1x128 groups (FOLD_LAUNCH takes 128 rows on strided reads)
PLAIN_TALL = [(64, 4), (128, 4), (128, 8)]


def call_key(x: torch.Tensor, kw: dict) -> tuple:
    """What decides a fold call's cost: shape, strides, dtype, blocks along dim 0, group rows, fused
    Hadamard block (0: none) and whether it has signs, rounding, scale."""
    return (tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."), kw.get("axis", -1) % 2 == 0,
            kw["group_rows"], kw.get("hadamard_block") or 0, kw.get("hadamard_signs") is not None,
            kw.get("rounding", "nearest"), kw.get("scale", "floor"))


def strided(strides, along_dim_0: bool) -> bool:
    """Whether a recorded call reads its block dim with a stride: :func:`~fp4train.kernels.mx_fold.block_dim_strided`,
    what its launch follows, of the strides and axis a key or a result row holds."""
    from fp4train.kernels.mx_fold import block_dim_strided

    return block_dim_strided(strides, 0 if along_dim_0 else 1)


def record_calls(model: str, recipe: str, batch: int, seq: int, device: torch.device, *, backend: str | None = None,
                 calibration_steps: int = 3, hadamard_only: bool = False) -> dict[tuple, dict]:
    """The ``quantize_mxfp4_fp8`` calls of one eager training step of ``setup``'s run, by :func:`call_key`:
    ``{"count", "x" (a copy of the first call's input), "kw" (its keywords but the counter)}``."""
    from fp4train.kernels import mx_fold

    run = setup(model, recipe, batch, seq, device, backend, calibration_steps)
    real, calls = mx_fold.quantize_mxfp4_fp8, {}

    def recording(x, **kw):
        if kw.get("hadamard_block") or not hadamard_only:
            c = calls.setdefault(call_key(x, kw), {"count": 0, "x": x.detach().clone(),
                                                  "kw": {k: v for k, v in kw.items() if k != "counter"}})
            c["count"] += 1
        return real(x, **kw)

    mx_fold.quantize_mxfp4_fp8 = recording  # the backend imports it at each call
    try:
        run.step()
    finally:
        mx_fold.quantize_mxfp4_fp8 = real
    del run
    return calls


def candidates(key: tuple, strided_sums: bool = False) -> list[dict]:
    """The keyword sets tried for a call: every launch of :data:`LAUNCHES` for its group size, each with
    both butterfly forms when it fuses a transform - but on strided reads (along dim 0) only permutes unless
    ``strided_sums``: there sums ran 1.2-18x slower at every launch of the H200 sweep
    (``bench/results/fold_sweep-NVIDIA_H200-hadamard-1e006b7.json``), and each candidate costs a compile."""
    gr, had = key[4], key[5]
    forms = ("permutes",) if had and strided(key[1], key[3]) and not strided_sums else ("permutes", "sums") if had else (None,)
    launches = LAUNCHES[gr] + (PLAIN_TALL if gr == 1 and not had else [])
    return [{"rows_per_program": rb if gr == 1 else None, "num_warps": nw, "butterfly": form}
            for form in forms for rb, nw in launches]


def in_use(key: tuple) -> dict:
    """The launch a call takes by default (``mx_fold.fold_launch``), as candidate keywords."""
    from fp4train.kernels.mx_fold import fold_launch

    gr = key[4]
    rb, nw, form = fold_launch(strided(key[1], key[3]), gr, key[5] > 0)
    return {"rows_per_program": rb if gr == 1 else None, "num_warps": nw, "butterfly": form}


def compare(calls: dict[tuple, dict], repeats: int, time_fn: Callable = median_time,
            cands: Callable[[tuple], list[dict]] = candidates, on_row: Callable[[list[dict]], None] | None = None) -> dict:
    """Time every call under every candidate (``time_fn(fn, repeats)`` seconds) after checking it gives the
    default's bits; ``{"calls": [...], "groups": {...}}`` with, per group of calls that share blocks along
    dim 0, group rows and transform, ms per step in use and for the best candidate. ``on_row(rows)`` is
    called after each call is timed, with the rows so far (for progress and partial results)."""
    from fp4train.kernels.mx_fold import quantize_mxfp4_fp8

    rows = []
    for key, c in calls.items():
        x, kw = c["x"], c["kw"]
        want = quantize_mxfp4_fp8(x, **kw)
        use = in_use(key)
        times = []
        for cand in cands(key):
            got = quantize_mxfp4_fp8(x, **{**kw, **cand})
            if not (torch.equal(got.codes, want.codes) and torch.equal(got.scales.view(torch.int32), want.scales.view(torch.int32))
                    and int(got.inexact) == int(want.inexact)):
                raise AssertionError(f"fold call {key}: candidate {cand} gives other bits than the default launch")
            counter = torch.zeros((), dtype=torch.int32, device=x.device)
            ms = time_fn(lambda: quantize_mxfp4_fp8(x, counter=counter, **{**kw, **cand}), repeats) * 1e3
            times.append({**cand, "ms": ms, "in_use": cand == use})
        if not any(t["in_use"] for t in times):  # the launch in use is not among the candidates: time it too
            counter = torch.zeros((), dtype=torch.int32, device=x.device)
            times.append({**use, "ms": time_fn(lambda: quantize_mxfp4_fp8(x, counter=counter, **kw), repeats) * 1e3, "in_use": True})
        rows.append({"shape": list(key[0]), "strides": list(key[1]), "dtype": key[2], "along_dim_0": key[3],
                     "block_dim_strided": strided(key[1], key[3]), "group_rows": key[4],
                     "hadamard_block": key[5], "signs": key[6], "rounding": key[7], "scale": key[8],
                     "calls_per_step": c["count"], "candidates": times})
        if on_row is not None:
            on_row(rows)
    return {"calls": rows, "groups": group_totals(rows)}


def group_totals(rows: list[dict]) -> dict:
    """Per group of calls (block dim strided or contiguous, group rows, transform; ``FOLD_LAUNCH_HADAMARD``'s key, and
    for files written before that key, from the rows' strides): calls per step, ms per step at the
    launches in use and under each candidate, and the best candidate."""
    groups = {}
    for r in rows:
        reads = "strided" if r.get("block_dim_strided", strided(r["strides"], r["along_dim_0"])) else "contiguous"
        g = groups.setdefault(f"block dim {reads}, {r['group_rows']}x128, hadamard {r['hadamard_block']}",
                              {"calls_per_step": 0, "in_use_ms_per_step": 0.0, "by_candidate": {}, "calls": 0, "_timed": {}})
        g["calls_per_step"] += r["calls_per_step"]
        g["calls"] += 1
        for t in r["candidates"]:
            ms = r["calls_per_step"] * t["ms"]
            if t["in_use"]:
                g["in_use_ms_per_step"] += ms
            name = f"{t['butterfly'] or 'plain'} rows {t['rows_per_program'] or 128} warps {t['num_warps']}"
            g["by_candidate"][name] = g["by_candidate"].get(name, 0.0) + ms
            g["_timed"][name] = g["_timed"].get(name, 0) + 1
    for g in groups.values():  # a candidate's total counts only if every call of the group timed it
        timed = g.pop("_timed")
        g["by_candidate"] = {n: ms for n, ms in g["by_candidate"].items() if timed[n] == g["calls"]}
        name, ms = min(g["by_candidate"].items(), key=lambda kv: kv[1])
        g["best"], g["best_ms_per_step"] = name, ms
    return groups


def moved_bytes(call: dict) -> int:
    """The bytes a fold call must move at the least: x read once (its dtype), one FP8 code byte written per
    element and one FP32 scale per group (128 elements of a row, or 128 x 128)."""
    n = call["shape"][0] * call["shape"][1]
    return n * {"float32": 4, "bfloat16": 2, "float16": 2}[call["dtype"]] + n + 4 * n // (128 * call["group_rows"])


def floors(result: dict, copy_gbps: float) -> dict:
    """How far the step's fold calls are from their memory floor (``moved_bytes`` at the copy bandwidth
    ``copy_gbps``, read + write bytes per second as ``bench/quantize_speed.py`` counts them): per call its floor and
    its times in use and at its own best candidate; per step the totals, and with each group's best (one launch a
    group, as ``FOLD_LAUNCH_HADAMARD`` sets; the file's groups, and the calls grouped by their reads as the table is
    keyed now, which differ for files written before that key) against each call's own best (a launch per call shape)."""
    calls, step = [], {"floor_ms": 0.0, "in_use_ms": 0.0, "group_best_ms": sum(g["best_ms_per_step"] for g in result["groups"].values()),
                       "group_best_by_reads_ms": sum(g["best_ms_per_step"] for g in group_totals(result["calls"]).values()),
                       "call_best_ms": 0.0}
    for r in result["calls"]:
        floor = moved_bytes(r) / (copy_gbps * 1e9) * 1e3
        use = next(t["ms"] for t in r["candidates"] if t["in_use"])
        best = min(t["ms"] for t in r["candidates"])
        calls.append({"shape": r["shape"], "dtype": r["dtype"], "along_dim_0": r["along_dim_0"], "group_rows": r["group_rows"],
                      "calls_per_step": r["calls_per_step"], "floor_ms": floor, "in_use_ms": use, "best_ms": best})
        n = r["calls_per_step"]
        step["floor_ms"] += n * floor
        step["in_use_ms"] += n * use
        step["call_best_ms"] += n * best
    return {"copy_GBps": copy_gbps, "calls": calls, "per_step": step}


def explain(path: Path, copy_gbps: float | None) -> None:
    """Print a committed result's calls against their memory floor (``--explain``)."""
    d = json.loads(path.read_text())
    copy_gbps = copy_gbps or d.get("copy_GBps")
    if not copy_gbps:
        raise SystemExit(f"{path} has no copy bandwidth of its own (an older results file): "
                         "give --copy-gbps or --copy-from a quantize_speed JSON of the same GPU")
    f = floors(d, copy_gbps)
    print(f"{d['model']} {d['recipe']} on {d['gpu']} ({d['commit']}), copy {copy_gbps:.1f} GB/s")
    for c in f["calls"]:
        print(f"  {str(c['shape']):>15} {c['dtype']:>8} along dim {0 if c['along_dim_0'] else 1} {c['group_rows']:>3}x128 "
              f"x{c['calls_per_step']:<3} floor {c['floor_ms']:.3f} ms, in use {c['in_use_ms']:.3f} ({c['in_use_ms'] / c['floor_ms']:.1f}x), "
              f"best {c['best_ms']:.3f} ({c['best_ms'] / c['floor_ms']:.1f}x)")
    s = f["per_step"]
    print(f"per step: floor {s['floor_ms']:.2f} ms, in use {s['in_use_ms']:.2f}, each group's best {s['group_best_ms']:.2f} "
          f"({s['group_best_ms'] / s['floor_ms']:.1f}x the floor; {s['group_best_by_reads_ms']:.2f} grouped by reads), "
          f"each call's best {s['call_best_ms']:.2f}")
    for name, g in group_totals(d["calls"]).items():
        print(f"  {name}: best {g['best']}, {g['best_ms_per_step']:.2f} ms a step")


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """GB/s of ``y.copy_(x)`` on 16384 x 8192 BF16, read + write bytes (as ``bench/quantize_speed.py``)."""
    x = torch.randn(16384, 8192, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / median_time(lambda: y.copy_(x), repeats) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--recipe", default="adahop")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--calibration-steps", type=int, default=3, help="AdaHOP: BF16 calibration steps before converting")
    ap.add_argument("--hadamard-only", action="store_true", help="only the calls with a fused Hadamard transform")
    ap.add_argument("--strided-sums", action="store_true", help="also time sums on strided reads (slower there in every sweep so far)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--explain", type=Path, metavar="FILE", help="print a committed result's calls against their memory floor, and exit")
    ap.add_argument("--copy-gbps", type=float, help="with --explain: the copy bandwidth (GB/s) if FILE has none")
    ap.add_argument("--copy-from", type=Path, metavar="QUANTIZE_SPEED_JSON", help="with --explain: take it from a quantize_speed run")
    args = ap.parse_args(argv)
    if args.explain:
        gbps = args.copy_gbps or (json.loads(args.copy_from.read_text())["results"]["copy"]["GBps"] if args.copy_from else None)
        return explain(args.explain, gbps)
    if not torch.cuda.is_available():
        raise SystemExit("fold_calls needs a CUDA GPU (its timings are CUDA events)")
    device = torch.device("cuda")
    calls = record_calls(args.model, args.recipe, args.batch_size, args.seq_len, device,
                         calibration_steps=args.calibration_steps, hadamard_only=args.hadamard_only)
    if not calls:
        raise SystemExit(f"one step of {args.recipe} on {args.model} made no fold calls{' with a fused transform' if args.hadamard_only else ''}")
    print(f"{sum(c['count'] for c in calls.values())} fold calls a step, {len(calls)} distinct", flush=True)
    gpu = torch.cuda.get_device_name()
    head = {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": code_commit() or "unknown", "torch": torch.__version__,
            "model": args.model, "recipe": args.recipe, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "copy_GBps": copy_bandwidth(device, args.repeats)}  # the floor each call is measured against (--explain)
    path = args.json or ROOT / "bench/results" / f"fold_calls-{args.model}-{args.recipe}-{gpu.replace(' ', '_')}.json"

    def on_row(rows):  # a cut run keeps what it timed: the file is rewritten after each call, marked partial
        r = rows[-1]
        use = next(t["ms"] for t in r["candidates"] if t["in_use"])
        best = min(r["candidates"], key=lambda t: t["ms"])
        print(f"[{len(rows)}/{len(calls)}] {r['shape']} {r['dtype']} along dim {0 if r['along_dim_0'] else 1} "
              f"{r['group_rows']}x128 {r['rounding']} x{r['calls_per_step']}: in use {use:.3f} ms, best {best['butterfly']} "
              f"rows {best['rows_per_program'] or 128} warps {best['num_warps']} {best['ms']:.3f} ms", flush=True)
        path.write_text(json.dumps({**head, "partial": len(rows) < len(calls), "calls": rows, "groups": group_totals(rows)}, indent=1) + "\n")

    result = compare(calls, args.repeats, cands=lambda k: candidates(k, args.strided_sums), on_row=on_row)
    total_use = sum(g["in_use_ms_per_step"] for g in result["groups"].values())
    total_best = sum(g["best_ms_per_step"] for g in result["groups"].values())
    for name, g in result["groups"].items():
        print(f"{name}: {g['calls_per_step']} calls, in use {g['in_use_ms_per_step']:.2f} ms/step, "
              f"best {g['best']}: {g['best_ms_per_step']:.2f} ms/step")
    print(f"fold calls in all: {total_use:.2f} ms/step in use, {total_best:.2f} with each group's best")
    explain(path, None)


if __name__ == "__main__":
    main()
