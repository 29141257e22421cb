"""Compare recipes: the same model, data order, seed and token budget under each recipe.

Runs every (recipe, seed) pair - one after another, or several at once, one per GPU, as
subprocesses - then writes a report folder:

* ``report.json``: per recipe the gap to BF16 in percent (per seed, at the same seed, and the mean), plus
  BF16's own seed-to-seed spread, so a real difference can be told from noise; and every run whole (final
  validation loss, tokens/s, peak memory, settings, loss curves): the comparison's evidence in one file;
* ``report.md``: the same as tables;
* ``loss.png``: training-loss curves (every logged step) and validation losses (means over seeds), and the
  validation gap to BF16 over training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..checkpoint import MANIFEST, Checkpoints
from ..devices import resolve_device
from .config import TrainConfig, saved_settings, speed_settings
from .features import recipe_and_features
from .run_dir import RunDirBusy, RunLock, busy, write_text
from .signals import terminate_as_interrupt
from .trainer import load_data, train

BASELINE = "bf16"
#: BF16 trained with Root + AdamW: the baseline of recipes trained with Root (``fullstack``: Q-Root, as the paper pairs it)
ROOT_BASELINE = "bf16-root"
#: the optimizers ROOT_BASELINE stands beside
ROOT_FAMILY = ("root", "qroot", "qroot_bf16ns")
#: the noise-floor runs: BF16 with each seed's initialization and rounding, the training windows in another order
REORDERED = "bf16-reordered"
#: their data-order seed is the run's seed plus this
REORDER_OFFSET = 1000


#: tokens of each --eval-data text a comparison evaluates every run on (the first ones)
EVAL_TOKENS = 262_144


def run_name(recipe: str, seed: int) -> str:
    return f"{recipe_label(recipe)}-seed{seed}"


def recipe_label(recipe: str) -> str:
    """A recipe as the report names it: a preset by its name, a recipe file by its file's stem."""
    return Path(recipe).stem if recipe.endswith(".json") else recipe


