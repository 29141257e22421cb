"""Where documents come from: local files and globs, the packaged corpus, Hugging Face datasets.

A *source spec* is one of

* ``None`` or ``"shakespeare"``: the packaged tiny-shakespeare (public domain, ~1.1 MB);
* a file or glob: ``.txt``, ``.jsonl``, ``.jsonl.xz``, ``.jsonl.gz``, ``.parquet``; several
  specs may be joined with commas;
* a directory: every supported file in it. If it holds ``train-*`` and ``val-*`` shards
  (as ``../shared/data/enwiki`` does), those are the train and validation splits;
* ``hf:NAME`` or ``hf:NAME:SPLIT``: a Hugging Face dataset (needs the ``datasets`` extra and a
  network; column ``text``).

Documents: one per JSON line (field ``text``; id from ``id`` or the line number) or parquet
row; a ``.txt`` file is cut at blank lines into documents of at least 2,000 characters.
"""

from __future__ import annotations

import glob
import gzip
import json
import lzma
import os
import zlib
from pathlib import Path
from typing import Iterator

ASSETS = Path(__file__).resolve().parent / "assets"
SHAKESPEARE = "shakespeare"
SUFFIXES = (".txt", ".jsonl", ".jsonl.xz", ".jsonl.gz", ".parquet")
_VAL_NAMES = ("val", "valid", "validation", "test", "dev")
MIN_TXT_DOC_CHARS = 2000


def _supported(p: str) -> bool:
    return p.endswith(SUFFIXES)


def expand(spec: str | None) -> list[str]:
    """The files (or pseudo-sources) a spec names, sorted; a clear error if none."""
    if spec in (None, "", SHAKESPEARE):
        return [SHAKESPEARE]
    out: list[str] = []
    for part in str(spec).split(","):
        part = part.strip()
        if part.startswith("hf:"):
            out.append(part)
        elif os.path.isdir(part):
            out += sorted(str(p) for p in Path(part).iterdir() if _supported(p.name))
        elif any(c in part for c in "*?["):
            out += sorted(p for p in glob.glob(part) if _supported(p))
        elif os.path.isfile(part):
            if not _supported(part):
                raise ValueError(f"unsupported data file {part!r}; use one of {', '.join(SUFFIXES)}")
            out.append(part)
        else:
            raise FileNotFoundError(f"data source {part!r} does not exist (a file, glob, directory, 'shakespeare' or hf:NAME)")
    if not out:
        raise FileNotFoundError(f"data source {spec!r} matched no {'/'.join(SUFFIXES)} files")
    return out


def looks_like_validation(path: str) -> bool:
    stem = Path(path).name.lower()
    return any(stem.startswith(v + "-") or stem.startswith(v + "_") or stem.startswith(v + ".") for v in _VAL_NAMES)


def split_sources(data: str | None, val_data: str | None) -> tuple[list[str], list[str] | None]:
    """(train files, validation files or None = hold out a fraction of the train documents).

    A directory with ``train-*``/``val-*`` shards splits itself. Training files whose names
    look like a validation split are refused (pass them as ``val_data``).
    """
    if data and os.path.isdir(data) and val_data is None:
        files = expand(data)
        val = [f for f in files if looks_like_validation(f)]
        train = [f for f in files if not looks_like_validation(f)]
        if val and train:
            return train, val
    train = expand(data)
    bad = [f for f in train if looks_like_validation(f)]
    if bad:
        raise ValueError(
            f"training data includes {', '.join(Path(b).name for b in bad)}, which look like a validation "
            "split; never train on it: pass it as val_data (--val-data) and leave it out of --data"
        )
    val = expand(val_data) if val_data else None
    if val:
        same = sorted(set(map(identity, train)) & set(map(identity, val)))
        if same:
            raise ValueError(
                f"{', '.join(same)} is both training and validation data (--data and --val-data); validation text must "
                "never enter training: give --val-data other files, or leave it out to hold out --val-fraction of the documents"
            )
    return train, val


