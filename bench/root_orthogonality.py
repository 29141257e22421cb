"""Newton-Schulz per layer shape: how near the exact orthogonal factor does each iteration land, in BF16 and on NVFP4
operands?

Question: Full-Stack FP4 runs Root's orthogonalization natively in NVFP4 with coefficients optimized per shape; does
fp4train's NVFP4 iteration (per-step coefficients fitted for NVFP4 products, :mod:`fp4train.optim.nvfp4_ns_fit`) land
as near the orthogonal factor as BF16 Muon? For the hidden-matrix shapes of a model preset (q/o: dim x dim, k/v:
kv_dim x dim, gate/up: ffn x dim, down: dim x ffn) and three spectrum classes (Gaussian; rank 8 plus noise; a power
law from 1 to 1e-3), each with ``--seeds`` draws, five steps against ``U V^T`` (float64 SVD), as the distance after
the best scalar fit ``min_alpha ||alpha X - U V^T||_F / ||U V^T||_F`` and the largest singular value of ``X`` (what
the update applies; that of ``alpha X`` too, which exceeds it where the bulk of the spectrum lands below 1: BF16
Muon's reaches 1.5 on square rank-8 matrices). Columns: BF16 with Muon's coefficients and with Root's by shape; NVFP4 products with the NVFP4
coefficients (``nvfp4``) and with Muon's (``nvfp4_muon``). The target: ``nvfp4`` within 1.5x of ``bf16_muon`` on every
class and shape, no singular value above 1.5. ``--momenta-data`` adds real updates: the NVFP4 momenta of one layer
per shape after ``--momenta-steps`` steps of the trainer's ``fullstack`` run of the model on that data (clipped as
Root clips them). Runs on the CPU or a GPU (``--device``). Writes the model's section of
``bench/results/root_orthogonality.json`` (``--json``), the other models' kept.

    python bench/root_orthogonality.py --model 20m [--seeds 2] [--device cuda] [--momenta-data enwiki]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import RESULTS, write_section
from fp4train.models import PRESETS
from fp4train.optim.newton_schulz import BF16_COEFFICIENTS, newton_schulz
from fp4train.optim.ns_coefficients import nvfp4_coefficients, shape_coefficients
from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar, spectrum_classes

TARGET = 1.5  #: the NVFP4 iteration's distance at most this times BF16 Muon's, its singular values at most this


def shapes(model: str) -> list[tuple[str, tuple[int, int]]]:
    """The distinct hidden-matrix shapes of a preset, named by their layers."""
    c = PRESETS[model]
    kv = c.dim // c.n_heads * c.n_kv_heads
    named = {"q_proj, o_proj": (c.dim, c.dim), "k_proj, v_proj": (kv, c.dim), "gate_proj, up_proj": (c.ffn_dim, c.dim),
             "down_proj": (c.dim, c.ffn_dim)}
    return list(named.items())


def landing(x: torch.Tensor, target: torch.Tensor) -> tuple[float | None, float | None, float | None]:
    """(distance after the best scalar fit, largest singular value of ``x`` - what the update applies - and of the
    fitted ``alpha x``); None where not finite."""
    x = x.float()
    if not torch.isfinite(x).all():
        return None, None, None
    d, alpha = fitted_distance(x, target)
    top = float(torch.linalg.matrix_norm(x.double(), ord=2))
    return float(d), top, top * float(alpha.abs())


def captured_momenta(model: str, data: str, steps: int, device: str) -> dict[tuple[int, int], torch.Tensor]:
    """Per hidden-matrix shape, the decoded NVFP4 momentum of the middle layer's matrix of that shape after ``steps``
    steps of the trainer's ``fullstack`` run (Q-Root) of ``model`` on ``data``, clipped at Root's 0.9 quantile."""
    import tempfile

    from fp4train.optim import state_codec
    from fp4train.optim.qmuon import robust_part
    from fp4train.train import TrainConfig, Trainer

    with tempfile.TemporaryDirectory() as out:
        t = Trainer(TrainConfig(model=model, recipe="fullstack", data=data, max_steps=steps, seq_len=512, batch_size=32,
                                lr=1e-3, warmup_steps=max(1, steps // 6), eval_every=0, ckpt_every=0, out=out, device=device,
                                progress=False, tensorboard=False), log=lambda m: None)
        t.run()
        found: dict[tuple[int, int], list[torch.Tensor]] = {}
        for group in t.opt.param_groups:
            for p in group["params"] if group.get("muon") else []:
                stored = {k.split(".", 1)[1]: v for k, v in t.opt.state[p].items() if k.startswith("momentum_buffer.")}
                if stored:
                    found.setdefault(tuple(p.shape), []).append(state_codec.decode_signed(stored, p.shape))
    return {shape: robust_part(ms[len(ms) // 2], 0.9) for shape, ms in found.items()}


def measure(model: str, seeds: int, device: str, momenta: dict | None = None) -> list[dict]:
    rows = []
    for layers, (m, n) in shapes(model):
        nv = nvfp4_coefficients(m, n)
        for seed in range(seeds):
            cases = dict(spectrum_classes(min(m, n), max(m, n), 100 + seed))
            cases = {k: (x if m <= n else x.T) for k, x in cases.items()}
            if seed == 0 and momenta and (m, n) in momenta:
                cases["momentum"] = momenta[m, n].float()
            for kind, x in cases.items():
                x = x.to(device)
                target = polar(x)
                row = {"layers": layers, "shape": [m, n], "matrix": kind, "seed": seed, "nvfp4_coefficients": [list(t) for t in nv]}
                for name, y in (("bf16_muon", newton_schulz(x, BF16_COEFFICIENTS)),
                                ("bf16_by_shape", newton_schulz(x, shape_coefficients(m, n))),
                                ("nvfp4", newton_schulz(x, nv, matmul="nvfp4")),
                                ("nvfp4_muon", newton_schulz(x, BF16_COEFFICIENTS, matmul="nvfp4"))):
                    row[name], row[f"{name}_top_singular_value"], row[f"{name}_fitted_top_singular_value"] = landing(y, target)
                row["nvfp4_over_bf16_muon"] = row["nvfp4"] / row["bf16_muon"] if row["nvfp4"] is not None else None
                row["meets_target"] = (row["nvfp4"] is not None and row["nvfp4_over_bf16_muon"] <= TARGET
                                       and row["nvfp4_top_singular_value"] <= TARGET)
                rows.append(row)
                print(f"{model} {layers} {m}x{n} {kind} seed {seed}: bf16 muon {row['bf16_muon']:.3f}, nvfp4 "
                      f"{row['nvfp4']} ({row['nvfp4_over_bf16_muon']}x, top {row['nvfp4_top_singular_value']}), "
                      f"nvfp4 with muon's {row['nvfp4_muon']}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="20m", choices=sorted(PRESETS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--momenta-data", default=None, help="also the momenta of a fullstack run on this data")
    ap.add_argument("--momenta-steps", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    path = args.json or RESULTS / "root_orthogonality.json"  # one section per model, the others kept
    momenta = captured_momenta(args.model, args.momenta_data, args.momenta_steps, args.device) if args.momenta_data else None
    rows = measure(args.model, args.seeds, args.device, momenta)
    worst = max((r["nvfp4_over_bf16_muon"] or float("inf")) for r in rows)
    top = max((r["nvfp4_top_singular_value"] or float("inf")) for r in rows)
    write_section(path, args.model, rows, model=args.model, seeds=args.seeds, steps=5, target=TARGET, worst_ratio=worst,
                  momenta=None if momenta is None else {"data": args.momenta_data, "steps": args.momenta_steps},
                  largest_singular_value=top, all_meet_target=all(r["meets_target"] for r in rows))
    print(f"worst nvfp4/bf16-muon {worst:.3f}, largest singular value {top:.3f}: "
          f"{'meets' if worst <= TARGET and top <= TARGET else 'misses'} the {TARGET}x target", flush=True)


if __name__ == "__main__":
    main()
