"""fp4train compare --across: each recipe's gap to BF16 against model size, from finished comparisons."""

import json

import pytest

from fp4train.cli import main
from fp4train.train.size_report import size_report


def _comparison(folder, model, params, tokens, gaps):
    """A finished comparison's report.json: ``gaps`` {recipe: (mean, ci95 or None)}."""
    folder.mkdir(parents=True)
    recipes = {"bf16": {"gap_pct_mean": 0.0, "gap_pct_ci95": None}}
    recipes.update({r: {"gap_pct_mean": m, "gap_pct_ci95": ci, "baseline": "bf16"} for r, (m, ci) in gaps.items()})
    rep = {"model": model, "tokens_per_run": tokens, "seeds": [0, 1, 2], "recipes": recipes,
           "runs": [{"recipe": "bf16", "seed": s, "params": params} for s in (0, 1, 2)]}
    (folder / "report.json").write_text(json.dumps(rep))
    return folder


def test_trends_are_read_from_the_intervals_at_the_smallest_and_largest_size(tmp_path):
    big = _comparison(tmp_path / "big", "60m", 60e6, 1.2e9, {"a": (1.5, [1.0, 2.0]), "b": (0.2, [0.0, 0.4]),
                                                             "c": (0.6, [0.1, 1.1]), "d": (0.3, None)})
    small = _comparison(tmp_path / "small", "20m", 20e6, 0.4e9, {"a": (0.3, [0.1, 0.5]), "b": (1.2, [0.9, 1.5]),
                                                                "c": (0.5, [0.2, 0.8]), "d": (0.4, [0.1, 0.7])})
    rep = size_report([big, small], tmp_path / "out")  # any order: sorted by parameters
    assert [s["model"] for s in rep["sizes"]] == ["20m", "60m"]
    trend = {r: x["trend"].split(" ")[0] for r, x in rep["recipes"].items()}
    assert trend == {"a": "grows", "b": "shrinks", "c": "holds", "d": "no"}
    assert rep["ranking"] == {"20m": ["a", "d", "c", "b"], "60m": ["b", "d", "c", "a"]} and not rep["same_ranking"]
    md = (tmp_path / "out" / "across_sizes.md").read_text()
    assert "| a | +0.30 [+0.10, +0.50] | +1.50 [+1.00, +2.00] | grows" in md
    assert "Tokens per parameter: 20m 20.00, 60m 20.00." in md  # the same budget per parameter: no warning
    assert (tmp_path / "out" / "gap_vs_size.png").read_bytes()[:4] == b"\x89PNG"


def test_across_warns_of_budgets_that_differ_and_refuses_bad_input(tmp_path, capsys):
    a = _comparison(tmp_path / "a", "20m", 20e6, 20e6, {"x": (0.5, [0.1, 0.9])})
    b = _comparison(tmp_path / "b", "60m", 60e6, 5e6, {"x": (0.4, [0.0, 0.8])})
    assert main(["compare", "--across", f"{a},{b}", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "mixes model size with training budget" in out and "x | +0.50 [+0.10, +0.90] | +0.40 [+0.00, +0.80] | holds" in out
    assert main(["compare", "--across", f"{a},{b}", "--recipes", "bf16,nvfp4", "--out", str(tmp_path / "o2")]) == 2
    assert "--across reads finished comparisons and trains nothing: leave out recipes" in capsys.readouterr().err
    assert main(["compare", "--across", f"{a},{b}", "--lr", "0.01", "--out", str(tmp_path / "o3")]) == 2
    assert "leave out lr" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no report.json"):
        size_report([a, tmp_path / "missing"], tmp_path / "o4")
    with pytest.raises(ValueError, match="two or more"):
        size_report([a], tmp_path / "o5")
