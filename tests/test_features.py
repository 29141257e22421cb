"""Training features (fp4train.features): a feature plugs into the trainer from outside, the trainer names no
method, and checkpoints written before the trainer was split into a loop and features resume after it, bit for bit."""

import ast
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import fp4train
from fp4train import recipes
from fp4train.checkpoint import Checkpoints
from fp4train.features import Feature
from fp4train.train import TrainConfig, Trainer
from fp4train.train.features import CATALOG, summary_defaults

REPO = Path(__file__).resolve().parents[1]
#: the last commit whose trainer carried AdaHOP's calibration and LoRA-SVD's realignment inline
BEFORE_FEATURES = "adfce7e71b3bd34914f2e581eac981847cf318ca"


def _cfg(out, **kw) -> TrainConfig:
    base = dict(model="tiny", seq_len=32, batch_size=2, max_steps=5, warmup_steps=1, eval_every=0, eval_batches=1, ckpt_every=2,
                out=str(out), progress=False, tensorboard=False, device="cpu")
    return TrainConfig(**{**base, **kw})


class CountSteps(Feature):
    """A feature from outside fp4train: counts optimizer steps, checkpoints its count, reports it."""

    def __init__(self):
        self.started, self.before, self.after, self.loaded = False, 0, 0, None

    def start(self, run):
        assert run.step == 0 and run.opt is not None
        self.started = True

    def before_step(self, run):
        assert run.step == self.after and all(p.grad is not None for p in run.model.parameters() if p.requires_grad)
        self.before += 1

    def after_step(self, run):
        self.after += 1
        assert run.step == self.after

    def state_dict(self):
        return {"counted_steps": self.after}

    def load_state_dict(self, checkpoint, run):
        self.loaded = checkpoint.get("counted_steps")
        self.after = self.before = self.loaded or 0

    def summary(self):
        return {"counted_steps": self.after}


def test_a_feature_plugs_in_from_outside_and_resumes_with_the_run(tmp_path):
    counter = CountSteps()
    summary = Trainer(_cfg(tmp_path / "a"), log=lambda m: None, features=[counter]).run()
    assert counter.started and counter.before == counter.after == 5 and summary["counted_steps"] == 5
    assert Checkpoints(tmp_path / "a").load()["counted_steps"] == 5

    # stopped after step 3 (last checkpoint: step 2), resumed: the count continues from the checkpoint's
    t = Trainer(_cfg(tmp_path / "b"), log=lambda m: None, features=[CountSteps()])
    real = t.train_step

    def dying():
        if t.step == 3:
            raise KeyboardInterrupt
        return real()

    t.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        t.run()
    resumed = CountSteps()
    assert Trainer(_cfg(tmp_path / "b"), resume=True, log=lambda m: None, features=[resumed]).run()["counted_steps"] == 5
    assert resumed.loaded == 2 and resumed.after == 5


def test_a_feature_that_holds_the_model_keeps_it_eager_until_it_lets_go(tmp_path, monkeypatch):
    """While a feature holds the model the trainer does not compile it; it compiles once, after the feature lets go."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(kw) or m)

    class HoldFor2(Feature):
        def holds_model(self):
            return self.steps < 2

        def start(self, run):
            self.steps, self.seen = 0, []

        def after_step(self, run):
            self.steps = run.step
            self.seen.append(len(compiled))  # what the trainer had compiled when this hook ran

    hold = HoldFor2()
    t = Trainer(_cfg(tmp_path / "r", compile=True), log=lambda m: None, features=[hold])
    assert compiled == []
    t.train_step()
    assert compiled == []
    t.train_step()
    assert len(compiled) == 1
    t.train_step()
    assert len(compiled) == 1 and hold.seen == [0, 0, 1]  # compiled after the hook that let go, once
    t.close()


def test_features_are_refused_unless_they_are_features(tmp_path):
    with pytest.raises(TypeError, match="is not a fp4train.features.Feature"):
        Trainer(_cfg(tmp_path / "r"), features=[object()])
    assert not (tmp_path / "r").exists()


def test_every_summary_has_every_features_keys(tmp_path):
    summary = Trainer(_cfg(tmp_path / "r", max_steps=1), log=lambda m: None).run()
    assert set(summary_defaults()) <= set(summary) and summary["bf16_steps"] == 0
    assert {cls.__name__ for cls in CATALOG} == {"AdaHOPCalibration", "LoRASVDRealignment"}


def _code_words(path: Path) -> set[str]:
    """The names, attributes, imported modules and strings of a module's code: docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.add(n.id)
        elif isinstance(n, ast.Attribute):
            words.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            words.add(n.module or "")
            words |= {a.name for a in n.names}
        elif isinstance(n, ast.Import):
            words |= {a.name for a in n.names}
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words.add(n.value)
    return words


def test_the_trainer_names_no_method():
    """The loop composes features; what a method does lives with it (AdaHOP's calibration in fp4train.adahop,
    LoRA-SVD's realignment beside its layer)."""
    words = " ".join(_code_words(Path(fp4train.__file__).parent / "train" / "trainer.py")).lower()
    for method in ("adahop", "calibrat", "recorder", "lora", "realign"):
        assert method not in words, method


