"""The training loop and CLI: exact resume after SIGKILL, NaN stop, compare report, --help."""

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

import fp4train
from fp4train.cli import HELP, build_parser, main
from fp4train.train import Checkpoints, TrainConfig, Trainer, TrainingDiverged
from fp4train.train.compare import interval95, write_report

# --device cpu: the bit-exact resume claims are CPU claims (GPU kernels such as embedding backward use atomics)
SMALL = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "2", "--no-progress", "--no-tensorboard",
         "--device", "cpu"]


def _cli(args, **kw):
    return subprocess.run([sys.executable, "-m", "fp4train", *args], capture_output=True, text=True, **kw)


def _records(run):
    keep = ("step", "loss", "grad_norm", "val_loss")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    args = ["train", *SMALL, "--recipe", "tib2d", "--max-steps", "30", "--ckpt-every", "3", "--eval-every", "10", "--log-every", "1"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    r = _cli(args + ["--out", str(ref)])
    assert r.returncode == 0, r.stderr

    p = subprocess.Popen([sys.executable, "-m", "fp4train", *args, "--out", str(killed)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = killed / "checkpoints.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if manifest.exists() and json.loads(manifest.read_text())["checkpoints"][-1]["step"] >= 6:
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-run"
    last = json.loads(manifest.read_text())["checkpoints"][-1]["step"]
    assert 6 <= last < 30 and not (killed / "summary.json").exists()

    r = _cli(args + ["--out", str(killed), "--resume"])
    assert r.returncode == 0, r.stderr
    assert f"resumed {killed} at step {last}" in r.stderr
    a = Checkpoints(ref).load()
    b = Checkpoints(killed).load()
    assert a["step"] == b["step"] == 30
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert _records(ref) == _records(killed)  # same loss at every step, before and after the kill


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = TrainConfig(model="tiny", recipe="mxfp4", seq_len=32, batch_size=2, max_steps=10, ckpt_every=3,
                      eval_batches=1, out=str(tmp_path), progress=False, tensorboard=False, device="cpu")
    t = Trainer(cfg)
    real = t.forward

    def poisoned(x, y):
        loss = real(x, y)
        return loss * float("nan") if t.step == 4 else loss  # the 5th step goes NaN

    t.forward = poisoned
    with pytest.raises(TrainingDiverged, match=r"diverged at step 5: loss is nan \(recipe mxfp4\); the last good checkpoint is .*step_000003.pt \(step 3\)"):
        t.run()
    assert Checkpoints(tmp_path).load()["step"] == 3


def test_compare_writes_report(tmp_path):
    out = tmp_path / "cmp"
    rc = main(["compare", *SMALL, "--recipes", "mxfp4", "--seeds", "0,1,2", "--max-steps", "3", "--eval-every", "0",
               "--noise-floor", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["recipes"]) == {"bf16", "mxfp4"} and rep["seeds"] == [0, 1, 2]
    assert rep["recipes"]["bf16"]["gap_pct_mean"] == 0.0
    m = rep["recipes"]["mxfp4"]
    bf = rep["recipes"]["bf16"]["val_loss_per_seed"]
    expect = [(m["val_loss_per_seed"][s] / bf[s] - 1) * 100 for s in ("0", "1", "2")]
    assert list(m["gap_pct_per_seed"].values()) == pytest.approx(expect)
    half = 4.303 * statistics.stdev(expect) / 3**0.5  # paired t, 2 degrees of freedom
    assert m["gap_pct_ci95"] == pytest.approx([statistics.mean(expect) - half, statistics.mean(expect) + half])
    assert m["resolved"] == (m["gap_pct_ci95"][0] > 0 or m["gap_pct_ci95"][1] < 0)
    assert rep["noise_floor"]["seed_range_pct"] is not None and rep["tokens_per_run"] == 3 * 64
    # the noise-floor runs: BF16 with each seed's init, the data in another order
    nf = rep["noise_floor"]
    assert nf["seed_std_pct"] == pytest.approx(statistics.stdev(bf.values()) / statistics.mean(bf.values()) * 100)
    for s in (0, 1, 2):
        run = out / "runs" / f"bf16-reordered-seed{s}"
        summ = json.loads((run / "summary.json").read_text())
        assert summ["seed"] == s and summ["data_seed"] == s + 1000
        assert nf["reorder_abs_pct_per_seed"][str(s)] == pytest.approx(abs(summ["final_val_loss"] / bf[str(s)] - 1) * 100)
    md = (out / "report.md").read_text()
    assert "| mxfp4 |" in md and "Noise floor (BF16): seed-to-seed standard deviation" in md and "95% interval" in md
    assert m["verdict"] in md
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # report.json alone is the evidence: every run's summary, settings and curves, as its run folder holds them
    saved = json.loads((out / "report.json").read_text())
    assert saved["settings"] == json.loads((out / "compare.json").read_text()) and saved["recipe_files"] == {}
    for x in saved["runs"]:
        run = out / "runs" / x["run"]
        metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        assert [tuple(p) for p in x["curve"]] == [(r["step"], r["val_loss"]) for r in metrics if "val_loss" in r]
        assert [tuple(p) for p in x["train_curve"]] == [(r["step"], r["loss"]) for r in metrics if "loss" in r]
        assert x["config"] == json.loads((run / "config.json").read_text()) and "adahop_calibration" not in x
        assert x["final_val_loss"] == json.loads((run / "summary.json").read_text())["final_val_loss"]

    # a comparison cut short: the unfinished recipe is named and left out, the rest still reported
    (out / "runs" / "mxfp4-seed1" / "summary.json").unlink()
    rep = write_report(out, ["bf16", "mxfp4"], [0, 1, 2])
    assert rep["unfinished"] == ["mxfp4"] and list(rep["recipes"]) == ["bf16"]
    assert "Not finished yet (left out above): mxfp4" in (out / "report.md").read_text()
    (out / "runs" / "bf16-seed0" / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"bf16 baseline has not finished for every seed \(\[0\]\)"):
        write_report(out, ["bf16", "mxfp4"], [0, 1, 2])


def test_a_gaps_verdict_names_the_run_it_was_measured_against():
    from fp4train.train.compare import _gap_stats

    assert _gap_stats([0.4, 0.6, 0.5], "fullstack", "bf16-root")["verdict"] == "resolved: worse than bf16-root"
    assert _gap_stats([-0.4, -0.6, -0.5], "mxfp4")["verdict"] == "resolved: better than BF16"
    assert _gap_stats([-0.4, 0.6, 0.1], "mxfp4")["verdict"] == "not resolved (the interval holds 0)"
    assert _gap_stats([0.5], "mxfp4")["verdict"] == "one seed: no interval"


@pytest.mark.parametrize("gpus", ["none", "0"])  # in this process / as a subprocess (the path a GPU machine takes)
def test_compare_resumes_an_interrupted_run(tmp_path, monkeypatch, capsys, gpus):
    args = ["compare", *SMALL, "--recipes", "mxfp4", "--max-steps", "6", "--ckpt-every", "2", "--eval-every", "3", "--log-every", "1"]
    assert main(args + ["--gpus", "none", "--out", str(tmp_path / "ref")]) == 0

    real = Trainer.train_step

    def crash_at_step_5(self):
        if self.step == 4 and self.recipe.name == "mxfp4":
            raise KeyboardInterrupt("simulated kill")
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_step_5)
    assert main(args + ["--gpus", "none", "--out", str(tmp_path / "cmp")]) == 130  # Ctrl-C: exit 130, no traceback
    monkeypatch.setattr(Trainer, "train_step", real)
    run = tmp_path / "cmp" / "runs" / "mxfp4-seed0"
    assert not (run / "summary.json").exists() and Checkpoints(run).entries()[-1]["step"] == 4
    # the report as far as it got: written as each run finished, the interrupted recipe named as unfinished
    assert json.loads((tmp_path / "cmp" / "report.json").read_text())["unfinished"] == ["mxfp4"]

    capsys.readouterr()
    if gpus != "none" and not torch.cuda.is_available():  # the subprocess path on a machine without a GPU, which the
        monkeypatch.setattr("fp4train.cli._gpus", lambda spec: [0])  # command line refuses: its runs go on the CPU
    assert main(args + ["--gpus", gpus, "--out", str(tmp_path / "cmp")]) == 0
    log = capsys.readouterr().err + ((run / "train.log").read_text() if gpus != "none" else "")
    assert f"resumed {run} at step 4" in log
    ref = tmp_path / "ref" / "runs" / "mxfp4-seed0"
    assert _records(run) == _records(ref)  # continued from step 4, bit-identical on CPU to the uninterrupted run
    assert all(torch.equal(a, b) for a, b in zip(Checkpoints(run).load()["model"].values(), Checkpoints(ref).load()["model"].values()))


def test_every_option_has_help():
    ap = build_parser()
    sub = ap._subparsers._group_actions[0].choices
    for name in ("train", "compare"):
        text = " ".join(sub[name].format_help().split())
        for key, h in HELP.items():
            if name == "compare" and key == "recipe":
                continue
            assert " ".join(h.split())[:40] in text, (name, key)
    assert "--resume" in sub["train"].format_help() and "--seeds" in sub["compare"].format_help()


def test_every_option_is_defined_once_on_its_field():
    """What the CLI and the checks know of an option comes from its TrainConfig field: its flag in every command
    that trains, none in `analyze` for what only a training run uses, whether it decides a run's result (compare) or
    is fixed on resume, and the value runs saved before it existed ran with."""
    from fp4train.train import config

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    sub = build_parser()._subparsers._group_actions[0].choices
    flags = {n: {o for a in p._actions for o in a.option_strings} for n, p in sub.items()}
    for name, f in fields.items():
        assert f.metadata["help"], name
        assert (config.flag(name) in flags["train"]) == f.metadata["cli"], name
        assert (config.flag(name) in flags["analyze"]) == (f.metadata["cli"] and not f.metadata["train_only"]), name
    assert config.RESULT_FIELDS == tuple(n for n, f in fields.items() if f.metadata["result"])
    assert set(config.RESUME_FIXED) <= set(config.RESULT_FIELDS) and {"model", "recipe", "seed", "optimizer"} <= set(config.RESUME_FIXED)
    assert {"max_steps", "lr"} <= set(config.RESULT_FIELDS) - set(config.RESUME_FIXED)  # a resumed run may train longer
    assert not {"out", "device", "log_every", "progress"} & set(config.RESULT_FIELDS)
    assert config.FIELDS_ADDED == {"hf_config": None, "optimizer": "adamw", "lora_lr_multiplier": 1.0, "data_seed": None,
                                   "deterministic": False}
    assert config.saved_settings({"seed": 3}) == {"seed": 3, **config.FIELDS_ADDED}
    with pytest.raises(TypeError, match="added= and before= go together"):
        config.option(1, help="x", added="0.2.0")


def test_toml_config_with_flag_overrides(tmp_path):
    (tmp_path / "c.toml").write_text('max_steps = 7\nlr = 0.01\nmodel = "tiny"\n')
    from fp4train.cli import _config_from_args

    args = build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml"), "--max-steps", "5"])
    cfg = _config_from_args(args)
    assert cfg.max_steps == 5 and cfg.lr == 0.01
    (tmp_path / "bad.toml").write_text("max_stepz = 7\n")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['max_stepz'\]"):
        TrainConfig.from_toml(tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        TrainConfig(max_steps=0)


def test_cli_errors_are_clean(tmp_path):
    r = _cli(["train", "--recipe", "nope", "--out", str(tmp_path)])
    assert r.returncode == 2 and "fp4train: error: unknown recipe 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = _cli(["train", "--resume", "--out", str(tmp_path / "missing"), *SMALL])
    assert r.returncode == 2 and "cannot resume: " in r.stderr and "does not exist; start the run without --resume" in r.stderr
    assert not (tmp_path / "missing").exists()  # a failed resume creates nothing


def test_recipes_subcommand():
    r = _cli(["recipes"])
    assert r.returncode == 0 and "tib2d" in r.stdout and "nvfp4" in r.stdout
    r = _cli(["recipes", "--show", "mxfp4"])
    assert 'name = "mxfp4"' in r.stdout


def test_resume_reuses_the_saved_config_and_refuses_changed_settings(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--recipe", "mxfp4", "--max-steps", "2", "--eval-every", "0", "--out", str(out)]) == 0
    # plain --resume with a longer budget: every other option comes from the run's config.json
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 0
    assert Checkpoints(out).load()["step"] == 4 and json.loads((out / "summary.json").read_text())["recipe"] == "mxfp4"
    rc = main(["train", "--out", str(out), "--resume", "--recipe", "tib2d", "--max-steps", "6"])
    assert rc == 2
    assert "cannot resume: the run's settings changed (recipe: checkpoint 'mxfp4' vs now 'tib2d')" in capsys.readouterr().err


def test_compile_mode_is_checked_and_draws_seeds_on_the_device(tmp_path, monkeypatch):
    """--compile-mode: a bad mode is refused with the choices; under reduce-overhead the trainer compiles with that
    mode and lets compiled layers draw their seeds on the device (a stream restarted from the run's seed) - every
    seeded recipe, nvfp4's random Hadamard signs included, so no layer is left out of CUDA graphs; each compiled
    call starts a CUDA-graph step; the default mode keeps host seeds."""
    from fp4train import counter_rng, device_seeds
    from fp4train.linear.op import parse

    with pytest.raises(ValueError, match="compile_mode must be one of default, reduce-overhead, got 'fast'"):
        TrainConfig(compile_mode="fast")
    with pytest.raises(ValueError, match="compile_mode reduce-overhead takes grad_accum 1 \\(got 2\\)"):
        TrainConfig(compile_mode="reduce-overhead", grad_accum=2)
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: modes.append(mode) or model)  # no compilation here
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for recipe in ("nvfp4", "tib2d", "mxfp4"):
        cfg = TrainConfig(model="tiny", recipe=recipe, seq_len=32, batch_size=2, max_steps=1, eval_batches=1, out=str(tmp_path / recipe),
                          progress=False, tensorboard=False, device="cpu", compile=True, compile_mode="reduce-overhead")
        t = Trainer(cfg, log=lambda m: None)
        assert modes[-1] == "reduce-overhead"
        torch.manual_seed(cfg.seed)
        assert device_seeds._STREAMS[torch.device("cpu")].base == counter_rng.fresh_seed()  # restarted from the run's seed
        # what a compiled call passes: every seeded layer draws on the device, nvfp4's (random signs) too
        seeded = [m for m in t.model.modules() if getattr(m, "spec", None) is not None and m.spec.needs_seed]
        assert bool(seeded) == (recipe != "mxfp4") and all(parse(m._config).seeded_on_device for m in seeded)
        n = len(marks)
        t.train_step()
        assert len(marks) == n + 1  # one per step (one micro-batch)
    t = Trainer(TrainConfig(model="tiny", seq_len=32, batch_size=2, out=str(tmp_path / "d"), progress=False, tensorboard=False,
                        device="cpu", compile=True), log=lambda m: None)
    assert modes[-1] is None  # default: torch.compile's own default, host seeds
    assert not any(getattr(m, "device_seeds", False) for m in t.model.modules())


def test_speed_settings_are_the_fastest_correct_ones_by_default_and_said_once(tmp_path):
    """Left unset, a GPU run compiles with CUDA graphs (reduce-overhead; the default mode where grad_accum > 1,
    which graphs cannot replay) and a CPU run stays eager; given values win; the run says once what it chose and
    its summary records it."""
    from fp4train.train.config import speed_settings

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert speed_settings(TrainConfig(), gpu)[:2] == (True, "reduce-overhead")
    assert "the default on a GPU; --no-compile" in speed_settings(TrainConfig(), gpu)[2]
    assert speed_settings(TrainConfig(grad_accum=2), gpu)[:2] == (True, "default")
    assert speed_settings(TrainConfig(parallel="fsdp"), gpu)[:2] == (True, "default")
    assert "no CUDA graphs under --parallel fsdp" in speed_settings(TrainConfig(parallel="fsdp"), gpu)[2]
    assert speed_settings(TrainConfig(compile=False), gpu)[:2] == (False, "default")
    assert speed_settings(TrainConfig(compile_mode="default"), gpu)[:2] == (True, "default")
    assert speed_settings(TrainConfig(), cpu)[:2] == (False, "default")
    assert speed_settings(TrainConfig(compile=True), cpu)[:2] == (True, "default")
    # a mixture of experts: eager unless asked, and then without CUDA graphs (its experts' shapes change every step)
    moe = speed_settings(TrainConfig(model="moe-20m"), gpu)
    assert moe[:2] == (False, "default") and "mixture of experts" in moe[2]
    assert speed_settings(TrainConfig(model="moe-20m", compile=True), gpu)[:2] == (True, "default")
    mixtral = tmp_path / "mixtral.json"
    mixtral.write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4}))
    assert speed_settings(TrainConfig(hf_config=str(mixtral)), gpu)[:2] == (False, "default")
    mixtral.write_text(json.dumps({"model_type": "llama"}))
    assert speed_settings(TrainConfig(hf_config=str(mixtral)), gpu)[:2] == (True, "reduce-overhead")
    from fp4train.cli import _config_from_args, build_parser

    args = build_parser().parse_args(["train", "--no-compile"])
    assert _config_from_args(args).compile is False and _config_from_args(build_parser().parse_args(["train"])).compile is None
    logs = []
    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=2, max_steps=1, eval_batches=1, out=str(tmp_path / "r"), progress=False,
                      tensorboard=False, device="cpu")
    summary = Trainer(cfg, log=logs.append).run()
    assert [m for m in logs if "speed settings" in m] == ["fp4train: speed settings: eager (the default on a CPU; --compile to compile)"]
    assert summary["compile"] is False and summary["compiled_graphs"] is None


