"""The ``fp4train`` command: ``train``, ``compare``, ``analyze``, ``eval``, ``export``, ``generate``, ``recipes``.

Every training option has a flag; ``--config file.toml`` sets many at once, and flags given on
the command line override the file. ``fp4train --version`` and ``fp4train --help`` answer without loading PyTorch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
from pathlib import Path

from . import __version__


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


def _at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


def _number(low: float, *, open_low: bool = False):
    """An argparse type: a finite number >= ``low`` (> where ``open_low``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < low or (open_low and v == low):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if open_low else '>='} {low:g}, got {text}")
        return v
    return parse


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that read a finished run: which run, which checkpoint, and whether to trust it."""
    p.add_argument("--run", required=True, help="the run directory (fp4train train --out; for a comparison, one of its "
                   "runs/<recipe>-seed<N> folders)")
    p.add_argument("--checkpoint", help="a checkpoint file of the run (default: its newest)")
    p.add_argument("--trust-checkpoint", action="store_true", help="load --checkpoint although no checkpoints.json lists "
                   "it (its checksums cannot be verified)")


def __getattr__(name: str):
    if name == "HELP":  # every training option's help text, from its definition (fp4train.train.config.TrainConfig)
        from .train.config import TrainConfig

        return {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.metadata["cli"]}
    raise AttributeError(name)


def _add_config_flags(p: argparse.ArgumentParser, *, train: bool = True, skip=(), out: str | None = None) -> None:
    """A flag per :class:`~fp4train.train.config.TrainConfig` option (its help, range, choices and default from the
    field); ``train=False``: not the options only a training run uses; ``skip``: nor these (the command's own)."""
    from .train.config import TrainConfig, choices

    out = out or TrainConfig.out
    p.add_argument("--config", metavar="TOML", help="read options from a TOML file (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        if not f.metadata["cli"] or (f.metadata["train_only"] and not train) or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = out if f.name == "out" else f.default if f.default is not dataclasses.MISSING else None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        bounds = f.metadata.get("bounds")
        h = f.metadata["help"] + (f"; {'each ' if f.name == 'betas' else ''}{bounds}" if bounds else "")
        h += f" (default: {shown})" if default is not None and f.type != "bool" else ""
        if f.type in ("bool", bool, "bool | None"):
            shown = "" if default is None else f" (default: {'on' if default else 'off'})"  # None: the help says
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=h + shown)
        elif f.name == "betas":
            p.add_argument(flag, dest=f.name, type=_betas, default=None, metavar="B1,B2", help=h)
        elif choices(f):
            p.add_argument(flag, dest=f.name, choices=choices(f), default=None, help=h)
        else:
            typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(flag, dest=f.name, type=typ, default=None, metavar=f.name.upper(), help=h)


def _config_from_args(args, *, drop=()):
    """The :class:`~fp4train.train.config.TrainConfig` of the flags: defaults (the subcommand's --out among them) < the
    run's own config.json (on --resume) < --config TOML < flags given."""
    from .train.config import TrainConfig

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if f.metadata["cli"] and f.name not in drop and getattr(args, f.name, None) is not None}
    cfg = _merged_config(args, overrides, {"out": args.default_out})
    if cfg.hf_config is not None and "model" in overrides:
        raise ValueError(f"--model {cfg.model} and --hf-config {cfg.hf_config} both name the model to train: give one "
                         "(--hf-config trains its config's architecture)")
    return cfg


def _merged_config(args, overrides: dict, defaults: dict):
    """``defaults`` < the run's config.json (on --resume) < the --config TOML < ``overrides``, as one config."""
    from .train.config import TrainConfig

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


