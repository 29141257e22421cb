"""Training-step throughput (tokens/s) and peak memory of a model under each recipe.

Question: how fast does one optimizer step run under each recipe, against BF16 measured in
the same run? Synthetic token ids (data loading excluded), AdamW, BF16 autocast on GPU.
Timed with CUDA events (CPU: perf_counter), median over ``--steps`` after ``--warmup`` steps.
Besides fp4train's recipes, ``torchao_fp8_rowwise`` is torchao's float8 rowwise training (the
peer a Hopper user would pick; needs torchao and an sm89+ GPU). A recipe that fails (out of
memory, a compile error) is recorded with its error and the others still run.

    python bench/train_speed.py --model 60m --recipes bf16,mxfp4,tib2d --batch-size 16 --seq-len 1024 [--compile]
    python bench/train_speed.py --model 1b --seq-len 2048 --batch-size 8 --compile --numerics triton \
        --recipes bf16,fp8_rowwise,torchao_fp8_rowwise,mxfp4,hadamard_mxfp4,tib2d,adahop,nvfp4

Writes ``bench/results/train_speed-<model>-<gpu>.json`` (or ``--json``), the run's settings inside.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

import fp4train
from fp4train import models
from common import results_path, write_results
from fp4train.timing import median_time


TORCHAO = "torchao_fp8_rowwise"


def convert(model, recipe: str, backend: str | None, numerics: str | None = None, device_seeds: bool = False):
    """fp4train's ``convert``, or torchao's float8 rowwise training for ``torchao_fp8_rowwise``
    (every linear but the LM head, as torchao's own Llama benchmarks do)."""
    if recipe != TORCHAO:
        fp4train.convert(model, recipe, backend=backend, numerics=numerics, device_seeds=device_seeds,
                         calibrating=bool(fp4train.recipes.get(recipe).calibrate))
        return
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError(f"{TORCHAO} needs torchao (pip install torchao): {e}") from e
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)


class Run(NamedTuple):
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step: Callable  # step(fwd=model) -> loss: one AdamW step on the run's batch
    strategies: dict | None  # AdaHOP's strategy mix after calibration, else None


def setup(model_name: str, recipe: str, batch: int, seq: int, device, backend: str | None = None,
          calibration_steps: int = 3, numerics: str | None = None, device_seeds: bool = False) -> Run:
    """The benchmarks' training run before its timed steps. The model is built (seed 0) and converted;
    ``step(fwd=model)`` is one AdamW step on one synthetic batch (BF16 autocast and fused AdamW on a
    GPU); an AdaHOP recipe is calibrated on ``calibration_steps`` BF16 steps first, as the trainer does.
    One procedure for every script that compares its numbers with this one's (``memory_peak.py``)."""
    torch.manual_seed(0)
    model = models.build(model_name, max_seq_len=max(seq, 512)).to(device)
    convert(model, recipe, backend, numerics, device_seeds)
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

        strategies = calibrate_in_place(model, rec, step, calibration_steps, backend=backend, numerics=numerics,
                                        device_seeds=device_seeds).strategy_counts()
    return Run(model, opt, step, strategies)


