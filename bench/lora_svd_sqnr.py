"""LoRA-SVD against plain NVFP4 on a trained run's weights and on its real activations and gradients.

Question: how much quantization error does LoRA-SVD's split remove from a linear layer's weight and from its
forward and dgrad GEMMs? Loads a run's newest checkpoint (BF16 recipe), runs one validation batch forward and
backward in FP32 to record every transformer linear's input X and output gradient dY, and for each layer
compares, against the exact products:

* plain NVFP4: ``W~ = Q(W)``, ``Y~ = Q(X) Q(W)^T``, ``dX~ = Q(dY) Q(W)``;
* LoRA-SVD (rank r, beta 1): ``W~ = Q(W_res) + B A``, ``Y~ = Q(X) Q(W_res)^T + (X A^T) B^T``, ``dX~ = Q(dY) Q(W_res) + (dY B) A``,

with Q NVFP4 round-to-nearest along each GEMM's inner dim (1x16 blocks, W in 16x16 tiles as the nvfp4 recipe
has it). The weight gradient is the same GEMM in both (``G = dY^T X``), so it is not compared. Reported: the
relative error (sum of squared errors over layers, over the sum of squares) of each, and its reduction. Three
settings, each a results entry: the defaults of earlier versions (``base``: no SVD oversampling, NVFP4 scales map
each block's largest element to 6), ``oversample``: the range finder samples ``r + 8`` directions (fullstack's
default), ``four_over_six``: NVFP4 with 4/6 adaptive block scaling on every operand (Cook et al., arXiv
2512.02010; the recipe option ``four_over_six``), plain and LoRA-SVD alike.

    fp4train train --model 20m --optimizer adamw --max-steps 60 --seq-len 128 --batch-size 8 --out runs/20m
    python bench/lora_svd_sqnr.py --run runs/20m --rank 32

Writes ``bench/results/lora_svd_sqnr.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import data_label, results_path, write_results
from fp4train.formats import fake_quantize
from fp4train.linear.lora_svd import svd_factors
from fp4train.train import TrainConfig, Trainer
from fp4train.checkpoint import Checkpoints


def q(x: torch.Tensor, axis: int = 1, block=None, four_over_six: bool = False) -> torch.Tensor:
    return fake_quantize(x.float(), "nvfp4", axis=axis, four_over_six=four_over_six, **({"block": block} if block else {}))


def record(trainer: Trainer) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(W, X, dY) of every transformer linear on one validation batch, in FP32."""
    model = trainer.model.float()
    xs, gs, handles = {}, {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}":
            handles.append(m.register_forward_hook(lambda mod, inp, out, n=name: xs.__setitem__(n, inp[0].detach())))
            handles.append(m.register_full_backward_hook(lambda mod, gin, gout, n=name: gs.__setitem__(n, gout[0].detach())))
    x, y = next(iter(trainer.evals))
    model(x, y).backward()
    for h in handles:
        h.remove()
    mods = dict(model.named_modules())
    return {n: (mods[n].weight.detach().float(), xs[n].reshape(-1, xs[n].shape[-1]), gs[n].reshape(-1, gs[n].shape[-1]))
            for n in xs}


def compare(layers: dict, rank: int, oversample: int = 0, four_over_six: bool = False) -> dict:
    sums: dict[str, float] = {}

    def add(key, err, ref):
        sums[key + "_err"] = sums.get(key + "_err", 0.0) + (err - ref).square().sum().item()
        sums[key + "_ref"] = sums.get(key + "_ref", 0.0) + ref.square().sum().item()

    for i, (w, x, dy) in enumerate(layers.values()):
        b, a = svd_factors(w, rank, 1.0, seed=i, oversample=oversample)
        w_res = w - b @ a
        y, dx = x @ w.T, dy @ w
        qx, qdy = q(x, four_over_six=four_over_six), q(dy, four_over_six=four_over_six)
        qw, qw_res = (q(t, block=(16, 16), four_over_six=four_over_six) for t in (w, w_res))
        add("w_plain", qw, w)
        add("w_lora", qw_res + b @ a, w)
        add("y_plain", qx @ qw.T, y)
        add("y_lora", qx @ qw_res.T + (x @ a.T) @ b.T, y)
        add("dx_plain", qdy @ qw, dx)
        add("dx_lora", qdy @ qw_res + (dy @ b) @ a, dx)
    out = {}
    for what in ("w", "y", "dx"):
        for how in ("plain", "lora"):
            out[f"{what}_rel_error_{how}"] = (sums[f"{what}_{how}_err"] / sums[f"{what}_{how}_ref"]) ** 0.5
        out[f"{what}_error_reduction"] = 1 - out[f"{what}_rel_error_lora"] / out[f"{what}_rel_error_plain"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a run directory (its newest checkpoint)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--json", type=Path, default=results_path("lora_svd_sqnr", per_device=False))
    args = ap.parse_args(argv)
    ck = Checkpoints(args.run).load()
    cfg = TrainConfig.from_dict({**ck["config"], "out": str(args.run / "lora_svd_sqnr.tmp"), "device": "cpu",
                                 "progress": False, "tensorboard": False, "compile": False, "recipe": "bf16"})
    trainer = Trainer(cfg, log=lambda m: None, checkpoints=False)
    trainer.model.load_state_dict(ck["model"])
    layers = record(trainer)
    res = {}
    for name, kw in (("base", {}), ("oversample", {"oversample": 8}), ("four_over_six", {"four_over_six": True})):
        res[name] = {**compare(layers, args.rank, **kw), "rank": args.rank, "oversample": kw.get("oversample", 0),
                     "four_over_six": kw.get("four_over_six", False)}
        print(f"{name}: " + ", ".join(f"{k}: {v:.4f}" for k, v in res[name].items() if isinstance(v, float)), flush=True)
    write_results(args.json, res, model=cfg.model, steps=ck.get("step"), data=data_label(cfg.data))


if __name__ == "__main__":
    main()