#: each command's one-line help and description
COMMANDS = {
    "train": ("train a model under one recipe",
              ("Train a Llama-style model under one recipe. Writes config.json, metrics.jsonl, TensorBoard logs, checkpoints "
               "and summary.json to --out, which no other process may write meanwhile. Ctrl-C or SIGTERM stops after the "
               "step in progress, with a checkpoint (exit 130 or 143); --resume continues.")),
    "compare": ("train several recipes on the same model, data, seed and budget",
                ("Train every recipe (BF16 is always included as the baseline) for every seed with otherwise identical "
                 "settings, then write report.md, report.json and loss.png to --out. Run again, the same command reuses "
                 "finished runs and resumes interrupted ones.")),
    "analyze": ("outlier-pattern maps and per-GEMM error of every recipe on a real model",
                ("Train the model in BF16 for --steps steps on real text, classify W, X and dY of every linear on every "
                 "step, and on capture steps measure each GEMM's error under plain MXFP4, inner Hadamard, outlier "
                 "extraction and every preset recipe. Writes analysis.json, analysis.md, patterns.png and "
                 "recipe_errors.png to --out.")),
    "eval": ("loss and perplexity of a trained checkpoint on any text",
             ("Evaluate a run's checkpoint on a text source (any --data that train reads): mean next-token loss and "
              "perplexity over non-overlapping windows, with the recipe's quantized forward (as trained) or as a plain "
              "BF16 model. Prints one line; --json FILE also writes it.")),
    "export": ("write a trained run as a Hugging Face folder (LlamaForCausalLM, or the --hf-config architecture)",
               ("Write a run's trained weights (LoRA-SVD merged) as a Hugging Face folder: config.json, model.safetensors "
                "and the tokenizer; transformers' from_pretrained loads it.")),
    "generate": ("continue a prompt with a trained run's model (a smoke look)",
                 ("Sample a continuation of --prompt from a run's checkpoint (plain forward, LoRA-SVD merged; top-k "
                  "sampling, seeded), printed as it is generated. A quick look at what a model learned, not a serving "
                  "path.")),
    "recipes": ("list the recipes", "List the registered recipes, or print one as TOML."),
}


def _top_level_parser() -> tuple[_Parser, argparse._SubParsersAction]:
    ap = _Parser(prog="fp4train", description="Train language models in FP4 (MXFP4, NVFP4) and compare recipes.")
    ap.add_argument("--version", action="version", version=f"fp4train {__version__}")
    return ap, ap.add_subparsers(dest="command", required=True, parser_class=_Parser)


def _subparser(name: str) -> argparse.ArgumentParser:
    """The parser of one ``fp4train`` command (for its defaults)."""
    ap = build_parser()
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def build_parser(*, commands: bool = True) -> argparse.ArgumentParser:
    """The ``fp4train`` parser; ``commands=False``: the commands' names alone, without their flags (which need the
    training config, and so PyTorch)."""
    ap, sub = _top_level_parser()
    if not commands:
        for name, (short, desc) in COMMANDS.items():
            sub.add_parser(name, help=short, description=desc)
        return ap

    def command(name: str) -> _Parser:
        return sub.add_parser(name, help=COMMANDS[name][0], description=COMMANDS[name][1])

    _add_training_commands(command)
    _add_run_commands(command)
    return ap


def _add_training_commands(command) -> None:
    """``train``, ``compare`` and ``analyze``: each takes the training options (:func:`_add_config_flags`)."""
    from .train.config import TrainConfig

    t = command("train")
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

    c = command("compare")
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
    c.add_argument("--across", default=None, help="comma-separated folders of finished comparisons, one per model size: "
                   "train nothing, write each recipe's gap to BF16 against model size (a table, the trend, the ranking "
                   "and a figure) into --out")
    c.add_argument("--noise-floor", action="store_true", help="also train BF16 once more per seed with the same "
                   "initialization and the training data in another order (--data-seed = seed + 1000): the report gives "
                   "this same-init spread beside BF16's seed-to-seed spread")

    a = command("analyze")
    _add_config_flags(a, train=False, out="runs/analysis")
    a.set_defaults(default_out="runs/analysis")
    a.add_argument("--steps", type=_at_least(1), default=200, help="BF16 training steps to observe (default: 200)")
    a.add_argument("--capture-every", type=_at_least(1), default=50, help="measure GEMM errors every N steps and at the "
                   "end (default: 50)")
    a.add_argument("--threshold", type=_number(0, open_low=True), default=4.0, help="outlier-pattern threshold, > 0 "
                   "(default: 4.0)")
    a.add_argument("--k", type=_at_least(1), default=16, help="outlier rows/channels extracted per operand (default: 16)")


