"""Training configuration: one dataclass, loadable from TOML, overridable from the command line.

Every field is checked when a config is made (type, range, choices), so a bad value from a flag or
a TOML file is refused with its name before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
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

@dataclass(frozen=True)
class Bounds:
    """The values a numeric option takes: ``low``..``high`` (``None``: unbounded), each end excluded where
    ``*_open``; finite, unless ``inf`` admits +inf."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    inf: bool = False

    def __contains__(self, v) -> bool:
        if isinstance(v, float) and (math.isnan(v) or (math.isinf(v) and not (self.inf and v > 0))):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def __str__(self) -> str:
        lo, hi = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {lo}"
        else:
            text = f"{'<' if self.high_open else '<='} {hi}"
        return text + (" (or inf)" if self.inf else "")


def _num(v) -> str:
    if v is None:
        return ""
    if float(v).is_integer():
        v = int(v)
        return f"2**{(v + 1).bit_length() - 1} - 1" if v > 2**20 and (v + 1) & v == 0 else str(v)
    return str(v)


POSITIVE = Bounds(0, low_open=True)
AT_LEAST_0 = Bounds(0)
AT_LEAST_1 = Bounds(1)
FRACTION = Bounds(0, 1)
SEED = Bounds(0, 2**63 - 1)


_NOT_ADDED = object()


def option(default=dataclasses.MISSING, *, help: str, bounds: Bounds | None = None, choices=None, result: bool = False,
           fixed: bool = False, train_only: bool = False, added: str | None = None, before=_NOT_ADDED, cli: bool = True, **kw):
    """A :class:`TrainConfig` field with everything the CLI and the checks read from it, so that an option is
    defined in this one place:

    * ``help``: the flag's help text; ``bounds``: the range of a number (each element's, for a tuple);
      ``choices``: the values of a string (a callable: computed when asked);
    * ``result``: the option decides what a finished run reports (``compare`` reruns a run made with another value;
      :data:`RESULT_FIELDS`); ``fixed``: a checkpoint's state belongs to its value, so ``--resume`` refuses a change
      (:data:`RESUME_FIXED`; a fixed option decides the result too);
    * ``train_only``: only a training run uses it (``analyze``, which trains BF16 briefly for itself, has no flag);
    * ``added``: the fp4train version that added the option, and ``before``: the value runs saved before then ran
      with (:data:`FIELDS_ADDED`); ``cli=False``: no flag (set from TOML or Python only).
    """
    if (added is None) != (before is _NOT_ADDED):
        raise TypeError("option(): added= and before= go together (the version, and what runs saved before it ran with)")
    meta = {"help": help, "bounds": bounds, "choices": choices, "result": result or fixed, "fixed": fixed,
            "train_only": train_only, "added": added, "before": None if before is _NOT_ADDED else before, "cli": cli}
    return field(default=default, metadata=meta, **kw)


def _model_names():
    from .. import models

    return tuple(models.names())


