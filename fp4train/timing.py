"""Timing and provenance helpers (the benchmark scripts in ``bench/``, run summaries).

``median_time``: the median wall time of ``fn`` over ``repeats`` calls after ``warmup`` calls,
measured with CUDA events on a GPU (each call bracketed by two events) and with ``time.perf_counter``
on a CPU. On a GPU the calls are queued back to back and synchronised once at the end, so that the
host's launch work for a call overlaps the GPU's run of the one before: an event pair then times
the GPU's work, not the host's latency to launch it (with a synchronisation after every call, the
GPU idles from the first event until the launch lands: 40-60 us a call for the Triton wrappers). ``back_to_back=False`` keeps that per-call synchronisation (train_speed's
steps, whose series started that way). ``code_commit``: the fp4train commit being measured.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import torch


def median_time(fn, repeats: int, *, warmup: int = 3, cuda: bool | None = None, back_to_back: bool = True) -> float:
    """Median seconds per call of ``fn`` (see the module docstring for ``back_to_back``)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    if cuda:
        events = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
            if not back_to_back:
                e.synchronize()
        torch.cuda.synchronize()
        ts = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def code_commit() -> str | None:
    """``$FP4TRAIN_COMMIT`` (set it where the tree has no .git, e.g. on a device machine), else git's."""
    if os.environ.get("FP4TRAIN_COMMIT"):
        return os.environ["FP4TRAIN_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]  # the checkout: fp4train/timing.py -> fp4train -> root
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