def compare(base: TrainConfig, recipes: list[str], seeds: list[int], out: str | Path, *, gpus: list[int] | None = None,
            overwrite: bool = False, eval_data: list[str] | None = None, eval_tokens: int = EVAL_TOKENS,
            recipe_optimizers: bool = False, noise_floor: bool = False) -> dict:
    """Train every recipe x seed from ``base`` and write the report to ``out``.

    ``gpus``: ``None`` trains in this process, one run after another; a list of GPU ids runs
    subprocesses, one per entry at a time (repeat an id to share a GPU between runs).

    Everything is checked before the first run: every recipe name, the data (tokenized once here),
    the device, and every run already in ``out``: a finished run is reused and an interrupted one
    resumed only if it was made with the settings asked for now (:data:`~.config.RESULT_FIELDS`);
    one made with other settings is refused, naming them, or with ``overwrite`` trained again.

    ``eval_data``: text sources (e.g. out-of-domain text) on which every finished run's checkpoint is evaluated
    with its recipe's forward (``fp4train eval``, the first ``eval_tokens`` tokens); the report adds their loss
    and gap to BF16. Results are kept in each run's folder and reused.

    ``recipe_optimizers``: each run takes its recipe's optimizer (``fullstack``: Q-Root + QAdamW; the others AdamW) in
    place of ``base.optimizer`` - what the CLI does when ``--optimizer`` is not given. A recipe trained with Root is
    then measured against BF16 trained with Root + AdamW (:data:`ROOT_BASELINE`, run alongside, as Full-Stack FP4's
    paper pairs them), the others against BF16 with AdamW.

    ``noise_floor``: also train BF16 once more per seed with the same initialization and rounding seeds but the
    training windows in another order (``data_seed = seed + REORDER_OFFSET``), so that the report can set the
    recipes' gaps beside two measures of noise: BF16's seed-to-seed spread and this same-init spread."""
    out = Path(out)
    if len(set(recipes)) < len(recipes):
        raise ValueError(f"--recipes names a recipe twice: {', '.join(recipes)}")
    recipes = [BASELINE] + [r for r in recipes if r != BASELINE]  # the baseline first: every gap needs it
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds names a seed twice: {', '.join(map(str, seeds))}")
    # recipe by recipe (a cut-short comparison still has whole pairs); the noise-floor runs right after BF16's
    labels = recipes[:1] + ([REORDERED] if noise_floor else []) + recipes[1:]
    per_recipe = {"optimizer": None} if recipe_optimizers else {}  # None: TrainConfig resolves the recipe's
    cfgs = {(r, s): dataclasses.replace(base, recipe=BASELINE if r == REORDERED else r, seed=s,
                                        data_seed=s + REORDER_OFFSET if r == REORDERED else base.data_seed,
                                        out=str(out / "runs" / run_name(r, s)), **per_recipe)
            for r in labels for s in seeds}
    if recipe_optimizers and any(cfgs[(r, seeds[0])].optimizer in ROOT_FAMILY for r in recipes):
        recipes = [BASELINE, ROOT_BASELINE] + recipes[1:]  # the Root-trained recipes' own baseline, right after BF16's
        root_runs = {(ROOT_BASELINE, s): dataclasses.replace(base, recipe=BASELINE, seed=s, optimizer="root",
                                                             out=str(out / "runs" / run_name(ROOT_BASELINE, s)))
                     for s in seeds}
        cfgs = {**{k: v for k, v in cfgs.items() if k[0] in (BASELINE, REORDERED)}, **root_runs,
                **{k: v for k, v in cfgs.items() if k[0] not in (BASELINE, REORDERED)}}
    # checks before any work: no other process writing here, recipes, device, data, the runs already there
    for d in [out, *(Path(c.out) for c in cfgs.values())]:
        holder = busy(d)
        if holder:
            raise RunDirBusy(holder)
    for cfg in cfgs.values():
        recipe_and_features(cfg)  # the recipe loads, and its features can run this config
    if not gpus:
        resolve_device(base.device)
    load_data(base)
    for text in eval_data or []:  # an unreadable evaluation text is refused now, not after the training
        from ..data.sources import check_readable, expand

        for f in expand(text):
            check_readable(f)
    if base.parallel != "none" and not gpus:
        raise ValueError(f"compare --parallel {base.parallel} spreads each run over the GPUs that --gpus lists (e.g. "
                         "--gpus 0,1); it cannot run in this process (--gpus none)")
    lock = RunLock(out, "compare").acquire()  # one comparison writes a folder at a time
    if lock.stale_note():
        print(lock.stale_note(), file=sys.stderr, flush=True)
    try:
        return _compare(base, recipes, seeds, out, cfgs, gpus=gpus, overwrite=overwrite, eval_data=eval_data,
                        eval_tokens=eval_tokens, noise_floor=noise_floor)
    finally:
        lock.release(remove_created=True)


def _compare(base: TrainConfig, recipes: list[str], seeds: list[int], out: Path, cfgs: dict, *, gpus, overwrite: bool,
             eval_data, eval_tokens: int, noise_floor: bool) -> dict:
    """:func:`compare`'s runs and report, once its checks have passed and its folder is locked."""
    stale = {key: diff for key, cfg in cfgs.items() if (diff := settings_changed(cfg))}
    if stale and not overwrite:
        lines = "; ".join(f"{run_name(*k)} ({d})" for k, d in stale.items())
        raise ValueError(f"{out} holds runs made with other settings: {lines}. Re-run them with --overwrite, or choose another --out")
    for key in stale:
        shutil.rmtree(cfgs[key].out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "compare.json", json.dumps({"base": base.to_dict(), "recipes": recipes, "seeds": seeds,
                                                 "noise_floor": noise_floor}, indent=1))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"fp4train compare: {len(cfgs)} runs ({', '.join(recipes)} x seeds {', '.join(map(str, seeds))}) into {out}")
    per_gpu = max(gpus.count(g) for g in gpus) if gpus and base.parallel == "none" else 1

    def on_finish(cfg: TrainConfig) -> None:
        """As each run finishes: its evaluations on the other texts, and the report so far (a comparison cut short
        keeps both)."""
        for text in eval_data or []:
            eval_run(Path(cfg.out), text, eval_tokens, device=base.device, log=log)
        if all(finished(c) for (r, _), c in cfgs.items() if r in (BASELINE, ROOT_BASELINE)):
            with contextlib.redirect_stdout(io.StringIO()):
                write_report(out, recipes, seeds, runs_per_gpu=per_gpu, eval_data=eval_data)

    if base.parallel != "none":  # each run over all the listed GPUs (torchrun), one run at a time
        run_parallel(cfgs, [gpus], on_finish=on_finish)
    elif gpus:
        run_parallel(cfgs, [[g] for g in gpus], on_finish=on_finish)
    else:
        for n, ((r, s), cfg) in enumerate(cfgs.items(), 1):
            if finished(cfg):
                log(f"fp4train compare: [{n}/{len(cfgs)}] {run_name(r, s)} is already done with these settings, reusing it")
                continue
            log(f"fp4train compare: [{n}/{len(cfgs)}] {run_name(r, s)}")
            resume = interrupted(cfg)  # else a fresh start, over what a run stopped before its first checkpoint left
            train(cfg, resume=resume, overwrite=not resume)
            Checkpoints(cfg.out).prune(1)  # a finished run needs only its last checkpoint
            on_finish(cfg)
    for text in eval_data or []:  # runs finished before (kept results are reused)
        for (r, s), cfg in cfgs.items():
            if finished(cfg):
                eval_run(Path(cfg.out), text, eval_tokens, device=base.device, log=log)
    report = write_report(out, recipes, seeds, runs_per_gpu=per_gpu, eval_data=eval_data)
    log(f"fp4train compare: report in {out / 'report.md'} (and report.json, loss.png)")
    return report


