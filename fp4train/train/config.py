"""Training configuration: one dataclass, loadable from TOML, overridable from the command line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainConfig:
    # what
    model: str = "tiny"
    recipe: str = "bf16"
    backend: str | None = None  # GEMM backend; default: the recipe's
    calibration: str | None = None  # AdaHOP: use this calibration JSON instead of calibrating
    # data
    data: str | None = None  # file/glob/dir/hf:NAME; None: the packaged tiny-shakespeare
    val_data: str | None = None
    val_fraction: float = 0.05  # held-out documents when no val_data
    tokenizer: str | None = None  # None: the packaged enwiki BPE-32k
    text_field: str = "text"
    cache_dir: str | None = None
    # shape of a step
    seq_len: int = 256
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1
    max_steps: int = 200
    # optimizer and schedule
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # evaluation, checkpoints, logging
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    log_every: int = 10
    out: str = "runs/train"
    # run
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # autocast dtype for non-quantized ops: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    compile: bool = False
    compile_mode: str = "default"  # with compile: default | reduce-overhead (the steps replayed as CUDA graphs)
    numerics: str | None = None  # eager | compiled | triton (same bits in each); None: the backend's (triton on a GPU)
    progress: bool = True
    tensorboard: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes carried into the run's config.json

    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        problems = []
        for k in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_batches", "keep_checkpoints", "log_every"):
            if getattr(self, k) < 1:
                problems.append(f"{k} must be >= 1, got {getattr(self, k)}")
        for k in ("warmup_steps", "eval_every", "ckpt_every"):
            if getattr(self, k) < 0:
                problems.append(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if self.numerics not in (None, "eager", "compiled", "triton"):
            problems.append(f"numerics must be eager, compiled or triton, got {self.numerics!r}")
        if self.compile_mode not in ("default", "reduce-overhead"):
            problems.append(f"compile_mode must be default or reduce-overhead, got {self.compile_mode!r}")
        if self.compile_mode == "reduce-overhead" and self.grad_accum > 1:
            # each compiled call starts a CUDA-graph step, whose replay may overwrite the gradients that earlier
            # micro-batches left in the graphs' memory
            problems.append(f"compile_mode reduce-overhead takes grad_accum 1 (got {self.grad_accum}): a larger batch_size "
                            "instead, or compile_mode default")
        if self.dtype not in ("auto", "bf16", "fp32"):
            problems.append(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> TrainConfig:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        with open(path, "rb") as f:
            d = tomllib.load(f)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(d)
