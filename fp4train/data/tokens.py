"""Tokenize once into a cached, memory-mapped token file per split.

Documents are tokenized with the end-of-text token after each, concatenated, and written as
one flat ``uint16`` (or ``uint32`` for vocabularies over 65,535) file, ``<key>-<split>.bin``,
beside ``<key>-<split>.json`` (token count, document ids and start offsets). The key hashes
the tokenizer, the source files (path, size, mtime) and the split rule, so a changed input
re-tokenizes and an unchanged one is read back at once. Files are written to a temporary
name and renamed, so an interrupted build never leaves a half file that looks complete.

Splits: validation files if given; otherwise a document goes to validation when a hash of
its id falls under ``val_fraction`` - stable across runs and machines, and whole documents
only, so no validation text ever reaches a training sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .sources import check_readable, iter_documents, split_sources
from .tokenizer import TextTokenizer


def default_cache_dir() -> Path:
    return Path(os.environ.get("FP4TRAIN_CACHE", Path.home() / ".cache" / "fp4train"))


@dataclass
class TokenSplit:
    """One split's tokens (a read-only memmap) and its documents."""

    name: str
    tokens: np.ndarray
    doc_ids: list[str]
    doc_offsets: np.ndarray  # start of each document in ``tokens``
    path: Path

    def __len__(self) -> int:
        return len(self.tokens)

    def doc_index_at(self, positions: np.ndarray) -> np.ndarray:
        """Index (into ``doc_ids``) of the document each token position belongs to."""
        return np.searchsorted(self.doc_offsets, positions, side="right") - 1


def _in_val(doc_id: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:4], "little")
    return (h % 100_000) < val_fraction * 100_000


def _file_key(files: list[str]) -> list:
    out = []
    for f in files:
        if os.path.isfile(f):
            st = os.stat(f)
            out.append([os.path.abspath(f), st.st_size, int(st.st_mtime)])
        else:
            out.append([f])
    return out


def load_splits(
    data: str | None,
    val_data: str | None,
    tokenizer: TextTokenizer,
    *,
    val_fraction: float = 0.05,
    cache_dir: str | Path | None = None,
    text_field: str = "text",
    verbose: bool = True,
) -> tuple[TokenSplit, TokenSplit]:
    """Train and validation :class:`TokenSplit` s for a data spec, built once and cached."""
    if not 0.0 < val_fraction < 1.0 and val_data is None:
        raise ValueError(f"val_fraction must be in (0, 1) when no validation data is given, got {val_fraction}")
    train_files, val_files = split_sources(data, val_data)
    for f in train_files + (val_files or []):
        check_readable(f)
    key_src = {
        "tokenizer": tokenizer.fingerprint,
        "train": _file_key(train_files),
        "val": _file_key(val_files) if val_files else None,
        "val_fraction": None if val_files else val_fraction,
        "text_field": text_field,
        "format": 1,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:20]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    names = ("train", "val")
    if not all(_complete(cache, key, n) for n in names):
        _build(cache, key, train_files, val_files, tokenizer, val_fraction, text_field, verbose)
    return tuple(_open(cache, key, n) for n in names)  # type: ignore[return-value]


def _paths(cache: Path, key: str, split: str) -> tuple[Path, Path]:
    return cache / f"{key}-{split}.bin", cache / f"{key}-{split}.json"


def _complete(cache: Path, key: str, split: str) -> bool:
    b, m = _paths(cache, key, split)
    if not (b.exists() and m.exists()):
        return False
    meta = json.loads(m.read_text())
    return b.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize


def _open(cache: Path, key: str, split: str) -> TokenSplit:
    b, m = _paths(cache, key, split)
    meta = json.loads(m.read_text())
    tokens = np.memmap(b, dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],)) if meta["n_tokens"] else np.zeros(0, meta["dtype"])
    return TokenSplit(split, tokens, meta["doc_ids"], np.asarray(meta["doc_offsets"], dtype=np.int64), b)


class _SplitWriter:
    def __init__(self, cache: Path, key: str, split: str, dtype):
        self.bin, self.meta = _paths(cache, key, split)
        self.tmp = self.bin.with_suffix(f".bin.tmp{os.getpid()}")
        self.f = open(self.tmp, "wb")
        self.dtype, self.n, self.ids, self.offsets = dtype, 0, [], []

    def add(self, doc_id: str, ids: list[int]):
        self.ids.append(doc_id)
        self.offsets.append(self.n)
        arr = np.asarray(ids, dtype=self.dtype)
        self.f.write(arr.tobytes())
        self.n += len(arr)

    def discard(self):
        """Remove the temporary file of a build that failed (no half file is ever left)."""
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def close(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.bin)
        meta = {"n_tokens": self.n, "dtype": np.dtype(self.dtype).name, "doc_ids": self.ids, "doc_offsets": self.offsets}
        tmp = self.meta.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.meta)


def _build(cache, key, train_files, val_files, tok: TextTokenizer, val_fraction, text_field, verbose):
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    writers = {s: _SplitWriter(cache, key, s, dtype) for s in ("train", "val")}
    jobs = [(f, None) for f in train_files] + [(f, "val") for f in (val_files or [])]
    t0 = time.time()
    def flush(batch: list[tuple[str, str]], forced: str | None) -> None:
        for (doc_id, _), ids in zip(batch, tok.encode_batch([t for _, t in batch])):
            split = forced or ("val" if val_files is None and _in_val(doc_id, val_fraction) else "train")
            writers[split].add(doc_id, ids + [tok.eot_id])
        batch.clear()

    try:
        for src, forced in jobs:
            if verbose:
                print(f"fp4train: tokenizing {src} ...", file=sys.stderr, flush=True)
            batch: list[tuple[str, str]] = []
            for doc in iter_documents(src, text_field):
                batch.append(doc)
                if len(batch) >= 512:
                    flush(batch, forced)
            flush(batch, forced)
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    for w in writers.values():
        w.close()
    if verbose:
        n = {s: w.n for s, w in writers.items()}
        print(f"fp4train: {n['train']:,} train / {n['val']:,} val tokens in {time.time() - t0:.0f}s (cache {cache})", file=sys.stderr)
