"""QAdamW's second-moment transform against direct NVFP4 storage, on the AdamW states of a real run.

Question: how much of Adam's second moment (and of the update it divides) does each way of storing it in NVFP4
keep? Reads the newest checkpoint of a run trained with ``--optimizer adamw`` (its FP32 ``exp_avg_sq``), stores
every state that QAdamW would quantize both ways - NVFP4 of ``v`` directly (1x16 blocks, as the first moment is
stored) and QAdamW's transform (sqrt, tile mean subtracted, block Hadamard 16, NVFP4, floor on load) - and reports
the relative error of ``v``, of ``sqrt(v)`` (Adam's denominator) and of the bias-free update ``m / (sqrt(v) + eps)`` over all of them (squared errors
summed over tensors before the ratio).

    fp4train train --model tiny --optimizer adamw --max-steps 200 --out runs/adamw-tiny
    python bench/qadamw_states.py --run runs/adamw-tiny

Writes ``bench/results/qadamw_states.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


from common import data_label, results_path, write_results
from fp4train.formats import fake_quantize
from fp4train.optim import state_codec
from fp4train.checkpoint import Checkpoints


def errors(states: list[dict], eps: float = 1e-8) -> dict:
    """Summed squared errors over ``states`` (each with FP32 ``exp_avg``, ``exp_avg_sq``), as ratios to the exact."""
    sums = {f"{q}{w}": 0.0 for q in ("v", "r", "u") for w in ("", "_direct", "_transform")}
    for st in states:
        m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
        two_d = v.reshape(-1, v.shape[-1])
        direct = fake_quantize(two_d, "nvfp4", axis=1).clamp_min(0).reshape(v.shape)
        transform = state_codec.decode_second_moment(state_codec.encode_second_moment(v), v.shape)
        u = m / (v.sqrt() + eps)
        sums["v"] += v.square().sum().item()
        sums["r"] += v.sum().item()  # sum of sqrt(v)^2
        sums["u"] += u.square().sum().item()
        for name, vq in (("direct", direct), ("transform", transform)):
            sums[f"v_{name}"] += (vq - v).square().sum().item()
            sums[f"r_{name}"] += (vq.sqrt() - v.sqrt()).square().sum().item()
            sums[f"u_{name}"] += (m / (vq.sqrt() + eps) - u).square().sum().item()
    return {f"{q}_rel_error_{w}": (sums[f"{q}_{w}"] / sums[q]) ** 0.5 for q in ("v", "r", "u") for w in ("direct", "transform")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a run directory trained with --optimizer adamw")
    ap.add_argument("--json", type=Path, default=results_path("qadamw_states", per_device=False))
    args = ap.parse_args(argv)
    ck = Checkpoints(args.run).load()
    states = [st for st in ck["optimizer"]["state"].values()
              if "exp_avg_sq" in st and st["exp_avg_sq"].dim() >= 2 and state_codec.fits(st["exp_avg_sq"].shape)]
    if not states:
        raise SystemExit(f"{args.run}: no AdamW second moments to measure (was the run trained with --optimizer adamw?)")
    res = errors(states)
    res["tensors"] = len(states)
    res["elements"] = sum(st["exp_avg_sq"].numel() for st in states)
    res["v_error_reduction"] = 1 - res["v_rel_error_transform"] / res["v_rel_error_direct"]
    res["r_error_reduction"] = 1 - res["r_rel_error_transform"] / res["r_rel_error_direct"]
    res["u_error_reduction"] = 1 - res["u_rel_error_transform"] / res["u_rel_error_direct"]
    cfg = ck.get("config", {})
    print(f"{res['tensors']} states, {res['elements']:,} elements: v error direct {res['v_rel_error_direct']:.4f}, "
          f"transform {res['v_rel_error_transform']:.4f} ({res['v_error_reduction']:.0%} lower); sqrt(v) error direct "
          f"{res['r_rel_error_direct']:.4f}, transform {res['r_rel_error_transform']:.4f} ({res['r_error_reduction']:.0%} lower); "
          f"update error direct "
          f"{res['u_rel_error_direct']:.4f}, transform {res['u_rel_error_transform']:.4f} ({res['u_error_reduction']:.0%} lower)")
    write_results(args.json, res, model=cfg.get("model"), steps=ck.get("step"), data=data_label(cfg.get("data")))


if __name__ == "__main__":
    main()
