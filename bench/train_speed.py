"""Training throughput (tokens/s) and peak memory of each recipe, as ``fp4train train`` runs it.

Question: how fast does a user's training run go under each recipe, against BF16 measured in the same
call? Every recipe runs through the trainer itself - its data path, gradient clipping, logging, AdaHOP
calibrated on the data the trainer's way (or loaded with ``--calibration``), its default speed settings on
a GPU (``torch.compile`` with CUDA graphs) unless ``--no-compile`` / ``--compile-mode`` say otherwise - and
the figure is the trainer's own: ``tokens_per_s`` of its ``summary.json``, tokens per step over the median
time of the run's steady steps (no compilation, no CUDA-graph recording, no BF16 calibration in them).
``torchao_fp8_rowwise`` is the peer a Hopper user would pick, torchao's float8 rowwise training (every
linear but the LM head, as torchao's own Llama benchmarks do), applied by the trainer's model hook to a
BF16 run. A recipe that fails (out of memory, a compile error) is recorded with its error and the others
still run. No checkpoint is written.

    python bench/train_speed.py --model 1b --seq-len 2048 --batch-size 8 --data ../shared/data/enwiki \\
        --recipes bf16,adahop,tib2d,mxfp4,nvfp4,torchao_fp8_rowwise

Writes ``bench/results/train_speed-<model>-<device>.json`` (or ``--json``), the run's settings inside.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import data_label, results_path, write_results

import fp4train
from fp4train.adahop.training import AdaHOPCalibration
from fp4train.train import TrainConfig, Trainer

TORCHAO = "torchao_fp8_rowwise"


def torchao_fp8_rowwise(model: torch.nn.Module) -> None:
    """torchao's float8 rowwise training on every linear but the LM head (needs torchao and an sm89+ GPU)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError(f"{TORCHAO} needs torchao (pip install torchao): {e}") from e
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)


def measure(recipe: str, *, model: str, data: str | None, batch: int, seq: int, steps: int, compile_: bool | None,
            compile_mode: str | None, backend: str | None, numerics: str | None, calibration: str | None, out: Path,
            device: str = "auto") -> dict:
    """One recipe's run through the trainer: ``steps`` steps after AdaHOP's calibration steps (if any)."""
    rec = fp4train.recipes.get("bf16" if recipe == TORCHAO else recipe)
    bf16_steps = rec.calibration_steps if rec.calibrate and not calibration else 0
    cfg = TrainConfig(model=model, recipe="bf16" if recipe == TORCHAO else recipe, data=data, seq_len=seq, batch_size=batch,
                      max_steps=bf16_steps + steps, warmup_steps=0, eval_every=0, eval_batches=1, log_every=steps,
                      out=str(out / recipe), progress=False, tensorboard=False, device=device, compile=compile_,
                      compile_mode=compile_mode, backend=backend, numerics=numerics,
                      calibration=calibration if rec.calibrate else None)
    trainer = Trainer(cfg, log=lambda m: print(f"  [{recipe}] {m}", flush=True), checkpoints=False,
                      model_hook=torchao_fp8_rowwise if recipe == TORCHAO else None)
    s = trainer.run()
    row = {"recipe": recipe, "tokens_per_s": s["tokens_per_s"], "step_ms": s["step_ms"], "steady_steps": s["steady_steps"],
           "peak_mem_gib": s["peak_mem_gib"],
           "calibration_peak_mem_gib": s["calibration_peak_mem_gib"], "compiled_graphs": s["compiled_graphs"], "bf16_steps": s["bf16_steps"],
           "compile": s["compile"], "compile_mode": s["compile_mode"], "numerics": s["numerics"], "backend": s["backend"]}
    adahop = trainer.feature(AdaHOPCalibration)
    if adahop is not None and adahop.calibration is not None:
        row["adahop_strategies"] = adahop.calibration.strategy_counts()
    return row


def measure_or_error(recipe: str, **kw) -> dict:
    """:func:`measure`, or the recipe's error (the benchmark goes on with the next recipe)."""
    try:
        return measure(recipe, **kw)
    except Exception as e:  # noqa: BLE001 - OOM, compile or kernel failures are results here
        import traceback

        return {"recipe": recipe, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500],
                "traceback": traceback.format_exc().splitlines()[-24:]}  # the innermost frames name what broke
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch._dynamo.reset()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipes", default="bf16,mxfp4")
    ap.add_argument("--data", default=None, help="training text, as fp4train train takes it (default: the packaged tiny-shakespeare)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="steps after AdaHOP's calibration; the first few (compilation, "
                    "CUDA-graph recording) are not timed")
    ap.add_argument("--compile", dest="compile_", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile (default: the trainer's - on a GPU yes, with CUDA graphs)")
    ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead"])
    ap.add_argument("--numerics", default=None, choices=["eager", "compiled", "triton"])
    ap.add_argument("--backend", default=None, help="GEMM backend (default: the recipe's: fp8_blockwise on a GPU)")
    ap.add_argument("--calibration", default=None, help="AdaHOP: a saved adahop_calibration.json instead of calibrating")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    recipes = ["bf16"] + [r for r in recipes if r != "bf16"]  # the baseline, measured first in the same call
    path = args.json or results_path("train_speed", args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in recipes:
            res = measure_or_error(r, model=args.model, data=args.data, batch=args.batch_size, seq=args.seq_len, steps=args.steps,
                                   compile_=args.compile_, compile_mode=args.compile_mode, backend=args.backend,
                                   numerics=args.numerics, calibration=args.calibration, out=Path(tmp), device=args.device)
            rows.append(res)
            if "error" in rows[0]:
                raise SystemExit(f"the bf16 baseline failed ({rows[0]['error']}); no speed can be compared - try a smaller --batch-size")
            if "error" in res:
                print(f"{args.model} {r:>20}: FAILED - {res['error']}", flush=True)
            else:
                res["speedup_vs_bf16"] = res["tokens_per_s"] / rows[0]["tokens_per_s"]
                mem = f", peak {res['peak_mem_gib']:.2f} GiB" if res["peak_mem_gib"] else ""
                print(f"{args.model} {r:>20}: {res['tokens_per_s']:>12,.0f} tokens/s ({res['speedup_vs_bf16']:.2f}x bf16), step "
                      f"{res['step_ms']:.1f} ms over {res['steady_steps']} steady steps{mem}", flush=True)
            # one file per model and device, the settings inside; after every recipe: a run cut short keeps what it measured
            write_results(path, rows, procedure="trainer", model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                          data=data_label(args.data), steps=args.steps, compile=rows[0].get("compile"),
                          compile_mode=rows[0].get("compile_mode") or "eager")


if __name__ == "__main__":
    main()
