"""Where the docs' examples live, and the commands of the shell ones (for the tests that run them)."""

import shlex
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def commands(*names: str) -> list[list[str]]:
    """The argument lists of the ``fp4train ...`` and ``torchrun ... -m fp4train ...`` commands of the shell examples
    ``names`` (all of them by default), in order, each line's comment and ``&&`` chains split off."""
    cmds = []
    for path in [EXAMPLES / n for n in names] or sorted(EXAMPLES.glob("*.sh")):
        for line in path.read_text().splitlines():
            for part in line.split(" #", 1)[0].split("&&"):
                part = part.strip()
                if part.startswith(("fp4train ", "torchrun ")):
                    cmds.append(shlex.split(part))
    return cmds
