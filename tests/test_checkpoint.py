"""Checkpoints: atomic, checksummed, damaged ones refused, the previous good one kept."""

import json

import pytest
import torch

from fp4train.train import CheckpointError, Checkpoints


def _state(v):
    return {"w": torch.full((1000,), float(v)), "step": v}


def test_roundtrip_and_pruning(tmp_path):
    c = Checkpoints(tmp_path, keep=2)
    for s in (10, 20, 30):
        c.save(s, _state(s))
    assert [e["step"] for e in c.entries()] == [20, 30]
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_000020.pt", "step_000030.pt"]
    assert c.load()["step"] == 30 and c.load(tmp_path / "step_000020.pt")["step"] == 20
    assert not list(tmp_path.glob("*.tmp"))


def test_truncated_checkpoint_is_refused_and_the_previous_one_named(tmp_path):
    c = Checkpoints(tmp_path, keep=2)
    c.save(10, _state(10))
    c.save(20, _state(20))
    p = tmp_path / "step_000020.pt"
    p.write_bytes(p.read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"step_000020.pt is truncated.*previous good checkpoint is .*step_000010.pt \(step 10\): resume from it with --resume"):
        c.load()
    assert c.load(tmp_path / "step_000010.pt")["step"] == 10  # kept, and loadable


def test_corrupted_byte_is_refused(tmp_path):
    c = Checkpoints(tmp_path)
    c.save(5, _state(5))
    p = tmp_path / "step_000005.pt"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match="corrupted: its SHA-256 does not match.*no earlier good checkpoint"):
        c.load()


def test_missing_and_unlisted(tmp_path):
    c = Checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        c.load()
    c.save(1, _state(1))
    with pytest.raises(CheckpointError, match="is not listed"):
        c.load(tmp_path / "other.pt")
    (tmp_path / "step_000001.pt").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        c.load()


def test_an_interrupted_save_leaves_the_manifest_consistent(tmp_path, monkeypatch):
    c = Checkpoints(tmp_path)
    c.save(1, _state(1))

    def boom(*a, **k):
        raise KeyboardInterrupt  # dies mid-write

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        c.save(2, _state(2))
    monkeypatch.undo()
    assert [e["step"] for e in json.loads((tmp_path / "checkpoints.json").read_text())["checkpoints"]] == [1]
    assert c.load()["step"] == 1 and not list(tmp_path.glob("*.tmp"))
