"""The training loop: any model preset, any recipe, checkpointed and exactly resumable.

One step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences, AdamW (fused on
CUDA), linear warmup then cosine decay, gradient clipping. Non-quantized ops run under BF16
autocast on GPU. Every ``eval_every`` steps the validation loss is measured on a fixed set of
windows. Every ``ckpt_every`` steps a checkpoint holds everything the next step depends on:
model, optimizer, scheduler, data position and all RNG states (torch CPU - which also seeds
stochastic rounding - CUDA, Python), so ``resume`` continues bit for bit. A non-finite loss or
gradient norm stops the run at once with the step named; the last good checkpoint stays.

Writes to ``out``: ``config.json``, ``metrics.jsonl`` (one JSON object per logged step),
TensorBoard events under ``tb/``, ``checkpoints.json`` + ``step_*.pt`` (sharded runs: ``step_*/`` directories), and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import backends, device_seeds, models
from .. import recipes as _recipes
from ..adahop.calibration import Calibration, PatternRecorder
from ..conversion import convert
from ..data import PackedBatches, eval_batches, load_splits, load_tokenizer
from ..linear import QuantizedLinear
from ..linear.lora_svd import realign as realign_lora_svd
from ..optim import QAdamW, QMuon, muon_groups
from ..row_shards import full
from ..timing import code_commit
from . import sharding
from .checkpoint import Checkpoints, CheckpointWriteError, expected_bytes
from .config import FIELDS_ADDED, TrainConfig, speed_settings
from .determinism import deterministic_algorithms
from .distributed import Ranks
from .distributed import setup as setup_ranks
from .run_dir import RunLock, check_free_space, check_run_dir, resume_command, run_files, write_text
from .signals import StopRequests, Terminated, TrainingInterrupted


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/Inf."""


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec} asked for, but PyTorch sees no CUDA GPU here; use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: there are only {torch.cuda.device_count()} CUDA GPU(s) (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    return dev


def check_recipe(cfg: TrainConfig):
    """The run's recipe, after refusing what cannot work: AdaHOP that would never leave its BF16 calibration."""
    recipe = _recipes.get(cfg.recipe)
    if recipe.calibrate and not cfg.calibration and cfg.max_steps <= recipe.calibration_steps:
        raise ValueError(f"recipe {recipe.name!r} spends its first {recipe.calibration_steps} steps calibrating in BF16, and "
                         f"--max-steps {cfg.max_steps} would end the run before any FP4 step: give more steps, or a saved "
                         "calibration with --calibration FILE")
    if cfg.calibration and not Path(cfg.calibration).is_file():
        raise FileNotFoundError(f"--calibration {cfg.calibration} does not exist (an adahop_calibration.json of an earlier run)")
    return recipe


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` after ``step`` optimizer steps: linear warmup, cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _numerics(model: torch.nn.Module) -> str | None:
    """The numerics the model's quantized layers run (None if it has none)."""
    return next((m.numerics for m in model.modules() if isinstance(m, QuantizedLinear)), None)


def _rng_state(device: torch.device) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "device_seeds": device_seeds.device_seed_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict, device: torch.device) -> None:
    torch.set_rng_state(st["torch"].cpu())  # the checkpoint may have been loaded onto the GPU
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"].cpu(), device)
    device_seeds.load_device_seed_state(st.get("device_seeds", {}))  # compile_mode reduce-overhead's seed streams


def load_data(cfg: TrainConfig, ranks: Ranks = Ranks()):
    """(tokenizer, train split, validation split, training batches, evaluation batches) of ``cfg``,
    tokenized once into the cache; refuses data that cannot make one training batch and one
    validation window."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    train_split, val_split = load_splits(cfg.data, cfg.val_data, tokenizer, val_fraction=cfg.val_fraction,
                                         cache_dir=cfg.cache_dir, text_field=cfg.text_field, verbose=cfg.progress)
    batches = PackedBatches(train_split, cfg.seq_len, cfg.batch_size, cfg.order_seed, rank=ranks.rank, world=ranks.world)
    evals = eval_batches(val_split, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
    return tokenizer, train_split, val_split, batches, evals


class SteadySteps:
    """The wall times of a run's steady steps. A step that compiled, the step after it (where CUDA graphs are
    recorded), the run's first step and AdaHOP's BF16 calibration steps are left out: what is left is what the
    run costs per step from then on. Each step ends on the host (the trainer reads its loss), so its wall time
    covers the GPU's work; the optimizer's kernels queued after that read land in the next step's time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._skip = 1  # the first step: allocator and autotuning warm-up

    def add(self, seconds: float, *, compiled: bool, calibrating: bool = False) -> None:
        if compiled or calibrating:
            self._skip = 1  # and the next: it records the CUDA graphs of what was compiled, or is the calibrated recipe's first
        elif self._skip:
            self._skip -= 1
        else:
            self.times.append(seconds)

    def median(self) -> float:
        return statistics.median(self.times)


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Trainer:
    """One run. Everything that can be checked is checked here, before any work: the run directory
    (see :func:`check_run_dir`), the device, the recipe, the data (readable, a training split of at
    least one batch, a validation split of at least one window, no file in both).

    ``resume``: ``True`` (the newest checkpoint in ``cfg.out``) or a checkpoint file; ``trust``: load
    that file although no manifest lists it; ``overwrite``: replace the run files ``cfg.out`` holds."""

    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, overwrite: bool = False, trust: bool = False, log=None,
                 checkpoints: bool = True, model_hook=None):
        """``checkpoints=False``: write none (benchmarks); ``model_hook(model)``: called on the converted model before the
        optimizer is made and the model compiled (another library's conversion, e.g. torchao's float8 training)."""
        self.cfg = cfg
        self.writes_checkpoints = checkpoints
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device)
        self.recipe = check_recipe(cfg)
        self.ranks = setup_ranks(cfg.parallel, cfg.batch_size, self.device.type)
        if self.ranks.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", self.ranks.local_rank)
        self.main = self.ranks.main  # rank 0 writes the run's files and logs; every rank trains
        self.log = (log or (lambda msg: print(msg, file=sys.stderr, flush=True))) if self.main else (lambda msg: None)
        # under torchrun rank 0 holds the lock for every rank (the others learn of a busy directory from it)
        check_run_dir(self.out, resume=resume, overwrite=overwrite, lock_held=not self.main)
        self.amp_dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else None, "bf16": torch.bfloat16, "fp32": None}[cfg.dtype]
        self.resume, self.trust, self.overwrite = resume, trust, overwrite
        self._lock = self._take_lock()
        try:
            check_run_dir(self.out, resume=resume, overwrite=overwrite, lock_held=True)  # again, as the directory's one writer
            self._build(model_hook)
        except BaseException:
            self.close(remove_created=True)
            raise

    def _take_lock(self) -> RunLock | None:
        """Make this process the one writer of the run directory (rank 0 for every rank; all fail alike)."""
        lock, problem = None, None
        if self.main:
            try:
                lock = RunLock(self.out, "train").acquire()
            except ValueError as e:
                problem = str(e)
        problem = self.ranks.broadcast(problem)
        if problem:
            raise ValueError(problem)
        if lock is not None and lock.stale_note():
            self.log(lock.stale_note())
        return lock

    def close(self, *, remove_created: bool = False) -> None:
        """Release the run directory (:meth:`run` does when it ends); ``remove_created``: remove it too if this run
        created it and wrote nothing into it."""
        if self._lock is not None:
            self._lock.release(remove_created=remove_created)

    def _build(self, model_hook) -> None:
        """The data, the model, the optimizer and the schedule (see :meth:`__init__`)."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # CUDA graphs (compile_mode reduce-overhead): compiled layers draw stochastic-rounding seeds on the device,
        # from a stream (re)started here, at a fixed point of the seeded CPU generator
        self.compile, self.compile_mode, self._speed = speed_settings(cfg, self.device)
        self._graphs = self.compile and self.compile_mode == "reduce-overhead"
        if self._graphs:
            device_seeds.restart_device_seed_stream(self.device)
        if not self.main:  # rank 0 tokenizes into the cache first; the others then read it
            self.ranks.barrier()
        self.tokenizer, self.train_split, self.val_split, self.batches, self.evals = load_data(cfg, self.ranks)
        if self.main:
            self.ranks.barrier()
        mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size)
        if cfg.seq_len > mcfg.max_seq_len:
            mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size, max_seq_len=cfg.seq_len)
        self.model = models.Llama(mcfg).to(self.device)
        # AdaHOP: the layers run BF16 until calibration (below) gives them their strategies
        convert(self.model, self.recipe, backend=cfg.backend, numerics=cfg.numerics, device_seeds=self._graphs,
                calibrating=bool(self.recipe.calibrate))
        if model_hook is not None:
            model_hook(self.model)
        # fsdp: shard now, unless AdaHOP's layer swap (which needs whole modules) is still to come: then apply_calibration
        # shards, after it
        self._sharded = cfg.parallel == "fsdp" and not self.recipe.calibrate
        if self._sharded:
            sharding.shard(self.model, self.device.type)
        self.opt = self._make_optimizer()
        self.sched = self._make_scheduler()
        self.bf16_steps = 0  # steps this run spent in BF16 calibration (AdaHOP)
        self.calibration_peak_gib: float | None = None  # peak memory of those steps, on a GPU
        self.ckpts = Checkpoints(self.out, keep=cfg.keep_checkpoints)
        self._disk = None  # the checkpoints' size and the room for them, for the run's header
        if self.writes_checkpoints and self.main:
            self._disk = check_free_space(self.out, expected_bytes(self.model, self.opt), cfg.keep_checkpoints)
        self.step = 0
        self._ddp = None
        self.forward = self._parallel(self.model)
        # AdaHOP: calibrate during the first steps (in BF16), or reuse a saved calibration
        self.calibration: Calibration | None = None
        self.recorder: PatternRecorder | None = None
        if self.recipe.calibrate and cfg.calibration:
            self.apply_calibration(Calibration.load(cfg.calibration))
        elif self.recipe.calibrate:
            # the calibration steps run eagerly: the recorder's hooks (one per layer, each reading its tensors on the
            # host) would make the compiler trace and recompile the model once per layer; it compiles once, after
            self.recorder = PatternRecorder.for_recipe(self.model, self.recipe).attach()
        elif self.compile:
            self.forward = self._compiled()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if cfg.optimizer == "qadamw":  # both moments in NVFP4 where a parameter's shape tiles (fp4train.optim)
            return QAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, compiled=self.compile)
        if cfg.optimizer in ("muon", "qmuon"):  # Muon on the 2D hidden weights at AdamW's lr (match_rms_adamw)
            return QMuon(muon_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=1e-8,
                         quantize_states=cfg.optimizer == "qmuon", compiled=self.compile)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=self.device.type == "cuda")

    def _make_scheduler(self):
        return torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, self.cfg))

    def _shard(self) -> None:
        """``--parallel fsdp`` with AdaHOP, once its layers have their strategies: shard the model (FSDP2,
        :mod:`.sharding`) and move the optimizer and scheduler onto its sharded parameters, their state kept."""
        by_name = sharding.state_by_name(self.model, self.opt) if self.opt.state else None
        sched = self.sched.state_dict()
        sharding.shard(self.model, self.device.type)
        self.opt = self._make_optimizer()
        self.sched = self._make_scheduler()  # first: it gives the param groups the initial_lr the saved ones hold
        if by_name is not None:
            sharding.load_state_by_name(self.model, self.opt, by_name)
        self.sched.load_state_dict(sched)
        self._sharded = True

    def _parallel(self, model):
        """``model`` under DistributedDataParallel when there are several processes (gradients averaged); under
        ``fsdp`` the model itself (sharded in place, or whole during AdaHOP's calibration steps)."""
        if self.ranks.world == 1 or self.cfg.parallel == "fsdp":
            return model
        if self._ddp is None:  # one wrapper for the run: a second would reduce every gradient again
            from torch.nn.parallel import DistributedDataParallel

            self._ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return self._ddp

    def apply_calibration(self, cal: Calibration) -> None:
        """Swap every calibrated layer to its AdaHOP strategies (parameters are kept)."""
        if self._sharded:  # a resumed run whose --calibration was applied (and the model sharded) at the start
            if self.calibration is not None and cal.to_dict() == self.calibration.to_dict():
                return
            raise ValueError("cannot resume: the checkpoint's AdaHOP calibration is not the one this run loaded "
                             "(--calibration); resume with the run's own settings")
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None
        self.calibration = cal
        convert(self.model, cal.recipe(self.recipe.name, base=self.recipe), backend=self.cfg.backend, numerics=self.cfg.numerics,
                device_seeds=self._graphs)
        if self.cfg.parallel == "fsdp":
            self._shard()
        self.forward = self._compiled() if self.compile else self._parallel(self.model)

    def _compiled(self):
        """The model under ``torch.compile`` with the config's mode. With ``reduce-overhead`` Inductor replays each
        graph as CUDA graphs, and the layers draw their stochastic-rounding seeds and random Hadamard signs on the
        device (set in __init__), so that every seeded layer is captured and each replay draws fresh ones."""
        mode = self.compile_mode
        return torch.compile(self._parallel(self.model), mode=None if mode == "default" else mode)

    def _step_begins(self) -> None:
        """Before each compiled call under CUDA graphs: a new iteration (the previous replay's outputs may be
        overwritten; everything kept from it - the loss sum, the evaluation total - is copied out first; the
        gradients are used and freed within the step, which is why the config asks grad_accum 1)."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint of an unsharded run, in the single-process format (a sharded run writes its shards:
        :meth:`_save`)."""
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), **self._plain_state()}

    def _plain_state(self) -> dict:
        """What a checkpoint holds besides the model's and the optimizer's tensors."""
        return {
            "scheduler": self.sched.state_dict(),
            "data": self.batches.state_dict(),
            "rng": _rng_state(self.device),
            "config": self.cfg.to_dict(),
            "recipe": self.recipe.to_dict(),
            "model_config": self.model.config.to_dict(),
            "adahop_calibration": self.calibration.to_dict() if self.calibration else None,
            "adahop_recorder": {"patterns": self.recorder.patterns, "steps": self.recorder.steps,
                                "err_sum": json.loads(json.dumps(self.recorder.err_sum)),
                                "err_n": json.loads(json.dumps(self.recorder.err_n))} if self.recorder else None,
        }

    def load_state_dict(self, st: dict) -> None:
        saved = st["config"]
        saved = {**FIELDS_ADDED, **saved}
        # the optimizer too: its state in the checkpoint is only the same optimizer's
        changed = [k for k in ("model", "recipe", "data", "val_data", "tokenizer", "seq_len", "batch_size", "seed", "data_seed",
                               "optimizer") if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(self.cfg, k)!r}" for k in changed)
            raise ValueError(f"cannot resume: the run's settings changed ({diffs}); resume with the same settings "
                             f"(plain `fp4train train --out DIR --resume` reuses them) or start a new --out")
        if st.get("adahop_calibration"):
            self.apply_calibration(Calibration.from_dict(st["adahop_calibration"]))
            self.bf16_steps = 0 if self.cfg.calibration else self.calibration.steps
        elif st.get("adahop_recorder") and self.recorder is not None:
            rec = st["adahop_recorder"]
            self.recorder.patterns, self.recorder.steps = rec["patterns"], rec["steps"]
            for layer, gemms in rec["err_sum"].items():
                for gemm, errs in gemms.items():
                    self.recorder.err_sum[layer][gemm].update(errs)
            for layer, gemms in rec["err_n"].items():
                self.recorder.err_n[layer].update(gemms)
        if "sharded" in st:  # written by a sharded run: each process reads its part
            sharding.load_sharded_state(self.model, self.opt, st["sharded"], st["optimizer_groups"])
        elif self._sharded:
            sharding.load_full_state(self.model, self.opt, st["model"], st["optimizer"])
        else:
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.batches.load_state_dict(st["data"])
        _set_rng_state(st["rng"], self.device)
        self.step = st["step"]

    # ---- pieces -------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, n = 0.0, 0
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for x, y in self.evals:
                self._step_begins()
                with self._autocast():
                    loss = self.forward(x.to(self.device), y.to(self.device))
                total += loss.float().item() * x.numel()
                n += x.numel()
        self.model.train()
        return total / n

    def train_step(self) -> tuple[float, float]:
        cfg = self.cfg
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(cfg.grad_accum):
            x, y = self.batches.next_batch()
            self._step_begins()
            with self._autocast():
                loss = self.forward(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach().float()
        if self.cfg.parallel == "fsdp" and not self._sharded and self.ranks.world > 1:
            sharding.average_gradients(self.model, self.ranks.world)  # AdaHOP's calibration steps: the model is whole
        loss_val = self.ranks.mean(loss_sum / cfg.grad_accum).item()  # the global batch's mean loss
        if not math.isfinite(loss_val):
            raise TrainingDiverged(self._diverged_msg(f"loss is {loss_val}"))
        gnorm = full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)).item()  # sharded: a DTensor
        if not math.isfinite(gnorm):
            raise TrainingDiverged(self._diverged_msg(f"gradient norm is {gnorm}"))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        lora = self.recipe.lora_svd
        if lora is not None and lora.realign_every and self.step % lora.realign_every == 0:
            n = realign_lora_svd(self.model, self.opt, seed=self.cfg.seed + self.step)
            self.log(f"fp4train: step {self.step}: LoRA-SVD realigned {n} layers (a fresh randomized SVD; the factors' "
                     "optimizer state restarts)")
        return loss_val, gnorm

    def _finish_calibration(self) -> None:
        cal = self.ranks.broadcast(self.recorder.result())  # rank 0's patterns: every rank runs the same strategies
        if self.device.type == "cuda":
            # the eager BF16 calibration steps peak above the compiled FP4 steps that follow; both are reported
            self.calibration_peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self.apply_calibration(cal)
        self.bf16_steps = cal.steps
        if self.main:
            cal.save(self.out / "adahop_calibration.json")
        self.log(f"fp4train: AdaHOP calibrated over {cal.steps} steps ({cal.mode}): GEMM strategies {cal.strategy_counts()}; "
                 f"table in {self.out / 'adahop_calibration.json'}")

    def _save(self) -> None:
        """A checkpoint of this step. Sharded, every process writes its shards (``torch.distributed.checkpoint``);
        otherwise rank 0 writes one file, the single-process format (under ddp the ranks hold the same state).
        A write that fails (a full or read-only disk) leaves the checkpoints there were, and stops every rank with
        one error that names the last of them and how to continue."""
        problem = None
        try:
            if self._sharded:
                tensors, groups = sharding.sharded_state(self.model, self.opt)
                self.ckpts.save_sharded(self.step, tensors, {"step": self.step, "optimizer_groups": groups, **self._plain_state()},
                                        main=self.main, barrier=self.ranks.barrier)
            elif self.main:
                self.ckpts.save(self.step, self.state_dict())
        except CheckpointWriteError as e:
            problem = str(e)
        problem = self.ranks.broadcast(problem)  # every rank waits for the write, and stops if it failed
        if problem:
            last = self.ckpts.entries()
            kept = (f"the last checkpoint, step {last[-1]['step']} ({self.out / last[-1]['file']}), is intact: once the disk can "
                    f"take it, continue with: {resume_command(self.out)}" if last else
                    "no checkpoint was written before: once the disk can take one, start the run again with --overwrite")
            raise CheckpointWriteError(f"{problem}; {kept}")

    def _stop_requested(self, stop: StopRequests) -> int:
        """The signal that asks the run to stop after this step (0: none). Under torchrun every rank stops at the same
        step: the ranks agree on it (a signal reaches them at slightly different times)."""
        signum = self.ranks.max(stop.signum or 0) if self.ranks.world > 1 else (stop.signum or 0)
        return int(signum)

    def _diverged_msg(self, what: str) -> str:
        last = self.ckpts.entries()
        keep = f"; the last good checkpoint is {self.out / last[-1]['file']} (step {last[-1]['step']})" if last else "; no checkpoint was written yet"
        return f"training diverged at step {self.step + 1}: {what} (recipe {self.recipe.name}){keep}"

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to ``max_steps``; returns the summary (also ``summary.json``). A resumed run that has
        finished returns its summary and writes nothing; one whose last step was checkpointed but not
        yet evaluated (stopped during the final evaluation) is evaluated and finished. With
        ``deterministic`` PyTorch's deterministic algorithms are on for the run (:mod:`.determinism`)."""
        try:
            with deterministic_algorithms(self.cfg.deterministic):
                return self._run()
        finally:
            self.close()

    def _run(self) -> dict:
        cfg = self.cfg
        if self.resume:
            st = self.ckpts.load(None if self.resume is True else self.resume, map_location=self.device, trust=self.trust)
            self.load_state_dict(st)
            if self.step >= cfg.max_steps:
                done = self._finished_summary()
                if done is not None:
                    self.log(f"fp4train: {self.out} is finished at step {self.step} (val loss {_fmt(done.get('final_val_loss'))}); "
                             "nothing to do. A larger --max-steps trains it further")
                    return done
                if self.step > cfg.max_steps:
                    raise ValueError(f"cannot resume: the checkpoint is at step {self.step}, past --max-steps {cfg.max_steps}; "
                                     f"give --max-steps {self.step} or more")
            self.log(f"fp4train: resumed {self.out} at step {self.step}")
        elif self.overwrite and self.main:
            for p in run_files(self.out):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        metrics_path = self.out / "metrics.jsonl"
        if self.main:  # the run's files are rank 0's
            self.out.mkdir(parents=True, exist_ok=True)
            write_text(self.out / "config.json", json.dumps({"train": cfg.to_dict(), "recipe": self.recipe.to_dict(),
                                                             "model": self.model.config.to_dict()}, indent=1))
            _truncate_metrics(metrics_path, self.step)
        self.ranks.barrier()
        tb = _tensorboard(self.out / "tb") if cfg.tensorboard and self.main else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        n_params = self.model.num_params()
        self.log(
            f"fp4train: model {cfg.model} ({n_params / 1e6:.1f}M params), recipe {self.recipe.name}, "
            f"{cfg.max_steps} steps x {cfg.tokens_per_step:,} tokens, device {self.device}, out {self.out}"
        )
        where = "GPU" if self.device.type == "cuda" else "machine"
        self.log(f"fp4train: speed settings: {self._speed}"
                 + (f"; deterministic algorithms (repeats give the same bits on this {where})" if cfg.deterministic else ""))
        if self._disk:
            self.log(f"fp4train: {self._disk}")
        graphs_before = _compiled_graphs()
        bar = _progress(cfg, self.step) if self.main else None  # after the header, so that the bar keeps a line of its own
        t_last, tok_last = time.perf_counter(), 0
        steady = SteadySteps()
        val_loss = None
        try:
            with open(metrics_path if self.main else os.devnull, "a") as mf, StopRequests(self.log) as stop:
                def write(rec):
                    mf.write(json.dumps(rec) + "\n")
                    mf.flush()
                    if tb:
                        for k, v in rec.items():
                            if k != "step":
                                tb.add_scalar(k, v, self.step)

                if self.step >= cfg.max_steps:  # the last step was checkpointed, its evaluation not done
                    val_loss = self.evaluate()
                    write({"step": self.step, "tokens": self.step * cfg.tokens_per_step, "val_loss": val_loss,
                           "val_ppl": math.exp(min(val_loss, 50))})
                while self.step < cfg.max_steps:
                    t_step, graphs = time.perf_counter(), _compiled_graphs()
                    calibrating = self.recorder is not None
                    loss, gnorm = self.train_step()  # ends on the host: it reads the loss and the gradient norm
                    steady.add(time.perf_counter() - t_step, compiled=_compiled_graphs() != graphs, calibrating=calibrating)
                    tok_last += cfg.tokens_per_step
                    if self.recorder is not None:
                        self.recorder.steps += 1
                        if self.step >= self.recipe.calibration_steps:
                            self._finish_calibration()
                    final = self.step == cfg.max_steps
                    rec = None
                    if self.step % cfg.log_every == 0 or final:
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        now = time.perf_counter()
                        rate = tok_last / (now - t_last)
                        t_last, tok_last = now, 0
                        rec = {"step": self.step, "loss": loss, "lr": self.sched.get_last_lr()[0], "grad_norm": gnorm,
                               "tokens": self.step * cfg.tokens_per_step, "tokens_per_s": rate}
                    saved = False
                    if final and self.writes_checkpoints:  # the result is safe before what can still fail (evaluation, report)
                        self._save()
                        saved = True
                    if (cfg.eval_every and self.step % cfg.eval_every == 0) or final:
                        val_loss = self.evaluate()
                        rec = rec or {"step": self.step, "loss": loss, "tokens": self.step * cfg.tokens_per_step}
                        rec.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                    if rec:
                        write(rec)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{val_loss:.3f}"} if val_loss is not None else {}))
                    if not saved and self.writes_checkpoints and cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                        self._save()
                        saved = True
                    signum = self._stop_requested(stop)
                    if signum and not final and not self.writes_checkpoints:  # nothing to resume from: stop at once
                        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
                    if signum and not final:
                        if not saved:
                            self._save()
                        raise TrainingInterrupted(self.out, self.step, self.out / self.ckpts.entries()[-1]["file"], signum)
        finally:
            if bar is not None:
                bar.close()
            if tb:
                tb.close()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        summary = {
            "model": cfg.model, "recipe": self.recipe.name, "seed": cfg.seed, "data_seed": cfg.order_seed,
            "optimizer": cfg.optimizer, "steps": self.step,
            "tokens": self.step * cfg.tokens_per_step, "params": n_params,
            "final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
            "bf16_steps": self.bf16_steps,
            # tokens per step over the median steady step (what bench/train_speed.py reports)
            "tokens_per_s": cfg.tokens_per_step / steady.median() if steady.times else None,
            "step_ms": steady.median() * 1e3 if steady.times else None, "steady_steps": len(steady.times),
            "peak_mem_gib": peak, "calibration_peak_mem_gib": self.calibration_peak_gib, "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "numerics": _numerics(self.model), "backend": backends.resolve(cfg.backend or self.recipe.backend),
            "commit": code_commit(), "torch": torch.__version__,
            "compile": self.compile, "compile_mode": self.compile_mode if self.compile else None,
            "deterministic": cfg.deterministic, "processes": self.ranks.world,
            "compiled_graphs": _compiled_graphs() - graphs_before if self.compile else None,
        }
        if self.main:
            write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        self.ranks.barrier()
        calib = f" ({self.bf16_steps} of them BF16 calibration)" if self.bf16_steps else ""
        if self.compile:  # a bounded number: a recompilation storm would show here
            self.log(f"fp4train: torch.compile made {summary['compiled_graphs']} graphs in this run")
        self.log(f"fp4train: done - {self.step} steps{calib}, val loss {_fmt(val_loss)}"
                 + (f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "")
                 + (f", peak {peak:.2f} GiB" if peak else "")
                 + (f" ({self.calibration_peak_gib:.2f} GiB in calibration)" if self.calibration_peak_gib else "") + f"; results in {self.out}")
        return summary

    def _finished_summary(self) -> dict | None:
        """The summary of a run that finished at the current step, else None."""
        path = self.out / "summary.json"
        try:
            done = json.loads(path.read_text()) if path.exists() else None
        except ValueError:
            return None
        return done if done and done.get("steps") == self.step else None


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def train(cfg: TrainConfig, *, resume: bool | str = False, overwrite: bool = False, trust: bool = False) -> dict:
    """Train as ``cfg`` says; returns the run summary (also written to ``cfg.out/summary.json``).
    ``resume``/``overwrite``/``trust``: see :class:`Trainer`."""
    return Trainer(cfg, resume=resume, overwrite=overwrite, trust=trust).run()


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records a crashed run logged after its last checkpoint."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    write_text(path, "".join(ln + "\n" for ln in keep))


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("fp4train: tensorboard is not installed; skipping TensorBoard logs (pip install tensorboard)", file=sys.stderr)
        return None
    return SummaryWriter(str(path))


def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=start, desc=f"{cfg.recipe}", unit="step", dynamic_ncols=True, mininterval=0.5)
