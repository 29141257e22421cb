"""fp4train.timing.median_time: on a GPU the calls are queued back to back (one synchronisation at the end),
so that the host's launch latency is not timed; train_speed keeps a synchronisation per call. Checked here with
a recording stand-in for CUDA events, since CI has no GPU."""

import torch

from fp4train import timing


class _Log(list):
    pass


def _fake_cuda(monkeypatch, log, times):
    clock = iter(range(10_000))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = next(clock)
            log.append("record")

        def synchronize(self):
            log.append("event sync")

        def elapsed_time(self, end):  # ms between the two records, scaled so each pair reads as its call's time
            return times[(end.t - 1) // 2]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("device sync"))


def test_median_time_queues_calls_back_to_back(monkeypatch):
    log = _Log()
    _fake_cuda(monkeypatch, log, times=[3.0, 1.0, 2.0, 9.0, 5.0])
    med = timing.median_time(lambda: log.append("call"), 5, warmup=1, cuda=True)
    assert med == 3.0 / 1e3  # the median of the five pairs' milliseconds, in seconds
    after_warmup = log[log.index("device sync") + 1:]
    assert "event sync" not in after_warmup and after_warmup.count("device sync") == 1 and after_warmup[-1] == "device sync"
    assert after_warmup[:-1] == ["record", "call", "record"] * 5


def test_median_time_can_synchronise_every_call(monkeypatch):
    log = _Log()
    _fake_cuda(monkeypatch, log, times=[4.0, 2.0, 6.0])
    med = timing.median_time(lambda: log.append("call"), 3, warmup=0, cuda=True, back_to_back=False)
    assert med == 4.0 / 1e3
    assert log.count("event sync") == 3 and log[:4] == ["device sync", "record", "call", "record"] and log[4] == "event sync"


def test_code_commit_is_the_checkouts_head(monkeypatch):
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(timing.__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    monkeypatch.delenv("FP4TRAIN_COMMIT", raising=False)
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True).strip()
    assert timing.code_commit() == head
    monkeypatch.setenv("FP4TRAIN_COMMIT", "abc1234")  # a tree without .git (a copy on another machine)
    assert timing.code_commit() == "abc1234"