def settings_changed(cfg: TrainConfig) -> str:
    """How the run already in ``cfg.out`` (if any) was made differently from ``cfg``: '' if the same
    (or there is none), else e.g. ``"max_steps 150 (now 300), lr 0.003 (now 0.001)"``."""
    saved = Path(cfg.out) / "config.json"
    if not saved.exists():
        return "its config.json is missing" if any(Path(cfg.out).glob("step_*")) else ""
    try:
        then = json.loads(saved.read_text())["train"]
    except (ValueError, KeyError):
        return "its config.json is damaged"
    now = cfg.result_settings()
    then = saved_settings(then)  # a run from before an option existed ran with what the option now calls it
    try:  # compile and its mode as the run resolves them on this machine (None: the device's default)
        dev = resolve_device(cfg.device)
        then_cfg = TrainConfig.from_dict({k: v for k, v in then.items() if k in now})
    except ValueError:
        dev = then_cfg = None
    if then_cfg is not None:
        then["compile"], then["compile_mode"], _ = speed_settings(then_cfg, dev)
        now["compile"], now["compile_mode"], _ = speed_settings(cfg, dev)
    then.update(dict.fromkeys(cfg.unused_by_recipe()))  # the same recipe (else that differs): the same options unused
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - JSON has lists
    return ", ".join(f"{k} {then.get(k)!r} (now {now[k]!r})" for k in now if norm(then.get(k)) != norm(now[k]))



def finished(cfg: TrainConfig) -> bool:
    return (Path(cfg.out) / "summary.json").exists()


def interrupted(cfg: TrainConfig) -> bool:
    """A run that wrote a checkpoint but no summary was stopped part-way: resume it, not restart it.
    (:func:`compare` has checked that it was made with the same settings.)"""
    return not finished(cfg) and (Path(cfg.out) / MANIFEST).exists()


