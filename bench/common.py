"""What the benchmark scripts share: where a results file goes and what every one records.

Each script writes one file per benchmark (and model) and device, overwritten when rerun - history is
git's. Every file holds the device, date, fp4train commit and torch version beside the script's own
settings and its ``results``; ``bench/tables.py`` makes the docs' tables from them.
"""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from pathlib import Path

import torch

from fp4train.timing import code_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def device_name() -> str:
    """The GPU's name (``NVIDIA H200``), or ``cpu``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def results_path(bench: str, *parts: str, per_device: bool = True) -> Path:
    """``bench/results/<bench>[-<part>...][-<device>].json``: one file per benchmark, its parts (e.g. the
    model) and, for a measurement that depends on the machine, the device."""
    names = [bench, *parts] + ([device_name().replace(" ", "_")] if per_device else [])
    return RESULTS / ("-".join(names) + ".json")


def write_results(path: Path, results, **settings) -> dict:
    """Write ``results`` with the run's provenance and ``settings`` to ``path`` (made if missing); returns
    what was written. Called after every measured row by the long benchmarks: a run cut short keeps what
    it measured."""
    out = _record(results, **settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def _record(results, **settings) -> dict:
    """``results`` with the run's provenance (device, date, commit, torch) and ``settings``."""
    return {"gpu": device_name(), "date": datetime.date.today().isoformat(), "commit": code_commit() or "unknown",
            "torch": torch.__version__, **settings, "results": results}


def write_section(path: Path, key: str, results, **settings) -> dict:
    """:func:`write_results` as the section ``key`` of a file that holds one section per setting (a benchmark run per
    model preset, say): the other sections are kept, this one replaced. Returns what was written of it."""
    old = json.loads(path.read_text()) if path.exists() else {}
    sections = old.get("sections", {})
    sections[key] = _record(results, **settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sections": dict(sorted(sections.items()))}, indent=1) + "\n")
    return sections[key]


def kernel_times(prof, steps: int) -> dict[str, tuple[float, int]]:
    """Kernel name -> (milliseconds per step, calls per step) of the profiled steps."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out[e.name][0] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
            out[e.name][1] += 1
    return {k: (v[0] / steps, v[1] // steps) for k, v in out.items()}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    noise = (ref - approx).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def data_label(data: str | None) -> str:
    """Training text as a results file names it: its file or folder name, not where it lay on a machine."""
    return Path(data.rstrip("/")).name if data else "tinyshakespeare (packaged)"