def test_the_word_finder_sees_code_not_docstrings(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""adahop in a docstring."""\nimport x  # lora in a comment\n\ndef f():\n    """realign"""\n    return y.calibrate("z")\n')
    assert _code_words(p) == {"x", "y", "calibrate", "z"}


# ---- checkpoints of the code before the features ------------------------------------------------
def _code_before_features(dest: Path) -> Path:
    """The package as it was at BEFORE_FEATURES, extracted into ``dest`` (skips where the history is not there)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the repository's git history (a clone, not an installed package)")
    r = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", BEFORE_FEATURES, "fp4train"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"commit {BEFORE_FEATURES[:10]} is not in this clone's history (a shallow clone?)")
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


_OLD_RUN = """
import json, sys
import fp4train
from fp4train.train import TrainConfig, Trainer
print(fp4train.__file__)
cfg = TrainConfig(**json.loads(sys.argv[1]))
Trainer(cfg, log=lambda m: None).run()
"""


@pytest.mark.parametrize("recipe,resume_at", [("mxfp4", 2), ("adahop3", 2), ("adahop3", 3), ("fullstack_r2", 3)])
def test_a_checkpoint_of_the_code_before_features_resumes_bit_for_bit(tmp_path, recipe, resume_at, monkeypatch):
    """The code before this design trains 5 steps, a checkpoint every step; the code now resumes from one of them (in
    AdaHOP's calibration, after it, between LoRA-SVD realignments) and ends on the same tensors, bit for bit. QAdamW
    (``fullstack``'s optimizer) has re-encoded its states with stochastic rounding since: the resumed run is given the
    rounding the checkpoint's code used, so that the continuations can be compared."""
    import functools

    from fp4train.optim import QAdamW
    from fp4train.train import optimizer

    monkeypatch.setattr(optimizer, "QAdamW", functools.partial(QAdamW, stochastic_states=False))
    old = _code_before_features(tmp_path / "old")
    # fullstack as that code knew it: QAdamW, no oversampling in the SVD (a field it does not know: left out of the
    # file it reads, and set to 0 for the code now after it ran)
    # (4/6 scaling: off, as that code's fullstack had it; AdaHOP's strategies: plain allowed, as that code chose)
    full_r2 = recipes.get("fullstack").replace(name="fullstack_r2", optimizer="qadamw", four_over_six=False,
                                               lora_svd=dataclasses.replace(recipes.get("fullstack").lora_svd, realign_every=2,
                                                                            oversample=0))
    files = {"adahop3": recipes.get("adahop").replace(name="adahop3", calibration_steps=3,
                                                      calibration_strategies=("plain", "iht", "oe")),
             "fullstack_r2": full_r2}
    path = None
    if recipe in files:
        path = tmp_path / f"{recipe}.json"
        d = files[recipe].to_dict()
        d.pop("four_over_six")  # recipe options that code did not know (off / all three: what it did)
        d.pop("calibration_strategies")
        if "lora_svd" in d:
            d["lora_svd"].pop("oversample")
        path.write_text(json.dumps(d))
        recipe = str(path)
    settings = dict(model="tiny", recipe=recipe, seq_len=32, batch_size=2, max_steps=5, warmup_steps=1, eval_every=0,
                    eval_batches=1, ckpt_every=1, keep_checkpoints=5, out=str(tmp_path / "run"), progress=False,
                    tensorboard=False, device="cpu")
    env = {**os.environ, "PYTHONPATH": str(old), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _OLD_RUN, json.dumps(settings)], env=env, cwd=old, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()) == old / "fp4train" / "__init__.py"  # the code before, not this checkout's
    assert Checkpoints(tmp_path / "run").entries()[-1]["step"] == 5
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")  # the same files, resumed by the code now
    if path is not None:
        files[Path(recipe).stem].save(path)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the old code ran
    try:
        logs = []
        resume = tmp_path / "resumed" / f"step_{resume_at:06d}.pt"
        # the checkpoint's settings: that code trained LoRA factors at the run's learning rate
        Trainer(TrainConfig(**{**settings, "out": str(tmp_path / "resumed"), "lora_lr_multiplier": 1.0}), resume=str(resume),
                log=logs.append).run()
        assert f"fp4train: resumed {tmp_path / 'resumed'} at step {resume_at}" in logs
    finally:
        torch.set_num_threads(threads)
    before, after = Checkpoints(tmp_path / "run").load(), Checkpoints(tmp_path / "resumed").load()
    # the code now saves a LoRA-SVD layer's merged weight beside its residual: the residual form is the one compared
    from fp4train.linear.lora_svd import residual_form

    now = residual_form(after["model"])
    assert before["step"] == after["step"] == 5 and now.keys() == before["model"].keys()
    for k, v in before["model"].items():
        assert torch.equal(v, now[k]), k
    for (i, a), (j, b) in zip(before["optimizer"]["state"].items(), after["optimizer"]["state"].items()):
        assert i == j and a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) if torch.is_tensor(a[n]) else a[n] == b[n] for n in a), i
    assert before.get("adahop_calibration") == after.get("adahop_calibration")
