"""AdaHOP calibration: record outlier patterns over the first steps, freeze a strategy table.

During calibration the model trains in BF16 while :class:`PatternRecorder` hooks every
quantizable linear and classifies, on every step, its weight W, its input X (flattened to
``[tokens, in]``) and its output gradient dY (``[tokens, out]``). Afterwards each tensor's
pattern is the majority over the steps, its *stability* the fraction of steps that agree,
and each GEMM's strategy comes from the pair of relative patterns:

* ``mode="rules"``: the rule table over the recipe's ``calibration_strategies``
  (:func:`fp4train.adahop.strategy.rules_for`: AdaHOP's IHT and OE, or ours with plain MXFP4 too);
* ``mode="measured"``: per layer and GEMM, of those strategies the one with the lowest relative output
  error, measured on the calibration batches themselves (on the real operands).

The result, a :class:`Calibration`, is saved as JSON (``adahop_calibration.json`` beside the
checkpoints) and turns into a per-layer :class:`~fp4train.recipes.Recipe` with
:meth:`Calibration.recipe`. Reload it for a resumed run or another run (``--calibration FILE``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..recipes.spec import GemmSpec, LinearSpec, OutlierSpec, Override, QuantSpec, Recipe, TransformSpec
from .patterns import GEMM_OPERANDS, Pattern, Relative, classify, gemm_operands, relative
from ..recipes.spec import check_calibration_strategies
from .strategy import PAPER_STRATEGIES, Strategy, choose, relative_error, rules_for

GEMMS = ("fprop", "dgrad", "wgrad")
MX = QuantSpec("mxfp4")
IHT = TransformSpec(block=32)


def gemm_spec(strategy: Strategy, rel_a: Relative, rel_b: Relative, k: int) -> GemmSpec:
    """The GemmSpec of one AdaHOP strategy (MXFP4 1x32, floor scales, RTNE)."""
    s = Strategy(strategy)
    if s is Strategy.PLAIN:
        return GemmSpec(MX, MX)
    if s is Strategy.OE and (Relative(rel_a), Relative(rel_b)) != (Relative.NONE, Relative.NONE):
        return GemmSpec(MX, MX, IHT, OutlierSpec(a=Relative(rel_a).value, b=Relative(rel_b).value, k=k))
    return GemmSpec(MX, MX, IHT)  # IHT, or OE with nothing to extract


def layer_spec(strategies: dict[str, str], relatives: dict[str, tuple[str, str]], k: int) -> LinearSpec:
    return LinearSpec(**{g: gemm_spec(Strategy(strategies[g]), *relatives[g], k) for g in GEMMS})


@dataclass
class Calibration:
    """What calibration found, per layer: patterns per step, majority, stability, strategies."""

    steps: int
    mode: str
    k: int
    threshold: float
    patterns: dict[str, dict[str, list[str]]]  # layer -> tensor -> pattern per step
    strategies: dict[str, dict[str, str]] = field(default_factory=dict)  # layer -> gemm -> strategy
    relatives: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # layer -> gemm -> [rel_a, rel_b]
    errors: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # measured: layer -> gemm -> strategy -> err

    def majority(self, layer: str) -> dict[str, Pattern]:
        return {t: Pattern(Counter(p).most_common(1)[0][0]) for t, p in self.patterns[layer].items()}

    def stability(self, layer: str) -> dict[str, float]:
        """Per tensor, the fraction of calibration steps that agree with its majority pattern."""
        out = {}
        for t, p in self.patterns[layer].items():
            out[t] = Counter(p).most_common(1)[0][1] / len(p)
        return out

    def assign(self, layer: str, rules=None) -> None:
        """Set ``layer``'s relative pattern pairs and rule-table strategies from its majority patterns."""
        maj = self.majority(layer)
        self.relatives[layer], self.strategies[layer] = {}, {}
        for gemm, ((ta, tra), (tb, trb)) in GEMM_OPERANDS.items():
            ra, rb = relative(maj[ta], tra), relative(maj[tb], trb)
            self.relatives[layer][gemm] = [ra.value, rb.value]
            self.strategies[layer][gemm] = choose(ra, rb, rules).value

    def recipe(self, name: str = "adahop", base: Recipe | None = None) -> Recipe:
        """A recipe with one override per calibrated layer (exact names); others stay BF16."""
        overrides = tuple(Override(layer, layer_spec(self.strategies[layer], {g: tuple(v) for g, v in self.relatives[layer].items()}, self.k))
                          for layer in sorted(self.strategies))
        keep = base.overrides if base is not None else ()
        return Recipe(name=name, linear=LinearSpec(), description=f"AdaHOP, calibrated over {self.steps} steps ({self.mode})",
                      overrides=keep + overrides, backend=base.backend if base is not None else "auto")

    def strategy_counts(self) -> dict[str, int]:
        """How many GEMMs got each strategy, e.g. ``{"plain": 108, "iht": 163, "oe": 23}``."""
        return dict(Counter(st for gemms in self.strategies.values() for st in gemms.values()))

    def table(self) -> list[dict]:
        rows = []
        for layer in sorted(self.strategies):
            maj, stab = self.majority(layer), self.stability(layer)
            rows.append({"layer": layer, **{f"{t}": maj[t].value for t in ("W", "X", "dY")},
                         **{f"stab_{t}": stab[t] for t in ("W", "X", "dY")}, **{g: self.strategies[layer][g] for g in GEMMS}})
        return rows

    # ---- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "fp4train-adahop-calibration/1", "steps": self.steps, "mode": self.mode, "k": self.k,
                "threshold": self.threshold, "patterns": self.patterns, "strategies": self.strategies,
                "relatives": self.relatives, "errors": self.errors}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if d.get("format") != "fp4train-adahop-calibration/1":
            raise ValueError("not an fp4train AdaHOP calibration file (missing format 'fp4train-adahop-calibration/1')")
        return cls(d["steps"], d["mode"], d["k"], d["threshold"], d["patterns"], d["strategies"], d["relatives"], d.get("errors", {}))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"calibration file {str(path)!r} does not exist")
        return cls.from_dict(json.loads(p.read_text()))


