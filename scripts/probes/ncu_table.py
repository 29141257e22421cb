"""Read Nsight Compute's CSV of ``scripts/probes/ncu_cases.py`` into one row per case: what bounds each kernel.

Question: the quantize and fold kernels run at 2-12x the time their bytes need (docs/fast_path.md); do they wait on
memory, or compute? ``scripts/gpu/torchao_3b_and_ncu.sh`` (or ``ncu_fold.sh``) ran ``ncu --csv --page details`` with the
SpeedOfLight, Occupancy, LaunchStats, WarpStateStats and MemoryWorkloadAnalysis sections. This keeps, per case, the
second of its two launches (the cases run each twice) and the figures that answer the question:

* ``sm_pct`` / ``dram_pct``: ncu's "Compute (SM) Throughput" and "DRAM Throughput", percent of peak. A kernel with
  the first far above the second is compute-bound (its busiest pipe or the instruction issue), not memory-bound.
* ``issue_per_cycle``: warp instructions a scheduler issues a cycle, achieved active warps per scheduler / warp
  cycles per issued instruction (at most 1).
* ``warp_instructions_per_element``: the dynamic count that follows from it, issue_per_cycle x cycles x 4 schedulers x
  SMs / elements; beside ``scripts/aot_check.py``'s static count, which also counts the branches not taken.
* ``floor_us``: the case's bytes (read + written) at ``--copy-gbps``; ``x_floor``: duration / floor.

    python scripts/probes/ncu_table.py bench/results/ncu/ncu_cases-NVIDIA_H200-6d232b9.csv.gz \\
        [--json bench/results/ncu/ncu_cases-NVIDIA_H200-6d232b9.json] [--copy-gbps 3927.7]

ncu launches no kernel for the copy case (``copy_`` of one dtype is a cudaMemcpy); the randn and fill kernels that
set the cases up are left out.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

METRICS = {"duration_us": ("GPU Speed Of Light Throughput", "Duration"),
           "sm_pct": ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
           "dram_pct": ("GPU Speed Of Light Throughput", "DRAM Throughput"),
           "l1_pct": ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
           "l2_pct": ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
           "sm_hz": ("GPU Speed Of Light Throughput", "SM Frequency"),
           "achieved_occupancy_pct": ("Occupancy", "Achieved Occupancy"),
           "theoretical_occupancy_pct": ("Occupancy", "Theoretical Occupancy"),
           "achieved_warps_per_sm": ("Occupancy", "Achieved Active Warps Per SM"),
           "registers": ("Launch Statistics", "Registers Per Thread"),
           "sms": ("Launch Statistics", "# SMs"),
           "blocks": ("Launch Statistics", "Grid Size"),
           "threads_per_block": ("Launch Statistics", "Block Size"),
           "warp_cycles_per_issue": ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
           "local_spill_requests": ("Memory Workload Analysis", "Local Memory Spilling Requests")}
_TO_US = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}
SETUP_KERNELS = ("distribution_elementwise", "FillFunctor")  # randn and the inexact counter's zeroing


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _case_bytes(case: str) -> tuple[int, int]:
    """(elements, bytes read + written) of a case of ncu_cases.py: a fold's are ``bench/fold_calls.py``'s
    ``moved_bytes`` of its shape, dtype and group rows (``ncu_cases.FOLD_CASES``); the 1D MXFP4 case reads BF16 and
    writes half a byte of code and a 1/32 byte scale an element (as ``bench/quantize_speed.py`` counts it)."""
    if case.startswith("mxfp4"):
        rows, cols = (int(n) for n in re.search(r"(\d+)x(\d+)", case).groups())
        n = rows * cols
        return n, n * 2 + n // 2 + n // 32
    cases = _load(ROOT / "scripts/probes/ncu_cases.py")
    folds = {cases.fold_case_name(name, shape, dtype): dict(shape=list(shape), dtype=str(dtype).removeprefix("torch."), group_rows=gr)
             for name, shape, dtype, _, gr in cases.FOLD_CASES}
    call = folds[case]
    return call["shape"][0] * call["shape"][1], _load(ROOT / "bench/fold_calls.py").moved_bytes(call)


def read(path: Path, copy_gbps: float | None = None) -> dict:
    """The cases of one ncu CSV (plain or .gz), in the order ncu_cases.py ran them."""
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    lines = raw.splitlines()
    ran = [ln[4:] for ln in lines if ln.startswith("ran ") and not ln.startswith("ran copy")]
    header = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[header:]))):
        k = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"], "values": {}})
        if row["Metric Name"]:
            value = row["Metric Value"]
            if row["Metric Unit"] in _TO_US:  # durations in microseconds whatever unit ncu chose
                value = str(_number(value) * _TO_US[row["Metric Unit"]])
            k["values"][(row["Section Name"], row["Metric Name"])] = value
    launches = [k for k in kernels.values() if not any(s in k["kernel"] for s in SETUP_KERNELS)]
    if len(launches) != 2 * len(ran):
        raise SystemExit(f"ncu_table: {len(launches)} kernel launches for {len(ran)} cases (two each expected) in {path}")
    cases = []
    for i, case in enumerate(ran):
        k = launches[2 * i + 1]  # the second launch of the case
        row = {"case": case, "kernel": k["kernel"].split("(")[0].strip()}
        row.update({name: _number(k["values"].get(key, "")) for name, key in METRICS.items()})
        elements, nbytes = _case_bytes(case)
        issue = row["achieved_warps_per_sm"] / 4 / row["warp_cycles_per_issue"]
        row["issue_per_cycle"] = issue
        row["warp_instructions_per_element"] = issue * row["duration_us"] * 1e-6 * row["sm_hz"] * 4 * row["sms"] / elements
        row["bytes"] = nbytes
        if copy_gbps:
            row["floor_us"] = nbytes / (copy_gbps * 1e9) * 1e6
            row["x_floor"] = row["duration_us"] / row["floor_us"]
        cases.append(row)
    return {"source": path.name, "copy_gbps": copy_gbps, "cases": cases}


def table(d: dict) -> str:
    """A markdown table of the cases."""
    out = ["| case | µs | × floor | SM % | DRAM % | occupancy % | regs | issue/cycle | warp instr/element | spill req |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["cases"]:
        out.append(f"| {r['case']} | {r['duration_us']:.1f} | {r.get('x_floor', float('nan')):.1f} | {r['sm_pct']:.0f} | "
                   f"{r['dram_pct']:.0f} | {r['achieved_occupancy_pct']:.0f} | {r['registers']:.0f} | {r['issue_per_cycle']:.2f} | "
                   f"{r['warp_instructions_per_element']:.2f} | {r['local_spill_requests']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --page details output of ncu_cases.py (.csv or .csv.gz)")
    ap.add_argument("--copy-gbps", type=float, help="the GPU's measured copy bandwidth (quantize_speed's copy row), for the floors")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    d = read(args.csv, args.copy_gbps)
    print(table(d))
    if args.json:
        args.json.write_text(json.dumps(d, indent=1) + "\n")
    return d


if __name__ == "__main__":
    main()
