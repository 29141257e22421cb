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
    with pytest.raises(CheckpointError, match="other.pt does not exist"):
        c.load(tmp_path / "other.pt")
    torch.save(_state(2), tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="is not listed"):
        c.load(tmp_path / "other.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save(_state(1), elsewhere / "step_000001.pt")  # the name of a listed checkpoint, in another folder
    with pytest.raises(CheckpointError, match="is not in the run directory"):
        c.load(elsewhere / "step_000001.pt")
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


def _sharded(c, step, v):
    """A sharded checkpoint written by one process (no process group: Distributed Checkpoint's single-process mode)."""
    return c.save_sharded(step, {"model": {"layers.0.w": torch.full((4, 3), float(v))}, "optimizer": {"layers.0.w": {
        "exp_avg": torch.full((4, 3), -float(v))}}}, {"step": step, "config": {"seed": v}}, main=True, barrier=lambda: None)


def test_a_sharded_checkpoint_is_a_checksummed_directory(tmp_path):
    from fp4train.checkpoint import read_tensors

    c = Checkpoints(tmp_path, keep=2)
    for s in (1, 2, 3):
        _sharded(c, s, s)
    assert [e["step"] for e in c.entries()] == [2, 3] and not (tmp_path / "step_000001").exists()
    entry = c.entries()[-1]
    assert entry["file"] == "step_000003" and {".metadata", "meta.pt"} <= set(entry["files"])
    assert entry["bytes"] == sum(f.stat().st_size for f in (tmp_path / "step_000003").iterdir())
    st = c.load()
    assert st["step"] == 3 and st["config"] == {"seed": 3} and st["sharded"] == tmp_path / "step_000003"
    w = read_tensors(st["sharded"], "model")
    assert list(w) == ["layers.0.w"] and torch.equal(w["layers.0.w"], torch.full((4, 3), 3.0))
    assert torch.equal(read_tensors(st["sharded"], "optimizer")["layers.0.w.exp_avg"], torch.full((4, 3), -3.0))
    _sharded(c, 3, 7)  # the same step again replaces it
    assert c.load()["config"] == {"seed": 7} and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))
    c.save(3, _state(3))  # and a file of the same step replaces the directory
    assert not (tmp_path / "step_000003").exists() and c.load()["step"] == 3
    c.prune(1)
    assert not (tmp_path / "step_000002").exists()


def test_a_damaged_shard_is_refused_and_the_previous_checkpoint_named(tmp_path):
    c = Checkpoints(tmp_path, keep=2)
    _sharded(c, 1, 1)
    _sharded(c, 2, 2)
    shard = next((tmp_path / "step_000002").glob("*.distcp"))
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted.*previous good checkpoint is .*step_000001 \(step 1\)"):
        c.load()
    (tmp_path / "step_000001" / "meta.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_000001/meta.pt is missing"):
        c.load(tmp_path / "step_000001")


def test_a_sharded_checkpoint_that_could_run_code_is_refused(tmp_path):
    import os
    import pickle

    c = Checkpoints(tmp_path)
    d = _sharded(c, 1, 1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"step_000001/.metadata is truncated or padded"):
        c.load(d, trust=True)  # listed: checked against the manifest first
    (tmp_path / "checkpoints.json").unlink()
    with pytest.raises(CheckpointError, match=r"refusing to load .*step_000001: its .metadata holds more than checkpoint metadata"):
        c.load(d, trust=True)  # unlisted and trusted: still refused
    d2 = c.save_sharded(2, {"model": {"w": torch.zeros(2)}, "note": "text"}, {"step": 2}, main=True, barrier=lambda: None)
    with pytest.raises(CheckpointError, match=r"it holds entries other than tensors \(note\)"):
        c.load(d2)
