"""Nothing a user does loses a run, and every bad input is one line of error, exit code 2.

Each test drives the CLI (``fp4train.cli.main`` in this process, or the ``fp4train`` command) on the
``tiny`` model and the CPU, the way a user would.
"""

import gzip
import hashlib
import json
import pickle
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
    assert f"{recipe} 2 of 3" in (out / "report.md").read_text()
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
    return [
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


def test_every_bad_input_is_one_line_naming_the_culprit_with_exit_code_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # the parquet and hf extras are not installed (import fails)
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(Trainer, "run", lambda self: pytest.fail("training started despite the bad input"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("FP4TRAIN_CACHE", str(cache))
    for args, culprits in _bad_inputs(tmp_path):
        try:
            rc, err = _run(args, capsys)
        except SystemExit as e:  # argparse's errors
            rc, err = e.code, capsys.readouterr().err
        _one_line_error(rc, err, *culprits)
    assert not (tmp_path / "out").exists()
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
    assert "{tiny,20m,60m,125m,350m,1b,3b}" in flat["train"] and "{eager,compiled,triton}" in flat["train"]
    assert "{default,reduce-overhead}" in flat["train"] and "{auto,bf16,fp32}" in flat["train"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"fp4train {fp4train.__version__}"


def test_the_run_header_is_printed_before_the_progress_bar(tmp_path, monkeypatch):
    from fp4train.train import trainer

    events = []
    monkeypatch.setattr(trainer, "_progress", lambda cfg, start: events.append("bar"))
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
