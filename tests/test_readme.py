"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    blocks = _blocks()
    assert len(blocks) >= 2
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), ns)
    assert ns["mine"].name == "mine"
    import fp4train

    assert isinstance(ns["model"][0], fp4train.QuantizedLinear)


def test_readme_example_is_about_ten_lines():
    first = [ln for ln in _blocks()[0].splitlines() if ln.strip()]
    assert len(first) <= 11


def test_readme_commands_parse():
    """Every `fp4train ...` command in the README is accepted by the CLI parser (flags, values)."""
    import shlex

    from fp4train.cli import build_parser

    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("fp4train "):
                    cmds.append(shlex.split(part)[1:])
                elif part.startswith("torchrun "):  # torchrun [its options] -m fp4train ...
                    argv = shlex.split(part)
                    cmds.append(argv[argv.index("fp4train") + 1:])
    assert len(cmds) >= 6
    for argv in cmds:
        build_parser().parse_args(argv)  # SystemExit on an unknown flag
