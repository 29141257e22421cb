"""Data-parallel and fully sharded training under torchrun (2 CPU processes, gloo) against one process at the same
global batch."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fp4train.train import TrainConfig, Trainer

BASE = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--device", "cpu", "--no-progress", "--no-tensorboard"]


def _train(out, *args, procs=1, parallel="ddp"):
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1
              else [sys.executable])
    extra = ["--parallel", parallel] if procs > 1 else []
    r = subprocess.run(launch + ["-m", "fp4train", "train", *BASE, *args, *extra, "--out", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(out):
    return {json.loads(ln)["step"]: json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()}


def _rel(a, b):
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a.keys() & b.keys())


# bf16: the same arithmetic but for the gradient's summation order (averaged over ranks); tib2d: stochastic rounding
# draws by position within each process's tensors, so other draws; adahop: rank 0's calibration on every rank (under
# fsdp the calibration steps run on the whole model, which is sharded after them)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("recipe,steps,tol", [("bf16", 4, 1e-5), ("tib2d", 6, 2e-2), ("adahop", 22, 2e-3)])
def test_two_processes_train_like_one_at_the_same_global_batch(tmp_path, recipe, steps, tol, parallel):
    args = ["--recipe", recipe, "--max-steps", str(steps), "--ckpt-every", "0"]
    _train(tmp_path / "one", *args)
    _train(tmp_path / "two", *args, procs=2, parallel=parallel)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    assert _rel(one, two) < tol
    summ = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summ["processes"] == 2 and summ["tokens"] == steps * 4 * 32  # the global batch
    if recipe == "adahop":
        cal = json.loads((tmp_path / "two" / "adahop_calibration.json").read_text())
        assert cal["steps"] == 20


def _checkpoint(run, step):
    """The run's checkpoint of ``step``: a file, or (written sharded) a directory."""
    return next(p for p in (run / f"step_{step:06d}.pt", run / f"step_{step:06d}") if p.exists())


@pytest.mark.parametrize("parallel,first,then,optimizer", [("ddp", 2, 1, "adamw"), ("ddp", 1, 2, "adamw"), ("fsdp", 2, 1, "adamw"),
                                                           ("fsdp", 1, 2, "adamw"), ("fsdp", 2, 2, "adamw"),
                                                           ("fsdp", 2, 1, "qadamw"), ("fsdp", 1, 2, "qmuon")])
def test_a_checkpoint_resumes_on_another_number_of_processes(tmp_path, first, then, parallel, optimizer):
    args = ["--recipe", "bf16", "--optimizer", optimizer, "--max-steps", "4", "--ckpt-every", "2", "--keep-checkpoints", "2"]
    _train(tmp_path / "ref", *args, procs=first, parallel=parallel)
    ref = _losses(tmp_path / "ref")
    run = tmp_path / "ref"
    step2 = _checkpoint(run, 2)
    if parallel == "fsdp" and first == 2:  # sharded: Distributed Checkpoint's directory, a file of shards per process
        assert step2.is_dir() and len(list(step2.glob("*.distcp"))) == 2
    _train(run, *args, "--resume", str(step2), procs=then, parallel=parallel)  # steps 3 and 4 again, on `then` processes
    again = _losses(run)
    assert sorted(again) == [1, 2, 3, 4] and _rel(ref, again) < 1e-5


@pytest.mark.parametrize("kind", ["qadamw", "muon", "qmuon", "lora_svd"])
def test_sharded_optimizers_keep_one_process_bits(kind):
    """The same gradients into sharded and whole parameters: equal parameters and states (NVFP4 codes included);
    LoRA-SVD's realignment of sharded layers: the whole layers' factors and residuals."""
    worker = Path(__file__).parent / "workers" / "sharded_optimizers.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
                        kind], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("optimizer", ["qadamw", "qmuon"])
def test_sharded_quantized_optimizers_train_like_one_process(tmp_path, optimizer):
    """BF16 linears (an NVFP4 recipe's per-tensor activation scales would differ between half and whole batches):
    the optimizer's NVFP4 states are what is sharded; the gradients differ by their summation order only."""
    args = ["--recipe", "bf16", "--optimizer", optimizer, "--max-steps", "6", "--ckpt-every", "0"]
    _train(tmp_path / "one", *args)
    _train(tmp_path / "two", *args, procs=2, parallel="fsdp")
    assert _rel(_losses(tmp_path / "one"), _losses(tmp_path / "two")) < 1e-5


