"""How long the README's quickstart takes, and how much disk it leaves.

Question: what does a newcomer wait for? Runs the README's Quickstart commands as written - the
``fp4train compare`` line (into a fresh folder, with an empty token cache: tokenization included) and,
with ``--tests``, the test-suite line - and times each. Copies the comparison's report (``report.json``,
``loss.png``) to ``bench/results/quickstart-<device>/`` beside ``timing.json`` (wall
seconds of each command, the run folder's size, the machine's cores); ``python bench/tables.py`` puts the
table and the times in the README.

With ``--platforms`` the comparison runs again under every other instruction set PyTorch's CPU kernels take on this
machine (``ATEN_CPU_CAPABILITY``) and on one thread, and ``timing.json`` keeps each run's validation losses beside the
CPU's maker: how far the table moves with the kernels a machine picks.

    python bench/quickstart.py [--tests] [--platforms]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from common import ROOT, device_name, write_results


def quickstart_commands(readme: str) -> tuple[list[str], list[str]]:
    """The README Quickstart section's ``fp4train compare`` and test-suite commands, as argument lists."""
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    compare = next(shlex.split(ln) for ln in lines if ln.startswith("fp4train compare"))
    tests = next(shlex.split(ln) for ln in lines if "pytest" in ln)
    return compare, tests


def _with_out(argv: list[str], out: str) -> list[str]:
    argv = list(argv)
    if "--out" in argv:
        argv[argv.index("--out") + 1] = out
    else:
        argv += ["--out", out]
    return argv


def _folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6


def _vendor() -> str:
    """The CPU's maker as the kernel reports it (GenuineIntel, AuthenticAMD, ...)."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("vendor_id"))
    except (OSError, StopIteration):
        return "unknown"


def _setting(cap: str | None, threads: int | None) -> dict:
    import torch

    return {"kernels": cap or torch.backends.cpu.get_cpu_capability(), "threads": threads or torch.get_num_threads(),
            "vendor": _vendor()}


def _other_settings() -> list[tuple[str | None, int | None]]:
    """(instruction set, threads) of each other run: the weaker instruction sets, then one thread."""
    import torch

    caps = ("AVX512", "AVX2", "DEFAULT")
    best = torch.backends.cpu.get_cpu_capability()
    weaker = list(caps[caps.index(best) + 1:]) if best in caps else []
    return [(c, None) for c in weaker] + ([(None, 1)] if torch.get_num_threads() > 1 else [])


def _val_losses(out: str) -> dict[str, float]:
    import json

    rep = json.loads(open(os.path.join(out, "report.json")).read())
    return {r: x["val_loss_mean"] for r, x in rep["recipes"].items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tests", action="store_true", help="also time the README's test-suite command (minutes)")
    ap.add_argument("--platforms", action="store_true", help="also run the comparison under the other instruction sets "
                    "and on one thread, and keep each run's losses (minutes each)")
    args = ap.parse_args(argv)
    compare, tests = quickstart_commands((ROOT / "README.md").read_text())
    dev = device_name().replace(" ", "_")
    dest = ROOT / "bench" / "results" / f"quickstart-{'cpu' if dev == 'cpu' else dev}"
    timing = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "quickstart")
        env = dict(os.environ, FP4TRAIN_CACHE=os.path.join(tmp, "cache"))  # tokenization included
        cmd = [sys.executable, "-m", "fp4train", *_with_out(compare[1:], out)]
        print("$", shlex.join(compare), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, cwd=ROOT)
        timing["compare_s"] = time.perf_counter() - t0
        timing["compare_disk_mb"] = _folder_mb(out)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "loss.png"):  # report.md is report.json's tables: bench/tables.py renders them
            shutil.copy(os.path.join(out, name), dest / name)
        platforms = [{**_setting(None, None), "val_loss": _val_losses(out)}]
        if args.platforms:
            for cap, threads in _other_settings():
                other = os.path.join(tmp, f"quickstart-{cap}-{threads}")
                run_env = dict(env, **({"ATEN_CPU_CAPABILITY": cap.lower()} if cap else {}),
                               **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
                subprocess.run([sys.executable, "-m", "fp4train", *_with_out(compare[1:], other), "--no-progress"],
                               env=run_env, check=True, cwd=ROOT)
                platforms.append({**_setting(cap, threads), "val_loss": _val_losses(other)})
    if args.tests:
        print("$", shlex.join(tests), flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, *tests[1:]], cwd=ROOT)
        timing["tests_s"] = time.perf_counter() - t0
        timing["tests_exit_code"] = done.returncode
    import torch

    # the FP4 rows depend on the CPU kernels' instruction set (a last-bit difference flips an FP4 code)
    write_results(dest / "timing.json", timing, compare=shlex.join(compare), tests=shlex.join(tests), cores=os.cpu_count(),
                  cpu=torch.backends.cpu.get_cpu_capability(), vendor=_vendor(), platforms=platforms)
    print(", ".join(f"{k} {v:.1f}" for k, v in timing.items()))


if __name__ == "__main__":
    main()