@dataclass
class TrainConfig:
    """Everything a training run is made of. Every field is checked when a config is made - its type, its range
    (:class:`Bounds`: finite numbers in the field's interval), its choices - whether it comes from a flag, a
    TOML file or Python, and the error names the field with its flag and what it takes."""

    # what
    model: str = option("tiny", fixed=True, help="model size preset (fp4train's Llama; see --hf-config for others)", choices=_model_names)
    hf_config: str | None = option(None, fixed=True, added="0.1.0", before=None,
                                   help="a transformers config (config.json or its folder) to train instead of --model, from "
                                   "random initialization: any causal LM AutoModelForCausalLM builds (Llama, Qwen2, Mistral, "
                                   "Phi-3, GPT-2, Mixtral, ...); its vocabulary is raised to the tokenizer's if smaller")
    recipe: str = option("bf16", fixed=True, train_only=True, help="recipe name (see `fp4train recipes`) or a recipe .json/.toml file")
    backend: str | None = option(None, result=True, train_only=True, help="GEMM backend: auto (the default: fp8_blockwise on a GPU machine, "
                                 "emulated elsewhere), fp8_blockwise (MXFP4 and FP8 rowwise GEMMs on FP8 tensor cores), or "
                                 "emulated (BF16 tensor cores or FP32, the reference)")
    calibration: str | None = option(None, result=True, train_only=True, help="AdaHOP recipes: reuse this adahop_calibration.json (from an earlier "
                                     "run) instead of calibrating")
    # data
    data: str | None = option(None, fixed=True, help="training text: a .txt/.jsonl/.jsonl.xz/.parquet file, a glob, a directory "
                              "(train-*/val-* shards split themselves), 'shakespeare' or hf:NAME[:SPLIT]; several joined "
                              "with commas. Default: the packaged tiny-shakespeare")
    val_data: str | None = option(None, fixed=True, help="validation text, same forms as --data (default: hold out --val-fraction of "
                                  "the documents)")
    val_fraction: float = option(0.05, result=True, help="fraction of documents held out for validation when --val-data is not given",
                                 bounds=Bounds(0, 1, low_open=True, high_open=True))
    tokenizer: str | None = option(None, fixed=True, help="tokenizer: a tokenizer.json(.xz) path or a Hugging Face name (default: the "
                                   "packaged 32k enwiki BPE)")
    text_field: str = option("text", result=True, help="JSON/parquet field that holds the text")
    cache_dir: str | None = option(None, help="where tokenized data is cached (default: $FP4TRAIN_CACHE or "
                                   "~/.cache/fp4train)")
    # shape of a step
    seq_len: int = option(256, fixed=True, help="tokens per sequence", bounds=AT_LEAST_1)
    batch_size: int = option(16, fixed=True, help="sequences per micro-batch", bounds=AT_LEAST_1)
    grad_accum: int = option(1, result=True, help="micro-batches per optimizer step", bounds=AT_LEAST_1)
    max_steps: int = option(200, result=True, train_only=True, help="optimizer steps to train (AdaHOP's BF16 calibration steps are among them)",
                            bounds=AT_LEAST_1)
    # optimizer and schedule
    optimizer: str | None = option(None, fixed=True, added="0.1.0", before="adamw", help="adamw (torch's, FP32 moments), qadamw (AdamW with both moments stored in "
                                   "NVFP4, fp4train.optim.QAdamW), muon (Muon on the 2D hidden weights, AdamW on the rest: "
                                   "torch's arithmetic), qmuon (the same with NVFP4 states, fp4train.optim.QMuon), root (Root: "
                                   "Muon with outliers soft-thresholded and Newton-Schulz coefficients fitted per shape) or "
                                   "qroot (Full-Stack FP4's Q-Root: NVFP4 states and native NVFP4 Newton-Schulz, "
                                   "fp4train.optim.QRoot), qroot_bf16ns (ours: Q-Root with BF16 Newton-Schulz); "
                                   "default: the recipe's (fullstack: qroot, fullstack_qadamw: qadamw), else adamw", choices=OPTIMIZERS)
    lr: float = option(3e-3, result=True, help="peak learning rate (of every optimizer)", bounds=POSITIVE)
    lora_lr_multiplier: float = option(2.0, fixed=True, added="0.1.0", before=1.0, help="LoRA-SVD recipes (fullstack): the "
                                       "low-rank factors' learning rate as a multiple of --lr (Full-Stack FP4 trains them "
                                       "at 2x)", bounds=POSITIVE)
    min_lr_ratio: float = option(0.1, result=True, help="the cosine schedule decays to lr * this", bounds=FRACTION)
    warmup_steps: int = option(20, result=True, help="linear warmup steps", bounds=AT_LEAST_0)
    weight_decay: float = option(0.1, result=True, help="decoupled weight decay of the matrices (each step multiplies them by "
                                 "1 - lr * weight_decay)", bounds=AT_LEAST_0)
    betas: tuple[float, float] = option((0.9, 0.95), result=True, help="the moments' decay rates, e.g. 0.9,0.95",
                                        bounds=Bounds(0, 1, high_open=True))
    grad_clip: float = option(1.0, result=True, help="clip the global gradient norm to this; inf: no clipping",
                              bounds=Bounds(0, low_open=True, inf=True))
    # evaluation, checkpoints, logging
    eval_every: int = option(50, train_only=True, help="evaluate the validation loss every N steps (and at the end); 0: only at the end",
                             bounds=AT_LEAST_0)
    eval_batches: int = option(8, result=True, train_only=True, help="validation batches per evaluation (the same ones every time)", bounds=AT_LEAST_1)
    ckpt_every: int = option(100, train_only=True, help="write a checkpoint every N steps (and at the end); 0: only at the end",
                             bounds=AT_LEAST_0)
    keep_checkpoints: int = option(2, train_only=True, help="how many recent checkpoints to keep", bounds=AT_LEAST_1)
    log_every: int = option(10, help="write a metrics record every N steps", bounds=AT_LEAST_1)
    out: str = option("runs/train", help="run directory (config, metrics.jsonl, TensorBoard logs, checkpoints, summary); "
                      "a new run needs an empty or new one")
    # run
    seed: int = option(0, fixed=True, help="seed for init, data order and stochastic rounding", bounds=SEED)
    data_seed: int | None = option(None, fixed=True, added="0.1.0", before=None, help="seed of the training windows' order alone (default: --seed); same init "
                                   "and rounding, another order", bounds=SEED)
    deterministic: bool = option(False, added="0.1.0", before=False, help="the same loss bits on every repeat of a run on one GPU: "
                                 "torch.use_deterministic_algorithms, a fixed cuBLAS workspace, atomic-free attention "
                                 "backward (slower; off by default)")
    device: str = option("auto", help="auto (GPU if there is one), cpu, cuda or cuda:N")
    parallel: str = option("none", help="none; ddp: data-parallel over the processes torchrun starts (torchrun "
                           "--nproc-per-node N -m fp4train train --parallel ddp ...; each takes batch-size / N sequences of "
                           "every batch, so the global batch is the same); fsdp: the same, with each transformer block's "
                           "weights, gradients and every optimizer's states sharded (FSDP2)", choices=PARALLEL)
    dtype: str = option("auto", result=True, help="autocast dtype for non-quantized ops: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32",
                        choices=DTYPES)
    compile: bool | None = option(None, result=True, train_only=True, help="torch.compile the model (default: on a GPU, off on a CPU; --no-compile "
                                  "runs eagerly)")
    compile_mode: str | None = option(None, result=True, train_only=True, help="with compile: default, or reduce-overhead (each step replayed as CUDA "
                                      "graphs: no per-kernel launch from the host, which bounds the quantized recipes' "
                                      "speed at small models; stochastic-rounding seeds are then drawn on the device, "
                                      "random Hadamard signs too); default: reduce-overhead on a GPU with --grad-accum 1, "
                                      "else default", choices=COMPILE_MODES)
    numerics: str | None = option(None, result=True, train_only=True, help="how quantization runs, same bits in each: eager (reference ops), compiled "
                                  "(torch.compile'd reference), triton (fp4train's kernels where they exist); default: "
                                  "triton with the fp8_blockwise backend (the default on a GPU machine), eager elsewhere",
                                  choices=NUMERICS)
    progress: bool = option(True, help="show a progress bar")
    tensorboard: bool = option(True, help="write TensorBoard logs")
    extra: dict = option(cli=False, help="free-form notes carried into the run's config.json", default_factory=dict)

    def __post_init__(self):
        problems = _type_problems(self)
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        for f in dataclasses.fields(self):  # a TOML integer for a float field, e.g. lr = 1
            if f.type == "float" and isinstance(getattr(self, f.name), int):
                setattr(self, f.name, float(getattr(self, f.name)))
        problems += _value_problems(self)
        if not _DEVICE.fullmatch(self.device):
            problems.append(f"device must be {DEVICE_FORMS}, got {self.device!r} (--device)")
        if not problems and self.lr * self.weight_decay >= 1:
            problems.append(f"lr * weight_decay must be < 1 (each step multiplies the weights by 1 - lr * weight_decay), "
                            f"got {self.lr} * {self.weight_decay}: lower --weight-decay or --lr")
        if self.compile_mode == "reduce-overhead" and self.grad_accum > 1:
            # each compiled call starts a CUDA-graph step, whose replay may overwrite the gradients that earlier
            # micro-batches left in the graphs' memory
            problems.append(f"compile_mode reduce-overhead takes grad_accum 1 (got {self.grad_accum}): a larger batch_size "
                            "instead, or compile_mode default")
        if self.hf_config is not None and self.model != "tiny":
            problems.append(f"--model {self.model} and --hf-config {self.hf_config} both name the model to train: give one "
                            "(--hf-config trains its config's architecture)")
        if self.optimizer is None:  # resolved here, so a saved config names the optimizer the run used
            try:
                from .. import recipes

                self.optimizer = recipes.get(self.recipe).optimizer or "adamw"
            except (ValueError, FileNotFoundError, TypeError):
                self.optimizer = "adamw"  # the bad recipe is reported when the run loads it
        if problems:
            raise ValueError("bad training config: " + "; ".join(problems))

    @property
    def order_seed(self) -> int:
        """The seed of the training windows' order."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def model_name(self) -> str:
        """What the run trains, as its summary and a comparison's report name it: the preset, or ``hf:<config>``."""
        return self.model if self.hf_config is None else f"hf:{self.hf_config}"

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
        """The :data:`RESULT_FIELDS` of this config (what two runs must share to be the same run), those the recipe
        does not use (:meth:`unused_by_recipe`) as None: a BF16 run is the same run whatever calibration file or LoRA
        learning-rate multiplier it was given."""
        out = {k: getattr(self, k) for k in RESULT_FIELDS}
        out.update(dict.fromkeys(self.unused_by_recipe()))
        return out

    def unused_by_recipe(self) -> list[str]:
        """The options this config's recipe does not use: ``calibration`` unless it calibrates (AdaHOP),
        ``lora_lr_multiplier`` unless it has LoRA-SVD linears (none if the recipe cannot be loaded)."""
        try:
            from .. import recipes

            rec = recipes.get(self.recipe)
        except (ValueError, FileNotFoundError, TypeError):
            return []
        return [k for k, used in (("calibration", rec.calibrate), ("lora_lr_multiplier", rec.lora_svd)) if not used]

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


