"""Recipes are data: what to do with each operand of each GEMM of a linear layer.

A linear layer ``Y = X W^T`` runs three GEMMs, each written ``C = A B^T`` with both operands
blocked along the inner dimension (docs/methods.md):

=======  =====================  ==========  ===================  ===================
GEMM     product                inner dim   operand ``a``        operand ``b``
=======  =====================  ==========  ===================  ===================
fprop    ``Y  = X W^T``         K (in)      X [M, K]             W [N, K]
dgrad    ``dX = dY W``          N (out)     dY [M, N]            W^T [K, N]
wgrad    ``dW = dY^T X``        M (tokens)  dY^T [N, M]          X^T [K, M]
=======  =====================  ==========  ===================  ===================

So a :class:`LinearSpec` holds three :class:`GemmSpec` s, each with two :class:`QuantSpec` s
(six operands) and an optional inner-dimension :class:`TransformSpec` shared by both
operands. A :class:`Recipe` adds a name, per-module overrides by name pattern and the
backend. Everything is a frozen dataclass and round-trips through ``to_dict``/``from_dict``
(and JSON/TOML, where ``None`` is written by omission).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats.quantize import FORMATS, ROUNDINGS
from ..transforms.hadamard import _check_block as _check_hadamard_block

#: The format name for "not quantized": the operand stays in the layer's compute dtype.
HIGH_PRECISION = "bf16"


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized (``format="bf16"``: it is not)."""

    format: str = HIGH_PRECISION
    block: int | tuple[int, int] | None = None  # None: the format's default; (b, b): 2D tiles
    scale: str = "floor"  # MX scale rule: "floor" | "ceil"
    rounding: str = "nearest"  # "nearest" | "stochastic"
    four_over_six: bool = False  # NVFP4 only

    def __post_init__(self):
        if isinstance(self.block, list):
            object.__setattr__(self, "block", tuple(self.block))
        if self.format != HIGH_PRECISION and self.format not in FORMATS:
            raise ValueError(f"unknown operand format {self.format!r}; choose {HIGH_PRECISION!r} or one of {sorted(FORMATS)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {self.rounding!r}; choose one of {ROUNDINGS}")
        if self.scale not in ("floor", "ceil"):
            raise ValueError(f"unknown scale rule {self.scale!r}; choose 'floor' or 'ceil'")
        if self.scale == "ceil" and self.format in ("nvfp4", "fp8"):
            raise ValueError(f"scale='ceil' is for MX formats (power-of-two scales), not {self.format}")
        if self.four_over_six and self.format != "nvfp4":
            raise ValueError("four_over_six is an NVFP4 option")
        b = self.block
        if isinstance(b, tuple):
            if len(b) != 2 or b[0] != b[1] or b[0] < 2 or b[0] % 2:
                raise ValueError(f"2D blocks must be square with an even side, like (32, 32); got {b}")
            if self.format == "fp8":
                raise ValueError("fp8 is scaled per row; it has no 2D tiles")
        elif b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 2 or b % 2):
            raise ValueError(f"block must be an even int >= 2, (b, b) or None; got {b!r}")

    @property
    def quantized(self) -> bool:
        return self.format != HIGH_PRECISION

    @property
    def is_2d(self) -> bool:
        return isinstance(self.block, tuple)

    @property
    def block_size(self) -> int | None:
        """Side of the block along the inner dimension (None: the whole row or unquantized)."""
        if not self.quantized:
            return None
        if self.block is None:
            return FORMATS[self.format].default_block
        return self.block[0] if self.is_2d else self.block

    @property
    def stochastic(self) -> bool:
        return self.quantized and self.rounding == "stochastic"

    def quantize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`fp4train.quantize` (besides axis and seed)."""
        kw: dict[str, Any] = dict(block=self.block, scale=self.scale, rounding=self.rounding)
        if self.four_over_six:
            kw["four_over_six"] = True
        return kw


@dataclass(frozen=True)
class TransformSpec:
    """An inner-dimension transform applied to both operands of a GEMM before quantization."""

    kind: str = "hadamard"
    block: int = 32
    random_signs: bool = False  # randomized Hadamard (RHT): seeded +-1 signs, fresh per step

    def __post_init__(self):
        if self.kind != "hadamard":
            raise ValueError(f"unknown transform {self.kind!r}; the only one is 'hadamard'")
        _check_hadamard_block(self.block)


_OUTLIER_KINDS = ("none", "inner", "outer")


@dataclass(frozen=True)
class OutlierSpec:
    """Outlier extraction (AdaHOP's OE) for one GEMM: what FOID takes out of each operand.

    ``a``/``b``: ``"outer"`` extracts the operand's ``k`` outlier rows (as the GEMM sees it),
    ``"inner"`` its ``k`` outlier inner channels (shared with the other operand, a rank-k
    update), ``"none"`` nothing. The extracted parts run in high precision; the residual is
    prepared as the GemmSpec says (see :mod:`fp4train.linear.outlier_gemm`).
    """

    a: str = "none"
    b: str = "none"
    k: int = 16

    def __post_init__(self):
        for v in (self.a, self.b):
            if v not in _OUTLIER_KINDS:
                raise ValueError(f"outlier extraction kind must be one of {_OUTLIER_KINDS}, got {v!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"outlier count k must be a positive int, got {self.k!r}")


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM ``C = A B^T``: how to prepare ``a`` and ``b`` (both along the inner dim)."""

    a: QuantSpec = field(default_factory=QuantSpec)
    b: QuantSpec = field(default_factory=QuantSpec)
    transform: TransformSpec | None = None
    outliers: OutlierSpec | None = None

    @property
    def quantized(self) -> bool:
        return self.a.quantized or self.b.quantized or self.transform is not None

    @property
    def inner_multiple(self) -> int:
        """What the inner dimension must be a multiple of (blocks and transform)."""
        m = 1
        for q in (self.a, self.b):
            if q.block_size is not None:
                m = _lcm(m, q.block_size)
        if self.transform is not None:
            m = _lcm(m, self.transform.block)
        return m


@dataclass(frozen=True)
class LinearSpec:
    """The three GEMMs of one linear layer (see the module docstring for the operands)."""

    fprop: GemmSpec = field(default_factory=GemmSpec)
    dgrad: GemmSpec = field(default_factory=GemmSpec)
    wgrad: GemmSpec = field(default_factory=GemmSpec)

    @property
    def quantized(self) -> bool:
        return self.fprop.quantized or self.dgrad.quantized or self.wgrad.quantized

    @property
    def needs_seed(self) -> bool:
        """Does any operand round stochastically or any transform draw random signs?"""
        for g in (self.fprop, self.dgrad, self.wgrad):
            if g.a.stochastic or g.b.stochastic or (g.transform is not None and g.transform.random_signs):
                return True
        return False

    def shape_problems(self, in_features: int, out_features: int) -> list[str]:
        """Why this spec cannot run a ``in_features -> out_features`` layer ([] if it can).

        Feature dimensions must hold whole blocks, 2D tiles and transform blocks (the token
        dimension M is padded inside the layer instead).
        """
        problems = []
        checks = [
            ("fprop", "in_features (K)", in_features, self.fprop.inner_multiple),
            ("dgrad", "out_features (N)", out_features, self.dgrad.inner_multiple),
        ]
        # 2D tiles of W cover both of its dims; 2D tiles of X / dY cover K / N in wgrad
        for gname, g, ops in (("fprop", self.fprop, "ab"), ("dgrad", self.dgrad, "ab"), ("wgrad", self.wgrad, "ab")):
            for o in ops:
                q: QuantSpec = getattr(g, o)
                if not q.is_2d:
                    continue
                other = {
                    ("fprop", "a"): (None, 0),  # X tiles over M (padded) and K
                    ("fprop", "b"): ("out_features (N)", out_features),
                    ("dgrad", "a"): (None, 0),  # dY tiles over M and N
                    ("dgrad", "b"): ("in_features (K)", in_features),
                    ("wgrad", "a"): ("out_features (N)", out_features),
                    ("wgrad", "b"): ("in_features (K)", in_features),
                }[(gname, o)]
                if other[0] is not None:
                    checks.append((gname, other[0], other[1], q.block_size))
        for gname, what, n, mult in checks:
            if n % mult:
                problems.append(f"{what}={n} is not a multiple of {mult} (block/transform size of {gname})")
        return sorted(set(problems))


@dataclass(frozen=True)
class LoRASVDSpec:
    """Full-Stack FP4's LoRA-SVD linear: ``W = W_res + beta * B A`` (:mod:`fp4train.linear.lora_svd`).

    ``B [out, rank]`` and ``A [rank, in]`` hold W's principal rank-``rank`` subspace in high precision (a
    randomized SVD, ``niter`` power iterations); the residual ``W_res`` runs the recipe's quantized GEMMs.
    The trainer realigns the split with a fresh SVD every ``realign_every`` optimizer steps (0: never);
    the paper realigns every 4k steps. The range finder samples ``oversample`` directions beyond the rank (the
    split keeps the top ``rank``), which brings the residual nearer the optimal rank-``rank`` tail on a flat
    spectrum (``tests/test_lora_svd.py`` measures it).
    """

    rank: int = 32
    beta: float = 1.0
    realign_every: int = 4000
    niter: int = 2
    oversample: int = 8

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA-SVD rank must be a positive int, got {self.rank!r}")
        if not self.beta > 0:
            raise ValueError(f"LoRA-SVD beta must be > 0, got {self.beta!r}")
        if isinstance(self.realign_every, bool) or not isinstance(self.realign_every, int) or self.realign_every < 0:
            raise ValueError(f"LoRA-SVD realign_every is a step count >= 0 (0: never), got {self.realign_every!r}")
        if isinstance(self.niter, bool) or not isinstance(self.niter, int) or self.niter < 0:
            raise ValueError(f"LoRA-SVD niter is a count of power iterations >= 0, got {self.niter!r}")
        if isinstance(self.oversample, bool) or not isinstance(self.oversample, int) or self.oversample < 0:
            raise ValueError(f"LoRA-SVD oversample is a count of extra sampled directions >= 0, got {self.oversample!r}")


#: What ``Recipe.attention`` may name: attention's QK^T, dS K and dS^T Q on NVFP4 operands (fp4train.attention).
ATTENTION_KINDS = ("nvfp4",)
#: The optimizers the trainer runs (``fp4train train --optimizer``); a recipe may name one as its default.
#: AdaHOP's per-GEMM strategies (fp4train.adahop.strategy), cheapest first
CALIBRATION_STRATEGIES = ("plain", "iht", "oe")


def check_calibration_strategies(strategies) -> tuple[str, ...]:
    """``strategies`` as a tuple in cost order, after refusing an empty or unknown set (one line naming the fix)."""
    names = tuple(strategies)
    if not names or any(s not in CALIBRATION_STRATEGIES for s in names):
        raise ValueError(f"calibration_strategies must be a non-empty subset of {CALIBRATION_STRATEGIES}, got {names!r}")
    return tuple(s for s in CALIBRATION_STRATEGIES if s in names)


OPTIMIZERS = ("adamw", "qadamw", "muon", "qmuon", "root", "qroot", "qroot_bf16ns")


#: what ``Override("role:NAME")`` may name (fp4train.roles: found from the model, not from layer names)
ROLES = ("query", "key", "value", "attn_output", "lm_head")
ROLE_PREFIX = "role:"
#: a role's usual layer names: what a role override matches where the model's roles are not known
NAME_FALLBACK = {
    "query": ("*q_proj", "*.query", "query"),
    "key": ("*k_proj", "*.key", "key"),
    "value": ("*v_proj", "*.value", "value"),
    "attn_output": ("*o_proj", "*out_proj"),
    "lm_head": ("lm_head", "*.lm_head"),
}


@dataclass(frozen=True)
class Override:
    """Modules whose qualified name matches ``pattern`` (fnmatch) use ``linear`` instead; a pattern
    ``"role:NAME"`` (one of :data:`ROLES`) matches the linears that have that role in the model
    (:mod:`fp4train.roles`: attention's Q/K/V projections, fused or not, its output projection, the LM head).

    ``linear=None`` keeps them as plain ``nn.Linear`` (high precision).
    """

    pattern: str
    linear: LinearSpec | None = None

    def __post_init__(self):
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"override {self.pattern!r}: unknown role {self.role!r}; roles are {', '.join(ROLES)}")

    @property
    def role(self) -> str | None:
        """The role this override names (``"role:query"`` -> ``"query"``), None for a name pattern."""
        return self.pattern[len(ROLE_PREFIX):] if self.pattern.startswith(ROLE_PREFIX) else None

    def matches(self, name: str, roles: frozenset | None) -> bool:
        """Does the module ``name`` with ``roles`` take this override? ``roles=None`` (not known): a role matches
        the names that role usually has (:data:`NAME_FALLBACK`)."""
        if self.role is None:
            return fnmatch.fnmatchcase(name, self.pattern)
        if roles is not None:
            return self.role in roles
        return any(fnmatch.fnmatchcase(name, p) for p in NAME_FALLBACK[self.role])


