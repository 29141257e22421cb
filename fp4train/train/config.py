"""Training configuration: one dataclass, loadable from TOML, overridable from the command line.

Every field is checked when a config is made (type, range, choices), so a bad value from a flag or
a TOML file is refused with its name before any work starts.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..recipes.spec import OPTIMIZERS

DTYPES = ("auto", "bf16", "fp32")
NUMERICS = ("eager", "compiled", "triton")
COMPILE_MODES = ("default", "reduce-overhead")
#: one process; data-parallel (fp4train.train.distributed) or fully sharded (fp4train.train.sharding) under torchrun
PARALLEL = ("none", "ddp", "fsdp")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

#: The fields that decide a run's result. Two runs that agree on these train the same model on the
#: same tokens (the rest - where it is written, how often it logs or checkpoints, the device - does not
#: change what a finished run reports, or changes it only within the numerics' own run-to-run noise).
RESULT_FIELDS = ("model", "recipe", "backend", "calibration", "data", "val_data", "val_fraction", "tokenizer", "text_field",
                 "seq_len", "batch_size", "grad_accum", "max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                 "betas", "grad_clip", "eval_batches", "seed", "data_seed", "dtype", "numerics", "compile", "compile_mode",
                 "optimizer")
#: fields added after runs were first saved, with the value a saved run without them had
FIELDS_ADDED = {"optimizer": "adamw", "data_seed": None, "deterministic": False}


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
    optimizer: str | None = None  # adamw | qadamw | muon | qmuon (fp4train.optim); None: the recipe's, else adamw
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
    seed: int = 0  # initialization, stochastic rounding, and the data order unless data_seed is given
    data_seed: int | None = None  # the order of the training windows; None: seed (a noise-floor probe changes only this)
    deterministic: bool = False  # the same loss bits on every repeat on one GPU (torch.use_deterministic_algorithms)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    parallel: str = "none"  # one of PARALLEL
    dtype: str = "auto"  # autocast dtype for non-quantized ops: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    compile: bool | None = None  # torch.compile the model; None: on a GPU yes, on a CPU no (speed_settings)
    compile_mode: str | None = None  # default | reduce-overhead (steps replayed as CUDA graphs); None: see speed_settings
    numerics: str | None = None  # eager | compiled | triton (same bits in each); None: the backend's (triton on a GPU)
    progress: bool = True
    tensorboard: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes carried into the run's config.json

    def __post_init__(self):
        problems = _type_problems(self)
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        for f in dataclasses.fields(self):  # a TOML integer for a float field, e.g. lr = 1
            if f.type == "float" and isinstance(getattr(self, f.name), int):
                setattr(self, f.name, float(getattr(self, f.name)))
        from .. import models

        if self.model not in models.names():
            problems.append(f"model must be one of {', '.join(models.names())}, got {self.model!r}")
        if not _DEVICE.fullmatch(self.device):
            problems.append(f"device must be {DEVICE_FORMS}, got {self.device!r}")
        if self.val_data is None and not 0.0 < self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in (0, 1) when no val_data is given, got {self.val_fraction}")
        for k in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_batches", "keep_checkpoints", "log_every"):
            if getattr(self, k) < 1:
                problems.append(f"{k} must be >= 1, got {getattr(self, k)}")
        for k in ("warmup_steps", "eval_every", "ckpt_every"):
            if getattr(self, k) < 0:
                problems.append(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if self.numerics not in (None, *NUMERICS):
            problems.append(f"numerics must be eager, compiled or triton, got {self.numerics!r}")
        if self.compile_mode not in (None, *COMPILE_MODES):
            problems.append(f"compile_mode must be default or reduce-overhead, got {self.compile_mode!r}")
        if self.compile_mode == "reduce-overhead" and self.grad_accum > 1:
            # each compiled call starts a CUDA-graph step, whose replay may overwrite the gradients that earlier
            # micro-batches left in the graphs' memory
            problems.append(f"compile_mode reduce-overhead takes grad_accum 1 (got {self.grad_accum}): a larger batch_size "
                            "instead, or compile_mode default")
        if self.optimizer is None:  # resolved here, so a saved config names the optimizer the run used
            try:
                from .. import recipes

                self.optimizer = recipes.get(self.recipe).optimizer or "adamw"
            except (ValueError, FileNotFoundError, TypeError):
                self.optimizer = "adamw"  # the bad recipe is reported when the run loads it
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.parallel not in PARALLEL:
            problems.append(f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))

    @property
    def order_seed(self) -> int:
        """The seed of the training windows' order."""
        return self.seed if self.data_seed is None else self.data_seed

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

    def result_settings(self) -> dict:
        """The :data:`RESULT_FIELDS` of this config (what two runs must share to be the same run). ``calibration``
        only where the recipe calibrates (AdaHOP): a BF16 run is the same run whatever calibration file it was given."""
        out = {k: getattr(self, k) for k in RESULT_FIELDS}
        try:
            from .. import recipes

            if not recipes.get(self.recipe).calibrate:
                out["calibration"] = None
        except (ValueError, FileNotFoundError, TypeError):
            pass
        return out

    @classmethod
    def from_toml(cls, path: str | Path, *, defaults: dict | None = None, **overrides) -> TrainConfig:
        """A config from a TOML file over ``defaults``, with ``overrides`` (flags) on top; errors name the file."""
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            with open(path, "rb") as f:
                d = tomllib.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the config file: {e}") from None
        d = {**(defaults or {}), **d, **{k: v for k, v in overrides.items() if v is not None}}
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


