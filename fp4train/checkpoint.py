"""Checkpoints that survive crashes: atomic writes, checksums, the previous one kept.

A checkpoint is either one ``torch.save`` file, ``step_000100.pt``, or - written by a sharded run, every process
its own part - a directory ``step_000100/`` in PyTorch's Distributed Checkpoint format
(``torch.distributed.checkpoint``: ``.metadata`` and one ``__R_0.distcp`` file of tensor shards per process) plus
``meta.pt``, everything that is not a sharded tensor. Either is written under a temporary name, flushed to disk
and renamed; its SHA-256 and size (per file, for a directory) go into ``checkpoints.json``, itself replaced
atomically. Only then are checkpoints beyond the newest ``keep`` deleted - so a crash at any moment leaves at
least one complete, verifiable checkpoint. Loading verifies sizes and checksums and refuses a damaged checkpoint
with an error that names the last good checkpoint to resume from instead. A checkpoint that no manifest lists
(the manifest was lost or damaged) loads only when the caller says it trusts it.

Files are read with ``torch.load(weights_only=True)``: tensors, numbers, strings and plain containers only, so a
checkpoint from elsewhere cannot run code when it is opened. A sharded checkpoint's ``.metadata`` is a pickle
(Distributed Checkpoint's own format): it is first read by an unpickler that admits only the checkpoint
metadata's own classes, and a checkpoint whose entries are not all tensors is refused (Distributed Checkpoint
unpickles non-tensor entries with no such restriction).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

MANIFEST = "checkpoints.json"
#: a sharded checkpoint's non-tensor part (step, settings, scheduler, data order, RNG, optimizer hyperparameters)
SHARDED_META = "meta.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or corrupted."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full or read-only disk, an I/O error): its temporary file is gone, and
    the checkpoints and the manifest there were are as they were."""


class _HashingWriter(io.RawIOBase):
    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # what the file refused (torch.save reports it as a RuntimeError of its own)

    def writable(self):
        return True

    def write(self, b):
        try:
            self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(b)
        self.n += len(b)
        return len(b)


def _write(path: Path, state) -> tuple[str, int]:
    """``torch.save(state)`` to ``path``, flushed to disk; (SHA-256, bytes). A failed write raises
    :class:`CheckpointWriteError` naming the file and the system's reason."""
    w = None
    try:
        with open(path, "wb") as f:
            w = _HashingWriter(f)
            torch.save(state, w)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        cause = (w.error if w is not None else None) or _os_error(e)
        if cause is None:
            raise
        raise CheckpointWriteError(f"could not write the checkpoint {path.name.removesuffix('.tmp')} in {path.parent}: "
                                   f"{cause.strerror or cause}") from cause
    return w.sha.hexdigest(), w.n


def _os_error(e: BaseException | None) -> OSError | None:
    """The ``OSError`` that ``e`` is or was raised from, if any (a Distributed Checkpoint failure: any process's)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        for failure in getattr(e, "failures", {}).values():  # torch.distributed.checkpoint's CheckpointException
            found = _os_error(failure[0] if isinstance(failure, tuple) else failure)
            if found is not None:
                return found
        e = e.__cause__ or e.__context__
    return None


def expected_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About what a checkpoint of ``model`` and ``optimizer`` takes, before the optimizer has any state: the model's
    tensors, and per parameter its optimizer's moments - two (AdamW's), or one (Muon's momentum, ``muon`` groups)
    - in FP32, or in NVFP4 where an optimizer with ``quantize_states`` keeps them so (codes, block scales, tile
    means: about 0.58 bytes an element)."""
    from .optim import state_codec
    from .row_shards import local

    storages = {}
    for t in model.state_dict().values():  # a sharded (DTensor) weight: its numel is the whole tensor's
        storages[(local(t).device, local(t).data_ptr())] = t.numel() * t.element_size()  # tied weights are saved once
    total = sum(storages.values())
    for group in optimizer.param_groups:
        moments = 1 if group.get("muon") else 2
        for p in group["params"]:
            quantized = group.get("quantize_states") and state_codec.fits(p.shape)
            total += int(moments * p.numel() * ((0.5 + 1 / 16 + 1 / 64) if quantized else 4))
    return total


