"""``fp4train analyze``: outlier patterns and per-GEMM quantization error on a real model.

Trains ``cfg.model`` in BF16 on ``cfg.data`` for ``steps`` steps and, on every step, classifies
W, X and dY of every quantizable linear (the pattern map, AdaHOP's Figure 4). On the capture
steps (every ``capture_every`` steps and the last) it also takes the three GEMMs' real operands
and measures, against a float64 product,

* per pattern pair (relative to the GEMM): the relative error of plain MXFP4, inner Hadamard
  and outlier extraction (AdaHOP's Figure 3, on real tensors), and the rule table derived from it;
* per layer and GEMM: the relative error and SQNR of every preset recipe's operand preparation,
  and of AdaHOP with the strategies that calibration on these same steps would pick.

Writes ``analysis.json``, ``analysis.md``, ``patterns.png`` and ``recipe_errors.png`` to ``out``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import recipes as _recipes
from ..adahop.calibration import Calibration
from ..linear.outlier_linear import gemm_with_outliers
from ..adahop.patterns import Pattern, classify, gemm_operands, outlier_ratios
from ..adahop.strategy import DEFAULT_K, PAPER_STRATEGIES, PLAIN_RULES, Strategy, derive_rules, relative_error
from ..backends import get as get_backend
from ..conversion import block_index
from ..linear.experts import mixtures_of_experts
from ..linear.operands import OP_A, OP_B, prepare
from ..quantizer import Quantizer
from ..train.config import TrainConfig
from ..train.trainer import Trainer

GEMMS = ("fprop", "dgrad", "wgrad")
_GEMM_ID = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def gemm_error(g, a: torch.Tensor, b: torch.Tensor, gemm: str, seed: int = 0) -> float:
    """Relative Frobenius error of ``a @ b.T`` computed as GemmSpec ``g`` says (emulated)."""
    ref = a.double() @ b.double().T
    if not g.quantized and g.outliers is None:
        return 0.0
    mult = g.transform.block if g.transform is not None else 1
    if a.shape[1] % mult:  # pad the inner dim (tokens in wgrad) as the layer does
        pad = -a.shape[1] % mult
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, pad))
    be = get_backend("emulated")
    gid = _GEMM_ID[gemm]
    if g.outliers is not None:
        c = gemm_with_outliers(a, b, g, seed=seed, gemm=gid, compute_dtype=torch.float32, backend=be, out_dtype=torch.float32)
    else:
        qa = prepare(a, g.a, axis=1, transform=g.transform, seed=seed, gemm=gid, operand=OP_A, compute_dtype=torch.float32,
                     quantizer=Quantizer())
        qb = prepare(b, g.b, axis=1, transform=g.transform, seed=seed, gemm=gid, operand=OP_B, compute_dtype=torch.float32,
                     quantizer=Quantizer())
        c = be.gemm(qa, qb, torch.float32)
    return float((c.double() - ref).norm() / ref.norm())


def _sqnr(err: float) -> float:
    return math.inf if err == 0 else -20 * math.log10(err)


class _Capture:
    def __init__(self, modules: dict[str, nn.Linear], threshold: float):
        self.modules, self.threshold = modules, threshold
        self.patterns = {n: {"W": [], "X": [], "dY": []} for n in modules}
        self.ratios = {n: {"W": [], "X": [], "dY": []} for n in modules}
        self.capture = False
        self.captured: dict[str, dict[str, torch.Tensor]] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _record(self, name, t, key):
        rr, cr = outlier_ratios(t)
        self.patterns[name][key].append(classify(t, self.threshold).value)
        self.ratios[name][key].append([rr, cr])

    def _hook(self, name):
        def hook(mod, inputs, out):
            if not torch.is_grad_enabled():
                return
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            self._record(name, mod.weight.detach(), "W")
            self._record(name, x, "X")
            if self.capture:
                self.captured[name] = {"X": x.float(), "W": mod.weight.detach().float()}

            def grad_hook(gr):
                dy = gr.detach().reshape(-1, gr.shape[-1])
                self._record(name, dy, "dY")
                if self.capture:
                    self.captured[name]["dY"] = dy.float()

            if out.requires_grad:
                out.register_hook(grad_hook)

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def analyze(cfg: TrainConfig, *, steps: int, capture_every: int, out: str | Path, threshold: float = 4.0,
            k: int = DEFAULT_K, max_tokens: int = 4096, log=None) -> dict:
    """Run the analysis (see the module docstring); returns what ``analysis.json`` holds."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(**{**cfg.to_dict(), "recipe": "bf16", "max_steps": steps, "out": str(out / "train"), "ckpt_every": 0,
                         "eval_every": 0})
    t = Trainer(cfg)
    presets = [r for r in _recipes.names() if r != "bf16" and not _recipes.get(r).calibrate]
    experts, routers = mixtures_of_experts(t.model)  # kept in high precision by convert: not a recipe's GEMMs
    targets = {n: m for n, m in t.model.named_modules()
               if isinstance(m, nn.Linear) and n not in routers and _recipes.get("mxfp4").spec_for(n) is not None}
    not_measured = {n: "a mixture of experts' stacked expert weights: the analysis measures linear layers" for n, _ in experts}
    not_measured.update(routers)
    if not_measured:
        log(f"fp4train analyze: not measured: {len(experts)} experts modules (stacked 3-D weights; the analysis measures "
            f"linear layers) and {len(routers)} routers (kept in high precision)")
    blocks = {n: t.model.config.n_layers for n in targets}
    cap = _Capture(targets, threshold)
    pair_err = defaultdict(lambda: defaultdict(list))  # (rel_a, rel_b) -> strategy -> errors
    layer_err = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # layer -> gemm -> method -> errors
    captures = []
    try:
        for step in range(1, steps + 1):
            cap.capture = step % capture_every == 0 or step == steps
            cap.captured = {}
            t.train_step()
            if not cap.capture:
                continue
            captures.append(step)
            log(f"fp4train analyze: step {step}/{steps}: measuring {len(cap.captured)} layers x 3 GEMMs")
            for name, ten in cap.captured.items():
                x, w, dy = ten["X"][:max_tokens], ten["W"], ten["dY"][:max_tokens]
                pats = {"X": classify(x, threshold), "W": classify(w, threshold), "dY": classify(dy, threshold)}
                bi = block_index(name)
                for gemm, a, b, ra, rb in gemm_operands({"X": x, "W": w, "dY": dy}, pats):
                    for s in Strategy:
                        e = relative_error(a, b, s, ra, rb, k)
                        pair_err[(ra.value, rb.value)][s.value].append(e)
                        layer_err[name][gemm][f"strategy:{s.value}"].append(e)
                    for r in presets:
                        spec = _recipes.get(r).spec_for(name, bi, blocks[name])
                        e = 0.0 if spec is None else gemm_error(getattr(spec, gemm), a, b, gemm)
                        layer_err[name][gemm][r].append(e)
    finally:
        cap.remove()

    pair_rows = []
    for (ra, rb), errs in sorted(pair_err.items()):
        mean = {s: statistics.mean(v) for s, v in errs.items()}
        pair_rows.append({"a": ra, "b": rb, "n": len(errs["plain"]), **{f"err_{s}": v for s, v in mean.items()},
                          "iht_improvement_pct": (1 - mean["iht"] / mean["plain"]) * 100 if mean["plain"] else 0.0,
                          "oe_improvement_pct": (1 - mean["oe"] / mean["plain"]) * 100 if mean["plain"] else 0.0,
                          "best": min(mean, key=mean.get)})
    real_rules = derive_rules(pair_rows)
    cal = Calibration(steps, "rules", k, threshold, cap.patterns)
    with_plain = Calibration(steps, "rules", k, threshold, cap.patterns)
    for name in targets:
        cal.assign(name)
        with_plain.assign(name, PLAIN_RULES)
    # AdaHOP (rules from this calibration), with plain allowed, and measured (the best of IHT/OE per layer and GEMM)
    for name in targets:
        for gemm in GEMMS:
            e = layer_err[name][gemm]
            e["adahop"] = e[f"strategy:{cal.strategies[name][gemm]}"]
            e["adahop_plain"] = e[f"strategy:{with_plain.strategies[name][gemm]}"]
            best = min(PAPER_STRATEGIES, key=lambda s: statistics.mean(e[f"strategy:{s}"]))
            e["adahop_measured"] = e[f"strategy:{best}"]
    methods = presets + ["adahop", "adahop_plain", "adahop_measured"]
    per_layer = {n: {g: {m: statistics.mean(v) for m, v in layer_err[n][g].items()} for g in GEMMS} for n in targets}
    mean_err = {m: statistics.mean(per_layer[n][g][m] for n in targets for g in GEMMS) for m in methods}
    result = {
        "model": cfg.model, "data": cfg.data, "steps": steps, "capture_steps": captures, "threshold": threshold, "k": k,
        "device": str(t.device), "gpu": torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else None,
        "patterns": cap.patterns, "ratios": cap.ratios,
        "stability": {n: cal.stability(n) for n in targets},
        "pattern_pairs": pair_rows, "rules_from_real_tensors": {f"{a.value}/{b.value}": s.value for (a, b), s in real_rules.items()},
        "adahop_strategies": cal.strategies,
        "gemm_errors": per_layer, "mean_relative_error": mean_err,
        "mean_sqnr_db": {m: _sqnr(v) for m, v in mean_err.items()}, "not_measured": not_measured,
    }
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    (out / "analysis.md").write_text(_markdown(result, methods))
    _plot_patterns(out / "patterns.png", cap.patterns)
    _plot_errors(out / "recipe_errors.png", per_layer, methods)
    log(f"fp4train analyze: wrote {out / 'analysis.md'}")
    return result


