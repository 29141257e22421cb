"""Data pipeline: sources, validation split kept apart, deterministic and resumable order."""

import gzip
import json
import lzma
import os

import numpy as np
import pytest
import torch

from fp4train.data import PackedBatches, eval_batches, expand, load_splits, load_tokenizer, split_sources


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in docs:
            f.write(json.dumps({"id": i, "text": t}) + "\n")


def _docs(n, tag):
    # each document repeats a unique marker word, so any leak is visible in decoded text
    return [(i, f" {tag}{i:04d}marker " * 40) for i in range(n)]


def test_sources_read_every_supported_format(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", _docs(3, "a"))
    _write_jsonl(tmp_path / "b.jsonl.xz", _docs(3, "b"), lzma.open)
    _write_jsonl(tmp_path / "c.jsonl.gz", _docs(3, "c"), gzip.open)
    (tmp_path / "d.txt").write_text("para one\n\npara two")
    files = expand(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["a.jsonl", "b.jsonl.xz", "c.jsonl.gz", "d.txt"]
    assert expand(str(tmp_path / "*.jsonl*")) == files[:3]
    assert expand(f"{tmp_path / 'a.jsonl'},{tmp_path / 'd.txt'}") == [files[0], files[3]]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        expand(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="matched no"):
        expand(str(tmp_path / "*.parquet"))
    (tmp_path / "e.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported data file"):
        expand(str(tmp_path / "e.csv"))


def test_bad_jsonl_line_names_file_and_line(tmp_path, tok):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a 'text' field"):
        load_splits(str(tmp_path / "bad.jsonl"), None, tok, cache_dir=tmp_path / "c", verbose=False)


def test_heldout_validation_documents_never_reach_training_sequences(tmp_path, tok):
    _write_jsonl(tmp_path / "train-00.jsonl", _docs(200, "d"))
    train, val = load_splits(str(tmp_path / "train-00.jsonl"), None, tok, val_fraction=0.1, cache_dir=tmp_path / "c", verbose=False)
    assert 5 <= len(val.doc_ids) <= 40 and not set(val.doc_ids) & set(train.doc_ids)
    val_markers = {f"d{d.split(':')[1].zfill(4)}marker" for d in val.doc_ids}
    loader = PackedBatches(train, 64, 4, seed=0)
    seen = ""
    for _ in range(loader.n_windows // 4):  # one full epoch
        x, y = loader.next_batch()
        seen += "".join(tok.decode(r.tolist()) for r in torch.cat([x, y[:, -1:]], 1))
    assert not any(m in seen for m in val_markers)
    assert any(f"d{d.split(':')[1].zfill(4)}marker" in seen for d in train.doc_ids[:5])


def test_directory_with_train_and_val_shards_splits_itself(tmp_path, tok):
    _write_jsonl(tmp_path / "train-00.jsonl.xz", _docs(20, "t"), lzma.open)
    _write_jsonl(tmp_path / "val-00.jsonl.xz", _docs(5, "v"), lzma.open)
    train_files, val_files = split_sources(str(tmp_path), None)
    assert [os.path.basename(f) for f in val_files] == ["val-00.jsonl.xz"]
    train, val = load_splits(str(tmp_path), None, tok, cache_dir=tmp_path / "c", verbose=False)
    assert all(d.startswith("train-00") for d in train.doc_ids) and all(d.startswith("val-00") for d in val.doc_ids)
    assert "vmarker" not in tok.decode(np.asarray(train.tokens[:2000]).tolist())


def test_training_on_a_validation_file_is_refused(tmp_path):
    _write_jsonl(tmp_path / "val-00.jsonl", _docs(2, "v"))
    _write_jsonl(tmp_path / "train-00.jsonl", _docs(2, "t"))
    with pytest.raises(ValueError, match="val-00.jsonl, which look like a validation split; never train on it"):
        split_sources(str(tmp_path / "*.jsonl"), None)


def test_order_is_deterministic_from_the_seed(tok):
    train, _ = load_splits(None, None, tok, verbose=False)
    a, b, c = (PackedBatches(train, 64, 8, seed=s) for s in (1, 1, 2))
    wa = [a.next_windows() for _ in range(5)]
    assert all(torch.equal(x, b.next_windows()) for x in wa)
    assert not all(torch.equal(x, c.next_windows()) for x in wa)
    assert torch.equal(a.gather(wa[0])[0], b.gather(wa[0])[0])


def test_resume_mid_epoch_continues_the_same_order(tok):
    train, _ = load_splits(None, None, tok, verbose=False)
    ref = PackedBatches(train, 128, 16, seed=3)
    n = ref.n_windows // 16
    full = [ref.next_windows() for _ in range(n + 5)]  # crosses into the next epoch
    part = PackedBatches(train, 128, 16, seed=3)
    for _ in range(n - 3):
        part.next_windows()
    state = json.loads(json.dumps(part.state_dict()))  # survives serialization
    resumed = PackedBatches(train, 128, 16, seed=3)
    resumed.load_state_dict(state)
    rest = [resumed.next_windows() for _ in range(8)]
    assert all(torch.equal(x, y) for x, y in zip(rest, full[n - 3 :]))
    with pytest.raises(ValueError, match="saved with seq_len=128"):
        PackedBatches(train, 64, 16, seed=3).load_state_dict(state)


def test_cache_is_reused_and_invalidated(tmp_path, tok):
    src = tmp_path / "train-00.jsonl"
    _write_jsonl(src, _docs(30, "x"))
    a, _ = load_splits(str(src), None, tok, cache_dir=tmp_path / "c", verbose=False)
    mtime = os.stat(a.path).st_mtime_ns
    b, _ = load_splits(str(src), None, tok, cache_dir=tmp_path / "c", verbose=False)
    assert b.path == a.path and os.stat(b.path).st_mtime_ns == mtime
    _write_jsonl(src, _docs(31, "x"))
    os.utime(src, (1, 1))
    c, _ = load_splits(str(src), None, tok, cache_dir=tmp_path / "c", verbose=False)
    assert c.path != a.path


def test_too_little_data_is_a_clear_error(tmp_path, tok):
    _write_jsonl(tmp_path / "train-00.jsonl", [(0, "tiny")])
    _write_jsonl(tmp_path / "val-00.jsonl", [(0, "tiny")])
    train, val = load_splits(str(tmp_path), None, tok, cache_dir=tmp_path / "c", verbose=False)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedBatches(train, 64, 4, seed=0)
    with pytest.raises(ValueError, match="too few for one window"):
        eval_batches(val, 64, 4, 2)


def test_shipped_corpus_and_tokenizer():
    tok = load_tokenizer()
    assert tok.vocab_size == 32000 and tok.decode(tok.encode_batch(["Hello, world"])[0]) == "Hello, world"
    train, val = load_splits(None, None, tok, verbose=False)
    assert len(train) > 300_000 and len(val) > 10_000
    with pytest.raises(FileNotFoundError, match="tokenizer file 'nope.json' does not exist"):
        load_tokenizer("nope.json")
