"""The benchmark scripts run (small sizes) and measure what they claim."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    readme = (ROOT / "README.md").read_text()
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
    readme = (ROOT / "README.md").read_text()
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
    assert f"mxfp4 {fast['mxfp4']:,.0f} vs BF16 {fast['bf16']:,.0f}" in readme
    ratios = [fast[r] / fast["bf16"] for r in fast if r != "bf16"]
    assert f"{min(ratios):.2f}–{max(ratios):.2f}× BF16" in readme
    assert f"{1 / max(ratios):.1f}–{1 / min(ratios):.1f}× slower" in readme


def test_adahop_numbers_in_docs_are_the_committed_analysis():
    d = ROOT / "bench/results/analyze-60m-enwiki"
    an = json.loads((d / "analysis.json").read_text())
    rs = json.loads((d / "rescored.json").read_text())
    readme, doc = (ROOT / "README.md").read_text(), (ROOT / "docs/adahop.md").read_text()
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