def run_parallel(cfgs: dict, slots: list[list[int]], on_finish=None) -> None:
    """Train each config in a subprocess; ``slots`` lists, per concurrent run, the GPU ids it runs on
    (``[[0], [0], [1], [1]]``: two runs at a time on each of two GPUs; ``[[0, 1]]``: one run at a time over two
    GPUs, under torchrun, for configs with ``parallel`` ddp or fsdp). Finished runs are skipped,
    interrupted ones resumed from their newest checkpoint. ``on_finish(cfg)`` is called in this process as
    each run finishes."""
    pending = [(k, c) for k, c in cfgs.items() if not finished(c)]
    running: dict[int, tuple] = {}
    failed = []
    try:
        with terminate_as_interrupt():  # SIGTERM, like Ctrl-C, stops the runs below (not this process alone)
            while pending or running:
                for slot, g in enumerate(slots):
                    if slot not in running and pending:
                        key, cfg = pending.pop(0)
                        Path(cfg.out).mkdir(parents=True, exist_ok=True)
                        cfg_path = Path(cfg.out) / "train_config.json"
                        dev = "cuda:0" if torch.cuda.is_available() else cfg.device  # the first GPU the subprocess sees
                        cfg_path.write_text(json.dumps(dataclasses.replace(cfg, device=dev, progress=False).to_dict()))
                        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, g)))
                        launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(g))]
                                                     if cfg.parallel != "none" else [])
                        resume = interrupted(cfg)
                        log = open(Path(cfg.out) / "train.log", "a" if resume else "w")
                        p = subprocess.Popen(launch + ["-m", "fp4train", "train", "--config-json", str(cfg_path)]
                                             + (["--resume"] if resume else ["--overwrite"]),
                                             env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)  # Ctrl-C reaches this process, which passes it on once
                        running[slot] = (p, key, log, cfg.out)
                        how = "resumed" if resume else "started"
                        where = (f"GPU{'s' if len(g) > 1 else ''} {','.join(map(str, g))}" if torch.cuda.is_available()
                                 else f"the CPU, {f'{len(g)} processes (torchrun)' if len(g) > 1 else 'in a subprocess'}")
                        print(f"fp4train: {how} {Path(cfg.out).name} on {where}", file=sys.stderr, flush=True)
                time.sleep(1)
                for slot, (p, key, log, run_out) in list(running.items()):
                    if p.poll() is not None:
                        log.close()
                        del running[slot]
                        if p.returncode != 0:
                            failed.append(f"{Path(run_out).name} (exit {p.returncode}, see {run_out}/train.log)")
                        else:
                            Checkpoints(run_out).prune(1)
                            print(f"fp4train: finished {Path(run_out).name}", file=sys.stderr, flush=True)
                            if on_finish is not None:
                                on_finish(cfgs[key])
    finally:  # interrupted (Ctrl-C, SIGTERM, a time limit): stop the runs, each after its step and a checkpoint
        for p, _key, _log, _out in running.values():
            p.send_signal(signal.SIGINT)
        for p, _key, log, _out in running.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait()
            log.close()
    if failed:
        raise RuntimeError("runs failed: " + ", ".join(failed))


def run_curve(run_dir: Path, key: str = "val_loss") -> list[tuple[int, float]]:
    """``[(step, value)]`` of ``key`` (``val_loss``, or ``loss``: the training loss at every logged step) in a run's
    metrics."""
    pts = []
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(ln)
        if key in rec:
            pts.append((rec["step"], rec[key]))
    return pts


def eval_name(text: str) -> str:
    """A short name for an evaluation text: its file or folder name."""
    return Path(text.rstrip("/")).name or text


def eval_run(run: Path, text: str, tokens: int, *, device: str = "auto", log=print) -> dict:
    """``run``'s evaluation on ``text`` (kept in ``run/eval-<name>.json``, redone when the run has moved on)."""
    from ..evaluate import evaluate

    path = run / f"eval-{eval_name(text)}.json"
    step = json.loads((run / "summary.json").read_text())["steps"]
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("step") == step and kept.get("data") == text and kept.get("max_tokens") == tokens:
            return kept
    res = evaluate(run, text, max_tokens=tokens, device=device, log=log)
    res["max_tokens"] = tokens
    write_text(path, json.dumps(res, indent=1))
    return res


#: two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the value at 30, a slightly wide interval)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201,
       12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080,
       22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}


def interval95(xs: list[float]) -> tuple[float, float] | None:
    """The 95% confidence interval of the mean of ``xs`` (Student's t; the per-seed gaps are paired differences,
    so this is the paired-t interval of the gap). None for fewer than two values."""
    if len(xs) < 2:
        return None
    half = T95[min(len(xs) - 1, 30)] * statistics.stdev(xs) / math.sqrt(len(xs))
    m = statistics.mean(xs)
    return m - half, m + half


def verdict(ci: tuple[float, float] | None, than: str = "BF16") -> str:
    """What a gap's 95% interval ``ci`` (None: one seed) says against ``than``, the run it was measured against."""
    if ci is None:
        return "one seed: no interval"
    if ci[0] > 0:
        return f"resolved: worse than {than}"
    if ci[1] < 0:
        return f"resolved: better than {than}"
    return "not resolved (the interval holds 0)"


