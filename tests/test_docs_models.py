"""docs/models.md's examples run as written: transformers.Trainer on a model AdaHOP calibrated and converted."""

import math
import re
import shlex
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def test_the_transformers_trainer_example_trains_a_calibrated_fp4_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import fp4train

    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)  # the example's output_dir
    ns: dict = {}
    exec(compile(code, str(DOC), "exec"), ns)
    layers = [m for m in ns["model"].modules() if isinstance(m, fp4train.QuantizedLinear)]
    assert len(layers) == 14 and all(m.spec.quantized and not m.uncalibrated for m in layers)
    logs = [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]
    assert ns["trainer"].state.global_step == 10 and logs and all(math.isfinite(float(v)) for v in logs)


def test_the_docs_commands_parse():
    from fp4train.cli import build_parser

    cmds = [shlex.split(line)[1:] for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
            for line in block.splitlines() if line.startswith("fp4train ")]
    assert cmds
    for argv in cmds:
        build_parser().parse_args(argv)
