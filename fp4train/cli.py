"""The ``fp4train`` command: ``train``, ``compare``, ``recipes``.

Every training option has a flag; ``--config file.toml`` sets many at once, and flags given on
the command line override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from . import models
from . import recipes as _recipes
from .train.config import COMPILE_MODES, DTYPES, NUMERICS, OPTIMIZERS, PARALLEL, TrainConfig

HELP = {
    "model": "model size preset: tiny, 20m, 60m, 125m, 350m, 1b, 3b",
    "recipe": "recipe name (see `fp4train recipes`) or a recipe .json/.toml file",
    "backend": "GEMM backend: auto (the default: triton on a GPU machine, emulated elsewhere), triton (Triton-kernel "
    "quantization, MXFP4 GEMMs on FP8 tensor cores), fp8_blockwise, or emulated (the reference, runs anywhere)",
    "calibration": "AdaHOP recipes: reuse this adahop_calibration.json (from an earlier run) instead of calibrating",
    "data": "training text: a .txt/.jsonl/.jsonl.xz/.parquet file, a glob, a directory (train-*/val-* shards split themselves), "
    "'shakespeare' or hf:NAME[:SPLIT]; several joined with commas. Default: the packaged tiny-shakespeare",
    "val_data": "validation text, same forms as --data (default: hold out --val-fraction of the documents)",
    "val_fraction": "fraction of documents held out for validation when --val-data is not given",
    "tokenizer": "tokenizer: a tokenizer.json(.xz) path or a Hugging Face name (default: the packaged 32k enwiki BPE)",
    "text_field": "JSON/parquet field that holds the text",
    "cache_dir": "where tokenized data is cached (default: $FP4TRAIN_CACHE or ~/.cache/fp4train)",
    "seq_len": "tokens per sequence",
    "batch_size": "sequences per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "max_steps": "optimizer steps to train",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine schedule decays to lr * this",
    "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay (matrices only)",
    "betas": "AdamW betas, e.g. 0.9,0.95",
    "grad_clip": "clip the global gradient norm to this",
    "eval_every": "evaluate the validation loss every N steps (and at the end); 0: only at the end",
    "eval_batches": "validation batches per evaluation (the same ones every time)",
    "ckpt_every": "write a checkpoint every N steps (and at the end); 0: only at the end",
    "keep_checkpoints": "how many recent checkpoints to keep",
    "log_every": "write a metrics record every N steps",
    "out": "run directory (config, metrics.jsonl, TensorBoard logs, checkpoints, summary); a new run needs an empty or new one",
    "seed": "seed for init, data order and stochastic rounding",
    "data_seed": "seed of the training windows' order alone (default: --seed); same init and rounding, another order",
    "deterministic": "the same loss bits on every repeat of a run on one GPU: torch.use_deterministic_algorithms, a "
    "fixed cuBLAS workspace, atomic-free attention backward (slower; off by default)",
    "device": "auto (GPU if there is one), cpu, cuda or cuda:N",
    "parallel": "none; ddp: data-parallel over the processes torchrun starts (torchrun --nproc-per-node N -m fp4train "
    "train --parallel ddp ...; each takes batch-size / N sequences of every batch, so the global batch is the same); "
    "fsdp: the same, with each transformer block's weights, gradients and optimizer states sharded (FSDP2)",
    "dtype": "autocast dtype for non-quantized ops: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32",
    "optimizer": "adamw (torch's, FP32 moments), qadamw (AdamW with both moments stored in NVFP4, "
    "fp4train.optim.QAdamW), muon (Muon on the 2D hidden weights, AdamW on the rest: torch's arithmetic) or qmuon "
    "(the same with NVFP4 states, fp4train.optim.QMuon); default: the recipe's (fullstack: qadamw), else adamw",
    "compile": "torch.compile the model (default: on a GPU, off on a CPU; --no-compile runs eagerly)",
    "compile_mode": "with compile: default, or reduce-overhead (each step replayed as CUDA graphs: no per-kernel "
    "launch from the host, which bounds the quantized recipes' speed at small models; stochastic-rounding seeds are "
    "then drawn on the device, random Hadamard signs too); default: reduce-overhead on a GPU with --grad-accum 1, "
    "else default",
    "numerics": "how quantization runs, same bits in each: eager (reference ops), compiled (torch.compile'd "
    "reference), triton (fp4train's kernels where they exist); default: triton with the triton backend (the default "
    "on a GPU machine), eager elsewhere",
    "progress": "show a progress bar",
    "tensorboard": "write TensorBoard logs",
}
_SKIP = {"extra"}
#: Options that only a training run uses (``analyze`` trains BF16 for its own --steps, without checkpoints)
_TRAIN_ONLY = ("recipe", "max_steps", "calibration", "backend", "numerics", "eval_every", "eval_batches", "ckpt_every",
               "keep_checkpoints", "compile", "compile_mode")
_CHOICES = {"model": models.names(), "dtype": DTYPES, "numerics": NUMERICS, "compile_mode": COMPILE_MODES, "optimizer": OPTIMIZERS, "parallel": PARALLEL}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the culprit and where to look, no usage block."""

    def error(self, message):
        self.exit(2, f"fp4train: error: {message} (see {self.prog} --help)\n")


