"""Every preset trains the tiny model for a few steps on the CPU to its committed golden losses, bit for bit, so that a
change of numerics is always a decision, never an accident (``golden_losses.py`` says how they are made and
rewritten: ``python tests/golden_losses.py``)."""

import json

import pytest
import torch
from golden_losses import GOLDEN, STEPS, golden_run, golden_set, machine_key

import fp4train

REGENERATE = "if the numerics changed on purpose, rewrite the golden values (python tests/golden_losses.py) and commit them"


@pytest.fixture(scope="module")
def golden():
    assert GOLDEN.exists(), f"{GOLDEN} is missing: python tests/golden_losses.py"
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("recipe", fp4train.recipes.names())
def test_every_preset_trains_to_its_golden_losses(recipe, golden, tmp_path):
    values = golden_set(golden["losses"].get(torch.__version__, {}))
    if values is None:  # the values are a property of one PyTorch build and CPU: CI's are in the file
        pytest.skip(f"no golden values for torch {torch.__version__} on {machine_key()} (the file has "
                    f"{', '.join(f'{v}: {sorted(c)}' for v, c in golden['losses'].items())}); python tests/golden_losses.py adds them")
    if recipe not in values:  # a preset added, or its numerics changed, since this build's values were made
        pytest.skip(f"no golden values for {recipe} on torch {torch.__version__} (changed since they were made): "
                    "python tests/golden_losses.py with this PyTorch adds them")
    got = golden_run(recipe, tmp_path)
    assert got == values[recipe], f"{recipe}'s losses changed: {REGENERATE}"


def test_the_golden_values_cover_every_preset_and_tell_them_apart(golden):
    assert golden["steps"] == STEPS and "2.13.0+cpu" in golden["losses"]  # CI's PyTorch
    for version, sets in golden["losses"].items():
        for values in sets.values():  # CI's PyTorch covers every preset; another build's may lag a numerics change
            if version == "2.13.0+cpu":
                assert sorted(values) == sorted(fp4train.recipes.names())
            else:
                assert set(values) <= set(fp4train.recipes.names())
    for values in (v for sets in golden["losses"].values() for v in sets.values()):
        finals = {r: v["train"][-1] for r, v in values.items()}
        assert len(set(finals.values())) == len(finals), finals  # every recipe's numerics show in its losses
        assert all(len(v["train"]) == STEPS for v in values.values())