def _gap_stats(gaps: list[float], recipe: str, baseline: str = BASELINE) -> dict:
    """A recipe's gaps (% per seed) to ``baseline`` summarized: mean, 95% interval, verdict (the baseline's gap is 0
    by definition)."""
    if recipe == BASELINE:
        return {"gap_pct_mean": 0.0, "verdict": "baseline"}
    ci = interval95(gaps)
    return {"gap_pct_mean": statistics.mean(gaps), "gap_pct_ci95": list(ci) if ci else None,
            "resolved": ci is not None and (ci[0] > 0 or ci[1] < 0),
            "verdict": verdict(ci, "BF16" if baseline == BASELINE else baseline)}


def _baseline_of(recipe: str, optimizer: str | None, recipes: list[str]) -> str:
    """What a recipe's gap is measured against: BF16 trained with Root + AdamW for a recipe trained with Root, where
    that baseline finished; BF16 with AdamW otherwise (and for the Root baseline itself)."""
    if recipe != ROOT_BASELINE and optimizer in ROOT_FAMILY and ROOT_BASELINE in recipes:
        return ROOT_BASELINE
    return BASELINE


def noise_floor(out: Path, seeds: list[int], base_losses: dict[int, float]) -> dict:
    """BF16's noise: the seed-to-seed spread of its final validation loss (sample standard deviation and max − min,
    in % of the mean) and, where the ``--noise-floor`` runs exist, the same-init spread: |L(seed, other order) −
    L(seed)| / L(seed) per seed, its mean and maximum (%)."""
    vals = [base_losses[s] for s in seeds]
    mean = statistics.mean(vals)
    nf = {"seed_std_pct": statistics.stdev(vals) / mean * 100 if len(vals) > 1 else None,
          "seed_range_pct": (max(vals) - min(vals)) / mean * 100 if len(vals) > 1 else None}
    reord = {s: json.loads(f.read_text())["final_val_loss"] for s in seeds
             if (f := out / "runs" / run_name(REORDERED, s) / "summary.json").exists()}
    if reord:
        per = {str(s): abs(reord[s] / base_losses[s] - 1) * 100 for s in reord}
        nf.update({"reorder_abs_pct_per_seed": per, "reorder_abs_pct_mean": statistics.mean(per.values()),
                   "reorder_abs_pct_max": max(per.values())})
    return nf


#: what report.json keeps of a run folder besides its summary and curves: its settings and AdaHOP's calibration
RUN_EVIDENCE = {"config": "config.json", "adahop_calibration": "adahop_calibration.json"}