def _markdown(r: dict, methods: list[str]) -> str:
    hw = r["gpu"] or r["device"]
    lines = [f"# Outlier patterns and GEMM errors: `{r['model']}`, {r['steps']} BF16 steps, captures at {r['capture_steps']}", "",
             f"Hardware: {hw}. Pattern threshold {r['threshold']}, outliers extracted per operand k={r['k']}.", "",
             *([f"Not measured: {', '.join(f'`{n}` ({why})' for n, why in r['not_measured'].items())}.", ""]
               if r.get("not_measured") else []),
             "## Mean relative GEMM error over layers and GEMMs (lower is better)", "",
             "| method | mean relative error | SQNR dB |", "|---|---:|---:|"]
    for m in sorted(methods, key=lambda m: r["mean_relative_error"][m]):
        lines.append(f"| {m} | {r['mean_relative_error'][m]:.4f} | {r['mean_sqnr_db'][m]:.2f} |")
    lines += ["", "## Error per pattern pair and strategy on real tensors (AdaHOP Figure 3)", "",
              "| A | B | GEMMs | plain | IHT | OE | IHT vs plain | OE vs plain | best |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["pattern_pairs"]:
        lines.append(f"| {p['a']} | {p['b']} | {p['n']} | {p['err_plain']:.4f} | {p['err_iht']:.4f} | {p['err_oe']:.4f} | "
                     f"{p['iht_improvement_pct']:+.1f}% | {p['oe_improvement_pct']:+.1f}% | {p['best']} |")
    lines += ["", "Rule table derived from these real tensors (cheapest strategy within 10% of the best): "
              + ", ".join(f"{k} → {v}" for k, v in r["rules_from_real_tensors"].items()), "",
              "## Pattern stability (fraction of steps agreeing with the majority)", "",
              "| layer | W | X | dY | fprop | dgrad | wgrad |", "|---|---|---|---|---|---|---|"]
    for n, st in r["stability"].items():
        maj = {t: max(set(r["patterns"][n][t]), key=r["patterns"][n][t].count) for t in ("W", "X", "dY")}
        s = r["adahop_strategies"][n]
        lines.append(f"| {n} | {maj['W']} ({st['W']:.2f}) | {maj['X']} ({st['X']:.2f}) | {maj['dY']} ({st['dY']:.2f}) | "
                     f"{s['fprop']} | {s['dgrad']} | {s['wgrad']} |")
    return "\n".join(lines) + "\n"


def _plot_patterns(path: Path, patterns: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    codes = {Pattern.NONE.value: 0, Pattern.ROW.value: 1, Pattern.COLUMN.value: 2}
    rows, labels = [], []
    for n, d in patterns.items():
        for tname in ("W", "X", "dY"):
            rows.append([codes[p] for p in d[tname]])
            labels.append(f"{n} {tname}")
    width = max(len(r) for r in rows)
    grid = torch.tensor([r + [0] * (width - len(r)) for r in rows]).numpy()
    fig, ax = plt.subplots(figsize=(10, max(3, 0.12 * len(rows) + 1)))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#dddddd", "#d62728", "#1f77b4"]), vmin=0, vmax=2)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=max(3, min(8, 600 // max(1, len(labels)))))
    ax.set_xlabel("training step")
    ax.set_title("outlier pattern per step (grey: none, red: row-wise, blue: column-wise)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_errors(path: Path, per_layer: dict, methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    names = list(per_layer)
    for ax, g in zip(axes, GEMMS):
        for m in methods:
            ax.plot(range(len(names)), [per_layer[n][g][m] for n in names], label=m, marker=".", lw=0.8)
        ax.set(title=g, xlabel="layer (model order)", ylabel="relative error")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