@pytest.mark.parametrize("first,then", [(2, 2), (1, 2), (2, 1)])
def test_a_sharded_fullstack_run_resumes(tmp_path, first, then):
    """LoRA-SVD layers realigned every 2 steps (the checkpoint at step 2 holds no optimizer state for the factors),
    QAdamW, NVFP4 attention: sharded, checkpointed, resumed - exactly on the same number of processes; on another
    within the difference that NVFP4's per-tensor activation scales make between half and whole batches."""
    from fp4train import recipes

    rd = recipes.get("fullstack").to_dict()
    rd["name"], rd["lora_svd"]["realign_every"] = "fullstack_realign2", 2
    (tmp_path / "recipe.json").write_text(json.dumps(rd))
    args = ["--recipe", str(tmp_path / "recipe.json"), "--max-steps", "4", "--ckpt-every", "2", "--keep-checkpoints", "2"]
    _train(tmp_path / "ref", *args, procs=first, parallel="fsdp")
    ref = _losses(tmp_path / "ref")
    _train(tmp_path / "ref", *args, "--resume", str(_checkpoint(tmp_path / "ref", 2)), procs=then, parallel="fsdp")
    assert sorted(ref) == [1, 2, 3, 4] and _rel(ref, _losses(tmp_path / "ref")) < (1e-6 if first == then else 5e-3)


def test_a_sharded_adahop_checkpoint_after_calibration_resumes_in_one_process(tmp_path):
    """Saved sharded after the calibration, resumed unsharded: the same losses; its model reads back whole for
    evaluation and export."""
    from fp4train.evaluate import evaluate
    from fp4train.export import load_checkpoint, load_model

    args = ["--recipe", "adahop", "--max-steps", "24", "--ckpt-every", "22", "--keep-checkpoints", "2"]
    _train(tmp_path / "ref", *args, procs=2, parallel="fsdp")
    ref = _losses(tmp_path / "ref")
    ck = load_checkpoint(tmp_path / "ref")
    assert ck["step"] == 24 and (tmp_path / "ref" / "step_000024").is_dir()
    model, _ = load_model(tmp_path / "ref")
    assert set(model.state_dict()) == set(ck["model"])
    res = evaluate(tmp_path / "ref", None, device="cpu", max_tokens=2000, log=lambda m: None)
    assert math.isfinite(res["loss"]) and res["step"] == 24
    _train(tmp_path / "ref", *args, "--resume", str(_checkpoint(tmp_path / "ref", 22)))
    assert _rel(ref, _losses(tmp_path / "ref")) < 1e-5


def test_parallel_launches_that_cannot_work_are_refused(tmp_path, monkeypatch):
    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=4, max_steps=1, device="cpu", progress=False, out=str(tmp_path / "a"),
                      parallel="ddp")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"--parallel ddp runs under torchrun: torchrun --nproc-per-node N"):
        Trainer(cfg)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"--batch-size 4 does not split over 3 processes: give a multiple of 3"):
        Trainer(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"launched as 2 processes \(torchrun\) but --parallel is none: add --parallel ddp"):
        Trainer(TrainConfig(model="tiny", device="cpu", out=str(tmp_path / "b")))
    with pytest.raises(ValueError, match=r"parallel must be one of none, ddp, fsdp, got 'zero3'"):
        TrainConfig(parallel="zero3")


def test_compare_runs_each_recipe_over_all_listed_devices(tmp_path, capsys, monkeypatch):
    import torch

    from fp4train.cli import main

    args = ["compare", *BASE, "--recipes", "mxfp4", "--max-steps", "2", "--parallel", "ddp"]
    if not torch.cuda.is_available():  # the command line refuses --gpus without a GPU: two CPU processes per run here
        monkeypatch.setattr("fp4train.cli._gpus", lambda spec: [0, 0] if spec == "0,0" else None)
    assert main(args + ["--gpus", "0,0", "--out", str(tmp_path / "cmp")]) == 0
    for run in ("bf16-seed0", "mxfp4-seed0"):
        assert json.loads((tmp_path / "cmp" / "runs" / run / "summary.json").read_text())["processes"] == 2
    where = "GPUs 0,0" if torch.cuda.is_available() else "the CPU, 2 processes (torchrun)"
    assert f"started mxfp4-seed0 on {where}" in capsys.readouterr().err
    assert main(args + ["--gpus", "none", "--out", str(tmp_path / "x")]) == 2
    assert "compare --parallel ddp spreads each run over the GPUs that --gpus lists" in capsys.readouterr().err