def check_calibratable(model: nn.Module, recipe) -> None:
    """Refuse (one ``ValueError`` naming every layer and the fix) a model whose layers the calibrated recipe could not
    run - checked before any calibration step: the inner Hadamard transform on every GEMM is the strategy with the
    most shape needs."""
    bound = LinearSpec(**{g: gemm_spec(Strategy.IHT, Relative.NONE, Relative.NONE, recipe.calibration_k) for g in GEMMS})
    from ..linear.conv1d import in_out

    problems = [f"  {n} ({type(m).__name__} {k}->{o}): {p}" for n, m in _targets(model, recipe).items()
                for k, o in [in_out(m)] for p in bound.shape_problems(k, o)]
    if problems:
        raise ValueError(f"recipe {recipe.name!r} could not run these layers after calibrating them:\n" + "\n".join(problems)
                         + "\nFix: keep them in high precision with an Override(pattern, None) in the recipe (or "
                         "convert(..., filter=...)), or give the model dimensions that are multiples of 32.")


def _targets(model: nn.Module, recipe) -> dict[str, nn.Module]:
    """The linears (``nn.Linear``, transformers' ``Conv1D``) of ``model`` that ``recipe`` quantizes."""
    from ..linear.conv1d import is_conv1d
    from ..linear.experts import mixtures_of_experts

    routers = mixtures_of_experts(model)[1]  # kept in high precision, as convert keeps them
    return {n: m for n, m in model.named_modules()
            if (isinstance(m, nn.Linear) or is_conv1d(m)) and n not in routers and recipe.spec_for(n) is not None}


def _weight(m: nn.Module) -> torch.Tensor:
    """The weight as ``[out, in]`` (a ``Conv1D``'s transposed)."""
    return m.weight if isinstance(m, nn.Linear) else m.weight.T