#: Embeddings are never nn.Linear; the output head stays high precision by default.
DEFAULT_OVERRIDES = (Override("role:lm_head"), Override("lm_head"), Override("*.lm_head"), Override("*embed*"))


@dataclass(frozen=True)
class Recipe:
    """A named training recipe: the default :class:`LinearSpec`, overrides, backend.

    ``keep_last_blocks``: fraction of the transformer blocks, counted from the output end,
    whose linears stay high precision (NVIDIA's NVFP4 recipe keeps ~15%). A module's block
    index is the first ``.<int>.`` in its name (``layers.11.mlp.up_proj`` -> 11).
    """

    name: str
    linear: LinearSpec = field(default_factory=LinearSpec)
    description: str = ""
    overrides: tuple[Override, ...] = DEFAULT_OVERRIDES
    keep_last_blocks: float = 0.0
    #: GEMM backend: "auto" (triton on a CUDA machine, emulated elsewhere) or a name in fp4train.backends
    backend: str = "auto"
    #: AdaHOP: "rules" or "measured" makes the trainer run ``calibration_steps`` steps with
    #: ``linear`` (BF16) while recording outlier patterns, then replace this recipe by the
    #: calibrated one (fp4train.adahop.calibration). None: no calibration.
    calibrate: str | None = None
    calibration_steps: int = 0
    calibration_k: int = 16
    calibration_threshold: float = 4.0
    #: the strategies calibration chooses between per GEMM: AdaHOP's inner Hadamard and outlier extraction; adding
    #: "plain" (MXFP4 without a transform where neither pays) is ours (the adahop_plain preset)
    calibration_strategies: tuple = ("iht", "oe")
    #: Full-Stack FP4: quantized linears become LoRA-SVD linears (None: plain quantized linears)
    lora_svd: LoRASVDSpec | None = None
    #: attention numerics: None keeps the model's own (SDPA); "nvfp4" is Full-Stack FP4's quantized attention
    attention: str | None = None
    #: the optimizer this recipe is meant to train with, when the user names none (None: AdamW)
    optimizer: str | None = None
    #: NVFP4 operands of the linears with "4/6" adaptive block scaling (Cook et al., arXiv 2512.02010): per block the
    #: scale that maps its largest element to 6 or to 4, whichever errs less (QuantSpec.four_over_six on each of them)
    four_over_six: bool = False

    def __post_init__(self):
        if isinstance(self.lora_svd, dict):
            object.__setattr__(self, "lora_svd", LoRASVDSpec(**self.lora_svd))
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTION_KINDS} or leave it out")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {OPTIMIZERS} or leave it out")
        if self.calibrate not in (None, "rules", "measured"):
            raise ValueError(f"calibrate must be None, 'rules' or 'measured', got {self.calibrate!r}")
        object.__setattr__(self, "calibration_strategies", check_calibration_strategies(self.calibration_strategies))
        if isinstance(self.overrides, list):
            object.__setattr__(self, "overrides", tuple(self.overrides))
        if not 0.0 <= self.keep_last_blocks <= 1.0:
            raise ValueError(f"keep_last_blocks is a fraction in [0, 1], got {self.keep_last_blocks}")
        if self.four_over_six and not any(q.quantized and q.format == "nvfp4" for spec in (self.linear, *(o.linear for o in self.overrides))
                                          if spec is not None for g in (spec.fprop, spec.dgrad, spec.wgrad) for q in (g.a, g.b)):
            raise ValueError(f"recipe {self.name!r}: four_over_six applies to NVFP4 operands, and its linears have none "
                             "(use an NVFP4 recipe such as nvfp4 or fullstack)")

    def spec_for(self, name: str, block_index: int | None = None, num_blocks: int | None = None, *,
                 roles: frozenset | None = None) -> LinearSpec | None:
        """The spec for the module called ``name`` (``None``: keep it high precision). ``roles``: the module's roles in
        its model (:func:`fp4train.roles.linear_roles`; None: not known, role overrides match by usual names)."""
        for o in self.overrides:
            if o.matches(name, roles):
                return self._options(o.linear)
        if self.keep_last_blocks > 0 and block_index is not None and num_blocks:
            n_keep = round(self.keep_last_blocks * num_blocks)
            if block_index >= num_blocks - n_keep:
                return None
        return self._options(self.linear)

    def _options(self, spec: LinearSpec | None) -> LinearSpec | None:
        """``spec`` with the recipe-wide options applied (4/6 scaling on its NVFP4 operands)."""
        if spec is None or not self.four_over_six:
            return spec

        def adaptive(q: QuantSpec) -> QuantSpec:
            return dataclasses.replace(q, four_over_six=True) if q.quantized and q.format == "nvfp4" else q

        return LinearSpec(**{g: dataclasses.replace(getattr(spec, g), a=adaptive(getattr(spec, g).a), b=adaptive(getattr(spec, g).b))
                             for g in ("fprop", "dgrad", "wgrad")})

    def roles_named(self) -> set[str]:
        """The roles its overrides name."""
        return {o.role for o in self.overrides if o.role is not None}

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        """A recipe from plain data (JSON, TOML). A misspelt or misplaced key is refused with its place in the
        recipe and the keys that place takes, e.g. ``linear.fprop.a: unknown key 'blok' (known: block, ...)``."""
        d = dict(_table(d, "recipe"))
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown recipe field(s) {sorted(unknown)}")
        if "linear" in d:
            d["linear"] = _linear_from_dict(d["linear"], "linear")
        if "overrides" in d:
            overrides = []
            for i, o in enumerate(d["overrides"] if isinstance(d["overrides"], (list, tuple)) else [d["overrides"]]):
                o = _checked(Override, o, f"overrides[{i}]", nested=("linear",))
                if "pattern" not in o:
                    raise ValueError(f"overrides[{i}]: a pattern is missing (e.g. pattern = \"*.down_proj\")")
                linear = o.get("linear")
                overrides.append(Override(o["pattern"], _linear_from_dict(linear, f"overrides[{i}].linear")
                                          if linear is not None else None))
            d["overrides"] = tuple(overrides)
        if d.get("lora_svd") is not None:
            d["lora_svd"] = LoRASVDSpec(**_checked(LoRASVDSpec, d["lora_svd"], "lora_svd"))
        return cls(**d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, s: str) -> Recipe:
        return cls.from_dict(json.loads(s))

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, s: str) -> Recipe:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        return cls.from_dict(tomllib.loads(s))

    def save(self, path: str | Path) -> None:
        """Write as JSON or TOML, by the file's suffix."""
        path = Path(path)
        text = self.to_toml() if path.suffix == ".toml" else self.to_json()
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        path = Path(path)
        if path.suffix not in (".json", ".toml"):
            raise ValueError(f"recipe files are .json or .toml, got {path}")
        try:
            text = path.read_text(encoding="utf-8")
            return cls.from_toml(text) if path.suffix == ".toml" else cls.from_json(text)
        except FileNotFoundError:
            raise FileNotFoundError(f"recipe file {path} does not exist") from None
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:  # TOML/JSON decode errors are ValueErrors
            raise ValueError(f"{path}: not a valid recipe: {e}") from None


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


