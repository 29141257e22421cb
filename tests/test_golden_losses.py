"""Every preset trains the tiny model for a few steps on the CPU to its committed golden losses, bit for bit, so that a
change of numerics is always a decision, never an accident (``golden_losses.py`` says how they are made and
rewritten: ``python tests/golden_losses.py``)."""

import json

import pytest
import torch
from golden_losses import GOLDEN, STEPS, band, golden_run, golden_set, machine_key

import fp4train

PRESETS = sorted(r.name for r in fp4train.recipes.PRESETS)  # not a recipe another test registered
REGENERATE = "if the numerics changed on purpose, rewrite the golden values (python tests/golden_losses.py) and commit them"


@pytest.fixture(scope="module")
def golden():
    assert GOLDEN.exists(), f"{GOLDEN} is missing: python tests/golden_losses.py"
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("recipe", PRESETS)
def test_every_preset_trains_to_its_golden_losses(recipe, golden, tmp_path):
    """On every machine, within the band the committed sets span (:func:`band`); on a machine with a set of its own
    (this PyTorch build, instruction set and CPU vendor), bit for bit."""
    got = golden_run(recipe, tmp_path)
    lows, highs = band(golden["losses"], recipe)
    flat = got["train"] + [got["val"]]
    outside = [(i, v, lo, hi) for i, (v, lo, hi) in enumerate(zip(flat, lows, highs)) if not lo <= v <= hi]
    assert not outside, (f"{recipe}'s losses left the band of every platform measured (step, loss, low, high): {outside}; "
                         f"{REGENERATE}")
    values = golden_set(golden["losses"].get(torch.__version__, {}))
    if values is not None and recipe in values:  # this machine's own set: the same bits
        assert got == values[recipe], f"{recipe}'s losses changed on {machine_key()}: {REGENERATE}"


def test_the_golden_values_cover_every_preset_and_tell_them_apart(golden):
    assert golden["steps"] == STEPS and "2.13.0+cpu" in golden["losses"]  # CI's PyTorch
    for version, sets in golden["losses"].items():
        # another build's or vendor's sets may lag a numerics change (they are rewritten on such a machine); every
        # preset has CI's PyTorch's sets of at least one vendor, at every instruction set measured
        for values in sets.values():
            assert set(values) <= set(PRESETS)
    ci = golden["losses"]["2.13.0+cpu"]
    assert any(all(sorted(v) == PRESETS for k, v in ci.items() if k.endswith("/" + vendor))
               for vendor in {k.split("/")[-1] for k in ci})
    for values in (v for sets in golden["losses"].values() for v in sets.values()):
        finals = {r: v["train"][-1] for r, v in values.items()}
        assert len(set(finals.values())) == len(finals), finals  # every recipe's numerics show in its losses
        assert all(len(v["train"]) == STEPS for v in values.values())


def test_the_band_holds_every_committed_set_and_is_narrower_than_the_recipes_differences(golden):
    for recipe in PRESETS:
        lows, highs = band(golden["losses"], recipe)
        for sets in golden["losses"].values():
            for values in sets.values():
                if recipe in values:
                    flat = values[recipe]["train"] + [values[recipe]["val"]]
                    assert all(lo <= v <= hi for v, lo, hi in zip(flat, lows, highs))
        assert max((hi - lo) / lo for lo, hi in zip(lows, highs)) < 0.03  # a band, not anything goes
    lows, highs = band(golden["losses"], "fullstack_qadamw")
    assert highs[-1] < band(golden["losses"], "bf16")[0][-1]  # a recipe whose losses differ falls outside another's band