@contextmanager
def single_process_ok():
    """Silences Distributed Checkpoint's warning that it runs in one process: here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


class Checkpoints:
    """The checkpoints of one run directory. ``choose_with``: the flag that picks one checkpoint in the command at hand
    (``--resume`` for ``train``, ``--checkpoint`` for ``eval``/``export``/``generate``), which errors suggest."""

    def __init__(self, directory: str | Path, keep: int = 2, *, choose_with: str = "--resume"):
        self.dir = Path(directory)
        self.keep = max(1, keep)
        self.choose_with = choose_with
        self._use_it = "resume from it with" if choose_with == "--resume" else "load it with"
        self._use_one = "resume from one with" if choose_with == "--resume" else "load one with"

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
                                  f"{self._use_one} {self.choose_with} {self.dir}/step_NNNNNN.pt "
                                  "--trust-checkpoint") from None

    def _write_manifest(self, entries: list[dict]) -> None:
        tmp = self.dir / f"{MANIFEST}.tmp"
        try:
            tmp.write_text(json.dumps({"checkpoints": entries}, indent=1))
            os.replace(tmp, self.dir / MANIFEST)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(f"could not write {self.dir / MANIFEST}: {e.strerror or e}") from e

    # ---- save / load ------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> Path:
        """Write ``state`` as one file (one process writes it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:06d}.pt"
        tmp = final.with_suffix(".pt.tmp")
        try:
            sha, n = _write(tmp, state)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._record({"step": step, "file": final.name, "sha256": sha, "bytes": n})
        return final

    def save_sharded(self, step: int, tensors: dict, meta: dict, *, main: bool, barrier) -> Path:
        """Every process calls it: ``tensors`` (nested dicts of tensors, sharded ones as ``DTensor``) through
        ``torch.distributed.checkpoint.save``, each process writing its own shards, and ``meta`` (plain data: only
        ``main`` writes it) into the directory ``step_NNNNNN``; ``barrier()`` waits for every process."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        final = self.dir / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if main:
            _remove(tmp)  # a save that died before its rename
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                raise CheckpointWriteError(f"could not write the checkpoint {final.name} in {self.dir}: {e.strerror or e}") from e
        barrier()
        try:
            with single_process_ok():
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not dist.is_initialized())
            barrier()  # every process's shards are on disk
            if not main:
                return final
            _write(tmp / SHARDED_META, meta)
            files = {f.name: {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in sorted(tmp.iterdir())}
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same step again (a resumed run): the new one replaces it
                _remove(old)
                final.rename(old)
            tmp.rename(final)
            _remove(old)
        except BaseException as e:
            if main:
                _remove(tmp)
            cause = _os_error(e)
            if cause is not None and not isinstance(e, CheckpointWriteError):
                raise CheckpointWriteError(f"could not write the checkpoint {final.name} in {self.dir}: "
                                           f"{cause.strerror or cause}") from e
            raise
        self._record({"step": step, "file": final.name, "sha256": _digest(files), "bytes": sum(f["bytes"] for f in files.values()),
                      "files": files})
        return final

    def _record(self, entry: dict) -> None:
        """List ``entry`` in the manifest (replacing one of its step), then delete what falls beyond ``keep``."""
        entries = self.entries()
        replaced = [e for e in entries if e["step"] == entry["step"] and e["file"] != entry["file"]]
        entries = [e for e in entries if e["step"] != entry["step"]] + [entry]
        entries.sort(key=lambda e: e["step"])
        keep, drop = entries[-self.keep :], entries[: -self.keep]
        self._write_manifest(keep)
        for e in drop + replaced:
            if e is not entry:
                _remove(self.dir / e["file"])

    def verify(self, entry: dict) -> str | None:
        """``None`` if the checkpoint (file or directory) is intact, else what is wrong with it."""
        p = self.dir / entry["file"]
        if not p.exists():
            return f"{p} is missing"
        if "files" not in entry:
            return _check_file(p, entry)
        for name, f in entry["files"].items():
            problem = _check_file(p / name, f)
            if problem:
                return problem
        return None

    def load(self, path: str | Path | None = None, map_location="cpu", *, trust: bool = False) -> dict:
        """Load the newest checkpoint (or ``path``) after verifying it. ``trust``: load ``path`` even
        when no manifest lists it (its integrity then cannot be checked)."""
        if path is not None and not Path(path).exists():
            raise CheckpointError(f"checkpoint {path} does not exist")
        if path is not None and Path(path).resolve().parent != self.dir.resolve():
            raise CheckpointError(f"checkpoint {path} is not in the run directory {self.dir}; give the checkpoint's own run")
        if path is not None and trust:
            try:
                listed = any(e["file"] == Path(path).name for e in self.entries())
            except CheckpointError:
                listed = False
            if not listed:
                return _read(Path(path), map_location)
        entries = self.entries()
        if path is None:
            if not entries:
                raise CheckpointError(f"no checkpoint {'to resume from ' if self.choose_with == '--resume' else ''}in {self.dir} "
                                  f"(no {MANIFEST})")
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
                f"{self._use_it} {self.choose_with} {shlex.quote(str(self.dir / good[-1]['file']))}"
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
            _remove(self.dir / e["file"])


def _check_file(p: Path, entry: dict) -> str | None:
    if not p.is_file():
        return f"{p} is missing"
    size = p.stat().st_size
    if size != entry["bytes"]:
        return f"{p} is truncated or padded: {size:,} bytes, the manifest says {entry['bytes']:,}"
    if _sha256(p) != entry["sha256"]:
        return f"{p} is corrupted: its SHA-256 does not match the manifest"
    return None


def _digest(files: dict) -> str:
    """One SHA-256 for a directory: over its files' names and SHA-256s."""
    return hashlib.sha256("".join(f"{n} {f['sha256']}\n" for n, f in sorted(files.items())).encode()).hexdigest()