def measure(model_name: str, recipe: str, batch: int, seq: int, steps: int, warmup: int, compile_: bool, device,
            backend: str | None = None, calibration_steps: int = 3, compile_mode: str | None = None,
            numerics: str | None = None) -> dict:
    graphs = compile_mode == "reduce-overhead"  # Inductor's CUDA graphs (cudagraph trees)
    # seeded layers draw on the device, so that their graphs are captured too
    run = setup(model_name, recipe, batch, seq, device, backend, calibration_steps, numerics=numerics, device_seeds=graphs)
    cuda = device.type == "cuda"
    last = {}

    def step(fwd):
        if graphs:  # a new iteration: the previous replay's outputs may be overwritten; keep the loss apart
            torch.compiler.cudagraph_mark_step_begin()
            last["loss"] = run.step(fwd).detach().clone()
        else:
            last["loss"] = run.step(fwd)

    from torch._dynamo.utils import counters

    skips_before = counters["inductor"]["cudagraph_skips"]
    fwd = torch.compile(run.model, mode=compile_mode) if compile_ else run.model

    def peak_gib():  # the peak since the last reset, then a fresh reset
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        p = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return p

    setup_peak = peak_gib()  # model, optimizer and (AdaHOP) the eager BF16 calibration steps
    t_first = time.perf_counter()
    warm_peaks = []  # each warm-up step's own peak: compilation, autotuning, allocator warm-up
    for _ in range(warmup):
        step(fwd)
        warm_peaks.append(peak_gib())
    warm_s = time.perf_counter() - t_first
    med = median_time(lambda: step(fwd), steps, warmup=0, cuda=cuda, back_to_back=False)  # as every committed run
    timed_peak = peak_gib()
    loss = last["loss"]
    return {
        "recipe": recipe, "tokens_per_s": batch * seq / med, "step_ms": med * 1e3,
        # the peak over every compiled step, warm-up included (what a user must have free)
        "peak_mem_gib": max([timed_peak, *warm_peaks]) if cuda else None,
        "warmup_step_peaks_gib": warm_peaks if cuda else None, "timed_peak_gib": timed_peak,
        "setup_peak_gib": setup_peak,
        "warmup_s": warm_s, "loss": loss.item(), **({"adahop_strategies": run.strategies} if run.strategies else {}),
        # graphs Inductor did not capture in CUDA graphs (a CPU tensor, a forbidden op: its log says which)
        **({"cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips_before} if graphs else {}),
    }


def measure_or_error(*args, **kw) -> dict:
    """:func:`measure`, or the recipe's error (the benchmark goes on with the next recipe)."""
    try:
        return measure(*args, **kw)
    except Exception as e:  # noqa: BLE001 - OOM, compile or kernel failures are results here
        import traceback

        return {"recipe": args[1], "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500],
                # where it failed: the innermost frames (a CUDA-graph capture error names the op that broke it)
                "traceback": traceback.format_exc().splitlines()[-24:]}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch._dynamo.reset()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipes", default="bf16,mxfp4")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead"],
                    help="with --compile: torch.compile's mode; reduce-overhead replays each graph as CUDA graphs (no "
                    "per-kernel host launch); a layer that draws a stochastic-rounding seed keeps its graph out of them")
    ap.add_argument("--numerics", default=None, choices=["eager", "compiled", "triton"],
                    help="how quantization runs (same bits): eager, compiled or triton (default: the backend's - "
                    "triton with the triton backend, eager otherwise)")
    ap.add_argument("--backend", default=None, help="GEMM backend for fp4train's recipes (default: the recipe's, "
                    "'auto': triton on a GPU machine, emulated elsewhere)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = fp4train.backends.resolve(args.backend or "auto")
    rows = []
    recipes = [r for r in args.recipes.split(",") if r]
    recipes = ["bf16"] + [r for r in recipes if r != "bf16"]  # the baseline, measured first in the same run
    for r in recipes:
        res = measure_or_error(args.model, r, args.batch_size, args.seq_len, args.steps, args.warmup, args.compile, device,
                               backend=args.backend, compile_mode=args.compile_mode, numerics=args.numerics)
        rows.append(res)
        if "error" in rows[0]:
            raise SystemExit(f"the bf16 baseline failed ({rows[0]['error']}); no speed can be compared - try a smaller --batch-size")
        if "error" in res:
            print(f"{args.model} {r:>15}: FAILED - {res['error']}", flush=True)
        else:
            res["speedup_vs_bf16"] = res["tokens_per_s"] / rows[0]["tokens_per_s"]
            mem = (f", peak {res['peak_mem_gib']:.2f} GiB (warm-up steps "
                   f"{', '.join(f'{p:.2f}' for p in res['warmup_step_peaks_gib'])}; timed {res['timed_peak_gib']:.2f}; "
                   f"setup {res['setup_peak_gib']:.2f})" if res["peak_mem_gib"] else "")
            print(f"{args.model} {r:>15}: {res['tokens_per_s']:>12,.0f} tokens/s ({res['speedup_vs_bf16']:.2f}x bf16), "
                  f"step {res['step_ms']:.1f} ms{mem}, warmup {res['warmup_s']:.1f}s", flush=True)
        numerics = args.numerics or ("triton" if backend == "triton" and device.type == "cuda" else "eager")  # convert()'s default
        # one file per model and GPU, the settings inside; after every recipe: a run cut short keeps what it measured
        write_results(args.json or results_path("train_speed", args.model), rows, model=args.model, batch_size=args.batch_size,
                      seq_len=args.seq_len, compile=args.compile, compile_mode=args.compile_mode or "default",
                      numerics=numerics, backend=backend)


if __name__ == "__main__":
    main()
