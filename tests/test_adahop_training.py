"""AdaHOP in the layer and the trainer: OE path, calibration, save/reload, exact resume."""

import json

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train import QuantizedLinear, quantize
from fp4train.adahop import Pattern, Relative, Strategy
from fp4train.adahop.calibration import Calibration, PatternRecorder, gemm_spec, layer_spec
from fp4train.adahop.strategy import extraction_for
from fp4train.adahop.training import AdaHOPCalibration
from fp4train.linear.outlier_gemm import oe_gemm
from fp4train.recipes import LinearSpec
from fp4train.train import Checkpoints, TrainConfig, Trainer
from fp4train.transforms import hadamard


def _x_with_outlier_channels(m=64, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, [3, 50, 77]] *= 40
    return x


def test_oe_layer_forward_equals_the_written_out_decomposition():
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    g = gemm_spec(Strategy.OE, Relative.INNER, Relative.NONE, k=4)
    spec = LinearSpec(fprop=g, dgrad=gemm_spec(Strategy.IHT, "none", "none", 4), wgrad=gemm_spec(Strategy.PLAIN, "none", "none", 4))
    q = QuantizedLinear.from_linear(lin, spec)
    x = _x_with_outlier_channels()
    y = q(x.clone().requires_grad_())

    def residual(a, b):
        qa = quantize(hadamard(a, 32), "mxfp4").dequantize(torch.float32)
        qb = quantize(hadamard(b, 32), "mxfp4").dequantize(torch.float32)
        return qa @ qb.T

    ext = extraction_for(x, lin.weight.detach(), Relative.INNER, Relative.NONE, 4)
    assert set(ext.inner.tolist()) >= {3, 50, 77}
    assert torch.equal(y.detach(), oe_gemm(x, lin.weight.detach(), ext, residual))
    ref = x.double() @ lin.weight.detach().double().T
    plain = QuantizedLinear.from_linear(lin, layer_spec({g: "plain" for g in ("fprop", "dgrad", "wgrad")},
                                                        {g: ("none", "none") for g in ("fprop", "dgrad", "wgrad")}, 4))
    err = lambda t: float((t.detach().double() - ref).norm() / ref.norm())  # noqa: E731
    assert err(y) < 0.5 * err(plain(x))


def test_oe_in_all_three_gemms_trains():
    torch.manual_seed(1)
    lin = nn.Linear(128, 96)
    oe = gemm_spec(Strategy.OE, Relative.INNER, Relative.OUTER, k=4)
    q = QuantizedLinear.from_linear(lin, LinearSpec(oe, gemm_spec(Strategy.OE, "outer", "inner", 4), gemm_spec(Strategy.OE, "inner", "inner", 4)))
    x = _x_with_outlier_channels(m=40).requires_grad_()  # 40 tokens: wgrad pads M to 64 for the IHT
    dy = torch.randn(40, 96)
    q(x).backward(dy)
    ref_dw = dy.double().T @ x.detach().double()
    rel = float((lin.weight.grad.double() - ref_dw).norm() / ref_dw.norm())
    assert torch.isfinite(x.grad).all() and rel < 0.2


def _all_plain_calibration(model_names):
    plain = {g: "plain" for g in ("fprop", "dgrad", "wgrad")}
    none = {g: ["none", "none"] for g in ("fprop", "dgrad", "wgrad")}
    return Calibration(1, "rules", 16, 4.0, {n: {"W": ["none"], "X": ["none"], "dY": ["none"]} for n in model_names},
                       {n: dict(plain) for n in model_names}, {n: dict(none) for n in model_names})


def test_all_plain_adahop_equals_mxfp4_bit_for_bit():
    torch.manual_seed(0)
    a = fp4train.models.build("tiny", vocab_size=128)
    b = fp4train.models.build("tiny", vocab_size=128)
    b.load_state_dict(a.state_dict())
    names = [n for n, m in a.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    fp4train.convert(a, _all_plain_calibration(names).recipe("adahop"))
    fp4train.convert(b, "mxfp4")
    idx = torch.randint(0, 128, (2, 32))
    la, lb = a(idx, idx), b(idx, idx)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_recorder_finds_planted_patterns_and_picks_strategies(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    model = nn.Sequential(lin)
    rec = PatternRecorder({"0": lin}).attach()
    for s in range(3):
        x = _x_with_outlier_channels(seed=s).requires_grad_()
        model(x).pow(2).mean().backward()
        rec.steps += 1
    rec.detach()
    cal = rec.result()
    assert cal.majority("0")["X"] is Pattern.COLUMN and cal.stability("0")["X"] == 1.0
    assert cal.relatives["0"]["fprop"] == ["inner", "none"]  # X's outlier channels lie along fprop's inner dim
    assert cal.relatives["0"]["wgrad"][1] == "outer"  # ... and are rows of X^T in wgrad
    assert cal.strategies["0"]["fprop"] == fp4train.adahop.DEFAULT_RULES[(Relative.INNER, Relative.NONE)].value
    counts = cal.strategy_counts()
    assert sum(counts.values()) == 3 and counts[cal.strategies["0"]["fprop"]] >= 1
    # for_recipe: every linear the recipe quantizes, with its settings
    r = PatternRecorder.for_recipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), fp4train.recipes.get("adahop_measured"))
    assert set(r.modules) == {"0", "1"} and r.mode == "measured"
    cal.save(tmp_path / "cal.json")
    again = Calibration.load(tmp_path / "cal.json")
    assert again.strategies == cal.strategies and again.recipe("a") == cal.recipe("a")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Calibration.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an fp4train AdaHOP calibration file"):
        Calibration.load(tmp_path / "bad.json")