def write_report(out: str | Path, recipes: list[str], seeds: list[int], *, runs_per_gpu: int = 1,
                 eval_data: list[str] | None = None) -> dict:
    """Report the finished runs in ``out/runs`` in ``report.json`` (the report, the comparison's settings, the recipes
    of its recipe files, and every run's summary, validation and training loss curves and :data:`RUN_EVIDENCE`: the
    comparison's evidence in one file), ``report.md`` and ``loss.png``.
    A recipe with a seed not yet finished is listed as
    unfinished and left out of the tables (re-running the same ``compare`` finishes it); BF16 must
    be complete, since every gap is measured against it. ``runs_per_gpu``: how many runs shared a
    GPU at once (their tokens/s are then only comparable with each other).

    Each recipe's gap to BF16 is paired by seed (the same initialization and data order); the report gives its
    mean with a 95% interval over seeds (:func:`interval95`) and says whether the interval excludes 0."""
    out = Path(out)
    done = {(r, s): out / "runs" / run_name(r, s) for r in recipes for s in seeds}
    unfinished = [r for r in recipes if any(not (done[(r, s)] / "summary.json").exists() for s in seeds)]
    if BASELINE in unfinished:
        raise FileNotFoundError(f"cannot report {out}: the {BASELINE} baseline has not finished for every seed "
                                f"({[s for s in seeds if not (done[(BASELINE, s)] / 'summary.json').exists()]}); run the comparison again to finish it")
    recipes = [r for r in recipes if r not in unfinished]
    if ROOT_BASELINE in unfinished:  # a Root-trained recipe has no gap until its own baseline has finished
        waiting = [r for r in recipes if json.loads((done[(r, seeds[0])] / "summary.json").read_text()).get("optimizer")
                   in ROOT_FAMILY]
        recipes = [r for r in recipes if r not in waiting]
        unfinished += waiting
    runs = []
    for r in recipes:
        for s in seeds:
            d = done[(r, s)]
            summ = json.loads((d / "summary.json").read_text())
            runs.append({**summ, "recipe_arg": r, "run": d.name, "curve": run_curve(d), "train_curve": run_curve(d, "loss"),
                         **{key: json.loads((d / name).read_text()) for key, name in RUN_EVIDENCE.items()
                            if (d / name).exists()}})
    by = {(x["recipe_arg"], x["seed"]): x for x in runs}
    base_losses = {s: by[(BASELINE, s)]["final_val_loss"] for s in seeds}
    nf = noise_floor(out, seeds, base_losses)
    summary = {}
    for r in recipes:
        baseline = _baseline_of(r, by[(r, seeds[0])].get("optimizer"), recipes)
        losses = [by[(r, s)]["final_val_loss"] for s in seeds]
        gaps = [(by[(r, s)]["final_val_loss"] / by[(baseline, s)]["final_val_loss"] - 1) * 100 for s in seeds]
        tps = [by[(r, s)]["tokens_per_s"] for s in seeds if by[(r, s)]["tokens_per_s"]]
        mem = [by[(r, s)]["peak_mem_gib"] for s in seeds if by[(r, s)]["peak_mem_gib"]]
        summary[recipe_label(r)] = {
            "val_loss_mean": statistics.mean(losses),
            "val_loss_per_seed": dict(zip(map(str, seeds), losses)),
            "gap_pct_per_seed": dict(zip(map(str, seeds), gaps)),
            **_gap_stats(gaps, r, baseline),
            "tokens_per_s": statistics.mean(tps) if tps else None,
            "peak_mem_gib": max(mem) if mem else None,
            "bf16_steps": max(by[(r, s)].get("bf16_steps", 0) for s in seeds),
            "optimizer": by[(r, seeds[0])].get("optimizer"),
            "baseline": baseline,
            "hardware": sorted({_hardware(by[(r, s)]) for s in seeds}),
        }
        evals = {}
        for text in eval_data or []:
            name = eval_name(text)
            got = {s: json.loads(f.read_text())["loss"] for s in seeds
                   if (f := done[(r, s)] / f"eval-{name}.json").exists()}
            base = {s: json.loads(f.read_text())["loss"] for s in seeds
                    if (f := done[(baseline, s)] / f"eval-{name}.json").exists()}
            paired = [s for s in seeds if s in got and s in base]
            if paired:
                egaps = [(got[s] / base[s] - 1) * 100 for s in paired]
                evals[name] = {"loss_mean": statistics.mean(got[s] for s in paired), "gap_pct_per_seed": egaps,
                               **_gap_stats(egaps, r, baseline)}
        if evals:
            summary[recipe_label(r)]["eval"] = evals
    first = runs[0]
    report = {
        "model": first["model"], "tokens_per_run": first["tokens"], "steps": first["steps"], "seeds": seeds,
        "device": first["device"], "gpu": first.get("gpu"), "hardware": sorted({_hardware(x) for x in runs}),
        "date": time.strftime("%Y-%m-%d"),
        "noise_floor": nf, "recipes": summary, "unfinished": unfinished,
        "numerics": sorted({x.get("numerics") or "eager" for x in runs}),
        "backends": sorted({x.get("backend") or "emulated" for x in runs}), "runs_per_gpu": runs_per_gpu,
        # the comparison's settings, its recipe files' recipes and each run whole (summary, settings, loss curves):
        # report.json alone is the comparison's evidence
        "settings": json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else None,
        "recipe_files": {recipe_label(r): json.loads(Path(r).read_text()) if Path(r).is_file() else None
                         for r in recipes if r.endswith(".json")},
        "runs": runs,
    }
    write_text(out / "report.json", json.dumps(report, indent=1))
    write_text(out / "report.md", report_markdown(report))
    _plot(out / "loss.png", runs, recipes, seeds)
    print((out / "report.md").read_text())
    return report


