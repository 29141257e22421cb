"""Stopping on a signal without losing work: Ctrl-C (SIGINT) and SIGTERM - what schedulers, ``timeout`` and
``torchrun`` send - are handled alike.

* During a run's steps (:class:`StopRequests`) the first signal lets the step in progress finish; the trainer then
  writes a checkpoint and stops (:class:`TrainingInterrupted`). A second signal stops at once; the last
  checkpoint stays.
* Elsewhere in a command (:func:`terminate_as_interrupt`), SIGTERM raises :class:`Terminated`, a
  ``KeyboardInterrupt``: whatever cleans up after Ctrl-C (temporary files, a comparison's subprocesses, each
  stopped after its step and checkpoint) cleans up after SIGTERM too.

The command's exit status is the shell's for the signal: 130 after SIGINT, 143 after SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived outside a run's steps."""

    signum = signal.SIGTERM


class TrainingInterrupted(KeyboardInterrupt):
    """A signal stopped the run after a whole step, whose checkpoint was written first."""

    def __init__(self, out: Path, step: int, checkpoint: Path, signum: int = signal.SIGINT):
        super().__init__(f"stopped at step {step}; checkpoint {checkpoint}")
        self.out, self.step, self.checkpoint, self.signum = out, step, checkpoint, signum


def exit_code(signum: int) -> int:
    """The shell's exit status of a process a signal ended: 128 + its number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}.get(signum, signal.Signals(signum).name)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within the block SIGTERM raises :class:`Terminated` (in the main thread; elsewhere nothing changes)."""
    if not _main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class StopRequests:
    """Within the block SIGINT and SIGTERM ask the run to stop: :attr:`requested` becomes True and
    :attr:`signum` names the signal; a second signal raises ``KeyboardInterrupt`` (:class:`Terminated` for
    SIGTERM) at once. ``log`` is told what will happen. Only the main thread can take signals."""

    def __init__(self, log):
        self.log, self.requested, self.signum = log, False, None
        self._old: dict = {}

    def __enter__(self) -> StopRequests:
        if _main_thread():
            self._old = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.requested, self.signum = True, signum
        again = "Ctrl-C again" if signum == signal.SIGINT else "a second SIGTERM"
        self.log(f"\nfp4train: {signal_name(signum)}: stopping after this step, with a checkpoint ({again} stops at once)")

    def __exit__(self, *exc) -> bool:
        for s, old in self._old.items():
            signal.signal(s, old)
        return False