def test_adahop_chooses_between_its_two_strategies_and_plain_mxfp4_is_the_named_variants(tmp_path):
    """The paper's AdaHOP picks inner Hadamard or outlier extraction for every GEMM; ``adahop_plain`` (ours) may pick
    MXFP4 without a transform where no pattern is seen; measured calibration compares the recipe's strategies only."""
    counts = {}
    for name in ("adahop", "adahop_plain", "adahop_measured"):
        Trainer(_cfg(tmp_path / name, recipe=name, max_steps=21, ckpt_every=0)).run()
        cal = Calibration.load(tmp_path / name / "adahop_calibration.json")
        counts[name] = cal.strategy_counts()
        if name == "adahop_measured":
            assert all(set(e) == {"iht", "oe"} for g in cal.errors.values() for e in g.values())
    assert set(counts["adahop"]) <= {"iht", "oe"} and set(counts["adahop_measured"]) <= {"iht", "oe"}
    assert counts["adahop_plain"].get("plain", 0) > 0  # the tiny model's GEMMs without a pattern
    assert sum(counts["adahop"].values()) == sum(counts["adahop_plain"].values())
    with pytest.raises(ValueError, match="calibration_strategies must be a non-empty subset"):
        fp4train.recipes.get("adahop").replace(calibration_strategies=("plain", "rotate"))


def _cfg(out, **kw):
    # CPU: bit-exact resume is a CPU guarantee (GPU kernels such as embedding backward use atomics)
    base = dict(model="tiny", recipe="adahop", max_steps=24, seq_len=32, batch_size=2, eval_every=0, eval_batches=1,
                ckpt_every=8, out=str(out), progress=False, tensorboard=False, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def test_trainer_calibrates_saves_and_resumes_exactly(tmp_path, monkeypatch):
    Trainer(_cfg(tmp_path / "ref")).run()
    cal_ref = json.loads((tmp_path / "ref" / "adahop_calibration.json").read_text())
    assert cal_ref["steps"] == 20 and set(cal_ref["strategies"]) and "lm_head" not in cal_ref["strategies"]

    # interrupted at step 17 (inside calibration; last checkpoint at 16), then resumed
    t = Trainer(_cfg(tmp_path / "cut"))
    real = t.train_step

    def dying():
        if t.step == 17:
            raise KeyboardInterrupt
        return real()

    t.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        t.run()
    Trainer(_cfg(tmp_path / "cut"), resume=True).run()
    assert json.loads((tmp_path / "cut" / "adahop_calibration.json").read_text()) == cal_ref
    a, b = Checkpoints(tmp_path / "ref").load(), Checkpoints(tmp_path / "cut").load()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k

    # another run reuses the saved table from step 0
    t2 = Trainer(_cfg(tmp_path / "reuse", calibration=str(tmp_path / "ref" / "adahop_calibration.json")))
    assert t2.feature(AdaHOPCalibration).recorder is None
    layer = t2.model.get_submodule("layers.0.mlp.up_proj")
    assert layer.spec.quantized and layer.spec == Calibration.from_dict(cal_ref).recipe("adahop").spec_for("layers.0.mlp.up_proj")


def test_analyze_writes_maps_tables_and_errors(tmp_path):
    from fp4train.cli import main

    out = tmp_path / "an"
    rc = main(["analyze", "--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--steps", "4", "--capture-every", "2",
               "--no-progress", "--no-tensorboard", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "analysis.json").read_text())
    assert r["capture_steps"] == [2, 4] and len(r["patterns"]) == 14
    assert all(len(v["X"]) == 4 and len(v["dY"]) == 4 for v in r["patterns"].values())
    errs = r["mean_relative_error"]
    assert set(errs) >= {"mxfp4", "nvfp4", "hadamard_mxfp4", "tib2d", "fp8_rowwise", "adahop", "adahop_plain", "adahop_measured"}
    assert errs["fp8_rowwise"] < errs["mxfp4"] and errs["adahop_measured"] <= min(
        statistics_min(r, s) for s in ("iht", "oe")) + 1e-12
    assert sum(p["n"] for p in r["pattern_pairs"]) == 14 * 3 * 2
    md = (out / "analysis.md").read_text()
    assert "AdaHOP Figure 3" in md and "| mxfp4 |" in md
    for png in ("patterns.png", "recipe_errors.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def statistics_min(r, strategy):
    """Mean over layers/GEMMs of one fixed strategy (adahop_measured picks the best per GEMM, so it is <=)."""
    vals = [g[f"strategy:{strategy}"] for layer in r["gemm_errors"].values() for g in layer.values()]
    return sum(vals) / len(vals)


def test_compiled_adahop_run_compiles_a_bounded_number_of_graphs(tmp_path, monkeypatch):
    """A compiled AdaHOP run calibrates eagerly (the recorder's per-layer hooks would have the compiler trace and
    recompile the model once per layer, up to its limit) and compiles once the calibrated recipe is in: a few
    graphs for the whole run (training forward/backward, evaluation), not one per layer. The backend is dynamo's
    ``eager`` (what is traced and how often does not depend on it; Inductor would take minutes on a CPU)."""
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    recipe = str(tmp_path / "adahop.json")
    fp4train.recipes.get("adahop").replace(calibration_steps=2).save(recipe)
    cfg = TrainConfig(model="tiny", recipe=recipe, seq_len=32, batch_size=2, max_steps=4, log_every=1, eval_every=0, eval_batches=1,
                      ckpt_every=0, out=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu", compile=True)
    Trainer(cfg).run()
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    assert 1 <= graphs <= 4 and recompiles <= 2, (graphs, dict(counters["recompiles"]))
    torch._dynamo.reset()
