"""Nothing a user does loses a run, and every bad input is one line of error, exit code 2.

Each test drives the CLI (``fp4train.cli.main`` in this process, or the ``fp4train`` command) on the
``tiny`` model and the CPU, the way a user would.
"""

import gzip
import hashlib
import json
import pickle
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.cli import build_parser, main
from fp4train.train import Checkpoints, TrainConfig, Trainer

SMALL = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--no-progress", "--no-tensorboard",
         "--device", "cpu"]


def _run(args, capsys):
    """``main(args)``: (exit code, stderr)."""
    capsys.readouterr()
    rc = main(args)
    return rc, capsys.readouterr().err


def _one_line_error(rc, err, *culprits):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("fp4train: error: "), err
    assert "Traceback" not in err
    for c in culprits:
        assert c in lines[0], (c, lines[0])
    return lines[0]


def _last_line_error(rc, err, *culprits):
    """A run that failed after it started: what it printed, then one line naming the culprit; exit code 2."""
    assert rc == 2 and "Traceback" not in err, err
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert last.startswith("fp4train: error: ") and sum(ln.startswith("fp4train: error") for ln in err.splitlines()) == 1, err
    for c in culprits:
        assert c in last, (c, last)
    return last


def _train(out, capsys, *extra, steps=2):
    rc, err = _run(["train", *SMALL, "--max-steps", str(steps), "--eval-every", "0", "--out", str(out), *extra], capsys)
    assert rc == 0, err
    return err


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- 1. resuming a finished run -------------------------------------------------------------
def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    _train(out, capsys)
    before = _files(out)
    rc, err = _run(["train", "--out", str(out), "--resume"], capsys)
    assert rc == 0 and f"{out} is finished at step 2" in err and "larger --max-steps" in err
    assert _files(out) == before  # summary.json (its val loss), metrics, config, checkpoints: byte for byte
    assert json.loads((out / "summary.json").read_text())["final_val_loss"] is not None


# ---- 2. a validation split too small; the final checkpoint comes before evaluation -----------
def test_a_dataset_without_a_validation_window_is_refused_before_training(tmp_path, capsys):
    txt = tmp_path / "small.txt"
    txt.write_text(("All the world's a stage, and all the men and women merely players. " * 45)[:3000])
    out = tmp_path / "run"
    rc, err = _run(["train", *SMALL, "--data", str(txt), "--out", str(out)], capsys)
    _one_line_error(rc, err, "validation split has 0 tokens", "--val-data", "--val-fraction")
    assert not out.exists()  # nothing was trained or written


def test_the_final_checkpoint_is_written_before_the_final_evaluation(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real = Trainer.evaluate

    def broken(self):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        main(["train", *SMALL, "--max-steps", "3", "--eval-every", "0", "--ckpt-every", "0", "--out", str(out)])
    assert Checkpoints(out).entries()[-1]["step"] == 3 and not (out / "summary.json").exists()
    monkeypatch.setattr(Trainer, "evaluate", real)
    monkeypatch.setattr(Trainer, "train_step", lambda self: pytest.fail("the run trained again"))
    rc, err = _run(["train", "--out", str(out), "--resume"], capsys)  # finishes: evaluates, writes the summary
    assert rc == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] > 0


# ---- 3. a new run into a directory that holds one --------------------------------------------
def test_a_new_run_never_overwrites_a_finished_one_unless_asked(tmp_path, capsys):
    out = tmp_path / "run"
    _train(out, capsys)
    before = _files(out)
    rc, err = _run(["train", *SMALL, "--max-steps", "3", "--out", str(out)], capsys)
    _one_line_error(rc, err, str(out), "finished at step 2", "--resume", "--overwrite")
    assert _files(out) == before
    rc, err = _run(["train", *SMALL, "--overwrite", "--data", str(tmp_path / "missing.txt"), "--out", str(out)], capsys)
    _one_line_error(rc, err, "missing.txt")
    assert _files(out) == before  # --overwrite removes the old run only once every check has passed
    _train(out, capsys, "--overwrite", steps=3)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3] and [e["step"] for e in Checkpoints(out).entries()] == [3]
    assert not (out / "step_000002.pt").exists()
    rc, err = _run(["train", *SMALL, "--out", str(tmp_path)], capsys)  # a directory with other things in it
    _one_line_error(rc, err, "is not empty", "run")


def test_resume_and_overwrite_cannot_be_combined_and_a_missing_run_is_not_created(tmp_path, capsys):
    rc, err = _run(["train", *SMALL, "--out", str(tmp_path / "r"), "--resume", "--overwrite"], capsys)
    _one_line_error(rc, err, "--resume", "--overwrite")
    (tmp_path / "empty").mkdir()
    rc, err = _run(["train", *SMALL, "--out", str(tmp_path / "empty"), "--resume"], capsys)
    _one_line_error(rc, err, "holds no checkpoint")
    assert not (tmp_path / "r").exists()


