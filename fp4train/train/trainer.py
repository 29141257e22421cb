"""The training loop: any model preset, any recipe, checkpointed and exactly resumable.

One step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences, the config's optimizer and
schedule (:mod:`.optimizer`), gradient clipping. Non-quantized ops run under BF16 autocast on GPU. Every
``eval_every`` steps the validation loss is measured on a fixed set of windows. Every ``ckpt_every`` steps a
checkpoint holds everything the next step depends on: model, optimizer, scheduler, data position, all RNG
states (:mod:`.rng_state`) and the features' state, so ``resume`` continues bit for bit. A non-finite loss or
gradient norm stops the run at once with the step named; the last good checkpoint stays.

What a method needs beyond its recipe (AdaHOP's calibration, LoRA-SVD's realignment) is a feature
(:mod:`fp4train.features`) that the trainer calls at fixed points; the run directory's checks and lock are
:mod:`.run_dir`'s, the metrics and the progress bar :mod:`.records`', what a checkpoint holds, resuming from one and
the run's summary :mod:`.run_state`'s.

Writes to ``out``: ``config.json``, ``metrics.jsonl`` (one JSON object per logged step), TensorBoard events
under ``tb/``, ``checkpoints.json`` + ``step_*.pt`` (sharded runs: ``step_*/`` directories), ``summary.json``,
and what features write (AdaHOP: ``adahop_calibration.json``).
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import time
from pathlib import Path

import torch

from .. import device_seeds, models
from ..checkpoint import Checkpoints, expected_bytes
from ..conversion import convert
from ..data import PackedBatches, eval_batches, load_splits, load_tokenizer
from ..devices import resolve_device
from ..row_shards import full
from . import run_state, sharding
from .config import TrainConfig, speed_settings
from .determinism import deterministic_algorithms
from .distributed import Ranks
from .distributed import setup as setup_ranks
from .features import recipe_and_features
from .optimizer import make_optimizer, make_scheduler
from .records import MetricsLog, SteadySteps, compiled_graphs, progress_bar
from .run_dir import RunLock, check_free_space, check_run_dir, write_text
from .signals import StopRequests, Terminated, TrainingInterrupted


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/Inf."""


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