def test_steady_steps_leave_out_warm_up_compilation_graph_recording_and_calibration():
    from fp4train.train.records import SteadySteps

    s = SteadySteps()
    for t, compiled, calibrating in [(9.0, False, True), (8.0, False, True),  # BF16 calibration
                                     (7.0, True, False), (6.0, False, False),  # compiles; records CUDA graphs
                                     (1.0, False, False), (1.2, False, False), (0.9, False, False)]:
        s.add(t, compiled=compiled, held=calibrating)
    assert s.times == [1.0, 1.2, 0.9] and s.median() == 1.0
    first = SteadySteps()
    for t in (5.0, 2.0, 2.0):
        first.add(t, compiled=False)
    assert first.times == [2.0, 2.0]  # the run's first step is warm-up


def test_trainer_without_checkpoints_and_with_a_model_hook(tmp_path):
    """Benchmarks run the trainer itself: ``checkpoints=False`` writes none, ``model_hook`` sees the converted model
    before the optimizer is made; the summary's tokens/s is tokens per step over the median steady step."""
    seen = []

    def hook(model):
        seen.append(type(model).__name__)
        model.extra_flag = True

    cfg = TrainConfig(model="tiny", recipe="mxfp4", seq_len=32, batch_size=2, max_steps=4, eval_batches=1, ckpt_every=1,
                      out=str(tmp_path / "r"), progress=False, tensorboard=False, device="cpu")
    t = Trainer(cfg, log=lambda m: None, checkpoints=False, model_hook=hook)
    assert seen == ["Llama"] and t.model.extra_flag
    s = t.run()
    assert not list((tmp_path / "r").glob("step_*.pt")) and s["steady_steps"] == 3
    assert s["tokens_per_s"] == pytest.approx(cfg.tokens_per_step / (s["step_ms"] / 1e3))


