"""A run directory: what it holds, who writes it, and whether it can take the run.

* :func:`check_run_dir` refuses, before any work, a command that would damage what a directory holds;
* :class:`RunLock` makes one process at a time the writer of a directory (``train``, ``resume`` and ``compare``
  alike): a second is refused with the holder's pid, and a lock left by a process that was killed is named and
  taken over;
* :func:`check_free_space` refuses a run whose checkpoints the disk cannot hold, before the first step;
* :func:`write_text` replaces a file whole or not at all; :func:`resume_command` is the command that continues a
  run, quoted for a shell.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import time
import warnings
import weakref
from pathlib import Path

from ..checkpoint import MANIFEST, CheckpointError, Checkpoints

#: What a run writes into its directory (``train.log`` and ``train_config.json`` are ``compare``'s launcher
#: files, written before the run starts).
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints.json", "checkpoints.json.tmp",
             "adahop_calibration.json", "tb")
LAUNCHER_FILES = ("train.log", "train_config.json")
#: the lock file of a directory a process is writing (removed when it is done)
LOCK = ".fp4train.lock"


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out`` (what ``--overwrite`` removes)."""
    if not out.is_dir():
        return []
    return [out / n for n in RUN_FILES if (out / n).exists()] + sorted(out.glob("step_*"))  # files, or sharded: directories


def clear_run_files(out: Path) -> None:
    """Remove the files of the run in ``out`` (``--overwrite``; the lock file stays: its holder is this process)."""
    for p in run_files(out):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def resume_command(out: str | Path) -> str:
    """The shell command that continues the run in ``out``."""
    return f"fp4train train --out {shlex.quote(str(out))} --resume"


def describe_run(out: Path) -> str:
    """'finished at step N', 'stopped at step N' or 'with no checkpoint yet': what a run directory holds."""
    try:
        entries = Checkpoints(out).entries()
    except CheckpointError:
        return "with a damaged checkpoint manifest"
    summary = out / "summary.json"
    if summary.exists():
        try:
            return f"finished at step {json.loads(summary.read_text())['steps']}"
        except (ValueError, KeyError):
            pass
    return f"stopped at step {entries[-1]['step']}" if entries else "with no checkpoint yet"