def _add_run_commands(command) -> None:
    """``eval``, ``export``, ``generate`` (each reads a finished run) and ``recipes``."""
    e = command("eval")
    _add_run_flags(e)
    e.add_argument("--data", default=None, help="text to evaluate on (default: the run's own validation split - the "
                   "documents its training never saw - its first 1,048,576 tokens unless --max-tokens says otherwise)")
    e.add_argument("--forward", default="recipe", choices=["recipe", "bf16"], help="recipe: the quantized forward the "
                   "run trained with; bf16: the same weights unquantized (LoRA-SVD merged) (default: recipe)")
    e.add_argument("--seq-len", type=_at_least(1), default=None, help="window length, >= 1 (default: the run's)")
    e.add_argument("--batch-size", type=_at_least(1), default=None, help="windows per forward, >= 1 (default: the run's)")
    e.add_argument("--max-tokens", type=_at_least(2), default=None, help="evaluate on the first N tokens only, at least "
                   "one window (default: all of --data's text; 1,048,576 tokens of the validation split)")
    e.add_argument("--device", default="auto", help="auto (GPU if there is one), cpu, cuda or cuda:N (default: auto)")
    e.add_argument("--json", help="also write the result to this JSON file")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    x = command("export")
    _add_run_flags(x)
    x.add_argument("--out", required=True, help="a new or empty folder to write")
    x.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype (default: bfloat16)")

    gen = command("generate")
    _add_run_flags(gen)
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=_at_least(1), default=50, help="tokens to generate, at most the model's "
                     "context length; printed as they come (default: 50)")
    gen.add_argument("--temperature", type=_number(0), default=0.8, help="sampling temperature, >= 0; 0: greedy "
                     "(default: 0.8)")
    gen.add_argument("--top-k", type=_at_least(1), default=50, help="sample among the k likeliest tokens (default: 50)")
    gen.add_argument("--seed", type=_at_least(0), default=0, help="sampling seed (default: 0)")
    gen.add_argument("--device", default="auto", help="auto (GPU if there is one), cpu, cuda or cuda:N (default: auto)")

    r = command("recipes")
    r.add_argument("--show", metavar="NAME", help="print this recipe as TOML (a starting point for a custom recipe)")


