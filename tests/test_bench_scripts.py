"""The benchmark scripts run (small sizes) and measure what they claim."""

import importlib.util
import json
import os

import pytest
import torch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_and_fast_path() -> str:
    """The README and docs/fast_path.md, where the README's fast-path session notes moved in session 20: the figures
    of both come from committed files."""
    return (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs/fast_path.md").read_text()


def _load(name, folder="bench"):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_probe(name):
    return _load(name, "scripts/probes")


def _load_script(name):
    return _load(name, "scripts")


def test_sqnr_script_small(tmp_path, capsys):
    mod = _load("sqnr_formats")
    mod.main(["--rows", "64", "--cols", "256", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert out.count("\n| ") == 2 * len(mod.VARIANTS)
    res = {(r["variant"], r["rounding"]): r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    # physics the table must show: Hadamard rescues MXFP4 on outlier channels, FP8 >> FP4,
    # stochastic rounding costs SQNR
    plain, had = res[("mxfp4 1x32 floor", "nearest")], res[("mxfp4 1x32 floor + H32", "nearest")]
    assert had["outlier_channels"] > plain["outlier_channels"] + 1
    assert res[("fp8 rowwise", "nearest")]["gaussian"] > plain["gaussian"] + 8
    assert res[("mxfp4 1x32 floor", "stochastic")]["gaussian"] < plain["gaussian"] - 1


def test_docs_table_is_from_the_script():
    doc = (ROOT / "docs/formats.md").read_text()
    assert "Produced by `python bench/sqnr_formats.py --update-docs`" in doc
    committed = json.loads((ROOT / "bench/results/sqnr_formats.json").read_text())
    for r in committed["results"]:
        line = f"| {r['variant']} | {r['rounding']} | {r['gaussian']:.2f} | {r['student_t']:.2f} | {r['outlier_channels']:.2f} |"
        assert line in doc


def test_readme_table_is_from_the_script():
    readme = _readme_and_fast_path()
    committed = json.loads((ROOT / "bench/results/sqnr_formats.json").read_text())
    nearest = {r["variant"]: r for r in committed["results"] if r["rounding"] == "nearest"}
    rows = [ln for ln in readme.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip() in nearest]
    assert len(rows) >= 5
    for ln in rows:
        r = nearest[ln.split("|")[1].strip()]
        assert ln == f"| {r['variant']} | {r['gaussian']:.2f} | {r['student_t']:.2f} | {r['outlier_channels']:.2f} |"


def test_sqnr_linear_script_small(tmp_path):
    mod = _load("sqnr_linear")
    mod.main(["--tokens", "64", "--in", "64", "--out", "64", "--seeds", "0", "--json", str(tmp_path / "l.json")])
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "l.json").read_text())["results"]}
    assert rows["fp8_rowwise"]["Y"] > rows["mxfp4"]["Y"] + 8  # FP8 keeps ~2 more bits
    assert all(10 < r["Y"] < 40 for r in rows.values())


def test_readme_results_are_the_committed_ones():
    readme = _readme_and_fast_path()
    quick = (ROOT / "bench/results/quickstart-cpu/report.md").read_text()
    for row in (ln for ln in quick.splitlines() if ln.startswith("| ")):
        assert row in readme, row
    cmp = (ROOT / "bench/results/compare-60m-enwiki/report.md").read_text()
    rows = [ln for ln in cmp.splitlines() if ln.startswith("| ") and not ln.startswith("| recipe")]
    assert len(rows) >= 5 and all(row in readme for row in rows)
    rep = json.loads((ROOT / "bench/results/compare-60m-enwiki/report.json").read_text())
    assert f"BF16's two seeds end {rep['bf16_seed_spread_pct']:.2f}% apart" in readme
    sweep = json.loads((ROOT / "bench/results/lr_sweep-60m-enwiki/lr_sweep.json").read_text())
    for r in sweep["results"]:
        v = r["val_loss_per_seed"]
        assert f"| {r['lr']:g} | {v[0]:.4f} | {v[1]:.4f} | {r['val_loss_mean']:.4f} | {r['seed_spread_pct']:.2f}% |" in readme
    speed = {r["recipe"]: r["tokens_per_s"] for r in json.loads((ROOT / "bench/results/train_speed-60m-H200-eager.json").read_text())["results"]}
    for name, k in (("bf16", 412), ("mxfp4", 22), ("tib2d", 20), ("nvfp4", 14), ("hadamard_mxfp4", 11)):
        assert round(speed[name] / 1000) == k and f"{name} {k}k" in readme.replace("BF16 412k", "bf16 412k")
    fast = {r["recipe"]: r["tokens_per_s"] for r in json.loads((ROOT / "bench/results/train_speed-60m-NVIDIA_H200-triton.json").read_text())["results"]}
    for name in ("mxfp4", "hadamard_mxfp4", "tib2d", "fp8_rowwise"):
        assert f"{name} {round(fast[name] / 1000)}k" in readme, name
    ratios = [fast[r] / fast["bf16"] for r in fast if r != "bf16"]
    assert f"{1 / max(ratios):.1f}–{1 / min(ratios):.1f}× slower" in readme
    e2e = json.loads((ROOT / "bench/results/summary.json").read_text())["e2e"]  # the status line: fp4train's recipes
    ours = [r["speedup_vs_bf16"] for m in e2e.values() for k, r in m.items()
            if k.split("+")[0] not in ("bf16", "torchao_fp8_rowwise") and "error" not in r and "+" not in k]
    assert f"a whole training step is\n{min(ours):.2f}–{max(ours):.2f}× BF16's speed compiled by default" in readme
    assert (f"mxfp4 ({e2e['3b']['mxfp4']['speedup_vs_bf16']:.2f}×) and AdaHOP ({e2e['3b']['adahop']['speedup_vs_bf16']:.2f}×) "
            "beat BF16 at 3b") in readme
    g = {k: e2e[m][k + "+cudagraphs"]["speedup_vs_bf16"] for m, k in (("3b", "tib2d"), ("1b", "adahop"), ("1b", "mxfp4"))}
    a3 = e2e["3b"]["adahop+cudagraphs"]["speedup_vs_bf16"]
    assert (f"AdaHOP runs at {a3:.2f}×\nand tib2d at {g['tib2d']:.2f}× at 3b, AdaHOP at {g['adahop']:.2f}× and mxfp4 at "
            f"{g['mxfp4']:.2f}× at 1b") in readme
    t1 = e2e["1b"]["tib2d+cudagraphs"]["speedup_vs_bf16"]
    assert (f"mxfp4 {g['mxfp4']:.2f}× BF16 at 1b, AdaHOP {g['adahop']:.2f}× and tib2d {t1:.2f}× ({a3:.2f}× and "
            f"{g['tib2d']:.2f}× at 3b)") in readme
    default_1b = [e2e["1b"][k]["speedup_vs_bf16"] for k in ("mxfp4", "adahop", "tib2d")]
    assert f"against\n  {min(default_1b):.2f}–{max(default_1b):.2f}× compiled by default" in readme


def test_adahop_numbers_in_docs_are_the_committed_analysis():
    d = ROOT / "bench/results/analyze-60m-enwiki"
    an = json.loads((d / "analysis.json").read_text())
    rs = json.loads((d / "rescored.json").read_text())
    readme, doc = _readme_and_fast_path(), (ROOT / "docs/adahop.md").read_text()
    for m in ("fp8_rowwise", "nvfp4", "adahop_measured", "mxfp4", "hadamard_mxfp4", "tib2d"):
        assert f"{m} {an['mean_relative_error'][m]:.4f}" in readme
        assert f"| {an['mean_relative_error'][m]:.4f} | {an['mean_sqnr_db'][m]:.2f} |" in doc
    assert f"adahop {rs['mean_relative_error']['adahop (current rules)']:.4f}" in readme
    for p in an["pattern_pairs"]:
        assert (f"| {p['a']} | {p['b']} | {p['n']} | {p['err_plain']:.4f} | {p['err_iht']:.4f} | {p['err_oe']:.4f} | "
                f"{p['iht_improvement_pct']:+.1f}% | {p['oe_improvement_pct']:+.1f}% |") in doc
    # the analysis's must-show: AdaHOP below naive MXFP4 and uniform Hadamard
    err = rs["mean_relative_error"]
    assert err["adahop (current rules)"] < err["mxfp4"] and err["adahop (current rules)"] < err["hadamard_mxfp4"]


def test_train_speed_measures_bf16_first_and_records_a_failing_recipe(tmp_path, monkeypatch):
    mod = _load("train_speed")
    real = mod.convert

    def convert(model, recipe, backend):
        if recipe == mod.TORCHAO:  # stands in for a missing torchao / an unsupported GPU
            raise RuntimeError("torchao_fp8_rowwise needs torchao")
        real(model, recipe, backend)

    monkeypatch.setattr(mod, "convert", convert)
    out = tmp_path / "s.json"
    mod.main(["--model", "tiny", "--recipes", "mxfp4,torchao_fp8_rowwise,adahop", "--batch-size", "2", "--seq-len", "32",
              "--steps", "2", "--warmup", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["recipe"] for r in rows] == ["bf16", "mxfp4", "torchao_fp8_rowwise", "adahop"]
    # AdaHOP is timed after its calibration, with every quantized GEMM given a strategy
    assert sum(rows[3]["adahop_strategies"].values()) == 3 * 7 * 2 and rows[3]["tokens_per_s"] > 0  # 3 GEMMs, 7 linears, 2 blocks
    assert rows[1]["tokens_per_s"] > 0 and rows[1]["speedup_vs_bf16"] == rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    tb = rows[2].pop("traceback")  # the innermost frames, for a failure on a machine nobody can log into
    assert rows[2] == {"recipe": "torchao_fp8_rowwise", "error": "RuntimeError: torchao_fp8_rowwise needs torchao"}
    assert tb[-1] == "RuntimeError: torchao_fp8_rowwise needs torchao" and any("in convert" in line for line in tb)


def test_summary_merges_linear_runs_later_variants_winning():
    """A rerun of some linear_speed variants (after a kernel change) replaces those variants only; each keeps the
    speedup over its own run's BF16 and names its run."""
    mod = _load("summary")
    row = lambda layer, bf16, v: {"model": "llama-3-8b", "layer": layer, "tokens": 16, "bf16_ms": bf16,  # noqa: E731
                                  "bf16_saved_bytes": 400, "variants": v}
    old = {"gpu": "G", "date": "d1", "commit": "old", "results": [
        row("qkv", 2.0, {"a": {"speedup_vs_bf16": 1.0, "saved_bytes": 100}, "b": {"speedup_vs_bf16": 0.5, "saved_bytes": 100}}),
        row("up", 4.0, {"a": {"speedup_vs_bf16": 1.1, "saved_bytes": 100}})]}
    new = {"gpu": "G", "date": "d2", "commit": "new", "results": [row("qkv", 2.2, {"a": {"speedup_vs_bf16": 1.4, "saved_bytes": 100}})]}
    m = mod.merge_linear([old, new])
    by = {r["layer"]: r["variants"] for r in m["results"]}
    assert by["qkv"]["a"] == {"speedup_vs_bf16": 1.4, "saved_bytes": 100, "commit": "new", "bf16_ms": 2.2}
    assert by["qkv"]["b"]["commit"] == "old" and by["up"]["a"]["commit"] == "old" and m["commits"] == ["old", "new"]
    assert mod.merge_linear([]) is None
    built = mod.build([], None, m, None)
    assert built["commit"] == ["new", "old"]  # every run the summary draws on
    t = {x["target"]: x for x in built["targets"]}
    assert t["linear fwd+bwd at the Llama-3-8B shapes, a: speedup vs BF16 (geometric mean)"]["measured"] == pytest.approx((1.4 * 1.1) ** 0.5)


def test_summary_checks_the_targets_and_says_how_far_off(tmp_path, capsys):
    mod = _load("summary")
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-30", "commit": "abc1234"}

    def e2e(model, rows):
        return {**meta, "model": model, "results": rows}

    files = {
        "e2e1b": e2e("1b", [{"recipe": "bf16", "tokens_per_s": 100.0, "peak_mem_gib": 40.0},
                            {"recipe": "adahop", "tokens_per_s": 120.0, "peak_mem_gib": 28.0},
                            {"recipe": "tib2d", "tokens_per_s": 90.0, "peak_mem_gib": 30.0},
                            {"recipe": "torchao_fp8_rowwise", "tokens_per_s": 110.0, "peak_mem_gib": 38.0}]),
        "e2e3b": e2e("3b", [{"recipe": "bf16", "tokens_per_s": 50.0, "peak_mem_gib": 70.0},
                            {"recipe": "adahop", "error": "OutOfMemoryError: CUDA out of memory"}]),
        # the other 3b recipes from a second run (another GPU): each against its own run's BF16
        "e2e3b_2": e2e("3b", [{"recipe": "bf16", "tokens_per_s": 40.0, "peak_mem_gib": 70.0},
                              {"recipe": "tib2d", "tokens_per_s": 52.0, "peak_mem_gib": 50.0}]),
        "gemm": {**meta, "results": [{"model": "square", "layer": "8192^3", "speedup_vs_bf16": 1.5}]},
        "linear": {**meta, "results": [
            {"model": "llama-3-8b", "layer": "qkv", "bf16_saved_bytes": 400,
             "variants": {"mxfp4:triton:fp8_blockwise": {"speedup_vs_bf16": 1.0, "saved_bytes": 100}}},
            {"model": "llama-3-8b", "layer": "up", "bf16_saved_bytes": 800,
             "variants": {"mxfp4:triton:fp8_blockwise": {"speedup_vs_bf16": 1.21, "saved_bytes": 200}}}]},
        "quantize": {**meta, "results": {"copy": {"ms": 1, "GBps": 4000},
                                         "triton mxfp4 nearest": {"ms": 1, "GBps": 2600, "fraction_of_copy": 0.65},
                                         "reference mxfp4 nearest": {"ms": 9, "GBps": 300, "fraction_of_copy": 0.075}}},
    }
    for k, v in files.items():
        (tmp_path / f"{k}.json").write_text(json.dumps(v))
    out = tmp_path / "summary.json"
    mod.main(["--e2e", str(tmp_path / "e2e1b.json"), str(tmp_path / "e2e3b.json"), str(tmp_path / "e2e3b_2.json"), "--gemm", str(tmp_path / "gemm.json"),
              "--linear", str(tmp_path / "linear.json"), "--quantize", str(tmp_path / "quantize.json"), "--json", str(out)])
    s = json.loads(out.read_text())
    assert {k: s[k] for k in ("gpu", "date", "commit")} == meta
    assert s["e2e"]["1b"]["adahop"] == {"tokens_per_s": 120.0, "peak_mem_gib": 28.0, "speedup_vs_bf16": 1.2,
                                        "bf16_peak_mem_gib": 40.0, "commit": "abc1234"}
    assert s["e2e"]["3b"]["adahop"] == {"error": "OutOfMemoryError: CUDA out of memory", "commit": "abc1234"}
    assert s["e2e"]["3b"]["tib2d"]["speedup_vs_bf16"] == pytest.approx(1.3)  # 52 / its own run's 40, not 52 / 50
    t = {x["target"]: x for x in s["targets"]}
    assert t["quantize triton mxfp4 nearest: fraction of copy bandwidth"]["met"] is True
    assert not any("reference" in k for k in t)  # only kernels are held to the bandwidth target
    assert t["FP4 GEMM at 8192^3 vs cuBLAS BF16"]["met"] is True
    lin = t["linear fwd+bwd at the Llama-3-8B shapes, mxfp4:triton:fp8_blockwise: speedup vs BF16 (geometric mean)"]
    assert lin["measured"] == pytest.approx(1.1) and lin["met"] is False and lin["short_by_pct"] == pytest.approx(-12.0)
    assert t["saved activation bytes, mxfp4:triton:fp8_blockwise: BF16 / quantized (min over the 8B shapes)"]["measured"] == 4.0
    assert t["end to end 1b, adahop: tokens/s vs BF16"]["measured"] == pytest.approx(1.2) and t["end to end 1b, adahop: tokens/s vs BF16"]["met"]
    assert t["end to end 1b, tib2d: tokens/s vs torchao_fp8_rowwise"]["met"] is False
    assert t["end to end 1b, adahop: peak memory BF16 / recipe (same batch)"]["measured"] == pytest.approx(40 / 28)
    assert t["end to end 3b, adahop: tokens/s vs BF16"] == {"target": "end to end 3b, adahop: tokens/s vs BF16", "goal": 1.25,
                                                          "measured": None, "met": None,
                                                          "note": "not measured; OutOfMemoryError: CUDA out of memory"}
    assert t["end to end 3b, tib2d: tokens/s vs BF16"]["measured"] == pytest.approx(1.3)
    assert t["end to end 3b, tib2d: peak memory BF16 / recipe (same batch)"]["measured"] == pytest.approx(70 / 50)
    assert "| FP4 GEMM at 8192^3 vs cuBLAS BF16 | 1.40 | 1.50 | yes |" in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({**files["gemm"], "gpu": "NVIDIA H100"}))
    with pytest.raises(SystemExit, match="different GPUs"):
        mod.main(["--e2e", str(tmp_path / "e2e1b.json"), "--gemm", str(tmp_path / "other.json"), "--json", str(out)])


def test_bf16_repeat_numbers_in_readme_and_log_are_the_committed_runs():
    """The same BF16 seed run three times: the values, their range and the step-64 spike quoted in
    README and LOG come from the committed run folders."""
    cmp = ROOT / "bench/results/compare-60m-enwiki"
    dirs = [cmp / "runs/bf16-seed0", ROOT / "bench/results/lr_sweep-60m-enwiki/lr0.0012-seed0", cmp / "earlier-runs/bf16-seed0"]
    finals = [json.loads((d / "summary.json").read_text())["final_val_loss"] for d in dirs]
    step64 = [next(json.loads(ln)["loss"] for ln in (d / "metrics.jsonl").read_text().splitlines() if json.loads(ln)["step"] == 64)
              for d in dirs]
    readme, log = _readme_and_fast_path(), (ROOT / "docs/LOG.md").read_text()
    spread = (max(finals) - min(finals)) / min(finals) * 100
    assert f"{finals[0]:.4f}, {finals[1]:.4f} (lr sweep) and {finals[2]:.4f}" in readme
    assert f"{finals[0]:.4f} (here), {finals[1]:.4f} (lr sweep), {finals[2]:.4f}" in log
    assert f"a {spread:.2f}% range" in readme and f"a {spread:.2f}% range" in log
    others = f"{step64[0]:.2f} and {step64[1]:.2f}"
    assert f"was {step64[2]:.2f}, the others' {others}" in readme
    assert f"was {step64[2]:.2f} at step 64 where the others' were {others}" in log.replace("\n", " ")


def test_adahop_early_gap_quoted_in_the_log_is_the_committed_runs():
    runs = ROOT / "bench/results/compare-60m-enwiki/runs"

    def val_at(recipe, seed, step):
        recs = map(json.loads, (runs / f"{recipe}-seed{seed}" / "metrics.jsonl").read_text().splitlines())
        return next(r["val_loss"] for r in recs if r["step"] == step and "val_loss" in r)

    def gap(recipe, step=128):  # mean over the two seeds, % of BF16 at the same seed
        return sum((val_at(recipe, s, step) / val_at("bf16", s, step) - 1) * 100 for s in (0, 1)) / 2

    others = [gap(r) for r in ("mxfp4", "hadamard_mxfp4", "tib2d")]
    log = (ROOT / "docs/LOG.md").read_text().replace("\n", " ")
    assert f"its gap is {gap('adahop'):.1f}%".replace("-", "−") in log
    assert f"the others' gaps are {min(others):.2f}–{max(others):.2f}% at step 128" in log


def test_readme_reading_of_the_finished_comparison_follows_its_report():
    """The README's claims about the 60m comparison hold in the committed report: all 14 runs
    finished; nvfp4 and adahop are the two best FP4 recipes, AdaHOP's seeds straddle NVFP4's;
    fp8_rowwise is below BF16 on both seeds, by less than the worst BF16 same-seed repeat (0.83%)."""
    rep = json.loads((ROOT / "bench/results/compare-60m-enwiki/report.json").read_text())
    assert not rep["unfinished"] and len(rep["recipes"]) == 7
    r = rep["recipes"]
    fp4 = sorted(("mxfp4", "hadamard_mxfp4", "tib2d", "adahop", "nvfp4"), key=lambda k: r[k]["gap_pct_mean"])
    assert fp4[:2] == ["nvfp4", "adahop"] and all(r[k]["gap_pct_mean"] <= 1.0 for k in fp4[:2])
    a, n = r["adahop"]["val_loss_per_seed"], r["nvfp4"]["val_loss_per_seed"]
    assert min(a.values()) < min(n.values()) and max(a.values()) > max(n.values())
    assert all(-0.83 < g < 0 for g in r["fp8_rowwise"]["gap_pct_per_seed"].values())
    readme = _readme_and_fast_path()
    assert "(AdaHOP's seeds\nstraddle NVFP4's)" in readme or "(AdaHOP's seeds straddle NVFP4's)" in readme


def test_readme_fast_path_numbers_are_the_committed_h200_results():
    """Every figure of the README's fast-path paragraph comes from a committed result file."""
    import math

    readme = _readme_and_fast_path()
    res = ROOT / "bench/results"
    summary = json.loads((res / "summary.json").read_text())
    e2e = summary["e2e"]
    for k in ("bf16", "torchao_fp8_rowwise", "fp8_rowwise", "mxfp4", "hadamard_mxfp4", "tib2d", "adahop", "nvfp4"):
        cells = [f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_bf16']:.2f}× | {r['peak_mem_gib']:.1f} | {r['commit']}"
                 for r in (e2e["1b"][k], e2e["3b"][k])]
        assert f"| {k} | {' | '.join(cells)} |" in readme, k
    def graph_cells(r):  # a row's cells for one model from runs in CUDA graphs (train_speed --compile-mode reduce-overhead)
        if r is None:
            return ["not run", "—", "—", "—"]
        if "error" in r:
            return ["failed", "—", "—", r["commit"]]
        return [f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_bf16']:.2f}×", f"{r['peak_mem_gib']:.1f}", r["commit"]]

    for k in ("bf16", "torchao_fp8_rowwise", "mxfp4", "tib2d", "adahop"):
        k += "+cudagraphs"
        assert f"| {k} | {' | '.join(graph_cells(e2e['1b'].get(k)) + graph_cells(e2e['3b'].get(k)))} |" in readme, k
    # AdaHOP at 3b in CUDA graphs: failed during capture at 384cb50; its first finished run (a6adc54) had the sums;
    # the row is session 21's, with the fold's launch keyed by reads, beside torchao in CUDA graphs
    assert all(e2e[m][k + "+cudagraphs"]["commit"] == "6d232b9" and "error" not in e2e[m][k + "+cudagraphs"]
               for m in ("1b", "3b") for k in ("adahop", "tib2d", "torchao_fp8_rowwise"))
    # the session-18 sentence: tib2d's rows as they were at b01c291
    t1g, t3g = ({r["recipe"]: dict(r, commit="b01c291") for r in json.loads(
        (res / f"e2e-h200/train_speed-{m}-reduce-overhead-b01c291.json").read_text())["results"]}["tib2d"] for m in ("1b", "3b"))
    first = {m: {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{m}-reduce-overhead-384cb50.json").read_text())["results"]}
             for m in ("1b", "3b")}
    assert (f"({first['1b']['tib2d']['speedup_vs_bf16']:.2f}× at 1b, {first['3b']['tib2d']['speedup_vs_bf16']:.2f}× at 3b; "
            f"`…-reduce-overhead-384cb50.json`)") in readme
    seeds = {m: {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{m}-reduce-overhead-{c}.json").read_text())["results"]}
             for m, c in (("1b", "c601335"), ("3b", "21ffa9f"))}
    s1, s3 = seeds["1b"]["tib2d"]["speedup_vs_bf16"], seeds["3b"]["tib2d"]["speedup_vs_bf16"]
    assert f"took it to {s1:.2f}× at 1b and {s3:.2f}× at 3b" in readme
    # session 18: the MXFP8 column kernel (no transposed copy of X for q/k) - the copy's share of the profile, the new run
    cp = {r["recipe"]: r for r in json.loads((res / "profile_step/1b-H200-copies-5703df7.json").read_text())["results"]}["tib2d"]
    aten = sum(k["ms_per_step"] for k in cp["top"] if "direct_copy_kernel" in k["kernel"])
    top_copy = cp["copies"][0]
    assert top_copy["shape"] == "2048x16384" and top_copy["calls_per_step"] == 32
    assert f"{top_copy['ms_per_step']:.2f} of their {aten:.2f} ms a 1b step" in readme
    assert t1g["commit"] == t3g["commit"] == "b01c291"
    assert (f"tib2d went from {s1:.2f}× to\n  {t1g['speedup_vs_bf16']:.2f}× at 1b and from {s3:.2f}× to "
            f"{t3g['speedup_vs_bf16']:.2f}× at 3b (b01c291)") in readme
    qp = json.loads((res / "quantize_speed-NVIDIA_H200-e19dc98.json").read_text())["results"]
    assert f"({qp['triton mxfp8 along dim 0']['ms']:.3f} ms on 16384 × 8192 BF16" in readme
    one, two = qp["triton dY 32x32 SR -> both folds (one pass)"]["ms"], qp["triton dY 32x32 SR -> packed -> two folds"]["ms"]
    assert one > two and f"({one:.3f}\n  against {two:.3f} ms)" in readme
    a17 = {r["recipe"]: r for r in json.loads((res / "e2e-h200/train_speed-1b-reduce-overhead-21ffa9f.json").read_text())["results"]}
    assert f"AdaHOP then ran at {a17['adahop']['speedup_vs_bf16']:.2f}× at 1b" in readme  # session 17, after the capture fixes
    # the summary's e2e table is what bench/summary.py makes of the committed runs (a later run's entry wins)
    e2e_dir = res / "e2e-h200"
    runs = [e2e_dir / f"train_speed-1b-{c}.json" for c in ("a35b562-gpu0", "a35b562-gpu1", "d8fb690", "57bd0e9", "7a9e335",
                                                             "680cd3e", "680cd3e-b", "680aa49", "3e2df64",
                                                             "reduce-overhead-38bdbed", "reduce-overhead-384cb50",
                                                             "reduce-overhead-c601335", "reduce-overhead-21ffa9f",
                                                             "reduce-overhead-b01c291", "reduce-overhead-b9fa87d",
                                                             "reduce-overhead-6d232b9", "reduce-overhead-6d232b9-torchao",
                                                             "reduce-overhead-6d232b9-b")]
    runs += [res / "train_speed-3b-NVIDIA_H200.json"] + [e2e_dir / f"train_speed-3b-{c}.json" for c in (
        "d8fb690", "57bd0e9", "7a9e335", "262876e", "0e1397a", "reduce-overhead-384cb50", "reduce-overhead-21ffa9f",
        "reduce-overhead-b01c291", "reduce-overhead-a6adc54", "reduce-overhead-b65d3f9", "reduce-overhead-b9fa87d",
        "reduce-overhead-6d232b9", "reduce-overhead-6d232b9-b")]
    assert _load("summary").e2e_table([json.loads(p.read_text()) for p in runs]) == e2e
    assert all(json.loads(p.read_text()).get("quantized_linears") == "in graph" for p in runs if "e2e-h200" in str(p))
    old = {m: {r["recipe"]: r for r in json.loads((e2e_dir / f"train_speed-{m}.json").read_text())["results"]}
           for m in ("1b-eec25b3", "3b-ff0a0ad-gpu0", "3b-ff0a0ad-gpu1")}
    m1, m3 = e2e["1b"]["mxfp4"], e2e["3b"]["mxfp4"]
    assert (f"mxfp4 went from {old['1b-eec25b3']['mxfp4']['speedup_vs_bf16']:.2f}× to {m1['speedup_vs_bf16']:.2f}× BF16 at 1b\n"
            f"  and from {old['3b-ff0a0ad-gpu0']['mxfp4']['speedup_vs_bf16']:.2f}× to {m3['speedup_vs_bf16']:.2f}× at 3b, and its 3b peak "
            f"memory from {old['3b-ff0a0ad-gpu0']['mxfp4']['peak_mem_gib']:.1f} to {m3['peak_mem_gib']:.1f} GiB") in readme
    f8_57 = {r["recipe"]: r for r in json.loads((e2e_dir / "train_speed-3b-57bd0e9.json").read_text())["results"]}["fp8_rowwise"]
    assert (f"fp8_rowwise fell from {old['3b-ff0a0ad-gpu1']['fp8_rowwise']['speedup_vs_bf16']:.2f}× to "
            f"{f8_57['speedup_vs_bf16']:.2f}× at 3b") in readme
    assert f"it is now {e2e['3b']['fp8_rowwise']['speedup_vs_bf16']:.2f}× at 3b" in readme
    ada3 = e2e["3b"]["adahop"]
    assert (f"at 3b it is {ada3['speedup_vs_bf16']:.2f}× ({ada3['commit']})" in readme
            and f"behind torchao ({e2e['3b']['torchao_fp8_rowwise']['speedup_vs_bf16']:.2f}×)" in readme)
    assert f"at 1b it is now {e2e['1b']['fp8_rowwise']['speedup_vs_bf16']:.2f}×" in readme
    t1, t3 = e2e["1b"]["tib2d"], e2e["3b"]["tib2d"]
    assert f"tib2d went from 0.72× to {t1['speedup_vs_bf16']:.2f}× at 1b\n  and from 0.82× to {t3['speedup_vs_bf16']:.2f}× at 3b" in readme
    ada = [r["speedup_vs_bf16"] for c in ("93647de", "f264ba3", "7a9e335")
           for r in json.loads((e2e_dir / f"train_speed-1b-{c}.json").read_text())["results"] if r["recipe"] == "adahop"]
    by_run = {c: {r["recipe"]: r for r in json.loads((e2e_dir / f"train_speed-1b-{c}.json").read_text())["results"]}
              for c in ("7a9e335", "680cd3e")}
    assert (f"({min(ada):.2f}–{max(ada):.2f}× at\n  7a9e335 and the two commits before; "
            f"{by_run['680cd3e']['adahop']['speedup_vs_bf16']:.2f}× at 680cd3e, "
            f"{e2e['1b']['adahop']['speedup_vs_bf16']:.2f}× at {e2e['1b']['adahop']['commit']})") in readme
    assert (f"mxfp4 at 1b fell from {by_run['7a9e335']['mxfp4']['speedup_vs_bf16']:.2f}× (7a9e335) to "
            f"{by_run['680cd3e']['mxfp4']['speedup_vs_bf16']:.2f}× (680cd3e) and {m1['speedup_vs_bf16']:.2f}× "
            f"({m1['commit']})") in readme
    # the kind-by-kind reading of the 1b profiles
    prof = _load("profile_step")
    tib = prof.explain(json.loads((res / "profile_step/1b-H200-triton-490b414.json").read_text()))["tib2d"]
    gemm = -(tib["gemm bf16"]["vs_bf16_ms"] + tib["gemm fp8"]["vs_bf16_ms"])
    total = sum(v["vs_bf16_ms"] for v in tib.values())
    assert (f"GEMMs take {gemm:.0f} ms a step less than BF16's (FP8 GEMMs {tib['gemm fp8']['ms']:.0f} ms in place of "
            f"{-tib['gemm bf16']['vs_bf16_ms']:.0f} ms of BF16 GEMMs), but fp4train's\n  quantize/fold kernels add "
            f"{tib['fp4train triton']['vs_bf16_ms']:.0f} ms and ATen copies {tib['aten elementwise']['vs_bf16_ms']:.0f} ms, "
            f"so its GPU time is {total:.0f} ms above BF16's") in readme
    ada_prof = json.loads((res / "profile_step/1b-H200-triton-adahop-490b414.json").read_text())
    ad = prof.explain(ada_prof)
    a_tot = sum(v["vs_bf16_ms"] for v in ad["adahop"].values())
    a_gemm = ad["adahop"]["gemm bf16"]["vs_bf16_ms"] + ad["adahop"]["gemm fp8"]["vs_bf16_ms"]
    assert (f"take {-a_tot:.0f} ms less than BF16's (`…/1b-H200-triton-adahop-490b414.json`: GEMMs {a_gemm:.0f} ms, "
            f"its Triton kernels +{ad['adahop']['fp4train triton']['vs_bf16_ms']:.0f} ms)").replace("-", "−") in readme.replace("-", "−")
    launches = {r["recipe"]: r["kernels_per_step"] for r in ada_prof["results"]}
    assert f"AdaHOP\n  launches {launches['adahop']:.0f} kernels a step against BF16's {launches['bf16']:.0f}" in readme
    run = {r["recipe"]: r for r in json.loads((e2e_dir / "train_speed-1b-680cd3e.json").read_text())["results"]}
    wall = {r["recipe"]: r["wall_ms_per_step"] for r in ada_prof["results"]}
    assert (f"yet its step in `train_speed` at 680cd3e is {run['adahop']['step_ms']:.0f} ms against BF16's "
            f"{run['bf16']['step_ms']:.0f}") in readme and a_tot < 0 and run["adahop"]["step_ms"] > run["bf16"]["step_ms"]
    assert f"its step took\n  {wall['adahop']:.0f} ms against BF16's {wall['bf16']:.0f}." in readme
    # memory: per-step peaks at 680cd3e, memory_peak agrees, the calibration's own peak
    offsets = [r["adahop"]["peak_mem_gib"] - r["mxfp4"]["peak_mem_gib"] for c in ("93647de", "f264ba3", "7a9e335")
               for r in [{x["recipe"]: x for x in json.loads((e2e_dir / f"train_speed-1b-{c}.json").read_text())["results"]}]]
    assert max(offsets) - min(offsets) < 0.05 and f"at 1b by the same {offsets[-1]:.1f} GiB over mxfp4 in every run" in readme
    steps = run["adahop"]["warmup_step_peaks_gib"] + [run["adahop"]["timed_peak_gib"]]
    assert max(steps) == run["adahop"]["peak_mem_gib"] and max(steps) - min(steps) < 0.01  # "in every step"
    assert (f"AdaHOP's 1b peak is {run['adahop']['peak_mem_gib']:.1f} GiB in every step, level with mxfp4 "
            f"({run['mxfp4']['peak_mem_gib']:.1f})") in readme
    mp = {r["recipe"]: r for r in json.loads((res / "memory_peak-1b-H200-490b414.json").read_text())["results"]}
    assert f"agrees ({mp['adahop']['step_peak_gib']:.1f} and {mp['mxfp4']['step_peak_gib']:.1f} GiB" in readme
    assert (f"peak at {run['adahop']['setup_peak_gib']:.1f} GiB at 1b, above\n  BF16's compiled steps "
            f"({run['bf16']['peak_mem_gib']:.1f} GiB)") in readme
    above_bf16 = [(m, k) for m in ("1b", "3b") for k, r in e2e[m].items()
                  if "error" not in r and r["peak_mem_gib"] >= r["bf16_peak_mem_gib"] and not k.startswith("bf16")]
    assert above_bf16 == [("3b", "adahop")]  # "at 1b every recipe now peaks below BF16; at 3b every recipe but AdaHOP"
    g = json.loads((res / "gemm_speed-NVIDIA_H200.json").read_text())["results"][0]
    assert g["layer"] == "8192^3" and g["inexact_elements_first_fold"] == 0
    assert (f"{g['mxfp4_fp8_blockwise']:.0f} TFLOP/s, {g['speedup_vs_bf16']:.2f}× cuBLAS BF16\n  ({g['bf16']:.0f} TFLOP/s)") in readme
    q = json.loads((res / "quantize_speed-NVIDIA_H200-ddc592e.json").read_text())["results"]
    mx = {k: v["fraction_of_copy"] * 100 for k, v in q.items() if k.startswith("triton mxfp4") and "values" not in k}
    assert f"reach {min(mx.values()):.0f}–{max(mx.values()):.0f}% of the GPU's copy bandwidth" in readme
    old_q = json.loads((res / "quantize_speed-NVIDIA_H200-680aa49.json").read_text())["results"]
    assert (f"The 1D MX kernel is at {mx['triton mxfp4 nearest']:.0f}%, up from {old_q['triton mxfp4 nearest']['fraction_of_copy'] * 100:.0f}% "
            f"before its launch changed") in readme
    assert f"The {mx['triton mxfp4 both layouts (one read)']:.0f}% is now the dual-layout kernel." in readme

    def geo(run, v):
        lin = json.loads((res / f"linear_speed-NVIDIA_H200-{run}.json").read_text())["results"]
        sp = [r["variants"][v]["speedup_vs_bf16"] for r in lin if r["model"] == "llama-3-8b"]
        return math.prod(sp) ** (1 / len(sp))

    assert (f"Llama-3-8B shapes is {geo('ddc592e', 'mxfp4:triton:triton'):.2f}× BF16 for mxfp4 (geometric mean)\n  and "
            f"{geo('ddc592e', 'tib2d:triton:triton'):.2f}× for tib2d") in readme
    assert f"{geo('2457109', 'mxfp4:triton:triton'):.2f}× and\n  {geo('2457109', 'tib2d:triton:triton'):.2f}× before session 12" in readme
    t = {x["target"]: x for x in summary["targets"]}
    assert all(t[f"linear fwd+bwd at the Llama-3-8B shapes, {v}:triton:triton: speedup vs BF16 (geometric mean)"]["met"] for v in ("mxfp4", "tib2d"))
    lin = json.loads((res / "linear_speed-NVIDIA_H200-ddc592e.json").read_text())["results"]
    saved = min(r["bf16_saved_bytes"] / r["variants"]["mxfp4:triton:triton"]["saved_bytes"] for r in lin if r["model"] == "llama-3-8b")
    assert f"{saved:.1f}× smaller than BF16's for MXFP4" in readme


def test_fold_sweep_explains_itself_and_needs_a_gpu(capsys):
    mod = _load("fold_sweep")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "which launch is fastest" in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            mod.main([])


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fold kernel runs on a GPU or under Triton's interpreter")
def test_fold_calls_records_a_steps_folds_and_times_each_candidate(monkeypatch):
    """bench/fold_calls.py on the tiny model (uniform Hadamard: every GEMM folds with a fused transform): the
    step's calls are recorded by what decides their cost, every candidate is checked for the default's bits
    and timed, and each group's best and in-use totals are the calls' counts times those times."""
    mod = _load("fold_calls")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls = mod.record_calls("tiny", "hadamard_mxfp4", 2, 64, dev, backend="triton", hadamard_only=True)
    keys = list(calls)
    assert keys and all(k[5] == 32 for k in keys)  # the recipe's 32-point transform on every call
    assert {k[3] for k in keys} == {False, True} and {k[4] for k in keys} == {1, 128}  # both axes, both group sizes
    assert {k[7] for k in keys} == {"nearest", "stochastic"}  # dY with stochastic rounding
    # fprop's X (along dim 1, 1x128 groups, nearest): once per distinct input - q/k/v share one, gate/up one, o and
    # down their own - so 4 per layer, in the shapes [tokens, dim] and [tokens, ffn]
    fprop_x = {k[0]: c["count"] for k, c in calls.items() if k[3:5] == (False, 1) and k[7] == "nearest"}
    assert fprop_x == {(128, 128): 2 * 3, (128, 384): 2 * 1}
    fake = iter(range(1, 10**6))  # each timing a distinct number of seconds, in call order
    timed = []

    def time_fn(fn, repeats):
        fn()
        timed.append(next(fake) * 1e-3)
        return timed[-1]

    # two launches that are not in use (FOLD_LAUNCH_HADAMARD: (16, 4) / (8, 4) rows and warps, 8 / 16 warps for 128x128)
    two = lambda key: [{"rows_per_program": None if key[4] == 128 else 32, "num_warps": 4, "butterfly": f} for f in ("permutes", "sums")]
    plain = mod.candidates(((256, 128), (128, 1), "bfloat16", True, 1, 0, False, "nearest", "floor"))  # no fused transform
    assert {c["butterfly"] for c in plain} == {None} and (128, 4) in {(c["rows_per_program"], c["num_warps"]) for c in plain}
    seen = []
    out = mod.compare(calls, 1, time_fn=time_fn, cands=two, on_row=lambda rows: seen.append(len(rows)))
    assert seen == list(range(1, len(calls) + 1))  # progress after every call, with the rows so far
    # the default candidates: on strided reads permutes only unless asked (sums lost there at every launch on the H200)
    assert {mod.strided(k[1], k[3]) for k in keys} == {False, True}
    for k in keys:
        forms = {c["butterfly"] for c in mod.candidates(k)}
        assert forms == ({"permutes"} if mod.strided(k[1], k[3]) else {"permutes", "sums"})
        assert {c["butterfly"] for c in mod.candidates(k, True)} == {"permutes", "sums"}
    # every call timed under both candidates and, since neither is the launch in use, under that one too: in that order
    assert len(out["calls"]) == len(calls) and [len(r["candidates"]) for r in out["calls"]] == [3] * len(calls)
    assert [t["ms"] for r in out["calls"] for t in r["candidates"]] == [t * 1e3 for t in timed]
    from fp4train.kernels.mx_fold import fold_launch

    for r in out["calls"]:
        use = [t for t in r["candidates"] if t["in_use"]]
        assert r["block_dim_strided"] == mod.strided(r["strides"], r["along_dim_0"])
        rb, nw, form = fold_launch(r["block_dim_strided"], r["group_rows"], True)
        assert len(use) == 1 and use[0] is r["candidates"][-1] and (use[0]["num_warps"], use[0]["butterfly"]) == (nw, form)
    # the groups' totals, recomputed from the per-call times: calls per step x ms, summed over a group's calls
    groups = {}
    for r in out["calls"]:
        g = groups.setdefault((r["block_dim_strided"], r["group_rows"]), {"n": 0, "use": 0.0, "permutes": 0.0, "sums": 0.0})
        g["n"] += r["calls_per_step"]
        g["use"] += r["calls_per_step"] * r["candidates"][2]["ms"]
        for t in r["candidates"][:2]:
            g[t["butterfly"]] += r["calls_per_step"] * t["ms"]
    assert len(groups) == len(out["groups"]) == 4
    for (reads_strided, gr), want in groups.items():
        got = out["groups"][f"block dim {'strided' if reads_strided else 'contiguous'}, {gr}x128, hadamard 32"]
        assert got["calls_per_step"] == want["n"] and got["in_use_ms_per_step"] == pytest.approx(want["use"])
        best = min(("permutes", "sums"), key=lambda f: want[f])  # the in-use launch was timed last: the slowest here
        assert got["best"] == f"{best} rows {32 if gr == 1 else 128} warps 4" and got["best_ms_per_step"] == pytest.approx(want[best])
    # against the memory floor: each call's bytes (x read, a code byte an element, an FP32 scale a group) at the copy
    # bandwidth; per step the totals, one launch a group (the table) never faster than a launch per call
    f = mod.floors(out, 100.0)
    for c, r in zip(f["calls"], out["calls"]):
        n = r["shape"][0] * r["shape"][1]
        want = n * (4 if r["dtype"] == "float32" else 2) + n + 4 * n // (128 * r["group_rows"])
        assert c["floor_ms"] == pytest.approx(want / 100e9 * 1e3) and c["best_ms"] == min(t["ms"] for t in r["candidates"])
    s = f["per_step"]
    assert s["floor_ms"] == pytest.approx(sum(c["calls_per_step"] * c["floor_ms"] for c in f["calls"]))
    assert s["in_use_ms"] == pytest.approx(sum(g["in_use_ms_per_step"] for g in out["groups"].values()))
    assert s["call_best_ms"] <= s["group_best_ms"] + 1e-9 and s["group_best_ms"] == pytest.approx(sum(g["best_ms_per_step"] for g in out["groups"].values()))
    assert s["group_best_by_reads_ms"] == pytest.approx(s["group_best_ms"])  # written with the reads key: the same groups
    # a candidate that gives other bits is an error, not a time
    import fp4train.kernels.mx_fold as mx_fold

    real = mx_fold.quantize_mxfp4_fp8
    monkeypatch.setattr(mx_fold, "quantize_mxfp4_fp8",
                        lambda x, **kw: real(x * (2.0 if kw.get("butterfly") == "sums" else 1.0), **kw))
    with pytest.raises(AssertionError, match="gives other bits"):
        mod.compare(dict([next(iter(calls.items()))]), 1, time_fn=time_fn, cands=two)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0


def test_saved_activations_counts_the_packed_x(tmp_path):
    mod = _load("saved_activations")
    out = tmp_path / "s.json"
    mod.main(["--model", "tiny", "--recipes", "bf16,mxfp4", "--batch-size", "2", "--seq-len", "64", "--no-compile", "--json", str(out)])
    r = {x["recipe"]: x for x in json.loads(out.read_text())["results"]}
    assert "uint8" in r["mxfp4"]["saved_mib_by_dtype"] and "uint8" not in r["bf16"]["saved_mib_by_dtype"]
    assert r["mxfp4"]["saved_mib"] < r["bf16"]["saved_mib"]


def test_memory_peak_replays_the_allocator_history_to_the_peak_and_charges_each_block_to_its_code():
    """The replay finds the peak (a block counts until its free completes, not when the free is
    requested) and what is alive then; each block goes to fp4train's frame, else Inductor's."""
    mod = _load("memory_peak")
    fp4 = [{"filename": "/x/torch/autograd/function.py", "name": "apply"},
           {"filename": "/repo/fp4train/linear/function.py", "name": "backward"}]
    ind = [{"filename": "/tmp/torchinductor_root/ab/cab.py", "name": "call"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": fp4},
        {"action": "alloc", "addr": 2, "size": 50, "frames": ind},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet free: still counts
        {"action": "alloc", "addr": 3, "size": 30, "frames": ind},  # peak: 1000 + 180
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "segment_alloc", "addr": 9, "size": 10**6},  # the allocator's own: not a block
        {"action": "alloc", "addr": 4, "size": 120, "frames": []},  # 1000 + 200: the new peak
        {"action": "free_completed", "addr": 4, "size": 120},
    ]
    peak, blocks = mod.peak_of_trace(events, start_bytes=1000)
    assert peak == 1200 and sorted(s for s, _ in blocks) == [30, 50, 120]
    peak, blocks = mod.peak_of_trace(events[:5], start_bytes=1000)
    assert peak == 1180 and sorted(s for s, _ in blocks) == [30, 50, 100]
    rows = mod.breakdown(blocks)
    assert rows[0] == {"origin": "fp4train/linear/function.py:backward", "gib": 100 / 2**30, "blocks": 1}
    assert rows[1]["origin"] == "inductor:call" and rows[1]["blocks"] == 2
    assert mod.origin([]) == "?" and mod.origin([{"filename": "/a/b/optimizer.py", "name": "step"}]) == "optimizer.py:step"


def test_profile_step_sorts_kernels_by_kind_and_explains_a_profile_against_bf16():
    mod = _load("profile_step")
    ours = mod.fp4train_kernels()
    assert {"_mx_tile_kernel", "_fold_kernel", "_packed_fold_kernel", "_decode_kernel"} <= ours
    kind = {n: mod.kernel_kind(n, ours) for n in (
        "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "triton_poi_fused_mul_silu_4",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<x>", "void at::native::elementwise_kernel<128, 2>",
        "_mx_tile_kernel", "memcpy")}
    assert list(kind.values()) == ["gemm fp8", "gemm bf16", "attention", "inductor", "optimizer", "aten elementwise",
                                   "fp4train triton", "other"]
    # every fp4train-looking kernel of the committed H200 profiles is one of ours (the name scan is not stale)
    for f in ("1b-H200-triton-490b414.json", "1b-H200-triton-adahop-490b414.json"):
        for r in json.loads((ROOT / "bench/results/profile_step" / f).read_text())["results"]:
            assert all(t["kernel"] in ours for t in r["top"] if t["kernel"].startswith("_")), f
    top = lambda *kv: [{"kernel": k, "ms_per_step": v} for k, v in kv]  # noqa: E731
    prof = {"results": [
        {"recipe": "bf16", "gpu_kernel_ms_per_step": 15.0,  # 1 ms outside the top list; the annotation wraps the optimizer
         "top": top(("nvjet_sm90_tst_a", 10.0), ("Optimizer.step#AdamW.step", 2.0), ("void multi_tensor_apply_kernel", 2.0))},
        {"recipe": "mxfp4", "gpu_kernel_ms_per_step": 12.0,
         "top": top(("nvjet_sm90_qqtst_a", 4.0), ("_fold_kernel", 3.0), ("void multi_tensor_apply_kernel", 2.0))},
    ]}
    rows = mod.explain(prof, ours)
    assert rows["bf16"]["gemm bf16"]["ms"] == 10.0 and rows["bf16"]["not ranked"]["ms"] == 1.0
    assert rows["mxfp4"]["gemm bf16"]["vs_bf16_ms"] == -10.0 and rows["mxfp4"]["gemm fp8"]["vs_bf16_ms"] == 4.0
    assert rows["mxfp4"]["fp4train triton"]["ms"] == 3.0 and rows["mxfp4"]["not ranked"]["ms"] == 3.0
    assert sum(v["ms"] for v in rows["bf16"].values()) == 13.0  # the annotation is not counted twice


def test_profile_step_charges_copies_to_the_fp4train_line_that_asked_for_them():
    """--copies: a second profiled run with Python stacks lists the heaviest ATen copies by (fp4train line, ATen
    op, shape) - on the CPU by CPU time; what says where a recipe's ATen copies (8.9 ms a 1b tib2d step) come from."""
    mod = _load("profile_step")
    r = mod.profile("tiny", "mxfp4", 1, 32, 1, 1, False, 1, 5, torch.device("cpu"), 4)
    rows = r["copies"]
    assert 0 < len(rows) <= 4 and [c["ms_per_step"] for c in rows] == sorted((c["ms_per_step"] for c in rows), reverse=True)
    assert all(c["frame"].startswith(("fp4train/", "bench/", "(no")) and c["op"].startswith("aten::") and c["calls_per_step"] >= 1
               for c in rows)
    assert any(c["frame"].startswith("fp4train/formats/") and ".py(" in c["frame"] for c in rows)  # file(line): function
    assert "copies" not in mod.profile("tiny", "bf16", 1, 32, 1, 1, False, 1, 5, torch.device("cpu"))  # only when asked


def test_readme_session_16_host_figures_are_the_committed_h200_results():
    """The README's session-16 paragraph: GPU time by kind, step times, host time per step, the run-to-run spread
    and the CUDA-graph run, each from a committed result file."""
    readme = " ".join(_readme_and_fast_path().split())  # one line: the paragraph's wrapping does not matter
    res = ROOT / "bench/results"
    prof = _load("profile_step")
    old = prof.explain(json.loads((res / "profile_step/1b-H200-triton-490b414.json").read_text()))["tib2d"]
    new = prof.explain(json.loads((res / "profile_step/1b-H200-triton-3e2df64.json").read_text()))
    gpu = {k: sum(v["vs_bf16_ms"] for v in new[k].values()) for k in ("tib2d", "adahop")}
    assert (f"tib2d's quantize/fold kernels from {old['fp4train triton']['vs_bf16_ms']:.0f} to "
            f"{new['tib2d']['fp4train triton']['vs_bf16_ms']:.1f} ms a step, so its GPU time is now {gpu['tib2d']:.1f} ms above "
            f"BF16's and AdaHOP's {-gpu['adahop']:.1f} ms below") in readme
    e2e = res / "e2e-h200"
    run = {r["recipe"]: r for r in json.loads((e2e / "train_speed-1b-3e2df64.json").read_text())["results"]}
    assert (f"their steps take {run['tib2d']['step_ms']:.0f} and {run['adahop']['step_ms']:.0f} ms against BF16's "
            f"{run['bf16']['step_ms']:.0f}") in readme
    host = {r["recipe"]: r for r in json.loads((res / "host_overhead/host_overhead-1b-H200-e4b5906.json").read_text())["results"]}
    assert (f"the host spends {host['tib2d']['enqueue_ms_per_step']:.0f} ms a step for tib2d, {host['adahop']['enqueue_ms_per_step']:.0f} "
            f"for AdaHOP and {host['mxfp4']['enqueue_ms_per_step']:.0f} for mxfp4, against {host['bf16']['enqueue_ms_per_step']:.0f} "
            f"for BF16") in readme
    spread = {}
    for name in ("680cd3e", "680cd3e-b", "680aa49", "3e2df64"):
        for r in json.loads((e2e / f"train_speed-1b-{name}.json").read_text())["results"]:
            spread.setdefault(r["recipe"], []).append(r["speedup_vs_bf16"])
    assert all(len(spread[k]) == 3 for k in ("adahop", "mxfp4", "tib2d"))
    assert ", ".join(f"{name} {min(spread[k]):.2f}–{max(spread[k]):.2f}×" for name, k in
                     (("AdaHOP", "adahop"), ("mxfp4", "mxfp4"), ("tib2d", "tib2d"))) in readme
    graphs = {r["recipe"]: r for r in json.loads((e2e / "train_speed-1b-reduce-overhead-38bdbed.json").read_text())["results"]}
    assert graphs["mxfp4"]["cudagraph_skips"] == 0 and f"mxfp4 reaches {graphs['mxfp4']['speedup_vs_bf16']:.2f}×" in readme
    sweep = json.loads((res / "fold_sweep-NVIDIA_H200-mx1d-38bdbed.json").read_text())["results"]
    ms = {(r["blocks_per_program"], r["num_warps"]): r["ms"] for r in sweep if r["group"] == "mx1d (mxfp4, nearest)"}
    assert f"runs {ms[(4, 4)] / ms[(64, 4)]:.1f}× faster" in readme


def test_host_overhead_explains_itself_and_measures_a_step(capsys, monkeypatch):
    """bench/host_overhead.py: --help; refuses to run without a GPU (its question is the host beside one); its
    measurement on the CPU (synchronisation stubbed): the step's wall and enqueue times and the profiled functions,
    fp4train's own among them for a quantized recipe."""
    mod = _load("host_overhead")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "Host (CPU) time of one training step" in capsys.readouterr().out
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        mod.main([])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = mod.argparse.Namespace(model="tiny", batch_size=1, seq_len=32, compile=False, warmup=1, steps=2, profile_steps=1, top=40)
    r = mod.measure(args, "mxfp4", torch.device("cpu"))
    assert r["recipe"] == "mxfp4" and r["wall_ms_per_step"] >= r["enqueue_ms_per_step"] > 0 and r["profiled_ms_per_step"] > 0
    assert len(r["top_cumtime"]) == 40 and any(f["function"].startswith("fp4train/") for f in r["top_cumtime"])
    assert all(f["calls_per_step"] > 0 and f["cumtime_ms"] >= f["tottime_ms"] for f in r["top_tottime"])


def test_activation_budget_figures_in_the_log_are_the_probes():
    """The memory target's arithmetic in docs/LOG.md (session 17) is what scripts/probes/activation_budget.py
    computes from the model's shapes and the committed peaks; the committed JSON is its output."""
    spec = importlib.util.spec_from_file_location("activation_budget", ROOT / "scripts/probes/activation_budget.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b = mod.budget("1b", 8 * 2048)
    committed = json.loads((ROOT / "bench/results/probes/activation_budget-1b.json").read_text())
    assert all(committed[k] == pytest.approx(v) for k, v in b.items() if isinstance(v, float))
    assert b["quantized_inputs_bf16_gib"] == pytest.approx(6.0)  # 16 layers x 384 MiB
    log = (ROOT / "docs/LOG.md").read_text()
    assert (f"inputs at zero bytes, BF16's {committed['bf16_peak_gib']:.1f} GiB peak would fall to {committed['floor_gib']:.1f} GiB, "
            f"which is {committed['floor_ratio']:.2f}×") in log.replace("\n", " ")
    assert (f"the same inputs take {b['quantized_inputs_mxfp4_gib']:.1f} GiB, and the count predicts "
            f"{committed['mxfp4_predicted_gib']:.1f} GiB for mxfp4. Its measured peak is {committed['mxfp4_measured_gib']:.1f} GiB") in log.replace("\n", " ")
    assert f"makes for BF16's backward: {b['bf16_weight_copies_gib']:.1f} GiB" in log.replace("\n", " ")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts launches in Triton's interpreter (CPU)")
def test_seed_ops_probe_counts_what_the_docs_say():
    """scripts/probes/seed_ops.py: the ops a seeded layer call spends on device seeds, by the reference's int64 ops
    and by the seed kernels - the committed JSON is its output, and the README/LOG figures are its numbers."""
    spec = importlib.util.spec_from_file_location("seed_ops", ROOT / "scripts/probes/seed_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = {(r["recipe"], r["path"]): r for r in json.loads((ROOT / "bench/results/probes/seed_ops.json").read_text())["results"]}
    ref, ker = mod.seed_ops_per_call("tib2d", False), mod.seed_ops_per_call("tib2d", True)
    assert committed[("tib2d", ref["path"])] == ref and committed[("tib2d", ker["path"])] == ker
    assert ker["ops"] == 2 * ker["derivations"]  # a launch and its output tensor per derivation
    readme, log = _readme_and_fast_path(), (ROOT / "docs/LOG.md").read_text().replace("\n", " ")
    assert f"device took {ref['ops']} tensor ops per layer call" in readme and f"{ker['ops']} ops a call)" in readme
    nv = committed[("nvfp4", ref["path"])]
    assert f"that is {ref['ops']} tensor ops in {ref['derivations']} derivations per call (nvfp4: {nv['ops']} in {nv['derivations']})" in log


def test_triton36_sm90_compile_record_covers_the_seed_kernels():
    """The committed aot_check result (Triton 3.6, the device's) that docs/LOG.md cites for session 17: every launch
    compiled, the seed kernels among them at the registers the LOG gives."""
    d = json.loads((ROOT / "bench/results/kernels-sm90-ptxas-triton36-0b52ec4.json").read_text())
    assert d["triton"] == "3.6.0" and all("error" not in r for r in d["results"])
    regs = [r["registers"] for r in d["results"] if r["kernel"].startswith("seeds.")]
    log = (ROOT / "docs/LOG.md").read_text().replace("\n", " ")
    assert len(regs) == 4 and f"the 4 launches compile at {min(regs)}–{max(regs)} registers" in log
    assert f"all {len(d['results'])} launches at 0b52ec4's kernels compile for sm90" in log


def test_session_18_figures_in_the_log_are_the_committed_runs():
    """docs/LOG.md, session 18: the copy that profile --copies found, the MXFP8 column kernel's speed and compile, the
    fused dY kernel that lost to the packed path, and tib2d in CUDA graphs before and after - from the committed files."""
    res = ROOT / "bench/results"
    log = (ROOT / "docs/LOG.md").read_text().replace("\n", " ")
    cp = {r["recipe"]: r for r in json.loads((res / "profile_step/1b-H200-copies-5703df7.json").read_text())["results"]}["tib2d"]
    aten = sum(k["ms_per_step"] for k in cp["top"] if "direct_copy_kernel" in k["kernel"])
    big = cp["copies"][0]
    assert (f"of the {aten:.2f} ms a step of ATen `direct_copy_kernel`, {big['ms_per_step']:.2f} ms were {big['calls_per_step']:.0f} "
            f"`aten::contiguous` calls on a 2048 × 16384 tensor a step") in log
    q = json.loads((res / "quantize_speed-NVIDIA_H200-e19dc98.json").read_text())["results"]
    col, row = q["triton mxfp8 along dim 0"], q["triton mxfp8 nearest"]
    assert (f"it takes {col['ms']:.3f} ms on 16384 × 8192 BF16 ({col['fraction_of_copy'] * 100:.0f}% of copy; the MXFP8 row "
            f"kernel {row['ms']:.3f} ms), in place of a {big['ms_per_step'] / big['calls_per_step']:.3f} ms copy") in log
    one, two = q["triton dY 32x32 SR -> both folds (one pass)"]["ms"], q["triton dY 32x32 SR -> packed -> two folds"]["ms"]
    sr = q["triton mxfp4 32x32 stochastic"]["ms"]
    assert one > two and f"**{one:.3f} ms against {two:.3f} ms** for tile kernel + two folds" in log
    assert f"the SR tile kernel alone {sr:.3f} ms" in log
    aot = json.loads((res / "kernels-sm90-ptxas-triton36-columns-302efd2.json").read_text())
    regs = [r["registers"] for r in aot["results"] if r["constexprs"]["ELEM"] == 1]
    assert aot["triton"] == "3.6.0" and all(r["spill_store_bytes"] == 0 and r["num_warps"] == 2 for r in aot["results"])
    assert f"{min(regs)}–{max(regs)} registers at 2 warps, no spills" in log
    runs = {(m, c): {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{m}-reduce-overhead-{c}.json").read_text())["results"]}
            for m, c in (("1b", "b01c291"), ("3b", "b01c291"), ("1b", "c601335"), ("3b", "21ffa9f"))}
    n1, n3 = runs[("1b", "b01c291")], runs[("3b", "b01c291")]
    assert all(r["cudagraph_skips"] == 0 for r in (*n1.values(), *n3.values()))
    assert (f"**tib2d {n1['tib2d']['speedup_vs_bf16']:.2f}× at 1b** ({n1['tib2d']['step_ms']:.1f} ms against BF16's "
            f"{n1['bf16']['step_ms']:.1f}; {runs[('1b', 'c601335')]['tib2d']['speedup_vs_bf16']:.2f}× at c601335) and "
            f"**{n3['tib2d']['speedup_vs_bf16']:.2f}× at 3b** ({n3['tib2d']['step_ms']:.1f} against {n3['bf16']['step_ms']:.1f}; "
            f"{runs[('3b', '21ffa9f')]['tib2d']['speedup_vs_bf16']:.2f}× at 21ffa9f)") in log
    top = {k["kernel"]: k["ms_per_step"] for k in cp["top"]}
    assert (f"the SR tile kernel {top['_mxfp4_tile_kernel']:.1f} ms, the packed folds "
            f"{top['_packed_fold_t_kernel'] + top['_packed_fold_kernel']:.1f} ms (`_packed_fold_t_kernel` "
            f"{top['_packed_fold_t_kernel']:.1f}, `_packed_fold_kernel` {top['_packed_fold_kernel']:.1f})") in log


def test_fused_hadamard_fold_build_records_are_what_the_log_says():
    """docs/LOG.md, session 18: the 32-block fused Hadamard fold's sm90 builds before (permutes) and after (sums), from
    the committed aot_check records: fewer instructions per element, shared-memory instructions and registers, no spills."""
    log = " ".join((ROOT / "docs/LOG.md").read_text().split())  # the list items' wrapping does not matter
    stats = {}
    for name in ("permutes", "sums"):
        d = json.loads((ROOT / f"bench/results/kernels-sm90-fold-hadamard-{name}-triton36.json").read_text())
        assert d["triton"] == "3.6.0" and all("error" not in r for r in d["results"])
        rows = [r for r in d["results"] if r["kernel"] == "mx_fold._fold_kernel" and r["constexprs"].get("HAD") == 32]
        for gr in (1, 128):
            rs = [r for r in rows if r["constexprs"]["GR"] == gr]
            stats[name, gr] = {k: (min(r[k] for r in rs), max(r[k] for r in rs))
                               for k in ("warp_instructions_per_element", "shared_memory_instructions", "registers", "spill_store_bytes")}
    old1, new1, old128, new128 = stats["permutes", 1], stats["sums", 1], stats["permutes", 128], stats["sums", 128]
    w = "warp_instructions_per_element"
    assert (f"from {old1[w][0]:.2f}–{old1[w][1]:.2f} to {new1[w][0]:.2f}–{new1[w][1]:.2f} warp instructions per element, and "
            f"shared-memory instructions from {old1['shared_memory_instructions'][0]}–{old1['shared_memory_instructions'][1]} "
            f"to {new1['shared_memory_instructions'][1]}. Registers fell from {old1['registers'][0]}–{old1['registers'][1]} "
            f"to {new1['registers'][0]}–{new1['registers'][1]}") in log
    assert (f"fell from {old128[w][0]:.2f}–{old128[w][1]:.2f} to {new128[w][0]:.2f}–{new128[w][1]:.2f}, shared-memory "
            f"instructions from {old128['shared_memory_instructions'][0]}–{old128['shared_memory_instructions'][1]} to "
            f"{new128['shared_memory_instructions'][1]}, and the {old128['spill_store_bytes'][0]}–{old128['spill_store_bytes'][1]} "
            f"bytes of spills went to none") in log and new128["spill_store_bytes"] == (0, 0)
    assert new1["shared_memory_instructions"][0] == new1["shared_memory_instructions"][1]


def test_session_19_figures_in_the_log_are_the_committed_runs():
    """docs/LOG.md, session 19: the fused Hadamard fold with sums - fast on the benchmark tensor, slow in AdaHOP's step
    because of dim 0 - then a sweep-chosen table that lost too; every figure from the committed files."""
    res = ROOT / "bench/results"
    log = " ".join((ROOT / "docs/LOG.md").read_text().split())
    q = json.loads((res / "quantize_speed-NVIDIA_H200-a6adc54.json").read_text())["results"]
    q0 = json.loads((res / "quantize_speed-NVIDIA_H200-e19dc98.json").read_text())["results"]
    fused = "triton hadamard 32 + mxfp4 -> fp8 1x128 (fused)"
    assert q[fused]["ms"] < q0[fused]["ms"] and f"**{q[fused]['ms']:.3f} ms against {q0[fused]['ms']:.3f} ms**" in log

    def run(name):
        return {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{name}.json").read_text())["results"]}

    s1, s3, p1, t1 = (run(n) for n in ("1b-reduce-overhead-a6adc54", "3b-reduce-overhead-a6adc54",
                                       "1b-reduce-overhead-563fa59-permutes", "1b-reduce-overhead-d5e048c"))
    assert all(r[k]["cudagraph_skips"] == 0 for r in (s1, s3, p1, t1) for k in ("adahop", "bf16"))
    f = lambda r, k: f"{r['adahop'][k]:.2f}" if k == "speedup_vs_bf16" else f"{r[k]['step_ms']:.1f}"  # noqa: E731
    assert f"**{f(s1, 'speedup_vs_bf16')}× BF16** ({f(s1, 'adahop')} ms a step against {f(s1, 'bf16')};" in log
    assert f"**{f(p1, 'speedup_vs_bf16')}×** again ({f(p1, 'adahop')} ms against {f(p1, 'bf16')};" in log
    assert f"**{f(t1, 'speedup_vs_bf16')}×** ({f(t1, 'adahop')} ms against BF16's {f(t1, 'bf16')};" in log
    assert f"ran at {s3['adahop']['speedup_vs_bf16']:.2f}× ({s3['adahop']['step_ms']:.1f} against {s3['bf16']['step_ms']:.1f} ms" in log
    lost = t1["adahop"]["step_ms"] - p1["adahop"]["step_ms"]  # the sweep's table against permutes at the former launches
    moved = abs(t1["bf16"]["step_ms"] / p1["bf16"]["step_ms"] - 1) * 100
    assert f"{lost:.0f} ms slower than permutes at the old launches. BF16 moved {moved:.1f}% between those two runs" in log
    prof = {}
    for name in ("563fa59", "permutes-563fa59"):
        d = json.loads((res / f"profile_step/1b-H200-triton-adahop-{name}.json").read_text())
        assert (d["batch_size"], d["seq_len"]) == (32, 1024) and "default batch, 32 × 1024 tokens" in log  # the LOG says so
        ada = {r["recipe"]: r for r in d["results"]}["adahop"]
        prof[name] = next(k for k in ada["top"] if k["kernel"] == "_fold_kernel")
        assert prof[name]["launches_per_step"] == 528
    assert (f"`_fold_kernel` (528 launches) took {prof['563fa59']['ms_per_step']:.1f} ms with sums against "
            f"{prof['permutes-563fa59']['ms_per_step']:.1f} with permutes") in log
    sweep = json.loads((res / "fold_sweep-NVIDIA_H200-hadamard-1e006b7.json").read_text())

    def ms(axis, gr, form, rb=None, nw=None):
        g = [r["ms"] for r in sweep["results"] if r["group"] == f"hadamard 32 fold axis {axis}, {gr}x128, {form}"
             and (rb is None or r["rows_per_program"] == rb) and (nw is None or r["num_warps"] == nw)]
        return min(g), max(g)

    s01, s0128, p01, p0128 = ms(0, 1, "sums"), ms(0, 128, "sums"), ms(0, 1, "permutes"), ms(0, 128, "permutes")
    by = {(r["group"], r["rows_per_program"], r["num_warps"]): r["ms"] for r in sweep["results"] if "ms" in r}
    along1 = [(ms_, by[(g.replace("sums", "permutes"), rb, nw)]) for (g, rb, nw), ms_ in by.items() if g.startswith("hadamard 32 fold axis 1")
              and g.endswith("sums")]
    assert len(along1) == 16 and all(a < b for a, b in along1) and "Along dim 1 sums led at every launch" in log
    assert (f"sums ran {s01[0]:.2f}–{s01[1]:.2f} ms with 1×128 groups and {s0128[0]:.2f}–{s0128[1]:.2f} ms with 128×128 "
            f"groups. Permutes ran {p01[0]:.2f}–{p01[1]:.2f} and {p0128[0]:.2f}–{p0128[1]:.2f} ms") in log
    best = sweep["best"]
    b1s, b128s = best["hadamard 32 fold axis 1, 1x128, sums"], best["hadamard 32 fold axis 1, 128x128, sums"]
    b0p, b0128p = best["hadamard 32 fold axis 0, 1x128, permutes"], best["hadamard 32 fold axis 0, 128x128, permutes"]
    assert (b1s["rows_per_program"], b1s["num_warps"], b128s["num_warps"], b0p["rows_per_program"], b0p["num_warps"],
            b0128p["num_warps"]) == (32, 4, 16, 8, 4, 16)
    old = [ms(a, g, "permutes", 16 if g == 1 else 128, 8 if g == 1 else 32)[0] for a, g in ((1, 1), (1, 128), (0, 1), (0, 128))]
    assert (f"sums at (32, 4) took {b1s['ms']:.3f} ms and at (128, 16) {b128s['ms']:.3f} ms, against {old[0]:.3f} and "
            f"{old[1]:.3f} ms with permutes at the launches in use. Along dim 0, permutes at (8, 4) took {b0p['ms']:.3f} ms "
            f"and at (128, 16) {b0128p['ms']:.3f} ms, against {old[2]:.3f} and {old[3]:.3f}") in log
    was = [ms(0, g, form, 16 if g == 1 else 128, 8 if g == 1 else 32)[0] for form in ("sums", "permutes") for g in (1, 128)]
    assert (f"along dim 0 took {was[0]:.2f} ms and {was[1]:.2f} ms with sums, against {was[2]:.2f} and {was[3]:.2f} ms "
            f"with permutes") in log
    readme = " ".join(_readme_and_fast_path().split())
    assert (f"({q[fused]['ms']:.3f} against {q0[fused]['ms']:.3f} ms, `quantize_speed-NVIDIA_H200-a6adc54.json`), but AdaHOP "
            f"in CUDA graphs fell to {s1['adahop']['speedup_vs_bf16']:.2f}× BF16 at 1b") in readme
    assert f"the same tree ran at {p1['adahop']['speedup_vs_bf16']:.2f}×" in readme
    assert f"also lost end to end ({t1['adahop']['speedup_vs_bf16']:.2f}×," in readme
    assert f"sums ran {was[0] / was[2]:.0f}× and {was[1] / was[3]:.0f}× slower at the launches in use" in readme
    for form, lines in (("permutes", ("5.94–7.59", "107–113", "64–80", "5.25–6.83", "160–188", "44–152")),
                        ("sums", ("8.31–9.59", "265–313", "104–113", "7.89–9.88", "849–956", "228–524"))):
        d = json.loads((res / f"kernels-sm90-fold-hadamard-axis0-{form}-triton36.json").read_text())
        assert d["triton"] == "3.6.0"
        for gr, (wi, sm, third) in ((1, lines[0:3]), (128, lines[3:6])):
            rs = [r for r in d["results"] if r["kernel"] == "mx_fold._fold_kernel" and r["constexprs"]["HAD"] == 32
                  and r["constexprs"]["GR"] == gr and "s_r" in r["specialized"]["equal_to_1"]]
            assert len(rs) == 5 and all(r["constexprs"]["SUMS"] == (form == "sums") for r in rs)
            span = lambda k, f="{}": f"{f.format(min(r[k] for r in rs))}–{f.format(max(r[k] for r in rs))}"
            assert span("warp_instructions_per_element", "{:.2f}") == wi and span("shared_memory_instructions") == sm
            assert span("registers" if gr == 1 else "spill_store_bytes") == third
            assert wi in log and sm in log and third in log


def test_mxfp4_pairs_kernel_build_record_is_what_the_log_says():
    """docs/LOG.md, session 19: the MXFP4 row kernel by even/odd elements against the one that packs by reshape and
    split, in the committed sm90 build (Triton 3.6) - fewer instructions per element, shared-memory instructions and
    shuffles, at the launch in use."""
    from fp4train.kernels.mx_quantize import MX1D_LAUNCH

    log = " ".join((ROOT / "docs/LOG.md").read_text().split())
    d = json.loads((ROOT / "bench/results/kernels-sm90-mx1d-pairs-triton36.json").read_text())
    assert d["triton"] == "3.6.0"
    spans = {}
    for kernel in ("_mx_kernel", "_mxfp4_pairs_kernel"):
        for sr in (False, True):
            rs = [r for r in d["results"] if r["kernel"] == f"mx_quantize.{kernel}" and r["constexprs"]["SR"] == sr
                  and r["constexprs"].get("ELEM", 0) == 0]
            assert rs and all((r["constexprs"]["BLOCKS"], r["num_warps"]) == MX1D_LAUNCH["mxfp4"] and r["spill_store_bytes"] == 0
                              for r in rs)
            span = lambda k, f="{}": f"{f.format(min(r[k] for r in rs))}–{f.format(max(r[k] for r in rs))}"  # noqa: E731
            spans[kernel, sr] = (span("warp_instructions_per_element", "{:.2f}"), span("shared_memory_instructions"), span("shuffles"))
    old_n, new_n = spans["_mx_kernel", False], spans["_mxfp4_pairs_kernel", False]
    old_s, new_s = spans["_mx_kernel", True], spans["_mxfp4_pairs_kernel", True]
    assert f"nearest: {new_n[0]} warp instructions per element against {old_n[0]}" in log
    assert f"SR: {new_s[0]} against {old_s[0]}" in log
    assert new_n[1] == new_s[1] == "19–19" and new_n[2] == "2–2" and old_n[1] == old_s[1] and old_n[2] == old_s[2]
    assert f"shared-memory instructions 19 against {old_n[1]}, shuffles 2 against {old_n[2]}, no spills" in log
    best = json.loads((ROOT / "bench/results/fold_sweep-NVIDIA_H200-680aa49.json").read_text())["best"]
    pairs, general = (best[f"tiles (MXFP4 32x32, nearest, pairs {p})"]["ms"] for p in (True, False))
    assert pairs > general and f"({pairs:.3f} against {general:.3f} ms, `fold_sweep-NVIDIA_H200-680aa49.json`" in log


def test_session_20_fold_table_and_figures_are_the_committed_h200_results():
    """docs/LOG.md and README, session 20: FOLD_LAUNCH_HADAMARD is each group's best of bench/fold_calls.py on AdaHOP's
    1b step; the end-to-end runs, the profile at train_speed's batch and the even/odd MXFP4 kernel's timings, as
    the files say."""
    import inspect

    from fp4train.kernels.mx_fold import FOLD_LAUNCH_HADAMARD
    from fp4train.kernels.mx_quantize import MX1D_LAUNCH, quantize_mxfp4

    res = ROOT / "bench/results"
    log = " ".join((ROOT / "docs/LOG.md").read_text().split())
    readme = " ".join(_readme_and_fast_path().split())
    fc = json.loads((res / "fold_calls-1b-adahop-NVIDIA_H200-e040beb.json").read_text())
    assert fc["gpu"] == "NVIDIA H200" and not fc.get("partial") and (fc["model"], fc["recipe"]) == ("1b", "adahop")
    assert sum(r["calls_per_step"] for r in fc["calls"]) == 205 and len(fc["calls"]) == 13
    groups = fc["groups"]
    # the table that ran end to end at b9fa87d: each group's best with the calls grouped by the axis argument (the file)
    by_axis = {(False, 1): (8, 4, "sums"), (False, 128): (128, 8, "permutes"), (True, 1): (16, 4, "permutes"), (True, 128): (128, 32, "permutes")}
    for (along_0, gr), (rb, nw, form) in by_axis.items():
        g = groups[f"along dim {0 if along_0 else 1}, {gr}x128, hadamard 32"]
        assert g["best"] == f"{form} rows {rb} warps {nw}", (along_0, gr)
        assert f"({g['calls_per_step']} calls)" in log
        if g["in_use_ms_per_step"] > g["best_ms_per_step"]:
            assert f"{g['in_use_ms_per_step']:.2f} in use" in log or f"{g['in_use_ms_per_step']:.2f} ms in use" in log
        assert f"{g['best_ms_per_step']:.2f}" in log
    # the table now: each group's best with the calls grouped by their reads (block dim strided or not), the same file
    fcm = _load("fold_calls")
    by_reads = fcm.group_totals(fc["calls"])
    for (reads_strided, gr), (rb, nw, form) in FOLD_LAUNCH_HADAMARD.items():
        g = by_reads[f"block dim {'strided' if reads_strided else 'contiguous'}, {gr}x128, hadamard 32"]
        assert g["best"] == f"{form} rows {rb} warps {nw}", (reads_strided, gr)
    views = [r for r in fc["calls"] if not r["along_dim_0"] and fcm.strided(r["strides"], False)]
    assert sum(r["calls_per_step"] for r in views) == 16 and all(r["shape"] == [2048, 16384] for r in views)
    v1 = {(t["butterfly"], t["rows_per_program"], t["num_warps"]): t["ms"] for t in next(r for r in views if r["group_rows"] == 1)["candidates"]}
    assert f"sums at (8, 4), {v1['sums', 8, 4]:.3f} ms, where permutes at (8, 4) take {v1['permutes', 8, 4]:.3f}" in log
    new_total = sum(g["best_ms_per_step"] for g in by_reads.values())
    assert f"{new_total:.2f} ms a step against {sum(g['best_ms_per_step'] for g in groups.values()):.2f}" in log
    for name, want in (("block dim contiguous, 1x128, hadamard 32", "sums at (16, 4), {:.2f}"),
                       ("block dim strided, 1x128, hadamard 32", "permutes at (8, 4), {:.2f}")):
        assert want.format(by_reads[name]["best_ms_per_step"]) in log
    d1 = groups["along dim 1, 1x128, hadamard 32"]["by_candidate"]
    assert f"Sums at (32, 4), the launch session 19's sweep picked, take {d1['sums rows 32 warps 4']:.2f}" in log
    perm = [v for k, v in d1.items() if k.startswith("permutes")]
    assert d1["sums rows 32 warps 4"] > max(perm) and f"than permutes at any launch ({min(perm):.1f}–{max(perm):.1f} ms a step)" in log
    use, best = (sum(g[k] for g in groups.values()) for k in ("in_use_ms_per_step", "best_ms_per_step"))
    assert f"In all {use:.2f} ms a step in use against {best:.2f} with each group's best" in log
    assert f"{use:.2f} ms a step at the launches in use, {best:.2f} with each group's best" in readme
    # against the memory floor (bench/fold_calls.py --explain, with the copy bandwidth of the same session's quantize_speed)
    copy = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]["copy"]["GBps"]
    fl = _load("fold_calls").floors(fc, copy)["per_step"]
    assert (f"memory floor of {fl['floor_ms']:.2f} ms a step" in log and f"{fl['call_best_ms']:.2f} ms with each call's own best launch" in log
            and f"{fl['group_best_ms'] / fl['floor_ms']:.1f}× the floor" in log)
    big = [r for r in fc["calls"] if r["shape"] == [16384, 8192] and not r["along_dim_0"]][0]
    ms = {(t["butterfly"], t["rows_per_program"], t["num_warps"]): t["ms"] for t in big["candidates"]}
    assert f"it is the fastest ({ms['sums', 32, 4]:.3f} ms against {ms['permutes', 16, 8]:.3f})" in log
    assert min(ms, key=ms.get) == ("sums", 32, 4) and big["calls_per_step"] == 6
    # end to end in CUDA graphs, BF16 in the same run
    run = lambda n: {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{n}.json").read_text())["results"]}  # noqa: E731
    n1, n3, o3, o1 = (run(n) for n in ("1b-reduce-overhead-b9fa87d", "3b-reduce-overhead-b9fa87d", "3b-reduce-overhead-b65d3f9",
                                       "1b-reduce-overhead-563fa59-permutes"))
    for new, old, model in ((n1, o1, "1b"), (n3, o3, "3b")):
        assert all(r["cudagraph_skips"] == 0 for r in (*new.values(), *old.values()))
    assert (f"**1.06×** ({n1['adahop']['step_ms']:.1f} ms a step against {n1['bf16']['step_ms']:.1f}" in log
            and f"{n1['adahop']['speedup_vs_bf16']:.2f}" == "1.06")
    assert f"it was 1.03× ({o1['adahop']['step_ms']:.1f} against {o1['bf16']['step_ms']:.1f}" in log
    assert (f"{o1['adahop']['step_ms'] - n1['adahop']['step_ms']:.1f} ms faster, against {use - best:.1f} ms that `fold_calls` "
            f"predicted, while BF16 moved {o1['bf16']['step_ms'] - n1['bf16']['step_ms']:.1f} ms") in log
    assert (f"**{n3['adahop']['speedup_vs_bf16']:.2f}×** ({n3['adahop']['step_ms']:.1f} against {n3['bf16']['step_ms']:.1f} ms" in log
            and f"{o3['adahop']['speedup_vs_bf16']:.2f}× ({o3['adahop']['step_ms']:.1f} against {o3['bf16']['step_ms']:.1f};" in log)
    assert (f"AdaHOP went from 1.03× to {n1['adahop']['speedup_vs_bf16']:.2f}× at 1b ({n1['adahop']['step_ms']:.1f} ms a step "
            f"against {n1['bf16']['step_ms']:.1f}) and from {o3['adahop']['speedup_vs_bf16']:.2f}×") in readme
    assert f"to {n3['adahop']['speedup_vs_bf16']:.2f}× at 3b (b9fa87d)" in readme
    assert f"Peak {n3['adahop']['peak_mem_gib']:.1f} GiB against BF16's {n3['bf16']['peak_mem_gib']:.1f} in both" in log
    assert f"{o3['adahop']['peak_mem_gib']:.1f}|{o3['bf16']['peak_mem_gib']:.1f}" == f"{n3['adahop']['peak_mem_gib']:.1f}|{n3['bf16']['peak_mem_gib']:.1f}"
    # the profile at 8 x 2048
    pr = json.loads((res / "profile_step/1b-H200-triton-adahop-8x2048-b2713c6.json").read_text())
    assert (pr["batch_size"], pr["seq_len"], pr["compile"]) == (8, 2048, True)
    p = {r["recipe"]: r for r in pr["results"]}
    b, a = p["bf16"], p["adahop"]
    assert f"GPU kernels {a['gpu_kernel_ms_per_step']:.1f} ms a step against BF16's {b['gpu_kernel_ms_per_step']:.1f}" in log
    assert (f"FP8 GEMMs {a['kinds']['gemm fp8']:.1f} ms plus {a['kinds']['gemm bf16']:.1f} of BF16 GEMMs (the outlier path, lm head) "
            f"against BF16's {b['kinds']['gemm bf16']:.1f} of GEMMs; fp4train's Triton kernels {a['kinds']['fp4train triton']:.1f} ms") in log
    k = {t["kernel"]: t for t in a["top"]}
    assert (f"`_fold_kernel` {k['_fold_kernel']['ms_per_step']:.1f} over {k['_fold_kernel']['launches_per_step']:.0f} launches" in log
            and f"`_mx_cols_kernel` {k['_mx_cols_kernel']['ms_per_step']:.1f}; `_packed_fold_kernel` "
                f"{k['_packed_fold_kernel']['ms_per_step']:.1f}" in log and f"`_hadamard_kernel` {k['_hadamard_kernel']['ms_per_step']:.1f}" in log)
    assert (f"attention {a['kinds']['attention']:.1f} against {b['kinds']['attention']:.1f}; inductor's kernels "
            f"{a['kinds']['inductor']:.1f} against {b['kinds']['inductor']:.1f}") in log
    assert (f"AdaHOP's kernels at {a['gpu_kernel_ms_per_step']:.1f} ms a step against BF16's {b['gpu_kernel_ms_per_step']:.1f}: its GEMMs "
            f"take {a['kinds']['gemm fp8'] + a['kinds']['gemm bf16']:.1f} ms against {b['kinds']['gemm bf16']:.1f}, and fp4train's "
            f"quantize/fold kernels {a['kinds']['fp4train triton']:.1f}") in readme
    # the even/odd MXFP4 row kernel, now the default
    assert inspect.signature(quantize_mxfp4).parameters["pairs"].default is True and MX1D_LAUNCH["mxfp4"] == (64, 4)
    q = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]
    for r in ("nearest", "stochastic"):
        assert q[f"triton mxfp4 {r} (even/odd)"]["ms"] < q[f"triton mxfp4 {r}"]["ms"]
    assert (f"nearest {q['triton mxfp4 nearest (even/odd)']['ms']:.3f} ms against {q['triton mxfp4 nearest']['ms']:.3f}, SR "
            f"{q['triton mxfp4 stochastic (even/odd)']['ms']:.3f} against {q['triton mxfp4 stochastic']['ms']:.3f}") in log
    assert f"({q['triton mxfp4 nearest (even/odd)']['ms']:.3f} against {q['triton mxfp4 nearest']['ms']:.3f} ms nearest in one run" in readme
    sw = {(r["group"], r["blocks_per_program"], r["num_warps"]): r["ms"]
          for r in json.loads((res / "fold_sweep-NVIDIA_H200-mx1d-b65d3f9.json").read_text())["results"]}
    eo = lambda r, bp, nw: sw[f"mx1d (mxfp4, {r}, even/odd)", bp, nw]  # noqa: E731
    gen = lambda r, bp, nw: sw[f"mx1d (mxfp4, {r})", bp, nw]  # noqa: E731
    assert (f"at `MX1D_LAUNCH`'s (64, 4) {eo('nearest', 64, 4):.3f} / {eo('stochastic', 64, 4):.3f} ms against "
            f"{gen('nearest', 64, 4):.3f} / {gen('stochastic', 64, 4):.3f}, and the general kernel's best launch (32, 4) takes "
            f"{gen('nearest', 32, 4):.3f} / {gen('stochastic', 32, 4):.3f}") in log
    for r in ("nearest", "stochastic"):  # the even/odd kernel at the launch in use beats the general one at every launch
        assert eo(r, 64, 4) < min(v for (g, _, _), v in sw.items() if g == f"mx1d (mxfp4, {r})")
    t = " ".join((res / "gpu-tests/pairs-b65d3f9.log").read_text().split())
    assert "29 passed" in t and "failed" not in t.lower() and "test_mxfp4_kernel_equals_reference" in t
    cut = (res / "gpu-tests/fold_hadamard-b2713c6-cut.log").read_text().splitlines()
    assert "cut by the 200 s limit (rc 124)" in cut[0] and sum(line.count(".") for line in cut[1:] if set(line) <= set(". [%]0123456789")) == 86
    assert "cut by its limit after 86 passed, none failed" in log
    # after the device time: torchao like for like, and the memory bound at 3b
    t = {x["target"]: x for x in json.loads((res / "summary.json").read_text())["targets"]}
    rate = lambda m, r: t[f"end to end {m}, {r}: tokens/s vs torchao_fp8_rowwise"]["measured"]  # noqa: E731
    # session 20's CUDA-graph rows (AdaHOP b9fa87d, tib2d b01c291) against torchao compiled by default
    e2e = json.loads((res / "summary.json").read_text())["e2e"]
    then = lambda m, r, c: {x["recipe"]: x for x in json.loads((res / f"e2e-h200/train_speed-{m}-reduce-overhead-{c}.json").read_text())["results"]}[r]["speedup_vs_bf16"]  # noqa: E731
    graphs = [then(m, r, c) / e2e[m]["torchao_fp8_rowwise"]["speedup_vs_bf16"] for m in ("1b", "3b") for r, c in (("adahop", "b9fa87d"), ("tib2d", "b01c291"))]
    like = [rate(m, r) for m in ("1b", "3b") for r in ("adahop", "tib2d")]
    assert f"and called them met ({min(graphs):.2f}–{max(graphs):.2f}×)" in log and f"we are behind it ({min(like):.2f}–{max(like):.2f}×)" in log
    bud = json.loads((res / "probes/activation_budget-3b.json").read_text())
    assert (f"counts {bud['quantized_inputs_bf16_gib']:.2f} GiB of BF16 inputs" in log and f"BF16's {bud['bf16_peak_gib']:.1f} GiB peak would "
            f"fall to {bud['floor_gib']:.1f} GiB, {bud['floor_ratio']:.2f}×" in log)


def test_fast_path_doc_is_the_committed_results():
    """docs/fast_path.md: each target's figure, the profile, the fold calls against their floor and the memory
    bound, as the committed files give them."""
    doc = " ".join((ROOT / "docs/fast_path.md").read_text().split())
    res = ROOT / "bench/results"
    summ = json.loads((res / "summary.json").read_text())
    t = {x["target"]: x for x in summ["targets"]}
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    gemm = t["FP4 GEMM at 8192^3 vs cuBLAS BF16"]["measured"]
    lin = {v: t[f"linear fwd+bwd at the Llama-3-8B shapes, {v}:triton:triton: speedup vs BF16 (geometric mean)"]["measured"] for v in ("mxfp4", "tib2d")}
    saved = {v: t[f"saved activation bytes, {v}:triton:triton: BF16 / quantized (min over the 8B shapes)"]["measured"] for v in ("mxfp4", "tib2d")}
    assert f"| 1.4× | {gemm:.2f}× | yes |" in doc
    assert f"mxfp4 {lin['mxfp4']:.2f}×, tib2d {lin['tib2d']:.2f}× | yes |" in doc
    assert f"{saved['mxfp4']:.1f}× (MXFP4), {saved['tib2d']:.1f}× (tib2d) | yes |" in doc
    e = lambda m, r, what="BF16": t[f"end to end {m}, {r}: tokens/s vs {what}"]["measured"]  # noqa: E731
    for m, goal in (("1b", "1.15×"), ("3b", "1.25×")):
        assert f"| end to end {m}, AdaHOP / tib2d (CUDA graphs) | {goal} | {e(m, 'adahop+cudagraphs'):.2f}× / {e(m, 'tib2d+cudagraphs'):.2f}× | no |" in doc
    peer = [e(m, f"{r}+cudagraphs", "torchao_fp8_rowwise") for m in ("1b", "3b") for r in ("adahop", "tib2d")]  # both in CUDA graphs
    ao = [summ["e2e"][m]["torchao_fp8_rowwise+cudagraphs"]["speedup_vs_bf16"] for m in ("1b", "3b")]
    assert all(p >= 1 for p in peer) and (f"in CUDA graphs, both: {peer[0]:.2f}× / {peer[1]:.2f}× at 1b, {peer[2]:.2f}× / {peer[3]:.2f}× "
                                          f"at 3b (torchao itself {ao[0]:.2f}× and {ao[1]:.2f}× BF16)") in doc
    assert all(t[f"end to end {m}, {r}+cudagraphs: tokens/s vs torchao_fp8_rowwise"]["met"] for m in ("1b", "3b") for r in ("adahop", "tib2d"))
    like = [e(m, r, "torchao_fp8_rowwise") for m in ("1b", "3b") for r in ("adahop", "tib2d")]  # both compiled by default
    assert all(p < 1 for p in like) and (f"compiled by default, both: {like[0]:.2f}× / {like[1]:.2f}× at 1b, {like[2]:.2f}× / {like[3]:.2f}× at 3b "
                                         "| yes in CUDA graphs; no compiled by default |") in doc
    assert f"gains nothing from CUDA graphs ({ao[0]:.2f}× at 1b, {ao[1]:.2f}× at 3b in them" in doc
    q = {k.removeprefix("quantize ").removesuffix(": fraction of copy bandwidth"): x["measured"] for k, x in t.items() if k.startswith("quantize triton")}
    assert f"| 60% | {pct(min(q.values()))[:-1]}–{pct(max(q.values()))} (the 1D MXFP4 kernel {pct(q['triton mxfp4 nearest'])}) | no |" in doc
    assert f"The block Hadamard kernel alone reaches {pct(q['triton hadamard 32'])}" in doc
    heavy = [q[k] for k in ("triton mxfp4 stochastic", "triton nvfp4 nearest (+amax)", "triton hadamard 32 + mxfp4 -> fp8 1x128 (fused)",
                            "triton mxfp8 stochastic")]
    assert f"are further off ({pct(min(heavy))[:-1]}–{pct(max(heavy))})" in doc
    mem = lambda m: t[f"end to end {m}, adahop+cudagraphs: peak memory BF16 / recipe (same batch)"]["measured"]  # noqa: E731
    assert f"| 1.3× lower | AdaHOP {mem('1b'):.2f}× at 1b, {mem('3b'):.2f}× at 3b | no |" in doc
    assert f"(AdaHOP {e('1b', 'adahop'):.2f}× at 1b, {e('3b', 'adahop'):.2f}× at 3b)" in doc
    # the profile
    p = {r["recipe"]: r for r in json.loads((res / "profile_step/1b-H200-triton-adahop-8x2048-b2713c6.json").read_text())["results"]}
    a, b = p["adahop"], p["bf16"]
    assert a["kernels_per_step"] > 2000
    assert f"takes {a['gpu_kernel_ms_per_step']:.1f} ms of GPU kernels against BF16's {b['gpu_kernel_ms_per_step']:.1f}" in doc
    assert (f"{a['kinds']['gemm fp8'] + a['kinds']['gemm bf16']:.1f} ms ({a['kinds']['gemm fp8']:.1f} of FP8 GEMMs, "
            f"{a['kinds']['gemm bf16']:.1f} of BF16 for the outlier path and the head) against BF16's {b['kinds']['gemm bf16']:.1f}") in doc
    fold = {k["kernel"]: k for k in a["top"]}["_fold_kernel"]["ms_per_step"]
    assert f"give {a['kinds']['fp4train triton']:.1f} ms of that back, {fold:.1f} of it in `_fold_kernel`" in doc
    g1 = {r["recipe"]: r for r in json.loads((res / "e2e-h200/train_speed-1b-reduce-overhead-6d232b9.json").read_text())["results"]}
    assert f"needs a step of about {g1['bf16']['step_ms'] / 1.15:.0f} ms in CUDA graphs, where the AdaHOP step now takes {g1['adahop']['step_ms']:.1f}" in doc
    g0 = {r["recipe"]: r for r in json.loads((res / "e2e-h200/train_speed-1b-reduce-overhead-b9fa87d.json").read_text())["results"]}
    assert (f"end to end it ran {g1['adahop']['step_ms']:.1f} ms against b9fa87d's {g0['adahop']['step_ms']:.1f} (BF16 "
            f"{g1['bf16']['step_ms']:.1f} against {g0['bf16']['step_ms']:.1f})") in doc
    # the fold calls against their floor
    fc = json.loads((res / "fold_calls-1b-adahop-NVIDIA_H200-e040beb.json").read_text())
    copy = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]["copy"]
    f = _load("fold_calls").floors(fc, copy["GBps"])
    s = f["per_step"]
    now = s["group_best_by_reads_ms"]
    assert "the 205 folds" in doc and (f"they take {s['group_best_ms']:.2f} ms a step at the launches measured end to end at b9fa87d "
                                       f"({s['in_use_ms']:.2f} at the former ones; {now:.2f} predicted for the table now in use, which "
                                       f"follows each call's reads), against a floor of {s['floor_ms']:.2f} ms") in doc
    x = [c["best_ms"] / c["floor_ms"] for c in f["calls"]]
    big = max(f["calls"], key=lambda c: c["floor_ms"] * (not c["along_dim_0"]))
    assert f"the largest call is at {big['best_ms'] / big['floor_ms']:.1f}× its floor" in doc and f"up to {max(x):.0f}× (64 programs" in doc
    worst = max(f["calls"], key=lambda c: c["best_ms"] / c["floor_ms"])
    assert (worst["shape"], worst["dtype"], worst["along_dim_0"], worst["group_rows"]) == ([512, 2048], "float32", True, 128)
    n, k = worst["shape"]  # along dim 0 the operand is x^T [k, n]: one program per 128x128 group, for 132 SMs
    assert f"up to {max(x):.0f}× ({(k // 128) * (n // 128)} programs for 132 SMs" in doc
    assert f"({s['call_best_ms']:.2f} against {now:.2f} ms a step predicted" in doc
    same = {}
    for c in f["calls"]:
        same.setdefault((tuple(c["shape"]), c["dtype"], c["group_rows"]), {})[c["along_dim_0"]] = c["best_ms"]
    ratio = max(v[True] / v[False] for v in same.values() if len(v) == 2)
    assert f"takes up to {ratio:.1f}× as long along dim 0 as along dim 1 on the same shape" in doc
    # the quantize kernel against copy, and its issue estimate from the sm90 build (warp instructions per element)
    qs = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]
    assert f"takes {qs['triton mxfp4 nearest (even/odd)']['ms']:.3f} ms against the copy's {copy['ms']:.3f} ms" in doc
    k = json.loads((res / "kernels-sm90-mx1d-pairs-triton36.json").read_text())
    wpe = [r["warp_instructions_per_element"] for r in k["results"] if r["kernel"] == "mx_quantize._mxfp4_pairs_kernel" and not r["constexprs"]["SR"]]
    spec = importlib.util.spec_from_file_location("aot_check", ROOT / "scripts/aot_check.py")
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    issue_ms = aot.issue_bound_ms(max(wpe), 16384 * 8192)  # what `aot_check.py --issue-ms RECORD` prints
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert aot.main(["--issue-ms", str(res / "kernels-sm90-mx1d-pairs-triton36.json")]) == 0
    assert f"{max(wpe):.2f} per element: {issue_ms:.3f} ms" in printed.getvalue()
    assert f"about {max(wpe):.1f} warp instructions per element nearest" in doc and f"is about {issue_ms:.2f} ms" in doc
    # the bytes it moves at the issue-bound and ALU-bound times, against the copy's bandwidth (the target's measure)
    nbytes = 16384 * 8192 * (2 + 1 / 2 + 1 / 32)
    pipes = [r for r in json.loads((res / "kernels-sm90-pipes-triton36.json").read_text())["results"]
             if r["kernel"] == "mx_quantize._mxfp4_pairs_kernel" and not r["constexprs"]["SR"] and not r["constexprs"]["CEIL"]
             and r["constexprs"]["BF16_PAIRS"]]  # what ran on the BF16 tensor (ncu: 47 registers, as this build)
    alu_ms = aot.issue_bound_ms(pipes[0]["pipe_cycles_per_element"]["alu"], 16384 * 8192)
    frac = lambda ms: nbytes / (ms * 1e-3) / (copy["GBps"] * 1e9)  # noqa: E731
    assert f"cap it at {pct(frac(issue_ms))} of copy's bandwidth (at the {nbytes / 1e6:.0f} MB it moves)" in doc
    assert f"caps it lower, at {alu_ms:.3f} ms or {pct(frac(alu_ms))}" in doc and frac(alu_ms) < 0.6
    ncu = {r["case"]: r for r in json.loads((res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.json").read_text())["cases"]}
    eo = ncu["mxfp4 even/odd 16384x8192"]
    need = nbytes / (0.6 * copy["GBps"] * 1e9) * 1e3  # ms for 60%
    use = alu_ms / (eo["duration_us"] / 1e3)  # the ALU pipe's share of the measured kernel time
    assert f"60% ({need:.3f} ms) needs about a third fewer ALU instructions per element at the pipe's measured {pct(use)} use" in doc
    assert 0.6 < need * use / alu_ms < 0.72  # "about a third fewer"
    # the memory bound
    for m in ("1b", "3b"):
        bud = json.loads((res / f"probes/activation_budget-{m}.json").read_text())
        assert f"from {bud['bf16_peak_gib']:.1f} to {bud['floor_gib']:.1f} GiB ({bud['floor_ratio']:.2f}×)" in doc
        assert bud["quantized_inputs_bf16_gib"] == {"1b": 6.0, "3b": 12.25}[m]
        ada = summ["e2e"][m]["adahop+cudagraphs"]["peak_mem_gib"]
        assert ada < bud["floor_gib"]  # AdaHOP's peak is past the bound
    assert "6.0 GiB at 1b, 12.25 GiB at 3b" in doc and "(29.2 and 69.9 GiB) are already past those bounds" in doc


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernels run on a GPU or under Triton's interpreter")
def test_ncu_cases_probe_runs_every_case():
    """scripts/probes/ncu_cases.py (for Nsight Compute on the device): every case runs, at small shapes here."""
    spec = importlib.util.spec_from_file_location("ncu_cases", ROOT / "scripts/probes/ncu_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ran = mod.main(["--small"])
    assert len(ran) == 4 + len(mod.FOLD_CASES) and sum(n.startswith("fold") for n in ran) == 5
    assert mod.main(["--small", "--only", "copy,SR"]) == ["copy 16384x8192", "mxfp4 even/odd SR 16384x8192"]


def test_summary_rates_against_torchao_only_like_for_like():
    """A recipe's figure in CUDA graphs against torchao compiled by default is a figure without a verdict; with
    torchao also run in CUDA graphs, it is against that run."""
    mod = _load("summary")
    meta = {"gpu": "NVIDIA H200", "date": "2026-12-01", "commit": "abc1234"}
    default = {**meta, "model": "1b", "results": [{"recipe": "bf16", "tokens_per_s": 100.0}, {"recipe": "adahop", "tokens_per_s": 90.0},
                                                  {"recipe": "torchao_fp8_rowwise", "tokens_per_s": 95.0}]}
    graphs = {**meta, "model": "1b", "compile_mode": "reduce-overhead",
              "results": [{"recipe": "bf16", "tokens_per_s": 100.0}, {"recipe": "adahop", "tokens_per_s": 110.0}]}
    t = {x["target"]: x for x in mod.build([default, graphs], None, None, None)["targets"]}
    x = t["end to end 1b, adahop+cudagraphs: tokens/s vs torchao_fp8_rowwise"]
    assert x["measured"] == pytest.approx(1.1 / 0.95) and x["met"] is None and x["note"].startswith("not like for like")
    assert t["end to end 1b, adahop: tokens/s vs torchao_fp8_rowwise"]["met"] is False  # 0.90 / 0.95, like for like
    peer_graphs = {**graphs, "results": graphs["results"] + [{"recipe": "torchao_fp8_rowwise", "tokens_per_s": 120.0}]}
    t = {x["target"]: x for x in mod.build([default, peer_graphs], None, None, None)["targets"]}
    x = t["end to end 1b, adahop+cudagraphs: tokens/s vs torchao_fp8_rowwise"]
    assert x["measured"] == pytest.approx(1.1 / 1.2) and x["met"] is False and "note" not in x
    md = mod.markdown(mod.build([default, graphs], None, None, None))
    assert "| end to end 1b, adahop+cudagraphs: tokens/s vs torchao_fp8_rowwise | 1.00 | 1.16 | not like for like |" in md


def test_ncu_table_and_the_compute_bound_reading_are_the_committed_h200_results():
    """scripts/probes/ncu_table.py makes the committed JSON from the committed ncu CSV, and docs/fast_path.md's
    reading of it (compute-bound, the ALU pipe) is what that file and the sm90 pipe counts say."""
    nt = _load_probe("ncu_table")
    res = ROOT / "bench/results"
    copy = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]["copy"]["GBps"]
    d = nt.read(res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.csv.gz", round(copy, 1))
    committed = json.loads((res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.json").read_text())
    assert d == committed and len(d["cases"]) == 8
    doc = (ROOT / "docs/fast_path.md").read_text()
    for row in nt.table(d).splitlines()[2:]:
        assert row in doc, row
    flat = " ".join(doc.split())
    c = {r["case"]: r for r in d["cases"]}
    act = [r for r in d["cases"] if not r["case"].startswith("fold W")]
    w = [r for r in d["cases"] if r["case"].startswith("fold W")]
    rng = lambda key, rows, f="{:.0f}": f"{f.format(min(r[key] for r in rows))}–{f.format(max(r[key] for r in rows))}"  # noqa: E731
    assert f"run their SMs at {rng('sm_pct', act)}% of peak and DRAM at {rng('dram_pct', act)}%" in flat
    assert all(r["sm_pct"] > 2 * r["dram_pct"] for r in act)  # compute-bound, not memory-bound
    assert f"issues {rng('issue_per_cycle', act, '{:.2f}')} warp instructions a cycle" in flat
    eo = c["mxfp4 even/odd 16384x8192"]
    rec = [r for r in json.loads((res / "kernels-sm90-pipes-triton36.json").read_text())["results"]
           if r["kernel"] == "mx_quantize._mxfp4_pairs_kernel" and not any(r["constexprs"][k] for k in ("SR", "CEIL")) and r["constexprs"]["BF16_PAIRS"]][0]
    assert rec["registers"] == eo["registers"]  # the build that ran (BF16 loaded as pairs)
    assert abs(eo["warp_instructions_per_element"] - rec["warp_instructions_per_element"]) < 0.05  # dynamic = static
    assert (f"({eo['warp_instructions_per_element']:.2f} warp instructions per element for the even/odd kernel) is what its sm90 "
            f"build holds ({rec['warp_instructions_per_element']:.2f},") in flat
    alu_share = rec["pipe_cycles_per_element"]["alu"] / 2 / rec["warp_instructions_per_element"]
    assert f"{100 * alu_share:.0f}% of those are integer ALU instructions" in flat
    aot = _load_script("aot_check")
    alu_ms = aot.issue_bound_ms(rec["pipe_cycles_per_element"]["alu"], 16384 * 8192)
    assert f"the ALU alone needs {alu_ms:.3f} ms on this tensor against the measured {eo['duration_us'] / 1e3:.3f}" in flat
    assert f"ncu's SM throughput for it, {eo['sm_pct']:.0f}%, is that pipe" in flat and abs(alu_ms / (eo["duration_us"] / 1e3) - eo["sm_pct"] / 100) < 0.05
    m, k = c["fold dY/X along M [16384, 2048] bfloat16"], c["fold X along K [16384, 2048] bfloat16"]
    assert f"({m['warp_instructions_per_element']:.2f} against {k['warp_instructions_per_element']:.2f})" in flat
    assert (f"small grids ({rng('blocks', w)} programs), {rng('registers', w)} registers with local-memory spills and "
            f"{rng('achieved_occupancy_pct', w)}% occupancy leave them latency-bound (SM {rng('sm_pct', w)}%)") in flat
    assert all(r["local_spill_requests"] > 0 for r in w)


def test_aot_pipe_cycles_count_each_pipe_at_its_rate():
    """scripts/aot_check.py's pipe count: integer ALU and integer multiply-add instructions hold their pipe two
    cycles, FP32 arithmetic one, conversions eight; loads, stores and branches count in no pipe."""
    aot = _load_script("aot_check")
    ops = ["LOP3", "SHF", "ISETP", "SEL", "IMAD", "FFMA", "FADD", "F2F", "LDG", "STG", "BRA", "EXIT"]
    assert aot.pipe_cycles(ops) == {"alu": 8, "fma_int": 2, "fma": 2, "xu": 8}
    assert aot.pipe_cycles([]) == {"alu": 0, "fma_int": 0, "fma": 0, "xu": 0}
    sets = [names for _, names in aot.SASS_PIPES.values()]
    assert sum(map(len, sets)) == len(set().union(*sets))  # each opcode in one pipe


def test_session_21_log_is_the_committed_h200_results():
    """docs/LOG.md's session 21: the CUDA-graph runs with torchao, the reads-keyed table against b9fa87d's, ncu's rows."""
    log = " ".join((ROOT / "docs/LOG.md").read_text().split("## 2026-12-01 — session 21")[1].split())
    res = ROOT / "bench/results"
    run = lambda name: {r["recipe"]: r for r in json.loads((res / f"e2e-h200/train_speed-{name}.json").read_text())["results"]}  # noqa: E731
    a1, t1, b1 = run("1b-reduce-overhead-6d232b9"), run("1b-reduce-overhead-6d232b9-torchao"), run("1b-reduce-overhead-6d232b9-b")
    a3, b3 = run("3b-reduce-overhead-6d232b9"), run("3b-reduce-overhead-6d232b9-b")
    x = lambda r, runs: f"{r['speedup_vs_bf16']:.2f}× ({r['step_ms']:.1f}"  # noqa: E731
    assert (f"| 1b | {a1['bf16']['step_ms']:.1f} / {t1['bf16']['step_ms']:.1f} / {b1['bf16']['step_ms']:.1f} | "
            f"{x(a1['adahop'], a1)} ms) | {x(b1['tib2d'], b1)}) | {x(t1['torchao_fp8_rowwise'], t1)}) | {x(b1['mxfp4'], b1)}) |") in log
    assert (f"| 3b | {a3['bf16']['step_ms']:.1f} / {b3['bf16']['step_ms']:.1f} | {x(a3['adahop'], a3)}) | {x(b3['tib2d'], b3)}) | "
            f"{x(a3['torchao_fp8_rowwise'], a3)}) | not run |") in log
    o1, o3 = run("1b-reduce-overhead-b9fa87d"), run("3b-reduce-overhead-b9fa87d")
    assert (f"AdaHOP took {a1['adahop']['step_ms']:.1f} ms a step at 1b against {o1['adahop']['step_ms']:.1f} at b9fa87d (BF16 "
            f"{a1['bf16']['step_ms']:.1f} against {o1['bf16']['step_ms']:.1f}), and {a3['adahop']['step_ms']:.1f} against "
            f"{o3['adahop']['step_ms']:.1f} at 3b (BF16 {a3['bf16']['step_ms']:.1f} against {o3['bf16']['step_ms']:.1f})") in log
    for r in json.loads((res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.json").read_text())["cases"]:
        if r["case"] in ("mxfp4 even/odd 16384x8192", "fold X along K [16384, 2048] bfloat16"):
            assert (f"| {r['duration_us']:.1f} | {r['x_floor']:.1f} | {r['sm_pct']:.0f} | {r['dram_pct']:.0f} | {r['achieved_occupancy_pct']:.0f} | "
                    f"{r['registers']:.0f} | {r['issue_per_cycle']:.2f} | {r['warp_instructions_per_element']:.2f} |") in log
    q = json.loads((res / "quantize_speed-NVIDIA_H200-b65d3f9.json").read_text())["results"]
    assert f"the even/odd kernel 0.219 against {q['triton mxfp4 nearest (even/odd)']['ms']:.3f} ms" in log
    fc = json.loads((res / "fold_calls-1b-adahop-NVIDIA_H200-e040beb.json").read_text())["calls"]
    call = next(c for c in fc if c["shape"] == [16384, 2048] and not c["along_dim_0"] and c["group_rows"] == 1)
    ev = next(c["ms"] for c in call["candidates"] if (c["rows_per_program"], c["num_warps"], c["butterfly"]) == (16, 4, "sums"))
    nc = {r["case"]: r for r in json.loads((res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.json").read_text())["cases"]}["fold X along K [16384, 2048] bfloat16"]
    assert f"activation fold along dim 1 {nc['duration_us'] / 1e3:.3f} against {ev:.3f} ms" in log and nc["duration_us"] / 1e3 < ev
    assert (f"(BF16 itself moved {a1['bf16']['step_ms'] - o1['bf16']['step_ms']:.0f} and "
            f"{a3['bf16']['step_ms'] - o3['bf16']['step_ms']:.0f} ms)") in log
    # fast_path.md: the 1D kernel's bandwidth at ncu's kernel time, and the range ahead of torchao in CUDA graphs
    doc = " ".join((ROOT / "docs/fast_path.md").read_text().split())
    eo = {r["case"]: r for r in json.loads((res / "ncu/ncu_cases-NVIDIA_H200-6d232b9.json").read_text())["cases"]}["mxfp4 even/odd 16384x8192"]
    at_ncu = eo["bytes"] / (eo["duration_us"] * 1e-6) / (q["copy"]["GBps"] * 1e9)
    assert f"At ncu's time the 1D kernel moves its bytes at {100 * at_ncu:.0f}% of copy's bandwidth" in doc
    t = {x["target"]: x["measured"] for x in json.loads((res / "summary.json").read_text())["targets"]}
    ahead = [t[f"end to end {m}, {r}+cudagraphs: tokens/s vs torchao_fp8_rowwise"] for m in ("1b", "3b") for r in ("adahop", "tib2d")]
    assert f"ahead of it at both sizes ({min(ahead):.2f}–{max(ahead):.2f}×)" in doc and min(ahead) > 1