def test_qadamw_trains_and_resumes_bit_for_bit(tmp_path):
    """--optimizer qadamw: the trainer's AdamW with NVFP4 moments; its checkpoint (codes, scales, tile means as
    plain tensors, loaded weights_only) resumes a run to the uninterrupted run's bits."""
    common = dict(model="tiny", recipe="mxfp4", optimizer="qadamw", seq_len=32, batch_size=2, eval_batches=1, eval_every=0,
                  log_every=1, progress=False, tensorboard=False, device="cpu")
    full = Trainer(TrainConfig(max_steps=4, out=str(tmp_path / "full"), **common), log=lambda m: None)
    assert isinstance(full.opt, fp4train.optim.QAdamW)
    full.run()
    Trainer(TrainConfig(max_steps=2, ckpt_every=2, out=str(tmp_path / "cut"), **common), log=lambda m: None).run()
    Trainer(TrainConfig(max_steps=4, ckpt_every=2, out=str(tmp_path / "cut"), **common), resume=True, log=lambda m: None).run()
    a, b = Checkpoints(tmp_path / "full").load(), Checkpoints(tmp_path / "cut").load()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    quantized = [st for st in a["optimizer"]["state"].values() if "exp_avg.codes" in st]
    assert quantized and all(st["exp_avg.codes"].dtype == torch.uint8 for st in quantized)
    def losses(run):  # the cut run also evaluated at its first end, step 2
        return [(r["step"], r["loss"], r["grad_norm"]) for r in _records(run)]

    assert losses(tmp_path / "full") == losses(tmp_path / "cut")
    with pytest.raises(ValueError, match="optimizer must be one of adamw, qadamw, muon, qmuon, root, qroot, qroot_bf16ns, got .sgd."):
        TrainConfig(optimizer="sgd")