_TYPES = {"str": (str,), "str | None": (str, type(None)), "int": (int,), "int | None": (int, type(None)), "float": (int, float), "bool": (bool,),
          "bool | None": (bool, type(None)), "dict": (dict,)}
_TYPE_NAMES = {"str": "a string", "str | None": "a string", "int": "an integer", "int | None": "an integer", "float": "a number", "bool": "true or false",
               "bool | None": "true or false", "dict": "a table"}


def speed_settings(cfg: TrainConfig, device) -> tuple[bool, str, str]:
    """``(compile, compile_mode, why)``: what the run uses. Given values are kept; where the config leaves them
    (None), a GPU run takes the fastest correct settings - ``torch.compile`` with its steps replayed as CUDA graphs
    (``reduce-overhead``; ``default`` where ``grad_accum`` > 1, which graphs cannot replay, or under ``--parallel``,
    whose gradient collectives run between the compiled pieces) - and a CPU run stays eager (Inductor's CPU code
    is no faster here and compiles for minutes). ``why`` says so in a line."""
    gpu = getattr(device, "type", str(device)) == "cuda"
    compile_ = cfg.compile if cfg.compile is not None else gpu
    if cfg.compile_mode is not None:
        mode = cfg.compile_mode
    else:
        mode = "reduce-overhead" if compile_ and gpu and cfg.grad_accum == 1 and cfg.parallel == "none" else "default"
    if not compile_:
        why = "eager" + (" (the default on a CPU; --compile to compile)" if cfg.compile is None else " (--no-compile)")
    else:
        what = "torch.compile with CUDA graphs (reduce-overhead)" if mode == "reduce-overhead" else "torch.compile (default mode)"
        why = what + (" - the default on a GPU; --no-compile runs eagerly" if cfg.compile is None else "")
        if cfg.compile_mode is None and gpu and cfg.parallel != "none":
            why += f" (no CUDA graphs under --parallel {cfg.parallel})"
    return compile_, mode, why


def _type_problems(cfg: TrainConfig) -> list[str]:
    """What is of the wrong type in ``cfg`` (a TOML file or a caller can give any value)."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.type == "tuple[float, float]":
            ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in v)
            what = "two numbers, e.g. [0.9, 0.95]"
        else:
            types = _TYPES[f.type]
            ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
            what = _TYPE_NAMES[f.type]
        if not ok:
            out.append(f"{f.name} must be {what}, got {v!r} ({type(v).__name__})")
    return out
