"""The recipe comparison's protocol: every preset, three seeds, BF16's noise floor, at one model size per call.

Question: which FP4 recipe comes closest to BF16, by how much, and is the difference larger than the
noise? Each call trains, with ``fp4train compare`` (same model, data order, seeds and token budget for
every recipe; each recipe with its own optimizer - ``fullstack``: Q-Root + QAdamW, paired to BF16 trained
with Root + AdamW), into ``--out``:

* every preset, BF16 first, seeds 0, 1, 2;
* the noise floor: BF16 again per seed with the same initialization and the training windows in another
  order (``compare --noise-floor``);
* ``--components``: Full-Stack FP4 with one part taken out at a time (BF16 attention, AdamW's FP32 moments,
  no LoRA-SVD), to see which part costs what;
* ``--fullstack-ablation``: Full-Stack FP4's component ablation as its paper runs it, into
  ``<out>/fullstack-ablation``: the NVFP4 LoRA-SVD linears alone, + the quantized optimizer, + NVFP4 attention,
  everything; all trained with Root (Q-Root or BF16 Root), so paired to BF16 Root + AdamW (``bf16-root``);
* ``--tib2d-ablation``: the 2D-block paper's ablation, into ``<out>/tib2d-ablation``: ``tib2d`` with one part
  changed at a time - 1x32 blocks in place of 32x32 tiles (the 1D-vs-2D comparison at a matched recipe the paper
  does not make), floor scales in place of ceil, round-to-nearest gradients in place of stochastic rounding,
  attention's Q/K projections in MXFP4 in place of MXFP8; paired with the main comparison's BF16 runs;
* ``--seed-ablation``: the paper-named presets against our additions, into ``<out>/seed-fidelity``: ``fullstack``
  (the paper's Q-Root with native NVFP4 Newton-Schulz, 4/6 on) beside ``fullstack_bf16ns`` (Q-Root with BF16
  Newton-Schulz, ours) and ``fullstack_no46`` (4/6 off), and ``adahop`` (IHT or OE) beside ``adahop_plain`` (plain
  MXFP4 allowed, ours); paired with BF16 and BF16 Root + AdamW (``--seed-ablation-recipes`` picks among them);
* ``--ablation``: AdaHOP without its BF16 start - a calibration made by a separate short run (another seed)
  loaded with ``--calibration``, so that every step of every seed is quantized - into ``<out>/adahop-precalibrated``,
  paired with the same BF16 runs;
* every finished run evaluated on ``--eval-data`` (out-of-domain text);
* ``--tokens-per-param R``: the run's length set to R tokens per model parameter (the batch stays the protocol's),
  so that comparisons at several sizes share one budget ratio (``fp4train compare --across`` sets them side by side).

The settings below are the protocol (``docs/comparing.md`` gives them and the noise floor they reach);
re-running the same command reuses finished runs and resumes interrupted ones, so a comparison can be run
in pieces. ``fp4train compare``'s report (``report.md``, ``report.json``, ``loss.png``) is written per folder.

    mkdir -p enwiki && cp ../shared/data/enwiki/*.jsonl.xz enwiki/   # the protocol's text: train-00..03, val-00
    python bench/compare_protocol.py --model 20m --data enwiki --components --ablation \\
        --eval-data shakespeare --out bench/results/compare-20m-enwiki
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import fp4train
from fp4train.train import TrainConfig
from fp4train.train.compare import BASELINE, REORDERED, ROOT_BASELINE, compare, run_name

#: every preset, in the order they are trained (a comparison cut short has the first ones whole)
PRESETS = ("bf16", "adahop", "tib2d", "fullstack", "nvfp4", "mxfp4", "hadamard_mxfp4", "fp8_rowwise", "adahop_measured")
#: 600 steps x 64 x 512 = 19.7M tokens per run (under one pass over four enwiki shards): past the early plateau,
#: where a shift of the plateau exit no longer moves the final loss by more than the recipes' gaps
PROTOCOL = dict(seq_len=512, batch_size=64, max_steps=600, lr=1e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1,
                grad_clip=1.0, eval_every=50, eval_batches=16, ckpt_every=100, keep_checkpoints=1, log_every=10)
#: ``--short``: 300 steps x 32 x 512 = 4.9M tokens, a quarter of the cost; its noise floor is above the gaps
SHORT = {**PROTOCOL, "batch_size": 32, "max_steps": 300, "warmup_steps": 75}
SEEDS = (0, 1, 2)


def budget(model: str, tokens_per_param: float, settings: dict = PROTOCOL) -> dict:
    """``settings`` with the training length set to ``tokens_per_param`` tokens per model parameter (the protocol's
    600 steps are 0.9 per parameter of ``20m``), warmup, evaluation and checkpoints kept at the protocol's share of
    the run (1/6, 1/12, 1/6); the batch stays the protocol's."""
    import torch

    from fp4train import models

    with torch.device("meta"):
        params = models.build(model).num_params()
    per_step = settings["seq_len"] * settings["batch_size"]
    steps = max(12, round(tokens_per_param * params / per_step))
    return {**settings, "max_steps": steps, "warmup_steps": max(1, steps // 6), "eval_every": max(1, steps // 12),
            "ckpt_every": max(1, steps // 6)}
EVAL_TOKENS = 131_072


def fullstack_components(folder: Path) -> list[str]:
    """Full-Stack FP4 less one part each, as recipe files in ``folder``: their paths."""
    full = fp4train.recipes.get("fullstack")
    return _recipe_files(folder, {
        "fullstack_bf16_attention": ("less one part: BF16 attention", full.replace(attention=None)),
        "fullstack_adamw": ("less one part: AdamW with FP32 moments", full.replace(optimizer=None)),
        "fullstack_no_lora": ("less one part: no LoRA-SVD", full.replace(lora_svd=None)),
    })


def fullstack_ablation(folder: Path) -> list[str]:
    """Full-Stack FP4's component ablation as its paper runs it: its NVFP4 LoRA-SVD linears alone (BF16 attention,
    Root with BF16 states), then with its quantized optimizer (Q-Root + QAdamW), or with its NVFP4 attention, then
    everything (``fullstack``); every one trained with the Root family, so paired to BF16 Root + AdamW. Recipe files
    in ``folder`` (``fullstack`` by name): their paths."""
    full = fp4train.recipes.get("fullstack")
    return [*_recipe_files(folder, {
        "fullstack_linear": ("linears only", full.replace(attention=None, optimizer="root")),
        "fullstack_linear_optimizer": ("linears + optimizer", full.replace(attention=None)),
        "fullstack_linear_attention": ("linears + attention", full.replace(optimizer="root")),
    }), "fullstack"]


def tib2d_ablation(folder: Path) -> list[str]:
    """The 2D-block paper's ablation in small: ``tib2d`` with one part changed at a time, as recipe files in
    ``folder`` (``tib2d`` by name): their paths."""
    tib2d = fp4train.recipes.get("tib2d")
    qk = [o for o in tib2d.overrides if o.pattern in ("role:query", "role:key")]
    return [*_recipe_files(folder, {
        "tib2d_1d": ("1x32 blocks in place of 32x32 tiles", _each_quant(tib2d, _one_d)),
        "tib2d_floor": ("floor scales in place of ceil", _each_quant(tib2d, lambda q: dataclasses.replace(q, scale="floor"))),
        "tib2d_nearest": ("round-to-nearest gradients in place of stochastic rounding",
                          _each_quant(tib2d, lambda q: dataclasses.replace(q, rounding="nearest"))),
        "tib2d_fp4_qk": ("Q/K projections in MXFP4 like every linear",
                         tib2d.replace(overrides=tuple(o for o in tib2d.overrides if o not in qk))),
    }, "Transposition-invariant 2D blocks"), "tib2d"]


def seed_fidelity(folder: Path, names: list[str]) -> list[str]:
    """The paper-named presets and our additions beside them (see ``--seed-ablation``), ``names`` among
    :data:`SEED_FIDELITY`: preset names and recipe files in ``folder``."""
    full = fp4train.recipes.get("fullstack")
    files = dict(zip(("fullstack_bf16ns", "fullstack_no46"), _recipe_files(folder, {
        "fullstack_bf16ns": ("Q-Root with BF16 Newton-Schulz (ours)", full.replace(optimizer="qroot_bf16ns")),
        "fullstack_no46": ("4/6 block scaling off", full.replace(four_over_six=False)),
    })))
    unknown = [n for n in names if n not in SEED_FIDELITY]
    if unknown:
        raise SystemExit(f"--seed-ablation-recipes: unknown {unknown}; choose among {SEED_FIDELITY}")
    return [files.get(n, n) for n in names]


#: the seed-fidelity ablation's recipes (``--seed-ablation``)
SEED_FIDELITY = ("fullstack", "fullstack_bf16ns", "fullstack_no46", "adahop", "adahop_plain")


def _one_d(q):
    """A 32x32-tile quantization as 1x32 blocks along the GEMM's inner dim (the same scale rule and rounding)."""
    return dataclasses.replace(q, block=q.block[1]) if isinstance(q.block, tuple) else q


def _each_quant(recipe, change):
    """``recipe`` with ``change`` applied to every operand quantization of its linear and of its overrides'."""
    def linear(spec):
        if spec is None:
            return None
        gemms = {g: dataclasses.replace(getattr(spec, g), a=change(getattr(spec, g).a), b=change(getattr(spec, g).b))
                 for g in ("fprop", "dgrad", "wgrad")}
        return dataclasses.replace(spec, **gemms)

    overrides = tuple(dataclasses.replace(o, linear=linear(o.linear)) for o in recipe.overrides)
    return recipe.replace(linear=linear(recipe.linear), overrides=overrides)


def _recipe_files(folder: Path, variants: dict, method: str = "Full-Stack FP4") -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (what, rec) in variants.items():
        path = folder / f"{name}.json"
        rec.replace(name=name, description=f"{method}, {what}").save(path)
        paths.append(str(path))
    return paths


def _link_runs_from(out: Path, other: Path, seeds: list[int], recipes: tuple[str, ...] = ()) -> None:
    """Link the main comparison's finished runs that an ablation would train again into ``other``: its BF16 runs (and
    their reordered twins; a recipe file or calibration changes nothing in a BF16 run) and its runs of the presets
    ``recipes`` that the ablation trains as they are (its full recipe, its own baseline)."""
    for s in seeds:
        for name in (run_name(BASELINE, s), run_name(REORDERED, s), *(run_name(r, s) for r in recipes)):
            link = other / "runs" / name
            if (out / "runs" / name).exists() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.relpath(out / "runs" / name, link.parent), link)


def calibration_run(base: TrainConfig, out: Path) -> Path:
    """A short AdaHOP run (seed 1000: its calibration steps and one more) whose calibration the ablation loads."""
    from fp4train.train import train

    cfg = dataclasses.replace(base, recipe="adahop", seed=1000, max_steps=fp4train.recipes.get("adahop").calibration_steps + 1,
                              eval_every=0, ckpt_every=0, out=str(out), tensorboard=False, optimizer=None)
    if not (out / "adahop_calibration.json").exists():
        train(cfg, overwrite=True)
    return out / "adahop_calibration.json"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipes", default=",".join(PRESETS), help="'' : none (only the ablations asked for)")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--components", action="store_true", help="also Full-Stack FP4 less one part at a time")
    ap.add_argument("--ablation", action="store_true", help="also AdaHOP with a calibration loaded from another run")
    ap.add_argument("--seed-ablation", action="store_true", help="also the paper-named presets against our additions")
    ap.add_argument("--seed-ablation-recipes", default=",".join(SEED_FIDELITY), help="which of them (comma-separated)")
    ap.add_argument("--fullstack-ablation", action="store_true",
                    help="also Full-Stack FP4's parts added one at a time, paired to BF16 Root + AdamW")
    ap.add_argument("--tib2d-ablation", action="store_true",
                    help="also tib2d with one part changed at a time (1D blocks, floor scales, no SR, MXFP4 Q/K)")
    ap.add_argument("--eval-data", default=None, help="comma-separated out-of-domain texts")
    ap.add_argument("--gpus", default="0,0,0", help="GPU ids, one run per entry at a time (default: three runs on GPU 0)")
    ap.add_argument("--short", action="store_true", help="the 4.9M-token budget (see SHORT) instead of 19.7M")
    ap.add_argument("--max-steps", type=int, default=None, help="(the protocol's unless a quick look is wanted)")
    ap.add_argument("--tokens-per-param", type=float, default=None,
                    help="train each run on this many tokens per model parameter instead of the fixed 600 steps "
                         "(comparisons across sizes at one ratio; the 20m protocol is 0.9)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus != "none" else None
    evals = [t for t in (args.eval_data or "").split(",") if t]
    settings = SHORT if args.short else PROTOCOL
    if args.tokens_per_param is not None:
        if args.short or args.max_steps:
            raise SystemExit("--tokens-per-param sets the run's length: leave out --short and --max-steps")
        if args.tokens_per_param <= 0:
            raise SystemExit(f"--tokens-per-param must be > 0, got {args.tokens_per_param}")
        settings = budget(args.model, args.tokens_per_param)
        print(f"compare_protocol: {args.model} at {args.tokens_per_param} tokens per parameter: {settings['max_steps']} steps "
              f"x {settings['seq_len'] * settings['batch_size']:,} tokens", flush=True)
    base = TrainConfig(model=args.model, data=args.data, **{**settings, "max_steps": args.max_steps or settings["max_steps"]},
                       progress=False, out=str(out))
    recipes = [r for r in args.recipes.split(",") if r]
    if args.components:
        recipes += fullstack_components(out / "recipes")
    run = dict(gpus=gpus, eval_data=evals, eval_tokens=EVAL_TOKENS, recipe_optimizers=True)
    if recipes:
        compare(base, recipes, seeds, out, noise_floor=True, **run)
    if args.fullstack_ablation:
        abl = out / "fullstack-ablation"
        _link_runs_from(out, abl, seeds, recipes=(ROOT_BASELINE, "fullstack"))
        compare(dataclasses.replace(base, out=str(abl)), fullstack_ablation(abl / "recipes"), seeds, abl, noise_floor=True,
                **run)
    if args.tib2d_ablation:
        abl = out / "tib2d-ablation"
        _link_runs_from(out, abl, seeds, recipes=("tib2d",))
        compare(dataclasses.replace(base, out=str(abl)), tib2d_ablation(abl / "recipes"), seeds, abl, noise_floor=True, **run)
    if args.seed_ablation:
        abl = out / "seed-fidelity"
        _link_runs_from(out, abl, seeds, recipes=(ROOT_BASELINE,))
        names = [n for n in args.seed_ablation_recipes.split(",") if n]
        compare(dataclasses.replace(base, out=str(abl)), seed_fidelity(abl / "recipes", names), seeds, abl, noise_floor=True,
                **run)
    if args.ablation:
        cal = calibration_run(base, out / "adahop-calibration-run")
        abl = out / "adahop-precalibrated"
        _link_runs_from(out, abl, seeds)
        compare(dataclasses.replace(base, calibration=str(cal), out=str(abl)), ["adahop"], seeds, abl, **run)

if __name__ == "__main__":
    main()