@pytest.mark.parametrize("optimizer", ["qmuon", "qroot", "qroot_bf16ns"])
def test_qmuon_trains_and_resumes_bit_for_bit(tmp_path, optimizer):
    """--optimizer qmuon / qroot: Muon or Root on the 2D hidden weights with an NVFP4 momentum buffer, AdamW on the
    rest; qroot is Full-Stack FP4's Q-Root, with native NVFP4 Newton-Schulz, qroot_bf16ns ours with BF16's; a resumed
    run reaches the uninterrupted run's bits."""
    common = dict(model="tiny", recipe="bf16", optimizer=optimizer, seq_len=32, batch_size=2, eval_batches=1, eval_every=0,
                  log_every=1, progress=False, tensorboard=False, device="cpu")
    full = Trainer(TrainConfig(max_steps=4, out=str(tmp_path / "full"), **common), log=lambda m: None)
    assert isinstance(full.opt, fp4train.optim.QRoot if "root" in optimizer else fp4train.optim.QMuon)
    assert (full.opt.param_groups[0]["robust_quantile"] is not None) == ("root" in optimizer)
    assert full.opt.param_groups[0]["ns_matmul"] == ("nvfp4" if optimizer == "qroot" else "bf16")
    muon = [g for g in full.opt.param_groups if g["muon"]]
    assert len(muon) == 1 and all(p.ndim == 2 for p in muon[0]["params"])
    assert not any(p is full.model.embed_tokens.weight for p in muon[0]["params"])
    full.run()
    Trainer(TrainConfig(max_steps=2, ckpt_every=2, out=str(tmp_path / "cut"), **common), log=lambda m: None).run()
    Trainer(TrainConfig(max_steps=4, ckpt_every=2, out=str(tmp_path / "cut"), **common), resume=True, log=lambda m: None).run()
    a, b = Checkpoints(tmp_path / "full").load(), Checkpoints(tmp_path / "cut").load()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert any("momentum_buffer.codes" in st for st in a["optimizer"]["state"].values())


