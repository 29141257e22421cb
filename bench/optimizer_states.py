"""Do NVFP4 optimizer states follow their gradients? Each quantized optimizer against its FP32 twin, over a run.

Question: a state re-encoded every step carries its encoding error forward; how far do the stored moments drift from
the FP32 moments that the same gradients give, over a thousand steps - not after one encode? A real run trains
(``fp4train train``'s own step: ``tiny`` on tiny-shakespeare by default, BF16, AdamW) and, through a trainer feature,
hands every step's gradients of the hidden 2-D weights (every block's linears) to shadow copies updated by:

* QAdamW with its states rounded to nearest (the design before stochastic rounding) and with stochastic rounding
  (the default), each against an FP32 AdamW twin (``quantize_states=False``: torch's arithmetic);
* QMuon's NVFP4 momentum (nearest and stochastic) against its FP32 twin.

Every ``--every`` steps it records the relative error (Frobenius, over all the weights) of ``m``, ``v`` and the
update direction ``m / (sqrt(v) + eps)`` (QMuon: of the momentum), and one encode's error of the FP32 states for
scale. Then the two synthetic cases of ``tests/test_optim.py``: entries whose gradient stops (how far they still
move, in learning-rate units) and a hundredfold drop of half the columns' gradient variance (v's ratio).

    python bench/optimizer_states.py --steps 1000

Writes ``bench/results/optimizer_states.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from common import data_label, results_path, write_results

from fp4train.features import Feature
from fp4train.optim import QAdamW, QMuon, state_codec
from fp4train.train import TrainConfig, Trainer

BETAS = (0.9, 0.95)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_optim import _stored_moments, stopped_gradient_drift, variance_drop_ratios  # noqa: E402 - the tests' own cases, not a copy


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum((x - y).float().square().sum().item() for x, y in zip(a, b))
    den = sum(y.float().square().sum().item() for y in b)
    return (num / den) ** 0.5 if den else 0.0


def muon_momentum(opt, p) -> torch.Tensor:
    st = opt.state[p]
    if "momentum_buffer" in st:
        return st["momentum_buffer"]
    return state_codec.decode_signed({k.split(".", 1)[1]: t for k, t in st.items() if k.startswith("momentum_buffer.")}, p.shape)


class Twins(Feature):
    """Shadow copies of the model's tileable 2-D weights, each set stepped by one optimizer with the run's gradients."""

    def __init__(self, every: int, lr: float):
        self.every, self.lr, self.rows = every, lr, []

    def start(self, run):
        self.names = [n for n, p in run.model.named_parameters()  # the hidden matrices (Muon's), embeddings left out
                      if p.ndim == 2 and state_codec.fits(p.shape) and "embed" not in n and "lm_head" not in n]
        params = dict(run.model.named_parameters())

        def copies():
            return [params[n].detach().float().clone().requires_grad_(True) for n in self.names]

        self.shadows = {}
        for name, make in {
            "adamw_fp32": lambda ps: QAdamW(ps, lr=self.lr, betas=BETAS, weight_decay=0.0, quantize_states=False),
            "qadamw_nearest": lambda ps: QAdamW(ps, lr=self.lr, betas=BETAS, weight_decay=0.0, stochastic_states=False),
            "qadamw_stochastic": lambda ps: QAdamW(ps, lr=self.lr, betas=BETAS, weight_decay=0.0),
            "muon_fp32": lambda ps: QMuon([{"params": ps, "muon": True}], lr=self.lr, quantize_states=False),
            "qmuon_nearest": lambda ps: QMuon([{"params": ps, "muon": True}], lr=self.lr, stochastic_states=False),
            "qmuon_stochastic": lambda ps: QMuon([{"params": ps, "muon": True}], lr=self.lr),
        }.items():
            ps = copies()
            self.shadows[name] = (ps, make(ps))
        self.params = [params[n] for n in self.names]

    def before_step(self, run):
        for ps, opt in self.shadows.values():
            for p, src in zip(ps, self.params):
                p.grad = src.grad.detach().float().clone()
            opt.step()
        if (run.step + 1) % self.every == 0:
            self.rows.append(self.measure(run.step + 1))

    def measure(self, step: int) -> dict:
        row = {"step": step}
        ps_f, opt_f = self.shadows["adamw_fp32"]
        mf, vf = zip(*(_stored_moments(opt_f, p) for p in ps_f))
        uf = [m / (v.sqrt() + 1e-8) for m, v in zip(mf, vf)]
        row["m_one_encode"] = _rel([state_codec.decode_signed(state_codec.encode_signed(m), m.shape) for m in mf], mf)
        row["v_one_encode"] = _rel([state_codec.decode_second_moment(state_codec.encode_second_moment(v), v.shape)
                                    for v in vf], vf)
        for name in ("qadamw_nearest", "qadamw_stochastic"):
            ps, opt = self.shadows[name]
            mq, vq = zip(*(_stored_moments(opt, p) for p in ps))
            row[f"{name}_m"], row[f"{name}_v"] = _rel(mq, mf), _rel(vq, vf)
            row[f"{name}_update"] = _rel([m / (v.sqrt() + 1e-8) for m, v in zip(mq, vq)], uf)
        bf = [muon_momentum(self.shadows["muon_fp32"][1], p) for p in self.shadows["muon_fp32"][0]]
        row["momentum_one_encode"] = _rel([state_codec.decode_signed(state_codec.encode_signed(b), b.shape) for b in bf], bf)
        for name in ("qmuon_nearest", "qmuon_stochastic"):
            ps, opt = self.shadows[name]
            row[f"{name}_momentum"] = _rel([muon_momentum(opt, p) for p in ps], bf)
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        return row


def synthetic() -> dict:
    """The two synthetic cases of tests/test_optim.py, by its own functions (see there)."""
    out = {}
    for sr in (False, True):
        rounding = "stochastic" if sr else "nearest"
        out[f"stopped_gradient_moved_{rounding}"], out["stopped_gradient_moved_fp32"] = stopped_gradient_drift(sr)
        out[f"variance_drop_v_ratio_{rounding}"], out["variance_drop_v_ratio_fp32"] = variance_drop_ratios(sr)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default=None, help="training text, as fp4train train takes it (default: tiny-shakespeare)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", type=Path, default=results_path("optimizer_states", per_device=False))
    args = ap.parse_args(argv)
    twins = Twins(args.every, args.lr)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model=args.model, data=args.data, seq_len=args.seq_len, batch_size=args.batch_size,
                          max_steps=args.steps, lr=args.lr, eval_every=0, eval_batches=1, out=str(Path(tmp) / "run"),
                          progress=False, tensorboard=False, device="cpu")
        Trainer(cfg, log=lambda m: None, checkpoints=False, features=[twins]).run()
    write_results(args.json, twins.rows, model=args.model, data=data_label(args.data), steps=args.steps, seq_len=args.seq_len,
                  batch_size=args.batch_size, lr=args.lr, betas=list(BETAS), synthetic=synthetic())


if __name__ == "__main__":
    main()
