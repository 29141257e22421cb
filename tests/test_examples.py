"""The examples the docs show (``examples/``; ``scripts/sync_examples.py`` puts them into the docs) run as written."""

import math
import runpy

import pytest
from examples_files import EXAMPLES, commands


def test_the_quantize_and_convert_example_trains_a_step():
    import fp4train

    ns = runpy.run_path(str(EXAMPLES / "quantize_and_convert.py"))
    assert isinstance(ns["model"][0], fp4train.QuantizedLinear) and math.isfinite(float(ns["loss"]))
    assert ns["model"][0].weight.grad is not None


def test_the_custom_recipe_example_makes_a_recipe_that_converts():
    import torch

    import fp4train

    mine = runpy.run_path(str(EXAMPLES / "custom_recipe.py"))["mine"]
    assert mine.name == "mine"
    model = fp4train.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), mine)
    assert isinstance(model[0], fp4train.QuantizedLinear)


def test_the_first_example_is_about_ten_lines():
    lines = [ln for ln in (EXAMPLES / "quantize_and_convert.py").read_text().splitlines() if ln.strip()]
    assert len(lines) <= 11


def test_the_transformers_trainer_example_trains_a_calibrated_fp4_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import fp4train

    monkeypatch.chdir(tmp_path)  # the example's output_dir
    ns = runpy.run_path(str(EXAMPLES / "hf_trainer.py"))
    layers = [m for m in ns["model"].modules() if isinstance(m, fp4train.QuantizedLinear)]
    assert len(layers) == 14 and all(m.spec.quantized and not m.uncalibrated for m in layers)
    logs = [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]
    assert ns["trainer"].state.global_step == 10 and logs and all(math.isfinite(float(v)) for v in logs)


def test_every_example_command_parses():
    """Every ``fp4train ...`` command of the examples is accepted by the CLI parser (flags, values)."""
    from fp4train.cli import build_parser

    cmds = [c[c.index("fp4train") + 1:] for c in commands()]
    assert len(cmds) >= 8
    for argv in cmds:
        build_parser().parse_args(argv)  # SystemExit on an unknown flag