def test_ctrl_c_stops_a_run_without_checkpoints_and_resume_keeps_its_optimizer(tmp_path, monkeypatch):
    """Ctrl-C on a run that writes no checkpoint stops after the step (nothing to resume, so no TrainingInterrupted);
    a checkpoint resumes only under the optimizer that wrote it (its state is that optimizer's); a checkpoint from
    before --optimizer existed is AdamW's."""
    from fp4train.train import trainer as trainer_mod
    from fp4train.train.trainer import TrainingInterrupted

    class Pressed:  # as if Ctrl-C came during the first step
        def __init__(self, log):
            self.requested, self.signum = True, signal.SIGINT

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(trainer_mod, "StopRequests", Pressed)
    common = dict(model="tiny", seq_len=32, batch_size=2, max_steps=3, eval_batches=1, progress=False, tensorboard=False,
                  device="cpu")
    t = Trainer(TrainConfig(out=str(tmp_path / "bench"), **common), log=lambda m: None, checkpoints=False)
    with pytest.raises(KeyboardInterrupt) as e:
        t.run()
    assert not isinstance(e.value, TrainingInterrupted) and t.step == 1 and not list((tmp_path / "bench").glob("step_*.pt"))
    with pytest.raises(TrainingInterrupted):
        Trainer(TrainConfig(out=str(tmp_path / "run"), **common), log=lambda m: None).run()
    monkeypatch.undo()
    st = Checkpoints(tmp_path / "run").load()
    other = Trainer(TrainConfig(out=str(tmp_path / "run"), optimizer="qadamw", **common), resume=True, log=lambda m: None)
    with pytest.raises(ValueError, match="optimizer: checkpoint 'adamw' vs now 'qadamw'"):
        other.load_state_dict(st)
    other.close()  # the run directory's one writer, until it lets go
    del st["config"]["optimizer"]  # a checkpoint written before the option existed
    Trainer(TrainConfig(out=str(tmp_path / "run"), **common), resume=True, log=lambda m: None).load_state_dict(st)