def _fields_where(key: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata[key])


#: The options that decide a run's result. Two runs that agree on these train the same model on the same tokens (the
#: rest - where it is written, how often it logs or checkpoints, the device - does not change what a finished run
#: reports, or changes it only within the numerics' own run-to-run noise). ``compare`` reruns a run that differs.
RESULT_FIELDS = _fields_where("result")
#: The options a checkpoint's state belongs to (the model, its data and their order, the optimizer): ``--resume``
#: refuses a change of any of them. The rest of :data:`RESULT_FIELDS` may change on resume (a larger --max-steps).
RESUME_FIXED = _fields_where("fixed")
#: Options that only a training run uses (``analyze`` trains BF16 for its own --steps, without checkpoints).
TRAIN_ONLY = _fields_where("train_only")
#: Options added after runs were first saved, with the value a saved run without them ran with.
FIELDS_ADDED = {f.name: f.metadata["before"] for f in dataclasses.fields(TrainConfig) if f.metadata["added"]}


def saved_settings(saved: dict) -> dict:
    """A run's saved ``train`` config with the options added since it was saved set to what it ran with."""
    return {**FIELDS_ADDED, **saved}


_TYPES = {"str": (str,), "str | None": (str, type(None)), "int": (int,), "int | None": (int, type(None)), "float": (int, float), "bool": (bool,),
          "bool | None": (bool, type(None)), "dict": (dict,)}
