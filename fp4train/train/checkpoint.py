"""Checkpoints that survive crashes: atomic writes, checksums, the previous one kept.

Each checkpoint is one ``torch.save`` file, ``step_000100.pt``, written to a temporary name,
flushed to disk and renamed; its SHA-256 (computed while writing) and size go into
``checkpoints.json``, itself replaced atomically. Only then are checkpoints beyond the newest
``keep`` deleted - so a crash at any moment leaves at least one complete, verifiable checkpoint.
Loading verifies size and checksum and refuses a damaged file with an error that names the
last good checkpoint to resume from instead. A checkpoint file that no manifest lists (the
manifest was lost or damaged) loads only when the caller says it trusts it.

Files are read with ``torch.load(weights_only=True)``: tensors, numbers, strings and plain
containers only, so a checkpoint from elsewhere cannot run code when it is opened.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import torch

MANIFEST = "checkpoints.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or corrupted."""


class _HashingWriter(io.RawIOBase):
    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def writable(self):
        return True

    def write(self, b):
        self.f.write(b)
        self.sha.update(b)
        self.n += len(b)
        return len(b)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


class Checkpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.dir = Path(directory)
        self.keep = max(1, keep)

    # ---- manifest ---------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        m = self.dir / MANIFEST
        if not m.exists():
            return []
        try:
            entries = json.loads(m.read_text())["checkpoints"]
            for e in entries:
                int(e["step"]), str(e["file"]), str(e["sha256"]), int(e["bytes"])
            return entries
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{m} is damaged ({type(e).__name__}: {e}); the checkpoint files may still be intact: "
                                  f"resume from one with --resume {self.dir}/step_NNNNNN.pt --trust-checkpoint") from None

    def _write_manifest(self, entries: list[dict]) -> None:
        tmp = self.dir / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"checkpoints": entries}, indent=1))
        os.replace(tmp, self.dir / MANIFEST)

    # ---- save / load ------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:06d}.pt"
        tmp = final.with_suffix(".pt.tmp")
        try:
            with open(tmp, "wb") as f:
                w = _HashingWriter(f)
                torch.save(state, w)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        entries = [e for e in self.entries() if e["step"] != step]
        entries.append({"step": step, "file": final.name, "sha256": w.sha.hexdigest(), "bytes": w.n})
        entries.sort(key=lambda e: e["step"])
        keep, drop = entries[-self.keep :], entries[: -self.keep]
        self._write_manifest(keep)
        for e in drop:
            (self.dir / e["file"]).unlink(missing_ok=True)
        return final

    def verify(self, entry: dict) -> str | None:
        """``None`` if the checkpoint file is intact, else what is wrong with it."""
        p = self.dir / entry["file"]
        if not p.exists():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != entry["bytes"]:
            return f"{p} is truncated or padded: {size:,} bytes, the manifest says {entry['bytes']:,}"
        if _sha256(p) != entry["sha256"]:
            return f"{p} is corrupted: its SHA-256 does not match the manifest"
        return None

    def load(self, path: str | Path | None = None, map_location="cpu", *, trust: bool = False) -> dict:
        """Load the newest checkpoint (or ``path``) after verifying it. ``trust``: load ``path`` even
        when no manifest lists it (its integrity then cannot be checked)."""
        if path is not None and trust:
            try:
                listed = any(e["file"] == Path(path).name for e in self.entries())
            except CheckpointError:
                listed = False
            if not listed:
                if not Path(path).is_file():
                    raise CheckpointError(f"checkpoint {path} does not exist")
                return _read(Path(path), map_location)
        entries = self.entries()
        if path is None:
            if not entries:
                raise CheckpointError(f"no checkpoint to resume from in {self.dir} (no {MANIFEST})")
            entry = entries[-1]
        else:
            name = Path(path).name
            matches = [e for e in entries if e["file"] == name]
            if not matches:
                raise CheckpointError(f"{path} is not listed in {self.dir / MANIFEST}, so its integrity cannot be checked; "
                                      "add --trust-checkpoint to load it anyway")
            entry = matches[0]
        problem = self.verify(entry)
        if problem:
            good = [e for e in entries if e is not entry and e["step"] < entry["step"] and self.verify(e) is None]
            hint = (
                f"; the previous good checkpoint is {self.dir / good[-1]['file']} (step {good[-1]['step']}): "
                f"resume from it with --resume {self.dir / good[-1]['file']}"
                if good
                else "; no earlier good checkpoint exists"
            )
            raise CheckpointError(f"refusing to load checkpoint: {problem}{hint}")
        return _read(self.dir / entry["file"], map_location)

    def prune(self, keep: int) -> None:
        """Keep only the newest ``keep`` checkpoints (a finished run needs only its last one)."""
        entries = self.entries()
        if len(entries) <= keep:
            return
        self._write_manifest(entries[-keep:])
        for e in entries[:-keep]:
            (self.dir / e["file"]).unlink(missing_ok=True)


def _read(path: Path, map_location) -> dict:
    """``torch.load`` of tensors and plain data only: opening a checkpoint never runs code from it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data, which could run "
                              f"code when unpickled ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None
