"""AdaHOP core: pattern detector, FOID, the outlier-extraction GEMM, the rule table."""

import json
from pathlib import Path

import pytest
import torch

from fp4train.adahop import (
    DEFAULT_RULES, PLAIN_RULES, WITH_PLAIN, Extraction, Pattern, Relative, Strategy, classify, derive_rules, foid,
    gemm_pair, oe_gemm, outlier_ratios, relative, rules_for, split, strategy_gemm,
)
from fp4train.adahop.strategy import iht_gemm

ROOT = Path(__file__).resolve().parent.parent


def _planted(kind, rows=256, cols=512, n=3, scale=30.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g)
    idx = torch.randperm(rows if kind == "row" else cols, generator=g)[:n]
    if kind == "row":
        t[idx] *= scale
    elif kind == "column":
        t[:, idx] *= scale
    return t, idx.sort().values


@pytest.mark.parametrize("seed", range(5))
def test_detector_classifies_planted_patterns(seed):
    assert classify(_planted("row", seed=seed)[0]) is Pattern.ROW
    assert classify(_planted("column", seed=seed)[0]) is Pattern.COLUMN
    assert classify(_planted("none", seed=seed)[0]) is Pattern.NONE
    heavy = torch.distributions.StudentT(3.0).sample((512, 512))
    assert classify(heavy) is Pattern.NONE  # heavy tails alone are not a pattern
    assert classify(_planted("row", scale=3.0, seed=seed)[0]) is Pattern.NONE  # below the threshold


def test_ratios_and_bad_shapes():
    rr, cr = outlier_ratios(_planted("column", scale=30.0)[0])
    assert cr > 10 and rr < 3
    with pytest.raises(ValueError, match="2D tensors"):
        classify(torch.randn(2, 3, 4))


def test_relative_patterns_follow_the_gemm_orientation():
    # X with outlier channels (columns): inner for fprop (along K), outer for wgrad (rows of X^T)
    p = {"X": Pattern.COLUMN, "W": Pattern.ROW, "dY": Pattern.ROW}
    assert gemm_pair(p, "fprop") == (Relative.INNER, Relative.OUTER)
    assert gemm_pair(p, "dgrad") == (Relative.OUTER, Relative.INNER)  # W rows are along N, dgrad's inner dim
    assert gemm_pair(p, "wgrad") == (Relative.INNER, Relative.OUTER)  # dY token rows are along M, wgrad's inner dim
    assert relative(Pattern.NONE, True) is Relative.NONE


@pytest.mark.parametrize("axis", [0, 1])
def test_foid_finds_planted_outliers(axis):
    t, idx = _planted("row" if axis == 0 else "column", n=5, scale=10.0, seed=3)
    assert torch.equal(foid(t, 5, axis=axis), idx)
    assert foid(t, 0, axis=axis).numel() == 0 and foid(t, 10_000, axis=axis).numel() == t.shape[axis]