def test_interval95_is_the_t_interval_of_the_mean():
    lo, hi = interval95([1.0, 2.0, 3.0])
    assert (lo, hi) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert interval95([0.5]) is None


def test_data_seed_changes_the_order_alone(tmp_path):
    """--data-seed: the same initialization (and rounding seeds), the training windows in another order."""
    kw = dict(model="tiny", seq_len=32, batch_size=2, max_steps=1, eval_batches=1, progress=False, tensorboard=False, device="cpu")
    a = Trainer(TrainConfig(**kw, out=str(tmp_path / "a")))
    b = Trainer(TrainConfig(**kw, data_seed=7, out=str(tmp_path / "b")))
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert not torch.equal(a.batches.next_batch()[0], b.batches.next_batch()[0])
    c = Trainer(TrainConfig(**kw, data_seed=0, out=str(tmp_path / "c")))  # data_seed = seed: the default order
    a2 = Trainer(TrainConfig(**kw, out=str(tmp_path / "a2")))
    assert torch.equal(a2.batches.next_batch()[0], c.batches.next_batch()[0])


def test_deterministic_run_switches_torch_to_deterministic_algorithms_for_its_duration(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []
    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=2, max_steps=2, eval_batches=1, progress=False, tensorboard=False,
                      device="cpu", deterministic=True, out=str(tmp_path / "a"))
    t = Trainer(cfg)
    real = t.train_step
    t.train_step = lambda: (seen.append(torch.are_deterministic_algorithms_enabled()), real())[1]
    summ = t.run()
    assert seen == [True, True] and summ["deterministic"] is True
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match=r"--deterministic: CUBLAS_WORKSPACE_CONFIG=:0:0 does not give reproducible"):
        Trainer(dataclasses.replace(cfg, out=str(tmp_path / "b"))).run()
    assert not torch.are_deterministic_algorithms_enabled()