_TYPE_NAMES = {"str": "a string", "str | None": "a string", "int": "an integer", "int | None": "an integer", "float": "a number", "bool": "true or false",
               "bool | None": "true or false", "dict": "a table"}


def has_experts(cfg: TrainConfig) -> bool:
    """Does the run's model route its tokens to experts: a ``moe-*`` preset, or a transformers config with more than
    one expert (``num_local_experts``, ``num_experts`` or ``n_routed_experts``)? A config that cannot be read counts
    as dense here; building the model names what is wrong with it."""
    if cfg.hf_config is None:
        from ..models import PRESETS

        return bool(cfg.model in PRESETS and PRESETS[cfg.model].n_experts)
    from ..models.hf import load_config

    try:
        config = load_config(cfg.hf_config)
    except ValueError:
        return False
    return any(isinstance(n := getattr(config, k, None), int) and n > 1
               for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def speed_settings(cfg: TrainConfig, device) -> tuple[bool, str, str]:
    """``(compile, compile_mode, why)``: what the run uses. Given values are kept; where the config leaves them
    (None), a GPU run takes the fastest correct settings - ``torch.compile`` with its steps replayed as CUDA graphs
    (``reduce-overhead``; ``default`` where ``grad_accum`` > 1, which graphs cannot replay, or under ``--parallel``,
    whose gradient collectives run between the compiled pieces) - and a CPU run stays eager (Inductor's CPU code
    is no faster here and compiles for minutes). A mixture of experts (:func:`has_experts`) stays eager on a GPU too
    unless asked, and compiles without CUDA graphs if it is: its experts' token counts change every step, and
    compiled graphs would be recompiled or re-recorded for them, and its quantized experts run eagerly inside a
    compiled model anyway (at ``moe-20m`` compiling made no quantized recipe faster: docs/models.md). ``why`` says
    so in a line."""
    gpu = getattr(device, "type", str(device)) == "cuda"
    moe = has_experts(cfg)
    compile_ = cfg.compile if cfg.compile is not None else gpu and not moe
    if cfg.compile_mode is not None:
        mode = cfg.compile_mode
    else:
        graphs = compile_ and gpu and cfg.grad_accum == 1 and cfg.parallel == "none" and not moe
        mode = "reduce-overhead" if graphs else "default"
    if moe and gpu and cfg.compile is None:
        why = ("eager - the default for a mixture of experts: its experts' token counts change every step; --compile "
               "compiles it (without CUDA graphs)")
    elif not compile_:
        why = "eager" + (" (the default on a CPU; --compile to compile)" if cfg.compile is None else " (--no-compile)")
    else:
        what = "torch.compile with CUDA graphs (reduce-overhead)" if mode == "reduce-overhead" else "torch.compile (default mode)"
        why = what + (" - the default on a GPU; --no-compile runs eagerly" if cfg.compile is None else "")
        if cfg.compile_mode is None and gpu and cfg.parallel != "none":
            why += f" (no CUDA graphs under --parallel {cfg.parallel})"
    return compile_, mode, why


def flag(name: str) -> str:
    """The command-line flag of a config field."""
    return "--" + name.replace("_", "-")


def choices(f: dataclasses.Field) -> tuple | None:
    c = f.metadata.get("choices")
    return tuple(c()) if callable(c) else c


def _value_problems(cfg: TrainConfig) -> list[str]:
    """What is out of range in ``cfg`` (its types are right): each field's :class:`Bounds` and choices."""
    out = []
    for f in dataclasses.fields(cfg):
        v, b, c = getattr(cfg, f.name), f.metadata.get("bounds"), choices(f)
        if v is None or (f.name == "val_fraction" and cfg.val_data is not None):  # None: the default; unused fraction
            continue
        if b is not None and not all(x in b for x in (v if isinstance(v, tuple) else (v,))):
            finite = " and finite" if f.type.startswith("float") and not b.inf and (b.low is None or b.high is None) else ""
            out.append(f"{'each of ' if isinstance(v, tuple) else ''}{f.name} must be {b}{finite}, got {_show(v)} ({flag(f.name)})")
        if c is not None and v not in c:
            out.append(f"{f.name} must be one of {', '.join(c)}, got {v!r} ({flag(f.name)})")
    return out


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


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