def _hardware(run: dict) -> str:
    """What a run trained on: its GPU's name, else its device."""
    return run.get("gpu") or run["device"]


def _hardware_line(rep: dict) -> str:
    """The report's hardware: one GPU (or device), or each with the recipes that ran on it - a comparison continued
    on another machine (a recipe added later) names both, and its tokens/s compare only within one."""
    kinds = rep.get("hardware") or [rep["gpu"] or rep["device"]]
    if len(kinds) == 1:
        return f"Hardware: {kinds[0]}."
    on = {k: [r for r, x in rep["recipes"].items() if k in x.get("hardware", [])] for k in kinds}
    return "Hardware: " + "; ".join(f"{k} ({', '.join(rs)})" for k, rs in on.items()) + " - tokens/s compare within one."


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def _ci(x: dict) -> str:
    ci = x.get("gap_pct_ci95")
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "—"


def report_markdown(rep: dict) -> str:
    """A comparison's report.md from its report.json (the tables and the verdicts)."""
    n = len(rep["seeds"])
    lines = [
        f"# Recipe comparison: `{rep['model']}`, {rep['tokens_per_run']:,} tokens per run, seeds {rep['seeds']}",
        "",
        f"{_hardware_line(rep)} Date: {rep['date']}. Validation loss at the end of training; gap = loss / BF16 loss − 1 at "
        f"the same seed, its mean over the {n} seeds with a 95% interval (paired t over seeds); a gap is resolved when "
        f"the interval excludes 0. Tokens/s: backend {', '.join(rep.get('backends', ['emulated']))}, numerics {', '.join(rep.get('numerics', []))}"
        + (f", up to {rep['runs_per_gpu']} runs sharing each GPU at once (compare them with each other only; "
           "`bench/train_speed.py` measures speed)." if rep.get("runs_per_gpu", 1) > 1 else "."),
        "",
        "| recipe | val loss (mean) | gap to BF16 % (mean) | 95% interval | verdict | gap per seed % | tokens/s | peak mem GiB |",
        "|---|---:|---:|---|---|---|---:|---:|",
    ]
    for r, x in rep["recipes"].items():
        per = ", ".join(f"{g:+.2f}" for g in x["gap_pct_per_seed"].values())
        lines.append(f"| {r} | {x['val_loss_mean']:.4f} | {x['gap_pct_mean']:+.2f} | {_ci(x)} | {x['verdict']} | {per} | "
                     f"{_fmt(x['tokens_per_s'], ',.0f')} | {_fmt(x['peak_mem_gib'], '.2f')} |")
    texts = sorted({t for x in rep["recipes"].values() for t in x.get("eval", {})})
    for t in texts:
        lines += ["", f"Loss on `{t}` (`--eval-data`, the recipe's forward; gap to BF16 at the same seed):", "",
                  "| recipe | loss (mean) | gap % (mean) | 95% interval | verdict |", "|---|---:|---:|---|---|"]
        for r, x in rep["recipes"].items():
            ev = x.get("eval", {}).get(t)
            if ev:
                lines.append(f"| {r} | {ev['loss_mean']:.4f} | {ev['gap_pct_mean']:+.2f} | {_ci(ev)} | {ev['verdict']} |")
    nf = rep.get("noise_floor") or {}
    if nf.get("seed_std_pct") is not None:
        lines += ["", f"Noise floor (BF16): seed-to-seed standard deviation {nf['seed_std_pct']:.3f}% of the validation loss "
                  f"(max − min {nf['seed_range_pct']:.3f}%)"
                  + (f"; same initialization, training data in another order: {nf['reorder_abs_pct_mean']:.3f}% on average, "
                     f"at most {nf['reorder_abs_pct_max']:.3f}%" if "reorder_abs_pct_mean" in nf else "")
                  + ". The intervals above already account for seed noise."]
    else:
        lines += ["", "One seed: these gaps carry no estimate of noise, so none of them is shown to be real. Run several "
                  "seeds (e.g. `--seeds 0,1,2`) to measure BF16's seed-to-seed spread beside them."]
    paired = [r for r, x in rep["recipes"].items() if x.get("baseline") == ROOT_BASELINE]
    if paired:
        lines += ["", f"{', '.join(paired)}: trained with Root, so the gap is to `{ROOT_BASELINE}` (BF16 trained with Root + "
                  "AdamW, Full-Stack FP4's baseline), not to BF16 with AdamW."]
    calib = {r: x["bf16_steps"] for r, x in rep["recipes"].items() if x.get("bf16_steps")}
    if calib:
        lines += ["", "Steps spent in BF16 calibration (counted in each run's steps): "
                  + ", ".join(f"{r} {n} of {rep['steps']}" for r, n in calib.items()) + "."]
    if rep.get("unfinished"):
        lines += ["", f"Not finished yet (left out above): {', '.join(rep['unfinished'])}. Run the same `fp4train compare` again to finish them."]
    return "\n".join(lines) + "\n"