# ---- 4. compare: runs made with other settings ------------------------------------------------
def test_compare_refuses_runs_made_with_other_settings_and_reruns_them_on_request(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--recipes", "mxfp4", "--eval-every", "0", "--out", str(out)]
    rc, err = _run(args + ["--max-steps", "2"], capsys)
    assert rc == 0, err
    assert "One seed: these gaps carry no estimate of noise" in (out / "report.md").read_text()
    assert f"report in {out / 'report.md'}" in err
    for run in ("bf16-seed0", "mxfp4-seed0"):  # a finished run keeps its last checkpoint only
        assert [e["step"] for e in Checkpoints(out / "runs" / run).entries()] == [2]
        assert len(list((out / "runs" / run).glob("step_*.pt"))) == 1
    rc, err = _run(args + ["--max-steps", "2"], capsys)  # the same settings: reused
    assert rc == 0 and "already done with these settings" in err
    rc, err = _run(args + ["--max-steps", "3", "--lr", "0.001"], capsys)
    line = _one_line_error(rc, err, "bf16-seed0", "mxfp4-seed0", "max_steps 2 (now 3)", "lr 0.003 (now 0.001)", "--overwrite")
    assert json.loads((out / "compare.json").read_text())["base"]["max_steps"] == 2, line  # unchanged
    rc, err = _run(args + ["--max-steps", "3", "--lr", "0.001", "--overwrite"], capsys)
    assert rc == 0, err
    rep = json.loads((out / "report.json").read_text())
    assert rep["steps"] == 3 and all(r["steps"] == 3 for r in rep["runs"])


# ---- 5. AdaHOP is never silently BF16 ----------------------------------------------------------
def test_adahop_without_calibration_says_it_runs_in_bf16(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="needs a calibration: until one is applied its layers run in BF16"):
        fp4train.convert(model, "adahop")
    assert model[0].uncalibrated and "uncalibrated: runs in BF16" in repr(model[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*needs a calibration")
        fp4train.convert(nn.Sequential(nn.Linear(64, 64)), "mxfp4")  # other recipes: no warning
    assert not fp4train.convert(nn.Sequential(nn.Linear(64, 64)), "mxfp4")[0].uncalibrated

    rc, err = _run(["train", *SMALL, "--recipe", "adahop", "--max-steps", "10", "--out", str(tmp_path / "a")], capsys)
    _one_line_error(rc, err, "first 20 steps calibrating in BF16", "--max-steps 10", "--calibration")
    assert not (tmp_path / "a").exists()


def test_reports_name_the_steps_spent_in_bf16_calibration(tmp_path, capsys):
    recipe = tmp_path / "adahop2.json"
    fp4train.recipes.get("adahop").replace(name="adahop2", calibration_steps=2).save(recipe)
    out = tmp_path / "cmp"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*needs a calibration")  # the trainer calibrates: convert() does not warn
        rc, err = _run(["compare", *SMALL, "--recipes", str(recipe), "--max-steps", "3", "--eval-every", "0", "--out", str(out)],
                       capsys)
    assert rc == 0, err
    assert json.loads((out / "runs" / "adahop2-seed0" / "summary.json").read_text())["bf16_steps"] == 2
    assert json.loads((out / "runs" / "bf16-seed0" / "summary.json").read_text())["bf16_steps"] == 0
    assert "Steps spent in BF16 calibration (counted in each run's steps): " in (out / "report.md").read_text()
    assert "adahop2 2 of 3" in (out / "report.md").read_text()  # a recipe file by its stem
    rep = json.loads((out / "report.json").read_text())  # the evidence: the recipe file's recipe and the calibration
    assert rep["recipe_files"] == {"adahop2": json.loads(recipe.read_text())}
    calibrated = [x for x in rep["runs"] if x["recipe_arg"] == str(recipe)]
    assert calibrated and all(x["adahop_calibration"] == json.loads((out / "runs" / x["run"] / "adahop_calibration.json")
                                                                    .read_text()) for x in calibrated)
    assert "(2 of them BF16 calibration)" in err


# ---- 6. compare checks every recipe before training ---------------------------------------------
def test_compare_checks_every_recipe_before_the_first_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Trainer, "run", lambda self: pytest.fail("a run started"))
    rc, err = _run(["compare", *SMALL, "--recipes", "mxfp4,mxfp44", "--out", str(tmp_path / "c")], capsys)
    _one_line_error(rc, err, "unknown recipe 'mxfp44'")
    assert not (tmp_path / "c").exists()
    rc, err = _run(["compare", *SMALL, "--recipes", "mxfp4,adahop", "--max-steps", "5", "--out", str(tmp_path / "c")], capsys)
    _one_line_error(rc, err, "adahop", "--max-steps 5")


# ---- 7. training and validation data overlap ------------------------------------------------------
def test_the_same_file_as_training_and_validation_data_is_refused(tmp_path, capsys):
    txt = tmp_path / "text.txt"
    txt.write_text("some text\n\n" * 500)
    rc, err = _run(["train", *SMALL, "--data", str(txt), "--val-data", str(txt), "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, str(txt.resolve()), "both training and validation data")
    rc, err = _run(["train", *SMALL, "--val-data", "shakespeare", "--out", str(tmp_path / "r")], capsys)  # the default data
    _one_line_error(rc, err, "both training and validation data")


# ---- 8. every bad input: one line naming the culprit, exit code 2 -------------------------------
def _bad_inputs(tmp_path):
    """(args, text the one-line error must hold) for each bad input a user can give."""
    d = tmp_path
    (d / "wrong_type.toml").write_text('max_steps = "ten"\n')
    (d / "syntax.toml").write_text("max_steps = = 3\n")
    (d / "recipe.toml").write_text('name = "mine"\nkeep_last_blokcs = 0.1\n[linear.fprop.a]\nformat = "mxfp4"\n')
    (d / "binary.txt").write_bytes(b"\x00\x01\x02ELF" * 500)
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n\n".encode("latin-1") * 200)
    gz = gzip.compress(b"".join(b'{"text": "line %d of a file cut short"}\n' % i for i in range(5000)))
    (d / "corrupt.jsonl.gz").write_bytes(gz[: len(gz) // 2])  # truncated
    (d / "data.parquet").write_bytes(b"PAR1")
    run = d / "damaged_manifest"
    run.mkdir()
    (run / "checkpoints.json").write_text('{"checkpoints": [{"step": 1, "fi')
    out = ["--out", str(d / "out")]
    tiny = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "max_position_embeddings": 128}
    (d / "bert.json").write_text(json.dumps({"model_type": "bert", **tiny}))
    (d / "llama.json").write_text(json.dumps({"model_type": "llama", **tiny}))
    (d / "bart.json").write_text(json.dumps({"model_type": "bart", "vocab_size": 128, "d_model": 64}))
    return [
        (["train", *SMALL[2:], "--hf-config", str(d / "bert.json"), *out], ["bert.json", "'bert' is an encoder", '"is_decoder": true']),
        (["train", *SMALL[2:], "--hf-config", str(d / "bart.json"), *out], ["bart.json", '"is_encoder_decoder": true']),
        (["train", *SMALL[2:], "--model", "60m", "--hf-config", str(d / "llama.json"), *out], ["--model 60m and --hf-config",
                                                                                          "both name the model"]),
        (["recipes", "--show", "nope"], ["unknown recipe 'nope'"]),
        (["train", *SMALL[:-2], "--device", "gpu", *out], ["device must be", "'gpu'"]),
        (["train", *SMALL, "--model", "huge", *out], ["--model", "invalid choice", "'huge'"]),
        (["train", "--config", str(d / "wrong_type.toml"), *out], ["wrong_type.toml", "max_steps must be an integer", "'ten'"]),
        (["train", "--config", str(d / "syntax.toml"), *out], ["syntax.toml", "not valid TOML"]),
        (["train", *SMALL, "--recipe", str(d / "recipe.toml"), *out], ["recipe.toml", "keep_last_blokcs"]),
        (["train", *SMALL, "--data", str(d / "binary.txt"), *out], ["binary.txt"]),
        (["train", *SMALL, "--data", str(d / "latin1.txt"), *out], ["latin1.txt", "not UTF-8"]),
        (["train", *SMALL, "--data", str(d / "corrupt.jsonl.gz"), *out], ["corrupt.jsonl.gz"]),
        (["train", *SMALL, "--data", str(d / "data.parquet"), *out], ["data.parquet", "pip install pyarrow"]),
        (["train", *SMALL, "--data", "hf:some/dataset", *out], ["hf:some/dataset", "pip install 'fp4train[hf]'"]),
        (["train", "--out", str(run), "--resume"], ["checkpoints.json is damaged", "--trust-checkpoint"]),
        (["train", *SMALL, "--betas", "0.9", *out], ["--betas", "two numbers"]),
        (["compare", *SMALL, "--seeds", "0,x", *out], ["--seeds", "'0,x'"]),
        (["train", *SMALL, "--data", str(d / "missing.txt"), *out], ["missing.txt", "does not exist"]),
    ]


def _bad_inputs_around_a_run(d, done):
    """(args, text the one-line error must hold) for bad input around the finished run ``done``: numbers out of range,
    resuming it with them, and ``eval``/``export``/``generate``/``compare`` with bad paths and values."""
    run = str(done)
    (d / "a_file").write_text("x")
    (d / "empty_run").mkdir()
    cmp = d / "cmp" / "runs"
    (cmp / "bf16-seed0").mkdir(parents=True)
    (cmp / "mxfp4-seed0").mkdir()
    out = ["--out", str(d / "out")]
    cases = [
        (["train", *SMALL, "--grad-clip", "-1", *out], ["grad_clip must be > 0 (or inf), got -1.0 (--grad-clip)"]),
        (["train", *SMALL, "--grad-clip", "0", *out], ["grad_clip must be > 0", "(--grad-clip)"]),
        (["train", *SMALL, "--weight-decay", "-1", *out], ["weight_decay must be >= 0", "(--weight-decay)"]),
        (["train", *SMALL, "--min-lr-ratio", "5", *out], ["min_lr_ratio must be in [0, 1], got 5.0 (--min-lr-ratio)"]),
        (["train", *SMALL, "--lr", "inf", *out], ["lr must be > 0 and finite, got inf (--lr)"]),
        (["train", *SMALL, "--lr", "nan", *out], ["lr must be > 0 and finite, got nan (--lr)"]),
        (["train", *SMALL, "--betas", "1.5,0.9", *out], ["each of betas must be in [0, 1), got 1.5,0.9 (--betas)"]),
        (["train", "--out", run, "--resume", "--max-steps", "4", "--lr", "nan"], ["lr must be > 0 and finite"]),
        (["train", "--out", run, "--resume", "--max-steps", "4", "--grad-clip", "-1"], ["grad_clip must be > 0"]),
        (["eval", "--run", run, "--json", str(d)], [f"--json {d} is a folder"]),
        (["eval", "--run", run, "--json", "/proc/no/e.json"], ["--json /proc/no/e.json cannot be written"]),
        (["eval", "--run", run, "--max-tokens", "0"], ["--max-tokens", "must be >= 2, got 0"]),
        (["eval", "--run", run, "--max-tokens", "-5"], ["--max-tokens", "must be >= 2, got -5"]),
        (["eval", "--run", run, "--batch-size", "0"], ["--batch-size", "must be >= 1, got 0"]),
        (["eval", "--run", str(d / "empty_run")], ["holds no checkpoint", "give the --out of an fp4train train run"]),
        (["eval", "--run", run, "--checkpoint", "/nope.pt"], ["checkpoint /nope.pt does not exist"]),
        (["export", "--run", str(d / "cmp"), "--out", str(d / "hf")],
         ["is a comparison's folder", f"--run {cmp / 'bf16-seed0'}", "mxfp4-seed0"]),
        (["export", "--run", run, "--out", str(d / "a_file")], [f"--out {d / 'a_file'} is a file"]),
        (["generate", "--run", run, "--prompt", "To be", "--max-new-tokens", "100000000"],
         ["--max-new-tokens 100000000 is more than the model's context of 512 tokens"]),
        (["generate", "--run", run, "--prompt", "x", "--checkpoint", "/nope.pt"], ["checkpoint /nope.pt does not exist"]),
        (["generate", "--run", run, "--prompt", "x", "--temperature", "nan"], ["--temperature", "finite number >= 0"]),
        (["compare", *SMALL, "--recipes", "", *out], ["--recipes ''", "names no recipe"]),
        (["compare", *SMALL, "--recipes", "mxfp4", "--seeds", "0,-1", *out], ["--seeds", "-1"]),
        (["analyze", *SMALL, "--steps", "0", *out], ["--steps", "must be >= 1, got 0"]),
    ]
    if not torch.cuda.is_available():
        cases.append((["compare", *SMALL, "--gpus", "0", *out], ["--gpus 0: PyTorch sees no CUDA GPU", "--gpus none"]))
    else:
        cases.append((["compare", *SMALL, "--gpus", "99", *out], ["GPU(s) [99] do not exist"]))
    return cases


def test_every_bad_input_is_one_line_naming_the_culprit_with_exit_code_2(tmp_path, capsys, monkeypatch, finished_run):
    import shutil

    import fp4train.evaluate

    done = tmp_path / "done"
    shutil.copytree(finished_run, done)
    before = _files(done)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # the parquet and hf extras are not installed (import fails)
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(Trainer, "run", lambda self: pytest.fail("training started despite the bad input"))
    monkeypatch.setattr(fp4train.evaluate, "build_model", lambda *a: pytest.fail("a model was built despite the bad input"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("FP4TRAIN_CACHE", str(cache))
    for args, culprits in _bad_inputs(tmp_path) + _bad_inputs_around_a_run(tmp_path, done):
        try:
            rc, err = _run(args, capsys)
        except SystemExit as e:  # argparse's errors
            rc, err = e.code, capsys.readouterr().err
        _one_line_error(rc, err, *culprits)
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()
    assert _files(done) == before  # the run's checkpoints, metrics and summary: byte for byte
    assert not [p.name for p in cache.rglob("*tmp*")]  # failed tokenizations leave no temporary files


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_device_cuda_without_a_gpu_is_an_error_not_a_traceback(tmp_path, capsys):
    rc, err = _run(["train", *SMALL[:-2], "--device", "cuda", "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, "--device cuda", "no CUDA GPU", "--device cpu")


def test_bad_input_from_the_command_line_prints_no_traceback(tmp_path):
    """The ``fp4train`` command itself (a subprocess): argparse and the config checks alike."""
    (tmp_path / "bad.toml").write_text("lr = [1, 2]\n")
    for args, culprit in ((["train", "--config", str(tmp_path / "bad.toml")], "lr must be a number"),
                          (["recipes", "--show", "nope"], "unknown recipe"),
                          (["train", "--dtype", "fp16"], "--dtype")):
        r = subprocess.run([sys.executable, "-m", "fp4train", *args], capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr and culprit in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "fp4train", "train", *SMALL, "--max-steps", "100000", "--ckpt-every", "0", "--eval-every", "0",
            "--log-every", "1", "--out", str(out)]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130, err
    assert "Traceback" not in err and f"continue with: fp4train train --out {out} --resume" in err
    stopped = Checkpoints(out).entries()[-1]["step"]
    assert f"stopped at step {stopped}" in err and stopped >= 2
    r = subprocess.run([sys.executable, "-m", "fp4train", "train", "--out", str(out), "--resume", "--max-steps", str(stopped + 1)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and f"resumed {out} at step {stopped}" in r.stderr, r.stderr


# ---- 9. checkpoints cannot run code ------------------------------------------------------------------
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    ck = tmp_path / "step_000001.pt"
    ck.write_bytes(pickle.dumps({"step": 1, "x": _Payload(str(marker))}, protocol=2))
    data = ck.read_bytes()
    (tmp_path / "checkpoints.json").write_text(json.dumps({"checkpoints": [
        {"step": 1, "file": ck.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}]}))
    with pytest.raises(fp4train.train.CheckpointError, match="refusing to load .*step_000001.pt: it holds objects other than tensors"):
        Checkpoints(tmp_path).load()
    assert not marker.exists()


def test_a_checkpoint_whose_manifest_was_lost_loads_when_trusted(tmp_path, capsys):
    out = tmp_path / "run"
    _train(out, capsys)
    (out / "checkpoints.json").unlink()
    ck = out / "step_000002.pt"
    rc, err = _run(["train", "--out", str(out), "--resume", str(ck), "--max-steps", "3"], capsys)
    _one_line_error(rc, err, "is not listed", "--trust-checkpoint")
    rc, err = _run(["train", "--out", str(out), "--resume", str(ck), "--trust-checkpoint", "--max-steps", "3"], capsys)
    assert rc == 0 and f"resumed {out} at step 2" in err, err


# ---- 11. the smaller things -----------------------------------------------------------------------
def test_help_shows_real_defaults_and_only_the_flags_each_command_uses():
    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("train", "compare", "analyze"):
        assert "(default: None)" not in sub[name].format_help(), name
    flat = {n: " ".join(sub[n].format_help().split()) for n in sub}
    assert "(default: runs/train)" in flat["train"] and "(default: runs/compare)" in flat["compare"]
    assert "(default: runs/analysis)" in flat["analyze"] and "runs/train" not in flat["analyze"]
    for flag in ("--recipe ", "--max-steps", "--ckpt-every", "--keep-checkpoints", "--compile-mode", "--calibration"):
        assert flag not in flat["analyze"], flag
    assert "{" + ",".join(fp4train.models.names()) + "}" in flat["train"] and "{eager,compiled,triton}" in flat["train"]
    assert "{default,reduce-overhead}" in flat["train"] and "{auto,bf16,fp32}" in flat["train"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fp4train {fp4train.__version__}"


def test_the_run_header_is_printed_before_the_progress_bar(tmp_path, monkeypatch):
    from fp4train.train import trainer

    events = []
    monkeypatch.setattr(trainer, "progress_bar", lambda cfg, start: events.append("bar"))
    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=2, max_steps=1, eval_batches=1, out=str(tmp_path / "r"),
                      tensorboard=False, device="cpu")
    Trainer(cfg, log=lambda m: events.append("header" if "fp4train: model tiny" in m else "log")).run()
    assert events.index("header") < events.index("bar")


def test_config_values_of_the_wrong_type_are_named():
    with pytest.raises(ValueError, match=r"max_steps must be an integer, got '10' \(str\)"):
        TrainConfig(max_steps="10")
    with pytest.raises(ValueError, match=r"compile must be true or false, got 1 \(int\)"):
        TrainConfig(compile=1)
    assert TrainConfig(lr=1).lr == 1.0 and isinstance(TrainConfig(lr=1).lr, float)  # a TOML integer for a float


def test_ctrl_c_before_the_first_step_says_to_start_again(tmp_path, capsys, monkeypatch):
    from fp4train.train import trainer

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "load_data", interrupted)  # Ctrl-C while the data is tokenized
    rc, err = _run(["train", *SMALL, "--out", str(tmp_path / "r")], capsys)
    assert rc == 130 and "Traceback" not in err
    assert "interrupted; continue with: the same command with --overwrite" in err


def test_runs_made_before_a_setting_existed_compare_as_they_ran(tmp_path):
    """A run whose config.json predates --optimizer and the device-dependent compile default is the same run as
    today's request on this machine where it ran the same way (AdamW; eager on a CPU), and another one where not."""
    from fp4train.train.compare import settings_changed

    cfg = TrainConfig(model="tiny", out=str(tmp_path / "run"), device="cpu")
    old = {k: v for k, v in cfg.to_dict().items() if k != "optimizer"}
    old.update(compile=False, compile_mode="default")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"train": old}))
    assert settings_changed(cfg) == ""
    assert settings_changed(TrainConfig(**{**cfg.to_dict(), "optimizer": "qadamw"})) == "optimizer 'adamw' (now 'qadamw')"
    assert settings_changed(TrainConfig(**{**cfg.to_dict(), "compile": True})) == "compile False (now True)"
    # a BF16 run saved before the LoRA factors' multiplier existed (it ran with 1.0) is today's BF16 run: no LoRA
    old.pop("lora_lr_multiplier", None)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"train": old}))
    assert settings_changed(cfg) == ""
    full = TrainConfig(**{**cfg.to_dict(), "recipe": "fullstack"})
    old["recipe"] = "fullstack"
    (tmp_path / "run" / "config.json").write_text(json.dumps({"train": old}))
    assert settings_changed(full) == "lora_lr_multiplier 1.0 (now 2.0)"


# ---- 12. numbers out of range: refused where they are defined, naming the flag and its range -----------------------
@pytest.mark.parametrize("flag,value,says", [
    ("--grad-clip", "-1", "grad_clip must be > 0 (or inf), got -1.0 (--grad-clip)"),
    ("--grad-clip", "0", "grad_clip must be > 0 (or inf), got 0.0 (--grad-clip)"),
    ("--weight-decay", "-1", "weight_decay must be >= 0 and finite, got -1.0 (--weight-decay)"),
    ("--min-lr-ratio", "5", "min_lr_ratio must be in [0, 1], got 5.0 (--min-lr-ratio)"),
    ("--lr", "inf", "lr must be > 0 and finite, got inf (--lr)"),
    ("--lr", "nan", "lr must be > 0 and finite, got nan (--lr)"),
    ("--betas", "1.5,0.9", "each of betas must be in [0, 1), got 1.5,0.9 (--betas)"),
    ("--seed", "-3", "seed must be in [0, 2**63 - 1], got -3 (--seed)"),
    ("--val-fraction", "1", "val_fraction must be in (0, 1), got 1.0 (--val-fraction)"),
])
def test_out_of_range_numbers_are_refused_from_flags_toml_and_python_alike(tmp_path, capsys, monkeypatch, flag, value, says):
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("a run was set up"))
    rc, err = _run(["train", *SMALL, flag, value, "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, says)
    field = flag[2:].replace("-", "_")
    parsed = [float(v) for v in value.split(",")] if "," in value else float(value)
    toml = tmp_path / "run.toml"
    toml.write_text(f"{field} = {f'[{value}]' if ',' in value else value}\n")  # TOML spells inf and nan so too
    rc, err = _run(["train", "--config", str(toml), "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, str(toml), says)
    with pytest.raises(ValueError, match=re.escape(says)):
        TrainConfig(**{field: tuple(parsed) if isinstance(parsed, list) else int(parsed) if field == "seed" else parsed})
    assert not (tmp_path / "r").exists()


def test_numbers_in_range_are_taken_and_infinite_clipping_means_none():
    cfg = TrainConfig(grad_clip=float("inf"), weight_decay=0.0, min_lr_ratio=1.0, betas=(0.0, 0.999), warmup_steps=0)
    assert cfg.grad_clip == float("inf")
    with pytest.raises(ValueError, match=r"lr \* weight_decay must be < 1"):
        TrainConfig(lr=0.5, weight_decay=2.0)


def test_help_gives_every_numbers_range_and_what_the_steps_count():
    sub = build_parser()._subparsers._group_actions[0].choices
    flat = " ".join(sub["train"].format_help().split())
    assert "peak learning rate (of every optimizer); > 0 (default: 0.003)" in flat and "(AdamW)" not in flat
    assert "AdaHOP's BF16 calibration steps are among them" in flat
    assert "inf: no clipping; > 0 (or inf) (default: 1.0)" in flat
    gen = " ".join(sub["generate"].format_help().split())
    for text in ("tokens to generate", "(default: 50)", "0: greedy (default: 0.8)", "(default: 0)", "--trust-checkpoint"):
        assert text in gen, text


# ---- 13. one writer per run directory -------------------------------------------------------------------------------
@pytest.fixture
def start():
    """``start(args)``: ``fp4train *args`` as a subprocess (stderr piped), killed at the test's end if still running."""
    procs = []

    def run(args, *, launcher=("-m", "fp4train")):
        p = subprocess.Popen([sys.executable, *launcher, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _wait_for(path, lines=0, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and (not lines or path.read_text().count("\n") >= lines):
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} did not appear")


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path, start):
    """Two `train` into one --out started together: the second is refused before it writes anything, naming the first's
    pid; so are a resume and a comparison into the busy folder. The first run is untouched by them."""
    from fp4train.train.run_dir import LOCK

    out = tmp_path / "run"
    first = start(["train", *SMALL, "--max-steps", "100000", "--ckpt-every", "2", "--eval-every", "0", "--log-every", "1",
                    "--out", str(out)])
    _wait_for(out / "metrics.jsonl", lines=3)
    for args in (["train", *SMALL, "--max-steps", "5", "--out", str(out)],
                 ["train", "--out", str(out), "--resume"],
                 ["train", *SMALL, "--overwrite", "--out", str(out)]):
        r = subprocess.run([sys.executable, "-m", "fp4train", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{out} is in use: fp4train train (pid {first.pid}, since " in r.stderr, r.stderr
    first.send_signal(signal.SIGINT)
    err = first.communicate(timeout=120)[1]
    assert first.returncode == 130, err
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer's records, in order
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 100000
    assert not (out / LOCK).exists()  # released on exit


def test_the_lock_is_taken_before_any_work_and_released_after(tmp_path, capsys, monkeypatch):
    from fp4train.train.run_dir import LOCK, RunLock

    out = tmp_path / "run"
    held = RunLock(out, "compare").acquire()  # another writer (in this process: the lock is per open file)
    import fp4train.train.compare

    for module in (fp4train.train.trainer, fp4train.train.compare):
        monkeypatch.setattr(module, "load_data", lambda *a: pytest.fail("the data was loaded"))
    rc, err = _run(["train", *SMALL, "--out", str(out)], capsys)
    _one_line_error(rc, err, f"{out} is in use: fp4train compare (pid {__import__('os').getpid()}", "choose another --out")
    rc, err = _run(["compare", *SMALL, "--recipes", "mxfp4", "--out", str(out)], capsys)
    _one_line_error(rc, err, f"{out} is in use: fp4train compare")
    held.release()
    assert not (out / LOCK).exists()
    monkeypatch.undo()
    _train(out, capsys)
    assert not (out / LOCK).exists() and (out / "summary.json").exists()


def test_a_lock_left_by_a_killed_run_is_named_and_taken_over(tmp_path, capsys, start):
    """SIGKILL leaves the lock file; the operating system has dropped the lock itself, so the next run takes it over,
    saying whose it was, and resumes as usual."""
    out = tmp_path / "run"
    p = start(["train", *SMALL, "--max-steps", "100000", "--ckpt-every", "2", "--eval-every", "0", "--log-every", "1",
                "--out", str(out)])
    _wait_for(out / "checkpoints.json")
    p.kill()
    p.wait()
    assert (out / ".fp4train.lock").exists()
    step = Checkpoints(out).entries()[-1]["step"]
    rc, err = _run(["train", "--out", str(out), "--resume", "--max-steps", str(step + 1)], capsys)
    assert rc == 0, err
    assert f"was left locked by fp4train train (pid {p.pid}, since " in err and "taking it over" in err
    assert f"resumed {out} at step {step}" in err and not (out / ".fp4train.lock").exists()


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    rc, err = _run(["train", *SMALL, "--data", str(tmp_path / "missing.txt"), "--out", str(out)], capsys)
    _one_line_error(rc, err, "missing.txt")
    assert not (tmp_path / "new").exists()  # the folders the lock made are gone again


# ---- 14. a full or read-only disk ---------------------------------------------------------------------------------
class _FullDisk:
    """A file whose disk fills up after ``room`` bytes: writes then fail with ENOSPC, as the system's would."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            raise OSError(28, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_checkpoint_write_that_fills_the_disk_keeps_the_last_one_and_the_run_resumes_bit_for_bit(tmp_path, capsys,
                                                                                                      monkeypatch):
    import builtins

    from fp4train import checkpoint

    args = [*SMALL, "--max-steps", "6", "--ckpt-every", "2", "--eval-every", "3", "--log-every", "1"]
    rc, err = _run(["train", *args, "--out", str(tmp_path / "ref")], capsys)
    assert rc == 0, err
    out = tmp_path / "run"

    def filling_open(path, mode="r", *a, **k):  # the disk is full when the checkpoint of step 4 is written
        f = builtins.open(path, mode, *a, **k)
        return _FullDisk(f, 1 << 20) if str(path).endswith("step_000004.pt.tmp") else f

    monkeypatch.setattr(checkpoint, "open", filling_open, raising=False)
    rc, err = _run(["train", *args, "--out", str(out)], capsys)
    line = _last_line_error(rc, err, "could not write the checkpoint step_000004.pt", "No space left on device",
                           f"the last checkpoint, step 2 ({out / 'step_000002.pt'}), is intact",
                           f"continue with: fp4train train --out {out} --resume")
    assert [e["step"] for e in Checkpoints(out).entries()] == [2] and Checkpoints(out).verify(Checkpoints(out).entries()[0]) is None
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000002.pt"], line  # no partial file left
    monkeypatch.undo()
    rc, err = _run(["train", "--out", str(out), "--resume"], capsys)
    assert rc == 0, err
    assert _records(out) == _records(tmp_path / "ref")


def _records(run):
    """What a run logged that depends on its numbers alone (not the wall clock)."""
    keep = ("step", "loss", "grad_norm", "lr", "val_loss")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_the_first_checkpoint_failing_says_so_and_nothing_is_left_half_written(tmp_path, capsys, monkeypatch):
    from fp4train import checkpoint

    def full_open(path, mode="r", *a, **k):
        if str(path).endswith(".pt.tmp"):
            raise OSError(28, "No space left on device", str(path))
        return open(path, mode, *a, **k)

    monkeypatch.setattr(checkpoint, "open", full_open, raising=False)
    out = tmp_path / "run"
    rc, err = _run(["train", *SMALL, "--max-steps", "3", "--ckpt-every", "2", "--out", str(out)], capsys)
    _last_line_error(rc, err, "No space left on device", "no checkpoint was written before", "--overwrite")
    assert not list(out.glob("step_*"))


def test_too_little_free_space_and_a_read_only_out_are_refused_before_the_first_step(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    from fp4train.train import run_dir

    monkeypatch.setattr(Trainer, "run", lambda self: pytest.fail("training started"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 30 * 10**6, 30 * 10**6))  # 30 MB free
    out = tmp_path / "run"
    rc, err = _run(["train", *SMALL, "--out", str(out)], capsys)
    _one_line_error(rc, err, f"{out} has 30.0 MB free", "checkpoints need about 161.6 MB (3 of about 53.9 MB",
                    "free space on that disk")
    assert not out.exists()
    monkeypatch.undo()
    monkeypatch.setattr(Trainer, "run", lambda self: pytest.fail("training started"))
    real_open = run_dir.os.open

    def read_only(path, *a, **k):
        if str(path).endswith(".fp4train.lock"):
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(run_dir.os, "open", read_only)
    monkeypatch.setattr(fp4train.models, "Llama", lambda *a: pytest.fail("the model was built"))
    rc, err = _run(["train", *SMALL, "--out", str(out)], capsys)
    _one_line_error(rc, err, f"cannot write to {out}: Read-only file system", "choose an --out on a writable disk")
    assert not out.exists()


# ---- 15. SIGTERM is Ctrl-C: the step finishes, a checkpoint is written, exit 143 ------------------------------------
def test_sigterm_checkpoints_says_how_to_resume_and_the_run_resumes_bit_for_bit(tmp_path, capsys, start):
    args = [*SMALL, "--recipe", "tib2d", "--max-steps", "12", "--ckpt-every", "5", "--eval-every", "4", "--log-every", "1"]
    rc, err = _run(["train", *args, "--out", str(tmp_path / "ref")], capsys)
    assert rc == 0, err
    out = tmp_path / "with space"  # the resume command is quoted for a shell
    p = start(["train", *args, "--max-steps", "100000", "--out", str(out)])
    _wait_for(out / "metrics.jsonl", lines=2)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "Traceback" not in err, err
    stopped = Checkpoints(out).entries()[-1]["step"]
    assert stopped >= 2
    assert f"stopped at step {stopped} by SIGTERM, checkpoint {out / f'step_{stopped:06d}.pt'}" in err
    assert f"continue with: fp4train train --out '{out}' --resume" in err
    r = subprocess.run([sys.executable, "-m", "fp4train", "train", "--out", str(out), "--resume", "--max-steps", "12"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"resumed {out} at step {stopped}" in r.stderr, r.stderr
    assert _records(out) == _records(tmp_path / "ref")


def test_sigterm_stops_a_comparison_whose_next_command_finishes_it(tmp_path, capsys, start):
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--recipes", "bf16", "--max-steps", "150", "--ckpt-every", "3", "--eval-every", "0",
            "--log-every", "1", "--gpus", "none", "--out", str(out)]
    p = start(args)
    _wait_for(out / "runs" / "bf16-seed0" / "metrics.jsonl", lines=2)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "Traceback" not in err, err
    assert "continue with: the same fp4train compare command" in err
    stopped = Checkpoints(out / "runs" / "bf16-seed0").entries()[-1]["step"]
    assert 0 < stopped < 150 and not (out / ".fp4train.lock").exists()
    rc, err = _run(args, capsys)
    assert rc == 0 and f"resumed {out / 'runs' / 'bf16-seed0'} at step {stopped}" in err, err
    assert json.loads((out / "report.json").read_text())["unfinished"] == []


def test_sigterm_under_torchrun_stops_every_rank_at_one_step_and_resumes_bit_for_bit(tmp_path, start):
    """torchrun passes SIGTERM on to its workers (and kills them 30 s later): each finishes its step, the ranks agree
    on the step to stop at, rank 0 writes the checkpoint and alone says how to continue."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fp4train",
                "train", *SMALL[:2], "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--no-progress",
                "--no-tensorboard", "--device", "cpu", "--parallel", "ddp", "--ckpt-every", "0", "--eval-every", "0",
                "--log-every", "1"]
    ref = subprocess.run(torchrun + ["--max-steps", "40", "--out", str(tmp_path / "ref")], capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    p = start(torchrun[1:] + ["--max-steps", "100000", "--out", str(out)], launcher=())
    _wait_for(out / "metrics.jsonl", lines=2, timeout=300)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=300)[1]
    stopped = Checkpoints(out).entries()[-1]["step"]
    assert 2 <= stopped < 40 and err.count(f"stopped at step {stopped} by SIGTERM") == 1, err[-3000:]
    r = subprocess.run(torchrun + ["--max-steps", "40", "--out", str(out), "--resume"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _records(out) == _records(tmp_path / "ref")


# ---- 16. eval, export, generate: paths, bounds, progress, trust --------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    rc = main(["train", *SMALL, "--max-steps", "2", "--eval-every", "0", "--out", str(out)])
    assert rc == 0
    return out


def test_export_into_a_read_only_place_is_one_line_and_leaves_nothing(finished_run, tmp_path, capsys, monkeypatch):
    from pathlib import Path

    real = Path.mkdir

    def read_only(self, *a, **k):
        if self.parent == tmp_path:
            raise OSError(30, "Read-only file system", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    monkeypatch.setattr("fp4train.export.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    rc, err = _run(["export", "--run", str(finished_run), "--out", str(tmp_path / "hf")], capsys)
    _one_line_error(rc, err, f"--out {tmp_path / 'hf'} cannot be written: Read-only file system")
    assert list(tmp_path.iterdir()) == []


def test_export_files_take_the_umask_and_a_failed_export_leaves_no_folder(finished_run, tmp_path, monkeypatch):
    import os

    from fp4train.export import export_hf

    old = os.umask(0o022)
    try:
        out = export_hf(finished_run, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    monkeypatch.setattr("transformers.LlamaForCausalLM.save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        export_hf(finished_run, tmp_path / "hf2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial folder, no temporary one


def test_export_makes_the_folders_above_its_out_and_removes_them_if_it_fails(finished_run, tmp_path, capsys, monkeypatch):
    rc, err = _run(["export", "--run", str(finished_run), "--out", str(tmp_path / "exports" / "my-model")], capsys)
    assert rc == 0 and (tmp_path / "exports" / "my-model" / "model.safetensors").is_file(), err
    monkeypatch.setattr("transformers.LlamaForCausalLM.save_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    rc, err = _run(["export", "--run", str(finished_run), "--out", str(tmp_path / "new" / "deeper" / "m")], capsys)
    assert rc != 0 and not (tmp_path / "new").exists()


def test_eval_says_when_its_text_is_the_runs_training_text_and_shows_progress(finished_run, tmp_path, capsys):
    rc, err = _run(["eval", "--run", str(finished_run), "--data", "shakespeare", "--max-tokens", "2000"], capsys)
    assert rc == 0
    assert "warning: the run trained on the packaged tiny-shakespeare: a loss on it is not a held-out loss" in err
    other = tmp_path / "other.txt"
    other.write_text("Engines and trains, rivers and bridges. " * 300)
    rc, err = _run(["eval", "--run", str(finished_run), "--data", str(other), "--json", str(tmp_path / "e.json")], capsys)
    assert rc == 0 and "warning" not in err and "eval" in err  # the progress bar, on stderr
    assert json.loads((tmp_path / "e.json").read_text())["tokens"] > 0


def test_eval_export_generate_take_trust_checkpoint_as_their_errors_suggest(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints.json").write_text("{damaged")
    ck = str(run / "step_000002.pt")
    rc, err = _run(["eval", "--run", str(run), "--checkpoint", ck, "--max-tokens", "500"], capsys)
    _one_line_error(rc, err, "checkpoints.json is damaged", f"load one with --checkpoint {run}/step_NNNNNN.pt --trust-checkpoint")
    rc, err = _run(["eval", "--run", str(run), "--checkpoint", ck, "--trust-checkpoint", "--max-tokens", "500"], capsys)
    assert rc == 0, err
    rc, err = _run(["generate", "--run", str(run), "--checkpoint", ck, "--trust-checkpoint", "--prompt", "To be",
                    "--max-new-tokens", "3"], capsys)
    assert rc == 0, err
    rc, err = _run(["export", "--run", str(run), "--checkpoint", ck, "--trust-checkpoint", "--out", str(tmp_path / "hf")], capsys)
    assert rc == 0 and (tmp_path / "hf" / "model.safetensors").exists(), err


def test_generate_prints_as_it_goes_and_ctrl_c_keeps_what_it_printed(finished_run, capsys, monkeypatch):
    import fp4train.evaluate as ev

    pieces = list(ev.generate_pieces(finished_run, "To be", max_new_tokens=12, temperature=0))
    assert len(pieces) > 1 and "".join(pieces) == ev.generate(finished_run, "To be", max_new_tokens=12, temperature=0)
    real = ev.generate_pieces

    def interrupted(*a, **k):
        for i, piece in enumerate(real(*a, **k)):
            if i == 3:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(ev, "generate_pieces", interrupted)
    capsys.readouterr()
    rc = main(["generate", "--run", str(finished_run), "--prompt", "To be", "--max-new-tokens", "12", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 130 and out == "To be" + "".join(pieces[:3]) and "interrupted" in err and "Traceback" not in err


# ---- 17. the smaller things -------------------------------------------------------------------------------------------
def test_recipe_typos_name_their_place_and_the_known_keys(tmp_path, capsys):
    bad = tmp_path / "mine.toml"
    bad.write_text('name = "mine"\n[linear.fprop.a]\nformat = "mxfp4"\nblok = 32\n')
    rc, err = _run(["train", *SMALL, "--recipe", str(bad), "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, "mine.toml", "linear.fprop.a: unknown key 'blok' (known: format, block, scale")
    assert "__init__" not in err


def test_data_errors_name_the_fix(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"body": "some text"}\n')
    (tmp_path / "empty.txt").write_text("\n\n")
    rc, err = _run(["train", *SMALL, "--data", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, "a.jsonl:1: expected a JSON object with a 'text' field, and this one has 'body'", "--text-field")
    rc, err = _run(["train", *SMALL, "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, "empty.txt is empty")
    rc, err = _run(["recipes"], capsys)
    assert "paper 00" not in capsys.readouterr().out


def test_deterministic_on_a_cpu_speaks_of_this_machine(tmp_path, capsys):
    err = _train(tmp_path / "r", capsys, "--deterministic", steps=1)
    assert "repeats give the same bits on this machine" in err and "GPU" not in err


def test_under_torchrun_only_rank_0_reports_a_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    rc, err = _run(["train", *SMALL, "--lr", "-1", "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and err == ""
    monkeypatch.setenv("RANK", "0")
    rc, err = _run(["train", *SMALL, "--lr", "-1", "--out", str(tmp_path / "r")], capsys)
    _one_line_error(rc, err, "lr must be > 0")


def test_the_version_and_the_top_level_help_do_not_load_torch():
    code = ("import sys; from fp4train.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    for args in (["--version"], ["--help"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", (args, r.stdout, r.stderr)


def test_eval_without_data_scores_a_bounded_part_of_the_runs_validation_split_and_says_so(finished_run, tmp_path, capsys):
    """No --data: the documents the run held out (never its training text), at most VALIDATION_TOKENS of them, named in
    the output and the JSON; --json's missing folders are made."""
    from fp4train.evaluate import VALIDATION_TOKENS

    out = tmp_path / "new" / "folder" / "e.json"
    rc, err = _run(["eval", "--run", str(finished_run), "--json", str(out)], capsys)
    res = json.loads(out.read_text())
    assert rc == 0 and "warning" not in err
    assert res["data"].startswith("the run's validation split (tinyshakespeare (packaged), held-out documents; the first")
    assert 0 < res["tokens"] <= VALIDATION_TOKENS
    rc, err = _run(["eval", "--run", str(finished_run), "--max-tokens", "600", "--json", str(out)], capsys)
    assert rc == 0 and "the first 600 of its" in json.loads(out.read_text())["data"]