def _to_plain(obj) -> Any:
    """Dataclasses -> dicts, tuples -> lists, ``None`` fields dropped (TOML has no null)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is not None:
                out[f.name] = _to_plain(v)
        return out
    if isinstance(obj, (tuple, list)):
        return [_to_plain(v) for v in obj]
    return obj


def _table(d, where: str) -> dict:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a table of keys, got {type(d).__name__} {d!r}")
    return d


def _checked(cls, d, where: str, nested: tuple[str, ...] = ()) -> dict:
    """``d`` (a table of plain data at ``where`` in a recipe) after refusing keys that ``cls`` does not have."""
    d = dict(_table(d, where))
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} (known: "
                         f"{', '.join(known)})")
    return d


def _gemm_from_dict(d, where: str) -> GemmSpec:
    d = _checked(GemmSpec, d, where)
    t, o = d.pop("transform", None), d.pop("outliers", None)
    return GemmSpec(
        a=QuantSpec(**_checked(QuantSpec, d.pop("a", {}), f"{where}.a")),
        b=QuantSpec(**_checked(QuantSpec, d.pop("b", {}), f"{where}.b")),
        transform=TransformSpec(**_checked(TransformSpec, t, f"{where}.transform")) if t is not None else None,
        outliers=OutlierSpec(**_checked(OutlierSpec, o, f"{where}.outliers")) if o is not None else None,
        **d,
    )


def _linear_from_dict(d, where: str = "linear") -> LinearSpec:
    return LinearSpec(**{k: _gemm_from_dict(v, f"{where}.{k}") for k, v in _checked(LinearSpec, d, where).items()})