class PatternRecorder:
    """Hooks the given linears and records W / X / dY patterns (and, measured mode, GEMM errors)."""

    def __init__(self, modules: dict[str, nn.Linear], *, mode: str = "rules", k: int = 16, threshold: float = 4.0,
                 rules=None, strategies=PAPER_STRATEGIES):
        if mode not in ("rules", "measured"):
            raise ValueError(f"calibration mode must be 'rules' or 'measured', got {mode!r}")
        self.modules, self.mode, self.k, self.threshold = modules, mode, k, threshold
        self.strategies = check_calibration_strategies(strategies)
        self.rules = rules if rules is not None else (rules_for(self.strategies) if mode == "rules" else rules_for(PAPER_STRATEGIES))
        self.patterns: dict[str, dict[str, list[str]]] = {n: {"W": [], "X": [], "dY": []} for n in modules}
        self.err_sum: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        self.err_n: dict = defaultdict(lambda: defaultdict(int))
        self.steps = 0
        self._handles = []

    @classmethod
    def for_recipe(cls, model: nn.Module, recipe) -> PatternRecorder:
        """A recorder over every linear of ``model`` (``Conv1D`` included) that ``recipe`` quantizes, with the
        recipe's calibration settings (mode, k, threshold); not attached yet."""
        return cls(_targets(model, recipe), mode=recipe.calibrate, k=recipe.calibration_k, threshold=recipe.calibration_threshold,
                   strategies=recipe.calibration_strategies)

    def attach(self) -> PatternRecorder:
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._forward_hook(name)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _forward_hook(self, name):
        def hook(mod, inputs, output):
            if not torch.is_grad_enabled():
                return  # evaluation: not a training step
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            w = _weight(mod).detach()
            rec = self.patterns[name]
            rec["W"].append(classify(w, self.threshold).value)
            rec["X"].append(classify(x, self.threshold).value)

            def grad_hook(g):
                dy = g.detach().reshape(-1, g.shape[-1])
                rec["dY"].append(classify(dy, self.threshold).value)
                if self.mode == "measured":
                    self._measure(name, x, w, dy)

            if output.requires_grad:
                output.register_hook(grad_hook)

        return hook

    def _measure(self, name, x, w, dy):
        pats = {"X": Pattern(self.patterns[name]["X"][-1]), "W": Pattern(self.patterns[name]["W"][-1]),
                "dY": Pattern(self.patterns[name]["dY"][-1])}
        tensors = {"X": x.float(), "W": w.float(), "dY": dy.float()}
        for gemm, a, b, ra, rb in gemm_operands(tensors, pats):
            for s in map(Strategy, self.strategies):
                self.err_sum[name][gemm][s.value] += relative_error(a, b, s, ra, rb, self.k)
            self.err_n[name][gemm] += 1

    def state_dict(self) -> dict:
        """What the recorder has seen so far (a checkpoint taken during the calibration steps)."""
        return {"patterns": self.patterns, "steps": self.steps, "err_sum": json.loads(json.dumps(self.err_sum)),
                "err_n": json.loads(json.dumps(self.err_n))}

    def load_state_dict(self, st: dict) -> None:
        self.patterns, self.steps = st["patterns"], st["steps"]
        for layer, gemms in st["err_sum"].items():
            for gemm, errs in gemms.items():
                self.err_sum[layer][gemm].update(errs)
        for layer, gemms in st["err_n"].items():
            self.err_n[layer].update(gemms)

    def result(self) -> Calibration:
        cal = Calibration(self.steps, self.mode, self.k, self.threshold, self.patterns)
        for name in self.modules:
            if not self.patterns[name]["dY"]:
                raise RuntimeError(f"no gradient was recorded for {name}; calibration needs training steps with backward")
            cal.assign(name, self.rules)
            if self.mode == "measured":
                for gemm in GEMMS:
                    n = self.err_n[name][gemm]
                    errs = {s: v / n for s, v in self.err_sum[name][gemm].items()}
                    cal.errors.setdefault(name, {})[gemm] = errs
                    cal.strategies[name][gemm] = min(errs, key=errs.get)
        return cal