def _read(path: Path, map_location) -> dict:
    """A checkpoint's content. A file: all of it. A sharded checkpoint (a directory): its non-tensor part, with
    ``"sharded"`` - the directory - for :func:`read_tensors` or ``torch.distributed.checkpoint.load`` to read
    the tensors from (into whole tensors, or into each process's shards)."""
    if path.is_dir():
        meta = _read(path / SHARDED_META, map_location)
        sharded_entries(path)  # refuses a directory that is not a checkpoint of tensors
        return {**meta, "sharded": path}
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {path.parent} is not a whole checkpoint") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"refusing to load {path}: it holds objects other than tensors and plain data, which could run "
                              f"code when unpickled ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what a Distributed Checkpoint's ``.metadata`` is made of: the classes of
    ``torch.distributed.checkpoint``'s metadata, dtypes, sizes, layouts and paths."""

    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name)
        if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem") and isinstance(obj, type):
            return obj
        if module == "torch" and (isinstance(obj, torch.dtype) or obj is torch.Size):
            return obj
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                              ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def sharded_entries(path: Path) -> dict:
    """A sharded checkpoint's tensors: ``{flattened name: (shape, dtype)}``, from its ``.metadata``, read safely
    (:class:`_MetadataUnpickler`); refuses one with non-tensor entries."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    try:
        with open(path / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a sharded checkpoint: it has no .metadata") from None
    except (pickle.UnpicklingError, AttributeError, EOFError, ImportError) as e:
        raise CheckpointError(f"refusing to load {path}: its .metadata holds more than checkpoint metadata, which could run "
                              f"code when unpickled ({str(e).splitlines()[0]})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"refusing to load {path}: its .metadata is not a checkpoint's metadata")
    others = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if others:
        raise CheckpointError(f"refusing to load {path}: it holds entries other than tensors ({', '.join(others[:3])}), "
                              "which would be unpickled without restriction")
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()}


def read_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The whole tensors under ``prefix`` (e.g. ``"model"``) of the sharded checkpoint ``path``, in one process on
    the CPU, keyed as in ``state_dict()``."""
    import torch.distributed.checkpoint as dcp

    lead = prefix + "."
    out = {k[len(lead):]: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in sharded_entries(path).items()
           if k.startswith(lead)}
    with single_process_ok():
        dcp.load({prefix: out}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return out