def _betas(s: str) -> tuple[float, float]:
    try:
        b = tuple(float(v) for v in s.split(","))
    except ValueError:
        b = ()
    if len(b) != 2:
        raise argparse.ArgumentTypeError(f"expected two numbers like 0.9,0.95, got {s!r}")
    return b


def _add_config_flags(p: argparse.ArgumentParser, *, skip=(), out: str = TrainConfig.out) -> None:
    p.add_argument("--config", metavar="TOML", help="read options from a TOML file (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SKIP or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = out if f.name == "out" else f.default if f.default is not dataclasses.MISSING else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        h = HELP[f.name] + (f" (default: {shown})" if default is not None and f.type != "bool" else "")
        if f.type in ("bool", bool, "bool | None"):
            shown = "" if default is None else f" (default: {'on' if default else 'off'})"  # None: the help says
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=h + shown)
        elif f.name == "betas":
            p.add_argument(flag, dest=f.name, type=_betas, default=None, metavar="B1,B2", help=h)
        elif f.name in _CHOICES:
            p.add_argument(flag, dest=f.name, choices=_CHOICES[f.name], default=None, help=h)
        else:
            typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(flag, dest=f.name, type=typ, default=None, metavar=f.name.upper(), help=h)


def _config_from_args(args, *, drop=()) -> TrainConfig:
    """Defaults (the subcommand's --out among them) < the run's own config.json (on --resume) < --config TOML
    < flags given."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if f.name not in _SKIP and f.name not in drop and getattr(args, f.name, None) is not None}
    defaults = {"out": args.default_out}
    if getattr(args, "config", None):
        return TrainConfig.from_toml(args.config, defaults=defaults, **overrides)
    if getattr(args, "resume", False):
        saved = Path(overrides.get("out", defaults["out"])) / "config.json"
        if saved.exists():
            try:
                base = json.loads(saved.read_text())["train"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"{saved} is damaged ({type(e).__name__}: {e}); give every option on the command line "
                                 "with --resume, as the run was started") from None
            # how many processes run it is this launch's, not the saved run's: a checkpoint resumes on any number
            # (a sharded run stays sharded where there are several; --parallel overrides)
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                base["parallel"] = "none"
            elif base.get("parallel", "none") == "none":
                base["parallel"] = "ddp"
            base.update(overrides)
            return TrainConfig.from_dict(base)
    return TrainConfig(**{**defaults, **overrides})


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = _Parser(prog="fp4train", description="Train language models in FP4 (MXFP4, NVFP4) and compare recipes.")
    ap.add_argument("--version", action="version", version=f"fp4train {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model under one recipe",
                       description="Train a Llama-style model under one recipe. Writes config.json, metrics.jsonl, "
                       "TensorBoard logs, checkpoints and summary.json to --out. Ctrl-C stops after the step in "
                       "progress, with a checkpoint; --resume continues.")
    _add_config_flags(t)
    t.set_defaults(default_out=TrainConfig.out)
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                   help="continue from the newest checkpoint in --out (or from the given checkpoint: a step_NNNNNN.pt file, "
                   "or a sharded run's step_NNNNNN directory); the run's "
                   "saved config.json supplies every option not given on the command line; a finished run is left "
                   "as it is unless a larger --max-steps extends it")
    t.add_argument("--overwrite", action="store_true", help="replace the run that --out holds (its checkpoints, metrics "
                   "and summary are deleted first)")
    t.add_argument("--trust-checkpoint", action="store_true", help="with --resume CHECKPOINT: load it although no "
                   "checkpoints.json lists it (its checksums cannot be verified)")
    t.add_argument("--config-json", help=argparse.SUPPRESS)

    c = sub.add_parser("compare", help="train several recipes on the same model, data, seed and budget",
                       description="Train every recipe (BF16 is always included as the baseline) for every seed with "
                       "otherwise identical settings, then write report.md, report.json and loss.png to --out. Run "
                       "again, the same command reuses finished runs and resumes interrupted ones.")
    _add_config_flags(c, skip=("recipe",), out="runs/compare")
    c.set_defaults(default_out="runs/compare")
    c.add_argument("--recipes", default="bf16,mxfp4,nvfp4", help="comma-separated recipe names (default: bf16,mxfp4,nvfp4)")
    c.add_argument("--seeds", default=None, help="comma-separated seeds, e.g. 0,1 (default: --seed)")
    c.add_argument("--gpus", default="auto", help="GPUs to spread runs over, one run per listed id at a time: auto (every GPU "
                   "when there are several), none (in this process), or e.g. 0,1 or 0,0,1,1 (two runs per GPU)")
    c.add_argument("--overwrite", action="store_true", help="train again the runs in --out that were made with other "
                   "settings (without it, such runs are refused and named)")
    c.add_argument("--eval-data", default=None, help="comma-separated text sources every finished run is also evaluated "
                   "on (the recipe's forward, the first 262,144 tokens), e.g. out-of-domain text; the report adds their "
                   "loss and gap to BF16")
    c.add_argument("--noise-floor", action="store_true", help="also train BF16 once more per seed with the same "
                   "initialization and the training data in another order (--data-seed = seed + 1000): the report gives "
                   "this same-init spread beside BF16's seed-to-seed spread")

    a = sub.add_parser("analyze", help="outlier-pattern maps and per-GEMM error of every recipe on a real model",
                       description="Train the model in BF16 for --steps steps on real text, classify W, X and dY of every "
                       "linear on every step, and on capture steps measure each GEMM's error under plain MXFP4, inner "
                       "Hadamard, outlier extraction and every preset recipe. Writes analysis.json, analysis.md, "
                       "patterns.png and recipe_errors.png to --out.")
    _add_config_flags(a, skip=_TRAIN_ONLY, out="runs/analysis")
    a.set_defaults(default_out="runs/analysis")
    a.add_argument("--steps", type=int, default=200, help="BF16 training steps to observe (default: 200)")
    a.add_argument("--capture-every", type=int, default=50, help="measure GEMM errors every N steps and at the end (default: 50)")
    a.add_argument("--threshold", type=float, default=4.0, help="outlier-pattern threshold (default: 4.0)")
    a.add_argument("--k", type=int, default=16, help="outlier rows/channels extracted per operand (default: 16)")

    e = sub.add_parser("eval", help="loss and perplexity of a trained checkpoint on any text",
                       description="Evaluate a run's checkpoint on a text source (any --data that train reads): mean "
                       "next-token loss and perplexity over non-overlapping windows, with the recipe's quantized forward "
                       "(as trained) or as a plain BF16 model. Prints one line; --json FILE also writes it.")
    e.add_argument("--run", required=True, help="the run directory (fp4train train --out)")
    e.add_argument("--checkpoint", help="a checkpoint file of the run (default: its newest)")
    e.add_argument("--data", default=None, help="text to evaluate on (default: the packaged tiny-shakespeare)")
    e.add_argument("--forward", default="recipe", choices=["recipe", "bf16"], help="recipe: the quantized forward the "
                   "run trained with; bf16: the same weights unquantized (LoRA-SVD merged)")
    e.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's)")
    e.add_argument("--batch-size", type=int, default=None, help="windows per forward (default: the run's)")
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate on the first N tokens only")
    e.add_argument("--device", default="auto", help="auto (GPU if there is one), cpu, cuda or cuda:N")
    e.add_argument("--json", help="also write the result to this JSON file")

    x = sub.add_parser("export", help="write a trained run as a Hugging Face LlamaForCausalLM folder",
                       description="Write a run's trained weights (LoRA-SVD merged) as a Hugging Face folder: "
                       "config.json, model.safetensors and the tokenizer; transformers' from_pretrained loads it.")
    x.add_argument("--run", required=True, help="the run directory (fp4train train --out)")
    x.add_argument("--out", required=True, help="a new or empty folder to write")
    x.add_argument("--checkpoint", help="a checkpoint file of the run (default: its newest)")
    x.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype (default: bfloat16)")

    gen = sub.add_parser("generate", help="continue a prompt with a trained run's model (a smoke look)",
                         description="Sample a continuation of --prompt from a run's checkpoint (plain forward, LoRA-SVD "
                         "merged; top-k sampling, seeded). A quick look at what a model learned, not a serving path.")
    gen.add_argument("--run", required=True, help="the run directory (fp4train train --out)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--checkpoint", help="a checkpoint file of the run (default: its newest)")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto")

    r = sub.add_parser("recipes", help="list the recipes", description="List the registered recipes, or print one as TOML.")
    r.add_argument("--show", metavar="NAME", help="print this recipe as TOML (a starting point for a custom recipe)")
    return ap


def main(argv=None) -> int:
    """The ``fp4train`` command. A user error (a bad flag, file or setting) is one line on stderr and exit
    code 2; Ctrl-C exits 130 saying how to continue; anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    from .train import CheckpointError, TrainingDiverged
    from .train.trainer import TrainingInterrupted

    try:
        return _run(args)
    except (TrainingDiverged, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"fp4train: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"fp4train: stopped at step {e.step}, checkpoint {e.checkpoint}; continue with: {_resume_hint(args)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        last = _last_checkpoint(args)
        hint = _resume_hint(args) if last or args.command != "train" else "the same command with --overwrite (no step was saved)"
        print(f"\nfp4train: interrupted{last}; continue with: {hint}", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.command == "recipes":
        print(_recipes.get(args.show).to_toml() if args.show else _recipes.describe())
        return 0

    if args.command == "eval":
        from .evaluate import evaluate

        res = evaluate(args.run, args.data, checkpoint=args.checkpoint, forward=args.forward, seq_len=args.seq_len,
                       batch_size=args.batch_size, max_tokens=args.max_tokens, device=args.device)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if args.command == "generate":
        from .evaluate import generate

        print(args.prompt + generate(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_k=args.top_k, seed=args.seed, checkpoint=args.checkpoint, device=args.device))
        return 0
    if args.command == "export":
        from .export import export_hf

        out = export_hf(args.run, args.out, checkpoint=args.checkpoint, dtype=args.dtype)
        print(f"fp4train: wrote {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
        return 0

    from .train.compare import compare
    from .train.trainer import train

    if args.command == "analyze":
        from .analysis import analyze

        cfg = _config_from_args(args, drop=_TRAIN_ONLY)
        analyze(cfg, steps=args.steps, capture_every=args.capture_every, out=cfg.out, threshold=args.threshold, k=args.k)
    elif args.command == "train":
        if args.config_json:
            with open(args.config_json) as f:
                cfg = TrainConfig.from_dict(json.load(f))
        else:
            cfg = _config_from_args(args)
        if args.trust_checkpoint and not isinstance(args.resume, str):
            raise ValueError("--trust-checkpoint goes with --resume CHECKPOINT (the checkpoint to load unverified)")
        train(cfg, resume=args.resume, overwrite=args.overwrite, trust=args.trust_checkpoint)
        from .train.distributed import leave

        leave()
    else:
        base = _config_from_args(args)
        seeds = _ints("--seeds", args.seeds) if args.seeds else [base.seed]
        recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
        eval_data = [t.strip() for t in args.eval_data.split(",") if t.strip()] if args.eval_data else None
        compare(base, recipes, seeds, base.out, gpus=_gpus(args.gpus), overwrite=args.overwrite, eval_data=eval_data,
                recipe_optimizers=getattr(args, "optimizer", None) is None, noise_floor=args.noise_floor)
    return 0


def _resume_hint(args) -> str:
    if args.command == "train":
        return f"fp4train train --out {args.out or args.default_out} --resume"
    if args.command == "compare":
        return "the same fp4train compare command (finished runs are reused, the stopped one resumes)"
    return "the same command"


def _last_checkpoint(args) -> str:
    if args.command != "train":
        return ""
    from .train import CheckpointError, Checkpoints

    out = args.out or args.default_out
    try:
        last = Checkpoints(out).entries()
    except CheckpointError:
        return ""
    return f"; the last checkpoint is {out}/{last[-1]['file']} (step {last[-1]['step']})" if last else ""


def _ints(flag: str, spec: str) -> list[int]:
    try:
        return [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 0,1,2; got {spec!r}") from None


def _gpus(spec: str) -> list[int] | None:
    if spec == "none":
        return None
    if spec == "auto":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return list(range(n)) if n > 1 else None
    gpus = _ints("--gpus", spec)
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [g for g in gpus if g >= n] if n else []
    if bad:
        raise ValueError(f"--gpus {spec}: GPU(s) {bad} do not exist; this machine has {n} (0..{n - 1})")
    return gpus


if __name__ == "__main__":
    sys.exit(main())