def calibrate_in_place(model: nn.Module, recipe, train_step, steps: int, *, backend: str | None = None, numerics: str | None = None,
                       device_seeds: bool = False) -> Calibration:
    """Record outlier patterns over ``steps`` calls of ``train_step()`` (the model's BF16 steps),
    then convert ``model`` to the calibrated recipe - what the trainer does over its first steps,
    for scripts that drive the steps themselves (benchmarks); ``backend``, ``numerics`` and
    ``device_seeds`` as :func:`fp4train.convert` takes them. Returns the calibration."""
    from ..conversion import convert

    rec = PatternRecorder.for_recipe(model, recipe).attach()
    try:
        for _ in range(steps):
            train_step()
            rec.steps += 1
    finally:
        rec.detach()
    cal = rec.result()
    convert(model, cal.recipe(recipe.name, base=recipe), backend=backend, numerics=numerics, device_seeds=device_seeds)
    return cal


def calibrate(model: nn.Module, batches, recipe="adahop", *, loss=None, backend: str | None = None,
              numerics: str | None = None) -> Calibration:
    """AdaHOP on any model: record the outlier patterns of ``model``'s linears over ``batches`` (forward and backward in
    the model's own precision, no optimizer step, the gradients cleared after each), then convert ``model`` in place to
    the calibrated recipe. Returns the :class:`Calibration` (``.save(path)`` keeps it for later runs).

    ``batches``: an iterable of what ``loss(model, batch)`` takes (the calibration records one step per batch; the
    recipe's ``calibration_steps`` is what ``fp4train train`` uses). Without ``loss``: a dict batch is the model's
    keyword arguments and its output's ``.loss`` the loss (Hugging Face models: give ``labels``); a tensor batch is
    token ids, and the model is called as ``model(ids, labels=ids)`` (Hugging Face causal LMs).
    ``recipe``: ``"adahop"``, ``"adahop_measured"`` or a calibrating Recipe; ``backend``, ``numerics`` as
    :func:`fp4train.convert` takes them."""
    from .. import recipes

    recipe = recipes.get(recipe)
    if not recipe.calibrate:
        raise ValueError(f"recipe {recipe.name!r} does not calibrate; use 'adahop' or 'adahop_measured' (or convert() "
                         "for other recipes)")
    loss = loss or _default_loss
    check_calibratable(model, recipe)
    rec = PatternRecorder.for_recipe(model, recipe).attach()
    try:
        for batch in batches:
            value = loss(model, batch)
            if not isinstance(value, torch.Tensor) or value.ndim != 0:
                raise TypeError(f"calibrate(): the loss must be a 0-d tensor, got {type(value).__name__}")
            if not torch.isfinite(value):
                raise FloatingPointError(f"calibrate(): the loss of calibration batch {rec.steps} is {value.item()}")
            value.backward()
            model.zero_grad(set_to_none=True)
            rec.steps += 1
    finally:
        rec.detach()
    if rec.steps == 0:
        raise ValueError("calibrate() got no batches: give at least one (fp4train train uses the recipe's "
                         f"calibration_steps = {recipe.calibration_steps})")
    cal = rec.result()
    from ..conversion import convert

    convert(model, cal.recipe(recipe.name, base=recipe), backend=backend, numerics=numerics)
    return cal


def _default_loss(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, torch.Tensor):
        out = model(batch, labels=batch)
    else:
        raise TypeError(f"calibrate(): a batch is a dict of model arguments or a tensor of token ids, got "
                        f"{type(batch).__name__}; pass loss=fn(model, batch) for other batches")
    value = getattr(out, "loss", out)
    if value is None:
        raise ValueError("calibrate(): the model returned no loss; give labels in the batch or pass loss=fn(model, batch)")
    return value
