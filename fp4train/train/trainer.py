"""The training loop: any model preset, any recipe, checkpointed and exactly resumable.

One step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences, AdamW (fused on
CUDA), linear warmup then cosine decay, gradient clipping. Non-quantized ops run under BF16
autocast on GPU. Every ``eval_every`` steps the validation loss is measured on a fixed set of
windows. Every ``ckpt_every`` steps a checkpoint holds everything the next step depends on:
model, optimizer, scheduler, data position and all RNG states (torch CPU - which also seeds
stochastic rounding - CUDA, Python), so ``resume`` continues bit for bit. A non-finite loss or
gradient norm stops the run at once with the step named; the last good checkpoint stays.

Writes to ``out``: ``config.json``, ``metrics.jsonl`` (one JSON object per logged step),
TensorBoard events under ``tb/``, ``checkpoints.json`` + ``step_*.pt``, and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from .. import backends, counter_rng, formats, models
from .. import recipes as _recipes
from ..adahop.calibration import Calibration, PatternRecorder
from ..timing import code_commit
from ..convert import convert
from ..data import PackedBatches, eval_batches, load_splits, load_tokenizer
from ..linear.module import set_device_seeds
from .checkpoint import Checkpoints
from .config import TrainConfig


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/Inf."""


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    return dev


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` after ``step`` optimizer steps: linear warmup, cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _rng_state(device: torch.device) -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "device_seeds": counter_rng.device_seed_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict, device: torch.device) -> None:
    torch.set_rng_state(st["torch"].cpu())  # the checkpoint may have been loaded onto the GPU
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"].cpu(), device)
    counter_rng.load_device_seed_state(st.get("device_seeds", {}))  # compile_mode reduce-overhead's seed streams


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, log=None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.device = resolve_device(cfg.device)
        self.amp_dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else None, "bf16": torch.bfloat16, "fp32": None}[cfg.dtype]
        self.resume = resume
        self.recipe = _recipes.get(cfg.recipe)

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # CUDA graphs (compile_mode reduce-overhead): compiled layers draw stochastic-rounding seeds on the device,
        # from a stream (re)started here, at a fixed point of the seeded CPU generator
        self._graphs = cfg.compile and cfg.compile_mode == "reduce-overhead"
        set_device_seeds(self._graphs)
        if self._graphs:
            counter_rng.restart_device_seed_stream(self.device)
        from ..formats import set_numerics

        if cfg.numerics is not None:
            set_numerics(cfg.numerics)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.train_split, self.val_split = load_splits(
            cfg.data, cfg.val_data, self.tokenizer, val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir,
            text_field=cfg.text_field, verbose=cfg.progress,
        )
        mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size)
        if cfg.seq_len > mcfg.max_seq_len:
            mcfg = models.config(cfg.model, vocab_size=self.tokenizer.vocab_size, max_seq_len=cfg.seq_len)
        self.model = models.Llama(mcfg).to(self.device)
        convert(self.model, self.recipe, backend=cfg.backend)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=self.device.type == "cuda",
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self.batches = PackedBatches(self.train_split, cfg.seq_len, cfg.batch_size, cfg.seed)
        self.evals = eval_batches(self.val_split, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
        self.ckpts = Checkpoints(self.out, keep=cfg.keep_checkpoints)
        self.step = 0
        self.forward = self._compiled() if cfg.compile else self.model
        # AdaHOP: calibrate during the first steps (in BF16), or reuse a saved calibration
        self.calibration: Calibration | None = None
        self.recorder: PatternRecorder | None = None
        if self.recipe.calibrate:
            if cfg.calibration:
                self.apply_calibration(Calibration.load(cfg.calibration))
            else:
                self.recorder = PatternRecorder.for_recipe(self.model, self.recipe).attach()

    def apply_calibration(self, cal: Calibration) -> None:
        """Swap every calibrated layer to its AdaHOP strategies (parameters are kept)."""
        if self.recorder is not None:
            self.recorder.detach()
            self.recorder = None
        self.calibration = cal
        convert(self.model, cal.recipe(self.recipe.name, base=self.recipe), backend=self.cfg.backend)
        if self.cfg.compile:
            self.forward = self._compiled()

    def _compiled(self):
        """The model under ``torch.compile`` with the config's mode. With ``reduce-overhead`` Inductor replays each
        graph as CUDA graphs, and the layers draw their stochastic-rounding seeds and random Hadamard signs on the
        device (set in __init__), so that every seeded layer is captured and each replay draws fresh ones."""
        mode = self.cfg.compile_mode
        return torch.compile(self.model, mode=None if mode == "default" else mode)

    def _step_begins(self) -> None:
        """Before each compiled call under CUDA graphs: a new iteration (the previous replay's outputs may be
        overwritten; everything kept from it - the loss sum, the evaluation total - is copied out first; the
        gradients are used and freed within the step, which is why the config asks grad_accum 1)."""
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
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
        changed = [k for k in ("model", "recipe", "data", "val_data", "tokenizer", "seq_len", "batch_size", "seed")
                   if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(self.cfg, k)!r}" for k in changed)
            raise ValueError(f"cannot resume: the run's settings changed ({diffs}); resume with the same settings "
                             f"(plain `fp4train train --out DIR --resume` reuses them) or start a new --out")
        if st.get("adahop_calibration"):
            self.apply_calibration(Calibration.from_dict(st["adahop_calibration"]))
        elif st.get("adahop_recorder") and self.recorder is not None:
            rec = st["adahop_recorder"]
            self.recorder.patterns, self.recorder.steps = rec["patterns"], rec["steps"]
            for layer, gemms in rec["err_sum"].items():
                for gemm, errs in gemms.items():
                    self.recorder.err_sum[layer][gemm].update(errs)
            for layer, gemms in rec["err_n"].items():
                self.recorder.err_n[layer].update(gemms)
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
        loss_val = loss_sum.item() / cfg.grad_accum
        if not math.isfinite(loss_val):
            raise TrainingDiverged(self._diverged_msg(f"loss is {loss_val}"))
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip).item()
        if not math.isfinite(gnorm):
            raise TrainingDiverged(self._diverged_msg(f"gradient norm is {gnorm}"))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return loss_val, gnorm

    def _finish_calibration(self) -> None:
        cal = self.recorder.result()
        self.apply_calibration(cal)
        cal.save(self.out / "adahop_calibration.json")
        self.log(f"fp4train: AdaHOP calibrated over {cal.steps} steps ({cal.mode}): GEMM strategies {cal.strategy_counts()}; "
                 f"table in {self.out / 'adahop_calibration.json'}")

    def _diverged_msg(self, what: str) -> str:
        last = self.ckpts.entries()
        keep = f"; the last good checkpoint is {self.out / last[-1]['file']} (step {last[-1]['step']})" if last else "; no checkpoint was written yet"
        return f"training diverged at step {self.step + 1}: {what} (recipe {self.recipe.name}){keep}"

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if self.resume:
            st = self.ckpts.load(None if self.resume is True else self.resume, map_location=self.device)
            self.load_state_dict(st)
            self.log(f"fp4train: resumed {self.out} at step {self.step}")
        (self.out / "config.json").write_text(json.dumps({"train": cfg.to_dict(), "recipe": self.recipe.to_dict(),
                                                          "model": self.model.config.to_dict()}, indent=1))
        metrics_path = self.out / "metrics.jsonl"
        _truncate_metrics(metrics_path, self.step)
        tb = _tensorboard(self.out / "tb") if cfg.tensorboard else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = _progress(cfg, self.step)
        n_params = self.model.num_params()
        self.log(
            f"fp4train: model {cfg.model} ({n_params / 1e6:.1f}M params), recipe {self.recipe.name}, "
            f"{cfg.max_steps} steps x {cfg.tokens_per_step:,} tokens, device {self.device}"
        )
        t_last, tok_last, tok_rates = time.perf_counter(), 0, []
        val_loss = None
        try:
            with open(metrics_path, "a") as mf:
                while self.step < cfg.max_steps:
                    loss, gnorm = self.train_step()
                    tok_last += cfg.tokens_per_step
                    if self.recorder is not None:
                        self.recorder.steps += 1
                        if self.step >= self.recipe.calibration_steps:
                            self._finish_calibration()
                    rec = None
                    if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        now = time.perf_counter()
                        rate = tok_last / (now - t_last)
                        if self.step > cfg.log_every:  # the first interval includes warm-up/compilation
                            tok_rates.append(rate)
                        t_last, tok_last = now, 0
                        rec = {"step": self.step, "loss": loss, "lr": self.sched.get_last_lr()[0], "grad_norm": gnorm,
                               "tokens": self.step * cfg.tokens_per_step, "tokens_per_s": rate}
                    if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.max_steps:
                        val_loss = self.evaluate()
                        rec = rec or {"step": self.step, "loss": loss, "tokens": self.step * cfg.tokens_per_step}
                        rec.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                    if rec:
                        mf.write(json.dumps(rec) + "\n")
                        mf.flush()
                        if tb:
                            for k, v in rec.items():
                                if k != "step":
                                    tb.add_scalar(k, v, self.step)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.3f}", **({"val": f"{val_loss:.3f}"} if val_loss is not None else {}))
                    if (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or self.step == cfg.max_steps:
                        self.ckpts.save(self.step, self.state_dict())
        finally:
            if bar is not None:
                bar.close()
            if tb:
                tb.close()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        summary = {
            "model": cfg.model, "recipe": self.recipe.name, "seed": cfg.seed, "steps": self.step,
            "tokens": self.step * cfg.tokens_per_step, "params": n_params,
            "final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
            "tokens_per_s": (sum(tok_rates) / len(tok_rates)) if tok_rates else None,
            "peak_mem_gib": peak, "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "numerics": formats.numerics(), "backend": backends.resolve(cfg.backend or self.recipe.backend),
            "commit": code_commit(), "torch": torch.__version__,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        self.log(f"fp4train: done - val loss {val_loss:.4f}" + (f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "")
                 + (f", peak {peak:.2f} GiB" if peak else ""))
        return summary


def train(cfg: TrainConfig, *, resume: bool | str = False) -> dict:
    """Train as ``cfg`` says; returns the run summary (also written to ``cfg.out/summary.json``)."""
    return Trainer(cfg, resume=resume).run()


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records a crashed run logged after its last checkpoint."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


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