def identity(source: str) -> str:
    """What makes two sources the same: the resolved path of a file, the spec of anything else."""
    return str(Path(source).resolve()) if os.path.isfile(source) else source


def check_readable(source: str) -> None:
    """Refuse, before any work, a source whose reader is not installed (``.parquet``, ``hf:``)."""
    if source.endswith(".parquet"):
        _require("pyarrow", f"reading {source} needs pyarrow: pip install pyarrow")
    elif source.startswith("hf:"):
        _require("datasets", f"{source} needs the Hugging Face 'datasets' package and a network: pip install 'fp4train[hf]'")


def _require(module: str, message: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise ValueError(message) from None


def iter_documents(source: str, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """(document id, text) pairs of one expanded source. A file that cannot be read as text (not
    UTF-8, binary, a damaged archive) is refused with an error naming it."""
    try:
        yield from _documents(source, text_field)
    except UnicodeDecodeError as e:
        raise ValueError(f"{source} is not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8 or leave it out") from None
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # damaged .gz / .xz, unreadable file
        raise ValueError(f"cannot read {source}: {e} (a damaged or truncated file?)") from None


def _documents(source: str, text_field: str) -> Iterator[tuple[str, str]]:
    if source == SHAKESPEARE:
        yield from _txt_docs("shakespeare", lzma.decompress((ASSETS / "tinyshakespeare.txt.xz").read_bytes()).decode("utf-8"))
    elif source.startswith("hf:"):
        yield from _hf_docs(source, text_field)
    elif source.endswith(".txt"):
        text = Path(source).read_text(encoding="utf-8")
        if "\x00" in text:
            raise ValueError(f"{source} holds NUL bytes: a binary file, not text; leave it out of the data")
        if not text.strip():
            raise ValueError(f"{source} is empty (no text in it); leave it out of the data")
        yield from _txt_docs(Path(source).name, text)
    elif source.endswith(".parquet"):
        yield from _parquet_docs(source, text_field)
    else:
        opener = lzma.open if source.endswith(".xz") else gzip.open if source.endswith(".gz") else open
        name = Path(source).name
        with opener(source, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    text = rec[text_field]
                except KeyError:
                    keys = ", ".join(map(repr, list(rec)[:6])) if isinstance(rec, dict) else ""
                    raise ValueError(f"{source}:{i + 1}: expected a JSON object with a {text_field!r} field, and this one "
                                     f"has {keys or 'none'}; --text-field names the field that holds the text") from None
                except (json.JSONDecodeError, TypeError) as e:
                    raise ValueError(f"{source}:{i + 1}: expected a JSON object with a {text_field!r} field ({e}); "
                                     "--text-field names the field that holds the text") from None
                yield f"{name}:{rec.get('id', i)}", text


def _txt_docs(name: str, text: str) -> Iterator[tuple[str, str]]:
    buf, n, k = [], 0, 0
    for para in text.split("\n\n"):
        buf.append(para)
        n += len(para) + 2
        if n >= MIN_TXT_DOC_CHARS:
            yield f"{name}:{k}", "\n\n".join(buf)
            buf, n, k = [], 0, k + 1
    if buf:
        yield f"{name}:{k}", "\n\n".join(buf)


def _parquet_docs(path: str, text_field: str) -> Iterator[tuple[str, str]]:
    check_readable(path)
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=[text_field])
    for i, text in enumerate(table.column(text_field).to_pylist()):
        yield f"{Path(path).name}:{i}", text


def _hf_docs(source: str, text_field: str) -> Iterator[tuple[str, str]]:
    check_readable(source)
    import datasets

    _, name, *split = source.split(":")
    ds = datasets.load_dataset(name, split=split[0] if split else "train", streaming=True)
    for i, rec in enumerate(ds):
        yield f"{name}:{i}", rec[text_field]
