"""Run under torchrun (gloo, CPU): QAdamW, QMuon and Muon on FSDP2-sharded parameters against the same optimizer on
the whole parameters, with the same gradients, or (``lora_svd``) LoRA-SVD's realignment of sharded layers against
whole ones; exits non-zero on the first difference."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fp4train.optim import QAdamW, QMuon
from fp4train.train.distributed import leave


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 64 and 96 rows tile over 2 processes (2 and 3 tiles each); 40 x 96 does not fit NVFP4 (FP32 states), nor the bias
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 96, bias=False),
                               torch.nn.Linear(96, 40, bias=True))


def _optimizer(kind: str, params):
    if kind == "qadamw":
        return QAdamW(params, lr=1e-2, weight_decay=0.1)
    groups = [{"params": params[:2], "muon": True}, {"params": params[2:]}]
    return QMuon(groups, lr=1e-2, quantize_states=kind == "qmuon", ns_matmul="bf16")


def _realign(kind: str) -> None:
    from fp4train import convert
    from fp4train.linear.lora_svd import realign

    keep = lambda name, m: name != "2"  # noqa: E731  (40 outputs: not NVFP4 blocks)
    whole, sharded = convert(_model(), "fullstack", filter=keep), convert(_model(), "fullstack", filter=keep)
    for layer in sharded:
        fully_shard(layer)
    realign(whole, seed=5)
    realign(sharded, seed=5)
    for (name, pw), ps in zip(whole.named_parameters(), sharded.parameters()):
        if not torch.equal(pw, ps.full_tensor()):
            sys.exit(f"{kind}: {name} differs after the realignment")


def main(kind: str) -> None:
    dist.init_process_group("gloo")
    if kind == "lora_svd":
        _realign(kind)
    else:
        _step(kind)
    leave()


def _step(kind: str) -> None:
    whole, sharded = _model(), _model()
    for layer in sharded:
        fully_shard(layer)
    ow, os_ = _optimizer(kind, list(whole.parameters())), _optimizer(kind, list(sharded.parameters()))
    for step in range(4):
        gen = torch.Generator().manual_seed(step)  # the same gradients on every process and for both models
        for pw, ps in zip(whole.parameters(), sharded.parameters()):
            g = torch.randn(pw.shape, generator=gen) * (1 + 10 * (torch.rand(pw.shape, generator=gen) > 0.99))
            pw.grad = g
            ps.grad = DTensor.from_local(g, ps.device_mesh, [torch.distributed.tensor.Replicate()]).redistribute(
                ps.device_mesh, ps.placements)
        ow.step()
        os_.step()
        for i, (pw, ps) in enumerate(zip(whole.parameters(), sharded.parameters())):
            if not torch.equal(pw, ps.full_tensor()):
                sys.exit(f"{kind}: parameter {i} differs after step {step + 1}")
            sw, ss = ow.state[pw], os_.state[ps]
            if sorted(sw) != sorted(ss):
                sys.exit(f"{kind}: parameter {i}'s states differ: {sorted(sw)} vs {sorted(ss)}")
            for k in sw:
                full = ss[k].full_tensor() if isinstance(ss[k], DTensor) else ss[k]
                if not isinstance(ss[k], DTensor) and k != "step":
                    sys.exit(f"{kind}: parameter {i}'s state {k} is not sharded")
                if not torch.equal(sw[k], full):
                    sys.exit(f"{kind}: parameter {i}'s state {k} differs after step {step + 1}")
    if kind == "qadamw":  # 48 rows: 24 per process, not a whole number of 16-row tiles
        bad = torch.nn.Linear(64, 48, bias=False)
        fully_shard(bad)
        try:
            QAdamW(bad.parameters())
            sys.exit("QAdamW took a parameter whose rows do not split into whole tiles")
        except ValueError as e:
            if "a parameter of shape (48, 64) does not split into whole 16-row tiles" not in str(e):
                raise


if __name__ == "__main__":
    main(sys.argv[1])