def check_run_dir(out: Path, *, resume: bool | str, overwrite: bool, lock_held: bool = False) -> None:
    """Refuse, before any work, a command that would damage what ``out`` holds: a directory another process is
    writing (``lock_held``: its lock is this run's), a new run into a directory that is not empty (unless
    ``overwrite``), a resume of a directory with nothing to resume. Removes nothing."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; give a directory for the run")
    holder = None if lock_held else busy(out)
    if holder:
        raise RunDirBusy(holder)
    if resume:
        if not out.is_dir():
            raise ValueError(f"cannot resume: {out} does not exist; start the run without --resume")
        if resume is True and not Checkpoints(out).entries():
            raise ValueError(f"cannot resume: {out} holds no checkpoint (no {MANIFEST}); start the run without --resume "
                             "(with --overwrite if the directory should be reused)")
        return
    if not out.exists() or overwrite:
        return  # overwrite: the trainer removes the old run's files, once every other check has passed
    others = sorted(p.name for p in out.iterdir() if p.name not in LAUNCHER_FILES and p.name != LOCK)
    if not others:
        return
    if run_files(out):
        raise ValueError(f"{out} already holds a run ({describe_run(out)}): continue it with `{resume_command(out)}` "
                         "(a larger --max-steps extends a finished run), replace it with --overwrite, or choose another --out")
    raise ValueError(f"{out} is not empty (it holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
                     "choose an empty or new --out, or add --overwrite to write the run there anyway")


class RunDirBusy(ValueError):
    """Another process is writing the directory."""


def busy(directory: Path) -> str | None:
    """Why ``directory`` cannot be written now (another process holds its lock), or None. Only looks."""
    try:
        import fcntl

        fd = os.open(directory / LOCK, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _in_use(directory, _holder(fd))
    finally:
        os.close(fd)
    return None


def _in_use(directory: Path, holder: dict) -> str:
    return f"{directory} is in use: {_describe(holder)} is writing it; wait for it to end or stop it, or choose another --out"


class RunLock:
    """The one writer of ``directory``: an exclusive ``flock`` on ``directory/.fp4train.lock``, which holds the
    writer's pid, host, command and start time. The operating system releases the lock when its process ends,
    however it ends, so a lock file that nobody holds is a stale one (its writer was killed): it is named and taken
    over. :meth:`release` removes the file. ``directory`` (and its parents) is created when missing;
    :attr:`created` is the topmost folder that was, so that a run refused before its first write can remove it."""

    def __init__(self, directory: str | Path, command: str):
        self.dir, self.command = Path(directory), command
        self.path = self.dir / LOCK
        self.created: Path | None = None
        self.stale: dict | None = None  # the holder a stale lock named
        self._fd: weakref.finalize | None = None

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # not a POSIX system
            warnings.warn(f"fp4train: no file locks on this system: nothing stops a second process writing {self.dir}",
                          stacklevel=2)
            return self
        self.created = _make_dirs(self.dir)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._undo_dirs()
                raise unwritable(self.dir, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunDirBusy(_in_use(self.dir, holder)) from None
            try:  # a lock released (and its file removed) between this open and this flock: lock the new file
                current = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        self.stale = _holder(fd) or None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        except OSError as e:
            os.close(fd)
            self._undo_dirs()
            raise unwritable(self.dir, e) from None
        self._fd = weakref.finalize(self, _unlock, self.path, fd)  # released when this lock is dropped, at the latest
        return self

    def release(self, *, remove_created: bool = False) -> None:
        """Remove the lock file and unlock; ``remove_created``: also remove the folders :meth:`acquire` made, if they
        are still empty (a run refused before it wrote anything)."""
        if self._fd is None:
            return
        self._fd()
        self._fd = None
        if remove_created:
            self._undo_dirs()

    def _undo_dirs(self) -> None:
        if self.created is None:
            return
        d = self.dir
        while True:
            try:
                d.rmdir()
            except OSError:
                return
            if d == self.created:
                return
            d = d.parent

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def stale_note(self) -> str | None:
        """A line naming the stale lock this lock took over, if it did."""
        if not self.stale:
            return None
        return (f"fp4train: {self.dir} was left locked by {_describe(self.stale)}, which ended without releasing it "
                "(killed?); taking it over")


def _unlock(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)  # first: a process that opened the file meanwhile then sees it is gone
    os.close(fd)  # closing unlocks


def _make_dirs(d: Path) -> Path | None:
    """``mkdir -p d``; the topmost folder it created (None if ``d`` existed)."""
    missing = []
    while not d.exists():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            raise unwritable(m.parent, e) from None
    return missing[-1] if missing else None


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another fp4train process"
    host = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    return f"fp4train {holder.get('command', '')} (pid {holder['pid']}{host}, since {holder.get('since', '?')})".replace("  ", " ")


def unwritable(path: Path, e: OSError) -> ValueError:
    """The one-line error for a place a run cannot write."""
    why = e.strerror or str(e)
    return ValueError(f"cannot write to {path}: {why}; choose an --out on a writable disk")


def check_free_space(out: Path, checkpoint_bytes: int, keep: int) -> str:
    """Refuse a run whose checkpoints would not fit on ``out``'s disk: each save writes the new checkpoint before it
    deletes the one beyond ``keep``, so the run needs room for ``keep + 1`` of them, less what its checkpoints
    already take. Returns a line for the run's header (the size and the room)."""
    import shutil

    have = sum(e["bytes"] for e in Checkpoints(out).entries()) if (out / MANIFEST).exists() else 0
    need = (keep + 1) * checkpoint_bytes - have
    free = shutil.disk_usage(out).free
    if free < need:
        fix = "free space on that disk, choose another --out"
        if keep > 1 and free >= 2 * checkpoint_bytes - have:
            fix += ", or keep fewer checkpoints (--keep-checkpoints 1)"
        raise ValueError(f"{out} has {_size(free)} free, but this run's checkpoints need about {_size(need)} ({keep + 1} of "
                         f"about {_size(checkpoint_bytes)}: --keep-checkpoints {keep} and the one being written): {fix}")
    return f"checkpoints of about {_size(checkpoint_bytes)}, {keep} kept ({_size(free)} free on that disk)"


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file, flushed, then renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["LAUNCHER_FILES", "LOCK", "RUN_FILES", "RunDirBusy", "RunLock", "check_free_space", "check_run_dir", "describe_run",
           "resume_command", "run_files", "unwritable", "write_text"]
