"""What a run records as it trains: ``metrics.jsonl`` and TensorBoard scalars (:class:`MetricsLog`), the
progress bar, and the wall times of its steady steps (:class:`SteadySteps`)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from .config import TrainConfig
from .run_dir import write_text


class MetricsLog:
    """``out/metrics.jsonl`` (one JSON object per record, flushed as written) and, with ``tensorboard``, the same
    numbers as TensorBoard scalars under ``out/tb``. Only the process that writes the run's files (``main``)
    writes; the others' records go nowhere. A resumed run first drops the records a crashed run logged after
    ``step``, its last checkpoint."""

    def __init__(self, out: Path, *, step: int, tensorboard: bool, main: bool):
        path = out / "metrics.jsonl"
        if main:
            _truncate(path, step)
        self._file = open(path if main else os.devnull, "a")
        self._tb = _tensorboard(out / "tb") if tensorboard and main else None

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb:
            for k, v in record.items():
                if k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb:
            self._tb.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _truncate(path: Path, step: int) -> None:
    """On resume, drop records a crashed run logged after its last checkpoint."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    write_text(path, "".join(ln + "\n" for ln in keep))


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("fp4train: tensorboard is not installed; skipping TensorBoard logs (pip install tensorboard)", file=sys.stderr)
        return None
    return SummaryWriter(str(path))


def progress_bar(cfg: TrainConfig, start: int):
    """A progress bar over the run's steps from ``start`` (None without ``cfg.progress``)."""
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=start, desc=f"{cfg.recipe}", unit="step", dynamic_ncols=True, mininterval=0.5)


class SteadySteps:
    """The wall times of a run's steady steps. A step that compiled, the step after it (where CUDA graphs are
    recorded), the run's first step and the steps during which a feature held the model (AdaHOP's BF16
    calibration) are left out: what is left is what the run costs per step from then on. Each step ends on the
    host (the trainer reads its loss), so its wall time covers the GPU's work; the optimizer's kernels queued
    after that read land in the next step's time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._skip = 1  # the first step: allocator and autotuning warm-up

    def add(self, seconds: float, *, compiled: bool, held: bool = False) -> None:
        if compiled or held:
            self._skip = 1  # and the next: it records the CUDA graphs of what was compiled, or is the released model's first
        elif self._skip:
            self._skip -= 1
        else:
            self.times.append(seconds)

    def median(self) -> float:
        return statistics.median(self.times)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
