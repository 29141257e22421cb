"""Golden losses: what every preset's training losses are, bit for bit, on the CPU (``test_golden_losses.py``).

Run this file to rewrite ``golden_losses.json`` after a deliberate change of numerics, and commit it with the change:

    python tests/golden_losses.py

The values depend on the CPU kernels PyTorch picks for the machine's vector instructions (AVX512, AVX2, ...) and on
its CPU's maker (the BLAS takes other kernels on AMD than on Intel at the same instruction set): FP4 rounding turns a
last-bit difference of an FP32 op into a different code, and a few steps make that visible. So the file holds, per
PyTorch version, one set per instruction set this machine can run (each computed in a subprocess with
``ATEN_CPU_CAPABILITY``), all on one thread, under ``"<instruction set>/<CPU vendor>"`` (sets under a bare
instruction set were made before the vendor was recorded; a machine without a set of its own vendor uses them).
Rewriting replaces the running PyTorch's sets of this machine's vendor and keeps the rest (rewrite those on such a
machine, or with that PyTorch, after a change of numerics; until then the changed presets are left out of them, and
their band comes from the sets that have them).

A machine with no set of its own still checks something: every preset's losses must fall in the band the committed
sets span (:func:`band`), and the quantizers' bits, which do not depend on the machine, are checked exactly by
``test_golden_quantizers.py``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden_losses.json")
STEPS = 8
#: AdaHOP's presets calibrate this many steps here (their own 20 would leave no FP4 step in so short a run)
CALIBRATION_STEPS = 2
#: the instruction sets PyTorch's CPU kernels come in, best first (ATEN_CPU_CAPABILITY's values)
CAPABILITIES = ("AVX512", "AVX2", "DEFAULT")


def golden_run(recipe: str, tmp: Path) -> dict:
    """``recipe``'s training loss at each of :data:`STEPS` steps of the ``tiny`` model and its final validation loss, on
    one CPU thread."""
    import fp4train
    from fp4train.train import TrainConfig, Trainer

    spec = fp4train.recipes.get(recipe)
    if spec.calibrate:
        path = tmp / f"{recipe}.json"
        spec.replace(calibration_steps=CALIBRATION_STEPS).save(path)
        recipe = str(path)
    out = tmp / f"run-{spec.name}"
    cfg = TrainConfig(model="tiny", recipe=recipe, seq_len=32, batch_size=2, max_steps=STEPS, warmup_steps=2, eval_every=0,
                      eval_batches=1, log_every=1, ckpt_every=0, out=str(out), device="cpu", progress=False, tensorboard=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the summation order of one thread, whatever the machine's core count
    try:
        Trainer(cfg, log=lambda m: None, checkpoints=False).run()
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {"train": [r["loss"] for r in records if "loss" in r], "val": records[-1]["val_loss"]}


def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def vendor() -> str:
    """The CPU's maker as the kernel reports it (``GenuineIntel``, ``AuthenticAMD``, ...), else the platform's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


def machine_key(cap: str | None = None) -> str:
    """The key of this machine's golden set at instruction set ``cap`` (default: the one PyTorch runs now)."""
    return f"{cap or capability()}/{vendor()}"


#: the band's margin beyond the committed sets' range, at least this fraction of a loss
BAND_MARGIN = 0.0025


def band(losses: dict, recipe: str) -> tuple[list[float], list[float]]:
    """``(lows, highs)``, per training step and then the validation loss: the range of ``recipe``'s losses over every
    committed set (every PyTorch version, instruction set and CPU vendor measured), widened on each side by that
    range again or :data:`BAND_MARGIN` of the loss, whichever is larger. A machine with no set of its own must land
    in it (how far the platforms measured spread: docs/running.md)."""
    runs = [v[recipe] for sets in losses.values() for v in sets.values() if recipe in v]
    cols = list(zip(*[r["train"] + [r["val"]] for r in runs]))
    lows, highs = [], []
    for c in cols:
        margin = max(max(c) - min(c), BAND_MARGIN * max(c))
        lows.append(min(c) - margin)
        highs.append(max(c) + margin)
    return lows, highs


def golden_set(sets: dict) -> dict | None:
    """This machine's golden set among one PyTorch version's ``sets``: its vendor's, else one made before vendors were
    recorded, else None."""
    return sets.get(machine_key(), sets.get(capability()))


def _all_presets() -> dict:
    import fp4train

    with tempfile.TemporaryDirectory() as d:
        return {r.name: golden_run(r.name, Path(d)) for r in fp4train.recipes.PRESETS}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":  # a subprocess: this capability's values, as JSON on stdout
        print(json.dumps({"capability": machine_key(), "losses": _all_presets()}))
        return
    best = capability()
    sets = {}
    for cap in CAPABILITIES[CAPABILITIES.index(best) if best in CAPABILITIES else 0:]:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap.lower())
        r = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True, check=True)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        sets[got["capability"]] = got["losses"]
        print(f"{got['capability']}: {len(got['losses'])} presets", file=sys.stderr)
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    versions = {v: s for v, s in old.get("losses", {}).items() if old.get("steps") == STEPS}
    versions[torch.__version__] = {**versions.get(torch.__version__, {}), **sets}
    GOLDEN.write_text(json.dumps({"steps": STEPS, "threads": 1, "losses": versions}, indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