@pytest.mark.parametrize("overlap", [0, 2, 4])
def test_both_inner_patterns_extract_the_union_of_channels_once(overlap):
    """Both operands with an inner pattern: the rank update runs over the union of their channels, each once,
    made without torch.unique (a host sync that a CUDA-graph capture refuses): a channel both pick is kept twice,
    sorted, and its repeat's columns are zeroed - the same product as the deduplicated index set."""
    from fp4train.adahop.strategy import extraction_for

    g = torch.Generator().manual_seed(overlap)
    a, b = torch.randn(48, 256, generator=g), torch.randn(40, 256, generator=g)
    ca = [10, 20, 30, 40]
    cb = ca[:overlap] + [100, 120, 140, 160][:4 - overlap]  # `overlap` channels in common
    a[:, ca] *= 40
    b[:, cb] *= 40
    ext = extraction_for(a, b, Relative.INNER, Relative.INNER, 4)
    union = sorted(set(ca) | set(cb))
    assert ext.inner.tolist() == sorted(ca + cb)  # both sets, sorted, repeats kept
    kept = ext.inner[~ext.inner_repeat]
    assert kept.tolist() == union and int(ext.inner_repeat.sum()) == len(ca) + len(cb) - len(union)
    exact = lambda x, y: x @ y.T  # noqa: E731 - nothing quantized: the decomposition is the product itself
    dedup = Extraction(inner=torch.tensor(union))
    torch.testing.assert_close(oe_gemm(a.double(), b.double(), ext, exact), oe_gemm(a.double(), b.double(), dedup, exact),
                               rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(oe_gemm(a.double(), b.double(), ext, exact), (a.double() @ b.double().T).float(),
                               rtol=1e-6, atol=1e-3)
    got, ref = oe_gemm(a, b, ext, iht_gemm), oe_gemm(a, b, dedup, iht_gemm)  # the same residual, quantized
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_oe_gemm_equals_the_dense_emulated_decomposition_and_slices_are_exact():
    a, _ = _planted("column", rows=64, cols=128, n=2, seed=1)
    b, _ = _planted("row", rows=96, cols=128, n=2, seed=2)
    ext = Extraction(a_rows=torch.tensor([3, 7]), b_rows=torch.tensor([5]), inner=torch.tensor([10, 20, 30]))
    got = oe_gemm(a, b, ext, iht_gemm)
    # dense: residual through the same quantized path, the rest written out entry by entry
    a_res, a_row, a_col = split(a, ext.a_rows, ext.inner)
    b_res, b_row, b_col = split(b, ext.b_rows, ext.inner)
    assert torch.equal(a_row, a[ext.a_rows]) and torch.equal(a_col, a[:, ext.inner]) and torch.equal(b_row, b[ext.b_rows])
    assert (a_res[ext.a_rows] == 0).all() and (a_res[:, ext.inner] == 0).all()
    expect = iht_gemm(a_res, b_res) + a[:, ext.inner] @ b[:, ext.inner].T
    expect[ext.a_rows] = a[ext.a_rows] @ b.T
    expect[:, ext.b_rows] = a @ b[ext.b_rows].T
    assert torch.equal(got, expect)
    # with nothing quantized the decomposition is exact
    exact = oe_gemm(a.double(), b.double(), ext, lambda x, y: x @ y.T)
    torch.testing.assert_close(exact, (a.double() @ b.double().T).float(), rtol=1e-6, atol=1e-4)


def test_strategies_rank_as_expected_on_planted_inner_outliers():
    a, _ = _planted("column", rows=128, cols=256, n=3, scale=40.0)
    b = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))  # seeded: the test must not depend on earlier tests
    ref = a.double() @ b.double().T

    def err(s):
        return float((strategy_gemm(a, b, s, Relative.INNER, Relative.NONE).double() - ref).norm() / ref.norm())

    assert err(Strategy.OE) < err(Strategy.IHT) < err(Strategy.PLAIN)


def test_default_rules_are_derived_from_the_committed_measurements():
    from fp4train.adahop.strategy import merge_rules

    planted = json.loads((ROOT / "bench/results/adahop_pattern_pairs.json").read_text())["results"]
    real = json.loads((ROOT / "bench/results/analyze-60m-enwiki/analysis.json").read_text())["pattern_pairs"]
    assert merge_rules(real, planted) == DEFAULT_RULES
    assert merge_rules(real, planted, strategies=WITH_PLAIN) == PLAIN_RULES
    assert len(DEFAULT_RULES) == len(PLAIN_RULES) == 9
    # AdaHOP chooses between its two strategies only; plain MXFP4 is the named variant's
    assert set(DEFAULT_RULES.values()) == {Strategy.IHT, Strategy.OE} and Strategy.PLAIN in PLAIN_RULES.values()
    assert rules_for(("oe", "iht")) is DEFAULT_RULES and rules_for(WITH_PLAIN) is PLAIN_RULES
    with pytest.raises(ValueError, match="use calibrate='measured'"):
        rules_for(("plain",))
    # a cheaper strategy wins within the tolerance
    row = {"a": "none", "b": "none", "err_plain": 0.105, "err_iht": 0.1, "err_oe": 0.1}
    assert derive_rules([row], strategies=WITH_PLAIN)[(Relative.NONE, Relative.NONE)] is Strategy.PLAIN
    assert derive_rules([row])[(Relative.NONE, Relative.NONE)] is Strategy.IHT
    row["err_plain"] = 0.2
    assert derive_rules([row], strategies=WITH_PLAIN)[(Relative.NONE, Relative.NONE)] is Strategy.IHT