class Trainer:
    """One run. Everything that can be checked is checked here, before any work: the run directory
    (see :func:`check_run_dir`), the device, the recipe and its features, the data (readable, a training split
    of at least one batch, a validation split of at least one window, no file in both).

    ``resume``: ``True`` (the newest checkpoint in ``cfg.out``) or a checkpoint file; ``trust``: load
    that file although no manifest lists it; ``overwrite``: replace the run files ``cfg.out`` holds;
    ``features``: :class:`fp4train.features.Feature` s to run besides those the recipe needs (their hooks run
    after the recipe's)."""

    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, overwrite: bool = False, trust: bool = False, log=None,
                 checkpoints: bool = True, model_hook=None, features=()):
        """``checkpoints=False``: write none (benchmarks); ``model_hook(model)``: called on the converted model before the
        optimizer is made and the model compiled (another library's conversion, e.g. torchao's float8 training)."""
        self.cfg = cfg
        self.writes_checkpoints = checkpoints
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device)
        self.recipe, self.features = recipe_and_features(cfg, features)
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

    def feature(self, kind: type):
        """The run's feature of type ``kind`` (None if it has none)."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    # ---- the model ----------------------------------------------------------------------------
    def _build(self, model_hook) -> None:
        """The data, the model, the optimizer and the schedule (see :meth:`__init__`), then the features' start."""
        cfg = self.cfg
        if cfg.hf_config:  # the config refused, if it must be, before anything is tokenized or built
            from ..models import hf

            hf.check_config(cfg.hf_config, seq_len=cfg.seq_len)
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
        if cfg.hf_config:  # any Hugging Face causal LM, from its config
            from ..models import hf

            self.model = hf.build(cfg.hf_config, vocab_size=self.tokenizer.vocab_size, seq_len=cfg.seq_len, log=self.log)
            self.model.to(self.device)
        else:
            mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size)
            if cfg.seq_len > mcfg.max_seq_len:
                mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size, max_seq_len=cfg.seq_len)
            self.model = models.Llama(mcfg).to(self.device)
        options = {k: v for f in self.features for k, v in f.convert_options().items()}
        convert(self.model, self.recipe, backend=cfg.backend, numerics=cfg.numerics, device_seeds=self._graphs, **options)
        if model_hook is not None:
            model_hook(self.model)
        self._sharded = self._ready = False
        if cfg.parallel == "fsdp" and not self._model_held():  # else sharded once the features let go (_model_released)
            sharding.shard(self.model, self.device.type)
            self._sharded = True
        self.opt = make_optimizer(self.model, cfg, self.device, compiled=self.compile)
        self.sched = make_scheduler(self.opt, cfg)
        self.ckpts = Checkpoints(self.out, keep=cfg.keep_checkpoints)
        self._disk = None  # the checkpoints' size and the room for them, for the run's header
        if self.writes_checkpoints and self.main:
            self._disk = check_free_space(self.out, expected_bytes(self.model, self.opt), cfg.keep_checkpoints)
        self.step = 0
        self._ddp = None
        self.forward = self._parallel(self.model)
        for f in self.features:
            f.start(self)
        self._model_released()

    def reconvert(self, recipe) -> None:
        """Convert the model's layers to ``recipe``, as the run converted them (a feature's layer swap; the
        parameters are kept)."""
        convert(self.model, recipe, backend=self.cfg.backend, numerics=self.cfg.numerics, device_seeds=self._graphs)

    def _model_held(self) -> bool:
        return any(f.holds_model() for f in self.features)

    def _model_released(self) -> None:
        """Once no feature holds the model: shard it (``--parallel fsdp``, if not yet) and compile it (with the
        config's mode). Called after every feature hook; acts once."""
        if self._ready or self._model_held():
            return
        if self.cfg.parallel == "fsdp" and not self._sharded:
            self._shard()
        self.forward = self._compiled() if self.compile else self._parallel(self.model)
        self._ready = True

    def _shard(self) -> None:
        """Shard the model (FSDP2, :mod:`.sharding`) after a feature held it whole, and move the optimizer and the
        scheduler onto its sharded parameters, their state kept."""
        by_name = sharding.state_by_name(self.model, self.opt) if self.opt.state else None
        sched = self.sched.state_dict()
        sharding.shard(self.model, self.device.type)
        self.opt = make_optimizer(self.model, self.cfg, self.device, compiled=self.compile)
        self.sched = make_scheduler(self.opt, self.cfg)  # first: it gives the param groups the initial_lr the saved ones hold
        if by_name is not None:
            sharding.load_state_by_name(self.model, self.opt, by_name)
        self.sched.load_state_dict(sched)
        self._sharded = True

    def _parallel(self, model):
        """``model`` under DistributedDataParallel when there are several processes (gradients averaged); under
        ``fsdp`` the model itself (sharded in place, or whole while a feature holds it)."""
        if self.ranks.world == 1 or self.cfg.parallel == "fsdp":
            return model
        if self._ddp is None:  # one wrapper for the run: a second would reduce every gradient again
            from torch.nn.parallel import DistributedDataParallel

            self._ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return self._ddp

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
        """The checkpoint of an unsharded run (:func:`.run_state.checkpoint_state`)."""
        return run_state.checkpoint_state(self)

    def load_state_dict(self, st: dict) -> None:
        """Continue from a checkpoint (:func:`.run_state.load_checkpoint_state`)."""
        run_state.load_checkpoint_state(self, st)

    # ---- a step -------------------------------------------------------------------------------
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
        """One optimizer step, the features' hooks around it; returns (the global batch's mean loss, the gradient norm)."""
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
            sharding.average_gradients(self.model, self.ranks.world)  # a feature holds the model whole
        loss_val = self.ranks.mean(loss_sum / cfg.grad_accum).item()  # the global batch's mean loss
        if not math.isfinite(loss_val):
            raise TrainingDiverged(self._diverged_msg(f"loss is {loss_val}"))
        gnorm = full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)).item()  # sharded: a DTensor
        if not math.isfinite(gnorm):
            raise TrainingDiverged(self._diverged_msg(f"gradient norm is {gnorm}"))
        for f in self.features:
            f.before_step(self)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        for f in self.features:
            f.after_step(self)
        self._model_released()
        return loss_val, gnorm

    def _stop_requested(self, stop: StopRequests) -> int:
        """The signal that asks the run to stop after this step (0: none). Under torchrun every rank stops at the same
        step: the ranks agree on it (a signal reaches them at slightly different times)."""
        signum = self.ranks.max(stop.signum or 0) if self.ranks.world > 1 else (stop.signum or 0)
        return int(signum)

    def _diverged_msg(self, what: str) -> str:
        last = self.ckpts.entries()
        keep = f"; the last good checkpoint is {self.out / last[-1]['file']} (step {last[-1]['step']})" if last else "; no checkpoint was written yet"
        return f"training diverged at step {self.step + 1}: {what} (recipe {self.recipe.name}){keep}"

    # ---- the run ------------------------------------------------------------------------------
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
        done = run_state.resume_or_clear(self)
        if done is not None:
            return done
        if self.main:  # the run's files are rank 0's
            self.out.mkdir(parents=True, exist_ok=True)
            write_text(self.out / "config.json", json.dumps({"train": self.cfg.to_dict(), "recipe": self.recipe.to_dict(),
                                                             "model": self.model.config.to_dict()}, indent=1))
        metrics = MetricsLog(self.out, step=self.step, tensorboard=self.cfg.tensorboard, main=self.main)
        self.ranks.barrier()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._header()
        graphs_before = compiled_graphs()
        steady = SteadySteps()
        with metrics:
            val_loss = self._loop(metrics, steady)
        return self._finish(val_loss, steady, compiled_graphs() - graphs_before)

    def _header(self) -> None:
        cfg = self.cfg
        what = f"{type(self.model.hf).__name__} from {cfg.hf_config}" if cfg.hf_config else cfg.model
        self.log(f"fp4train: model {what} ({self.model.num_params() / 1e6:.1f}M params), recipe {self.recipe.name}, "
                 f"{cfg.max_steps} steps x {cfg.tokens_per_step:,} tokens, device {self.device}, out {self.out}")
        where = "GPU" if self.device.type == "cuda" else "machine"
        self.log(f"fp4train: speed settings: {self._speed}"
                 + (f"; deterministic algorithms (repeats give the same bits on this {where})" if cfg.deterministic else ""))
        if self._disk:
            self.log(f"fp4train: {self._disk}")

    def _loop(self, metrics: MetricsLog, steady: SteadySteps) -> float | None:
        """The steps to ``max_steps``: each logged, evaluated and checkpointed as the config says, a stop request
        honoured after the step it came in; returns the last validation loss."""
        cfg = self.cfg
        bar = progress_bar(cfg, self.step) if self.main else None  # after the header, so that the bar keeps a line of its own
        t_last, tok_last, val_loss = time.perf_counter(), 0, None
        try:
            with StopRequests(self.log) as stop:
                if self.step >= cfg.max_steps:  # the last step was checkpointed, its evaluation not done
                    val_loss = self.evaluate()
                    metrics.write({"step": self.step, "tokens": self.step * cfg.tokens_per_step, "val_loss": val_loss,
                                   "val_ppl": math.exp(min(val_loss, 50))})
                while self.step < cfg.max_steps:
                    t_step, graphs, held = time.perf_counter(), compiled_graphs(), self._model_held()
                    loss, gnorm = self.train_step()  # ends on the host: it reads the loss and the gradient norm
                    steady.add(time.perf_counter() - t_step, compiled=compiled_graphs() != graphs, held=held)
                    tok_last += cfg.tokens_per_step
                    final = self.step == cfg.max_steps
                    rec = None
                    if self.step % cfg.log_every == 0 or final:
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        now = time.perf_counter()
                        rec = {"step": self.step, "loss": loss, "lr": self.sched.get_last_lr()[0], "grad_norm": gnorm,
                               "tokens": self.step * cfg.tokens_per_step, "tokens_per_s": tok_last / (now - t_last)}
                        t_last, tok_last = now, 0
                    saved = False
                    if final and self.writes_checkpoints:  # the result is safe before what can still fail (evaluation, report)
                        run_state.save_checkpoint(self)
                        saved = True
                    if (cfg.eval_every and self.step % cfg.eval_every == 0) or final:
                        val_loss = self.evaluate()
                        rec = rec or {"step": self.step, "loss": loss, "tokens": self.step * cfg.tokens_per_step}
                        rec.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                    if rec:
                        metrics.write(rec)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{val_loss:.3f}"} if val_loss is not None else {}))
                    if not saved and self.writes_checkpoints and cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                        run_state.save_checkpoint(self)
                        saved = True
                    self._stop_if_asked(stop, final=final, saved=saved)
        finally:
            if bar is not None:
                bar.close()
        return val_loss

    def _stop_if_asked(self, stop: StopRequests, *, final: bool, saved: bool) -> None:
        """After a step: stop the run if a signal asked to (a checkpoint first, so that it can resume)."""
        signum = self._stop_requested(stop)
        if not signum or final:
            return
        if not self.writes_checkpoints:  # nothing to resume from: stop at once
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        if not saved:
            run_state.save_checkpoint(self)
        raise TrainingInterrupted(self.out, self.step, self.out / self.ckpts.entries()[-1]["file"], signum)

    def _finish(self, val_loss: float | None, steady: SteadySteps, graphs: int) -> dict:
        """The run's summary: written as ``summary.json``, said in a line, returned."""
        summary = run_state.run_summary(self, val_loss, steady, graphs)
        if self.main:
            write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        self.ranks.barrier()
        if self.compile:  # a bounded number: a recompilation storm would show here
            self.log(f"fp4train: torch.compile made {summary['compiled_graphs']} graphs in this run")
        notes = "".join(f.done_note() for f in self.features)
        peak = summary["peak_mem_gib"]
        self.log(f"fp4train: done - {self.step} steps{notes}, val loss {run_state.fmt_loss(val_loss)}"
                 + (f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "")
                 + (f", peak {peak:.2f} GiB" if peak else "") + f"; results in {self.out}")
        return summary

def train(cfg: TrainConfig, *, resume: bool | str = False, overwrite: bool = False, trust: bool = False, features=()) -> dict:
    """Train as ``cfg`` says; returns the run summary (also written to ``cfg.out/summary.json``).
    ``resume``/``overwrite``/``trust``/``features``: see :class:`Trainer`."""
    return Trainer(cfg, resume=resume, overwrite=overwrite, trust=trust, features=features).run()