def loss_axis(values) -> tuple[float, float, bool]:
    """``(low, high, log)``: a loss axis that holds every value of ``values`` with a small margin, logarithmic where
    the largest is more than 1.5 times the smallest (a training curve from its first steps)."""
    lo, hi = min(values), max(values)
    if hi > 1.5 * lo > 0:
        return lo / 1.03, hi * 1.03, True
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
    return lo - pad, hi + pad, False


def loss_figure(runs: list[dict], recipes: list[str], seeds: list[int]):
    """The comparison's figure. Left: each recipe's training loss at every logged step (line) and its validation loss at
    every evaluation (markers), means over seeds, the validation band from the lowest to the highest seed; the axis
    fits the data (:func:`loss_axis`). Right: the gap to BF16 at the same seed of the validation loss, its mean with
    the 95% interval over seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    by = {(x["recipe_arg"], x["seed"]): dict(x["curve"]) for x in runs}
    train = {(x["recipe_arg"], x["seed"]): dict(x.get("train_curve") or ()) for x in runs}
    shown = []  # every plotted loss, for the axis
    for i, r in enumerate(recipes):
        color = f"C{i % 10}"  # the same colour for a recipe in both panels
        label = recipe_label(r)
        tsteps = sorted(set.intersection(*(set(train[(r, s)]) for s in seeds)))
        tmeans = [statistics.mean(train[(r, s)][t] for s in seeds) for t in tsteps]
        if tsteps:
            ax1.plot(tsteps, tmeans, color=color, lw=1, alpha=0.8, label=f"{label} (training)")
        steps = sorted(set.intersection(*(set(by[(r, s)]) for s in seeds)))
        vals = [[by[(r, s)][t] for s in seeds] for t in steps]
        means = [statistics.mean(v) for v in vals]
        shown += tmeans + [x for v in vals for x in v]
        ax1.plot(steps, means, ls="none", marker="o", ms=5, mec="k", mew=0.5, color=color, label=f"{label} (validation)")
        if len(seeds) > 1 and len(steps) > 1:
            ax1.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15, lw=0)
        if r != BASELINE:
            ts = [t for t in steps if all(t in by[(BASELINE, s)] for s in seeds)]
            gaps = [[(by[(r, s)][t] / by[(BASELINE, s)][t] - 1) * 100 for s in seeds] for t in ts]
            ax2.plot(ts, [statistics.mean(g) for g in gaps], label=label, color=color, marker="o", ms=4)
            cis = [interval95(g) for g in gaps]
            if ts and cis[0] is not None:
                ax2.fill_between(ts, [c[0] for c in cis], [c[1] for c in cis], color=color, alpha=0.15, lw=0)
    ax1.set(xlabel="step", ylabel="loss", title="training loss (lines) and validation loss (markers), mean over seeds")
    if shown:
        lo, hi, log = loss_axis(shown)
        if log:
            ax1.set_yscale("log")
        ax1.set_ylim(lo, hi)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set(xlabel="step", ylabel="gap to BF16 (%)", title="validation gap to BF16, same seed (mean, band: 95% interval)")
    for a in (ax1, ax2):
        a.grid(alpha=0.3, which="both")
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot(path: Path, runs: list[dict], recipes: list[str], seeds: list[int]) -> None:
    import matplotlib.pyplot as plt

    fig = loss_figure(runs, recipes, seeds)
    fig.savefig(path, dpi=110)
    plt.close(fig)
