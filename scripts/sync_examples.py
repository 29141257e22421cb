"""Put the files of ``examples/`` into the docs' code blocks that show them.

The examples are code the test suite runs (``tests/test_examples.py``); the README and ``docs/`` show them between
markers::

    <!-- example:examples/training.sh -->
    ```bash
    ...the file, as it is...
    ```
    <!-- /example -->

Run after editing an example; ``--check`` changes nothing and exits 1 naming every block that differs from its file,
every marker naming a missing file and every example no doc shows (CI runs it before the tests).

    python scripts/sync_examples.py [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LANGUAGES = {".py": "python", ".sh": "bash", ".toml": "toml"}
BLOCK = re.compile(r"<!-- example:(\S+) -->\n.*?<!-- /example -->", flags=re.S)


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def block(name: str) -> str:
    """The marked block showing ``examples/...`` file ``name`` (a path from the repository root)."""
    path = ROOT / name
    text = path.read_text()
    return f"<!-- example:{name} -->\n```{LANGUAGES.get(path.suffix, '')}\n{text.rstrip()}\n```\n<!-- /example -->"


def synced(text: str, problems: list[str], where: str) -> tuple[str, set[str]]:
    """``text`` with every example block rewritten from its file, and the files it shows."""
    shown = set()

    def sub(m):
        name = m.group(1)
        if not (ROOT / name).is_file():
            problems.append(f"{where}: the example block names {name}, which does not exist")
            return m.group(0)
        shown.add(name)
        return block(name)

    return BLOCK.sub(sub, text), shown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a doc differs from its examples")
    args = ap.parse_args(argv)
    problems: list[str] = []
    shown: set[str] = set()
    for doc in docs():
        where = str(doc.relative_to(ROOT))
        old = doc.read_text()
        new, names = synced(old, problems, where)
        shown |= names
        if new != old:
            if args.check:
                problems.append(f"{where}: an example block differs from its file - run python scripts/sync_examples.py")
            else:
                doc.write_text(new)
                print(f"updated {where}")
    for path in sorted(EXAMPLES.iterdir()):
        name = str(path.relative_to(ROOT))
        if path.suffix in LANGUAGES and name not in shown:
            problems.append(f"{name}: no doc shows this example - mark a block <!-- example:{name} --> in one")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