def test_calibration_file_is_not_a_result_setting_of_a_recipe_that_does_not_calibrate():
    a = TrainConfig(recipe="bf16").result_settings()
    assert TrainConfig(recipe="bf16", calibration="x.json").result_settings() == a
    assert TrainConfig(recipe="adahop", calibration="x.json").result_settings()["calibration"] == "x.json"


def test_lora_lr_multiplier_is_a_result_setting_of_lora_svd_recipes_only():
    assert TrainConfig(recipe="bf16", lora_lr_multiplier=1.0).result_settings() == TrainConfig(recipe="bf16").result_settings()
    assert TrainConfig(recipe="fullstack", lora_lr_multiplier=1.0).result_settings()["lora_lr_multiplier"] == 1.0


def test_the_comparison_figure_shows_every_logged_training_loss_on_an_axis_fit_to_the_data():
    """After a run with one evaluation, loss.png still shows a curve: the training loss at every logged step beside the
    evaluation marker, on a y-range from the data (logarithmic when the losses span a wide range)."""
    import matplotlib.pyplot as plt

    from fp4train.train.compare import loss_axis, loss_figure

    def run(recipe, scale):
        train = [(s, scale * (10.4 - 4 * (1 - 0.9 ** s))) for s in range(1, 41)]
        return {"recipe_arg": recipe, "seed": 0, "curve": [(40, scale * 6.6)], "train_curve": train}

    runs = [run("bf16", 1.0), run("mxfp4", 1.01)]
    fig = loss_figure(runs, ["bf16", "mxfp4"], [0])
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 40]
    assert len(lines) == 2  # one training curve per recipe, every logged step
    values = [v for r in runs for _, v in r["train_curve"] + r["curve"]]
    lo, hi = ax.get_ylim()
    assert lo <= min(values) and hi >= max(values) and hi < 1.1 * max(values) and lo > 0.9 * min(values)
    assert ax.get_yscale() == "log"  # 10.5 down to 6.4
    plt.close(fig)
    assert loss_axis([6.40, 6.45]) == pytest.approx((6.3975, 6.4525, False))
    assert loss_axis([6.4])[0] < 6.4 < loss_axis([6.4])[1]
