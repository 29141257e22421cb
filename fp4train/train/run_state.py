"""A run's checkpoint and summary: what a checkpoint holds (:func:`checkpoint_state`), how a run writes one
(:func:`save_checkpoint`) and continues from one (:func:`load_checkpoint_state`, :func:`resume_or_clear`), and the
summary a finished run writes (:func:`run_summary`). Functions of a :class:`~.trainer.Trainer` ``t`` (this module
imports no trainer: the trainer imports it)."""

from __future__ import annotations

import json
import math

import torch

from .. import backends
from ..checkpoint import CheckpointWriteError
from ..linear import QuantizedLinear
from ..timing import code_commit
from . import sharding
from .config import RESUME_FIXED, saved_settings
from .features import summary_defaults
from .records import SteadySteps
from .rng_state import rng_state, set_rng_state
from .run_dir import clear_run_files, resume_command


def checkpoint_state(t) -> dict:
    """The checkpoint of an unsharded run, in the single-process format (a sharded run writes its shards:
    :func:`save_checkpoint`)."""
    return {"step": t.step, "model": t.model.state_dict(), "optimizer": t.opt.state_dict(), **plain_state(t)}


def plain_state(t) -> dict:
    """What a checkpoint holds besides the model's and the optimizer's tensors (the features' state at its top
    level)."""
    out = {"scheduler": t.sched.state_dict(), "data": t.batches.state_dict(), "rng": rng_state(t.device),
           "config": t.cfg.to_dict(), "recipe": t.recipe.to_dict(), "model_config": t.model.config.to_dict()}
    for f in t.features:
        out.update(f.state_dict())
    return out


def load_checkpoint_state(t, st: dict) -> None:
    """Continue from the checkpoint ``st``: refused if a setting it depends on changed (:data:`.config.RESUME_FIXED`);
    the features' state first, then the model's and the optimizer's (sharded or whole), the schedule, the data
    position, the RNG states and the step."""
    saved = saved_settings(st["config"])
    changed = [k for k in RESUME_FIXED if saved.get(k) != getattr(t.cfg, k)]  # the optimizer too: its state is its own
    if changed:
        diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(t.cfg, k)!r}" for k in changed)
        raise ValueError(f"cannot resume: the run's settings changed ({diffs}); resume with the same settings "
                         f"(plain `fp4train train --out DIR --resume` reuses them) or start a new --out")
    for f in t.features:  # before the tensors: a feature may change the layers, and the model be sharded after
        f.load_state_dict(st, t)
    t._model_released()
    if "sharded" in st:  # written by a sharded run: each process reads its part
        sharding.load_sharded_state(t.model, t.opt, st["sharded"], st["optimizer_groups"])
    elif t._sharded:
        sharding.load_full_state(t.model, t.opt, st["model"], st["optimizer"])
    else:
        t.model.load_state_dict(st["model"])
        t.opt.load_state_dict(st["optimizer"])
    t.sched.load_state_dict(st["scheduler"])
    t.batches.load_state_dict(st["data"])
    set_rng_state(st["rng"], t.device)
    t.step = st["step"]


def save_checkpoint(t) -> None:
    """A checkpoint of this step. Sharded, every process writes its shards (``torch.distributed.checkpoint``);
    otherwise rank 0 writes one file, the single-process format (under ddp the ranks hold the same state).
    A write that fails (a full or read-only disk) leaves the checkpoints there were, and stops every rank with
    one error that names the last of them and how to continue."""
    problem = None
    try:
        if t._sharded:
            tensors, groups = sharding.sharded_state(t.model, t.opt)
            t.ckpts.save_sharded(t.step, tensors, {"step": t.step, "optimizer_groups": groups, **plain_state(t)},
                                 main=t.main, barrier=t.ranks.barrier)
        elif t.main:
            t.ckpts.save(t.step, t.state_dict())
    except CheckpointWriteError as e:
        problem = str(e)
    problem = t.ranks.broadcast(problem)  # every rank waits for the write, and stops if it failed
    if problem:
        last = t.ckpts.entries()
        kept = (f"the last checkpoint, step {last[-1]['step']} ({t.out / last[-1]['file']}), is intact: once the disk can "
                f"take it, continue with: {resume_command(t.out)}" if last else
                "no checkpoint was written before: once the disk can take one, start the run again with --overwrite")
        raise CheckpointWriteError(f"{problem}; {kept}")


def resume_or_clear(t) -> dict | None:
    """Load the checkpoint to resume from (a finished run: its summary, returned), or clear the run files
    ``--overwrite`` replaces."""
    cfg = t.cfg
    if t.resume:
        st = t.ckpts.load(None if t.resume is True else t.resume, map_location=t.device, trust=t.trust)
        load_checkpoint_state(t, st)
        if t.step >= cfg.max_steps:
            done = finished_summary(t)
            if done is not None:
                t.log(f"fp4train: {t.out} is finished at step {t.step} (val loss {fmt_loss(done.get('final_val_loss'))}); "
                      "nothing to do. A larger --max-steps trains it further")
                return done
            if t.step > cfg.max_steps:
                raise ValueError(f"cannot resume: the checkpoint is at step {t.step}, past --max-steps {cfg.max_steps}; "
                                 f"give --max-steps {t.step} or more")
        t.log(f"fp4train: resumed {t.out} at step {t.step}")
    elif t.overwrite and t.main:
        clear_run_files(t.out)
    return None


def run_summary(t, val_loss: float | None, steady: SteadySteps, graphs: int) -> dict:
    """What ``summary.json`` says of a finished run: its settings, result, speed (over its ``steady`` steps), memory,
    provenance, the number of ``graphs`` compiled and the features' own entries."""
    cfg = t.cfg
    features = summary_defaults()
    for f in t.features:
        features.update(f.summary())
    return {
        "model": cfg.model_name, "recipe": t.recipe.name, "seed": cfg.seed, "data_seed": cfg.order_seed,
        "optimizer": cfg.optimizer, "steps": t.step,
        "tokens": t.step * cfg.tokens_per_step, "params": t.model.num_params(),
        "final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
        # tokens per step over the median steady step (what bench/train_speed.py reports)
        "tokens_per_s": cfg.tokens_per_step / steady.median() if steady.times else None,
        "step_ms": steady.median() * 1e3 if steady.times else None, "steady_steps": len(steady.times),
        "peak_mem_gib": torch.cuda.max_memory_allocated(t.device) / 2**30 if t.device.type == "cuda" else None,
        "device": str(t.device), "gpu": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else None,
        "numerics": _numerics(t.model), "backend": backends.resolve(cfg.backend or t.recipe.backend),
        "commit": code_commit(), "torch": torch.__version__,
        "compile": t.compile, "compile_mode": t.compile_mode if t.compile else None,
        "deterministic": cfg.deterministic, "processes": t.ranks.world,
        "compiled_graphs": graphs if t.compile else None, **features,
    }


def finished_summary(t) -> dict | None:
    """The summary of a run that finished at the current step, else None."""
    path = t.out / "summary.json"
    try:
        done = json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None
    return done if done and done.get("steps") == t.step else None


def fmt_loss(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _numerics(model: torch.nn.Module) -> str | None:
    """The numerics the model's quantized layers run (None if it has none)."""
    return next((m.numerics for m in model.modules() if isinstance(m, QuantizedLinear)), None)
