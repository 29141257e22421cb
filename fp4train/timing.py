"""Timing and provenance helpers (the benchmark scripts in ``bench/``, run summaries).

``median_time``: the median wall time of ``fn`` over ``repeats`` calls after ``warmup`` calls,
measured with CUDA events on a GPU (each call bracketed by two events, synchronised) and with
``time.perf_counter`` on a CPU. ``code_commit``: the fp4train commit being measured.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import torch


def median_time(fn, repeats: int, *, warmup: int = 3, cuda: bool | None = None) -> float:
    """Median seconds per call of ``fn``."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def code_commit() -> str | None:
    """``$FP4TRAIN_COMMIT`` (set it where the tree has no .git, e.g. on a device machine), else git's."""
    if os.environ.get("FP4TRAIN_COMMIT"):
        return os.environ["FP4TRAIN_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