def main(argv=None) -> int:
    """The ``fp4train`` command. A user error (a bad flag, file or setting, a full or read-only disk) is one line on
    stderr and exit code 2; Ctrl-C exits 130 and SIGTERM 143, each saying how to continue; anything else is a bug and
    keeps its traceback. Under torchrun, rank 0 speaks for every rank."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(commands=bool(argv) and argv[0] in COMMANDS).parse_args(argv)
    from .train import CheckpointError, TrainingDiverged
    from .train.signals import TrainingInterrupted, exit_code, signal_name, terminate_as_interrupt

    quiet = int(os.environ.get("RANK", "0")) > 0

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    try:
        with terminate_as_interrupt():
            return _run(args)
    except (TrainingDiverged, CheckpointError, ValueError, FileNotFoundError) as e:
        say(f"fp4train: error: {e}")
        return 2
    except OSError as e:  # the disk (full, read-only) or a path (a folder where a file goes): the reason and the path
        say(f"fp4train: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}{_last_checkpoint(args)}"
            + (f"; continue with: {_resume_hint(args)}" if _last_checkpoint(args) or args.command == "compare" else ""))
        return 2
    except TrainingInterrupted as e:
        by = "" if e.signum == signal.SIGINT else f" by {signal_name(e.signum)}"
        say(f"fp4train: stopped at step {e.step}{by}, checkpoint {e.checkpoint}; continue with: {_resume_hint(args)}")
        return exit_code(e.signum)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (signals.Terminated), outside a run's steps
        signum = getattr(e, "signum", signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
        if args.command in ("train", "compare"):
            last = _last_checkpoint(args)
            hint = _resume_hint(args) if last or args.command != "train" else "the same command with --overwrite (no step was saved)"
            say(f"\nfp4train: {what}{last}; continue with: {hint}")
        else:
            say(f"\nfp4train: {what}")
        return exit_code(signum)


def _run(args) -> int:
    if args.command == "recipes":
        from . import recipes as _recipes

        print(_recipes.get(args.show).to_toml() if args.show else _recipes.describe())
        return 0

    if args.command == "eval":
        from .evaluate import evaluate
        from .train.run_dir import write_text

        if args.json:
            _check_output_file(args.json, "--json")
        res = evaluate(args.run, args.data, checkpoint=args.checkpoint, trust=args.trust_checkpoint, forward=args.forward,
                       seq_len=args.seq_len, batch_size=args.batch_size, max_tokens=args.max_tokens, device=args.device,
                       progress=args.progress)
        if args.json:
            write_text(Path(args.json), json.dumps(res, indent=1) + "\n")
        return 0
    if args.command == "generate":
        from .evaluate import generate_pieces

        pieces = generate_pieces(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, seed=args.seed, checkpoint=args.checkpoint, trust=args.trust_checkpoint,
                          device=args.device)
        first = next(pieces, None)  # the checks and the model's loading happen before anything is printed
        if first is not None:
            sys.stdout.write(args.prompt + first)
            sys.stdout.flush()
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
        else:
            sys.stdout.write(args.prompt)
        print()
        return 0
    if args.command == "export":
        from .export import export_hf

        out = export_hf(args.run, args.out, checkpoint=args.checkpoint, trust=args.trust_checkpoint, dtype=args.dtype)
        print(f"fp4train: wrote {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
        return 0

    from .train.compare import compare
    from .train.config import TRAIN_ONLY, TrainConfig
    from .train.trainer import train

    if args.command == "analyze":
        from .analysis import analyze

        cfg = _config_from_args(args, drop=TRAIN_ONLY)
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
    elif args.across is not None:
        from .train.size_report import size_report

        base, compare_flags, defaults = _config_from_args(args), _subparser("compare"), TrainConfig()
        trained = [f for f in ("recipes", "seeds", "eval_data", "gpus", "noise_floor", "overwrite")
                   if getattr(args, f) != compare_flags.get_default(f)]
        trained += [k for k, v in base.to_dict().items() if k != "out" and v != getattr(defaults, k)]
        if trained:
            raise ValueError(f"--across reads finished comparisons and trains nothing: leave out {', '.join(trained)} "
                             "(only --out applies)")
        rep = size_report([f.strip() for f in args.across.split(",") if f.strip()], base.out)
        print((Path(base.out) / "across_sizes.md").read_text())
        print(f"fp4train compare: gap against model size in {base.out} (across_sizes.md, .json, gap_vs_size.png)"
              + ("" if rep["same_ranking"] else "; the ranking changes with size"))
    else:
        base = _config_from_args(args)
        seeds = _ints("--seeds", args.seeds) if args.seeds else [base.seed]
        bad = [s for s in seeds if s < 0]
        if bad:
            raise ValueError(f"--seeds takes seeds >= 0, got {', '.join(map(str, bad))}")
        recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
        if not recipes:
            raise ValueError(f"--recipes {args.recipes!r} names no recipe: give comma-separated names, e.g. mxfp4,nvfp4 "
                             "(see fp4train recipes)")
        eval_data = [t.strip() for t in args.eval_data.split(",") if t.strip()] if args.eval_data else None
        if args.eval_data is not None and not eval_data:
            raise ValueError(f"--eval-data {args.eval_data!r} names no text: give comma-separated sources, or leave it out")
        compare(base, recipes, seeds, base.out, gpus=_gpus(args.gpus), overwrite=args.overwrite, eval_data=eval_data,
                recipe_optimizers=getattr(args, "optimizer", None) is None, noise_floor=args.noise_floor)
    return 0


def _check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, a file that cannot be written: a folder, a read-only place. Missing folders above it
    are made."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name, e.g. {p / 'result.json'}")
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written: {e.strerror or e}") from None
    if not existed:
        p.unlink()


def _out(args) -> str:
    return getattr(args, "out", None) or args.default_out


def _resume_hint(args) -> str:
    if args.command == "train":
        from .train.run_dir import resume_command

        return resume_command(_out(args))
    if args.command == "compare":
        return "the same fp4train compare command (finished runs are reused, the stopped one resumes)"
    return "the same command"


def _last_checkpoint(args) -> str:
    if args.command != "train":
        return ""
    from .train import CheckpointError, Checkpoints

    out = _out(args)
    try:
        last = Checkpoints(out).entries()
    except CheckpointError:
        return ""
    return f"; the last checkpoint is {Path(out) / last[-1]['file']} (step {last[-1]['step']})" if last else ""


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
    if not gpus:
        raise ValueError(f"--gpus {spec!r} names no GPU: give ids such as 0,1, or none (runs in this process) or auto")
    if not n:
        raise ValueError(f"--gpus {spec}: PyTorch sees no CUDA GPU on this machine; use --gpus none (runs in this process, "
                         "on the CPU) or auto")
    bad = [g for g in gpus if g < 0 or g >= n]
    if bad:
        raise ValueError(f"--gpus {spec}: GPU(s) {bad} do not exist; this machine has {n} (0..{n - 1})")
    return gpus


if __name__ == "__main__":
    sys.exit(main())
