"""fp4train's own mixture-of-experts model (the moe-* presets): routing, its load-balancing loss, quantized experts
through convert, and the commands that run it (train, analyze; export is in test_export_eval)."""

import json

import pytest
import torch
import torch.nn.functional as F

import fp4train
from fp4train import models
from fp4train.linear.experts import mixtures_of_experts
from fp4train.models.moe import MoE


def _experts_by_hand(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    """Each token: its top-k experts' SwiGLU outputs weighted by the renormalized router softmax, one token at a time."""
    probs = F.softmax(moe.gate(h).float(), dim=-1)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        w, idx = probs[t].topk(moe.top_k)
        for wi, e in zip(w / w.sum(), idx.tolist()):
            gate, up = (moe.experts.gate_up_proj[e] @ h[t]).chunk(2)
            out[t] += wi * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
    return out


def test_moe_routes_each_token_to_its_top_k_experts_and_balances_them():
    torch.manual_seed(0)
    moe = MoE(dim=32, ffn_dim=48, n_experts=4, experts_per_token=2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        got = moe(x)
        want = _experts_by_hand(moe, x.reshape(-1, 32)).reshape(x.shape)
        assert torch.allclose(got, want, atol=1e-5)
        probs = F.softmax(moe.gate(x.reshape(-1, 32)), dim=-1)
        counts = torch.bincount(probs.topk(2).indices.flatten(), minlength=4).float()
        assert torch.allclose(moe.aux_loss, 4 * (counts / counts.sum() * probs.mean(0)).sum())


def test_the_balance_loss_trains_and_evaluation_reports_cross_entropy_alone():
    torch.manual_seed(0)
    m = models.build("moe-tiny", vocab_size=64)
    idx = torch.randint(0, 64, (2, 16))
    ce = m.eval()(idx, idx)
    train = m.train()(idx, idx)
    aux = sum(layer.mlp.aux_loss for layer in m.layers) / len(m.layers)
    assert torch.allclose(train, ce + m.config.router_aux_loss_coef * aux)


def test_convert_quantizes_every_expert_and_keeps_the_routers():
    m = fp4train.convert(models.build("moe-tiny", vocab_size=64), "nvfp4")
    experts, routers = mixtures_of_experts(m)
    assert [n for n, _ in experts] == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert all(mod.fp4train_experts.specs["gate_up_proj"].quantized for _, mod in experts)
    assert sorted(routers) == ["layers.0.mlp.gate", "layers.1.mlp.gate"]
    assert all(type(m.get_submodule(r)) is torch.nn.Linear for r in routers)  # high precision
    idx = torch.randint(0, 64, (2, 16))
    plain = models.build("moe-tiny", vocab_size=64)
    plain.load_state_dict(m.state_dict())
    with torch.no_grad():  # quantized, and close
        q, ref = m(idx), plain(idx)
    assert not torch.equal(q, ref) and float((q - ref).norm() / ref.norm()) < 0.2


@pytest.mark.parametrize("recipe", ["nvfp4", "fullstack"])
def test_moe_trains_under_fp4_recipes(tmp_path, recipe):
    from fp4train.train import TrainConfig, Trainer

    cfg = TrainConfig(model="moe-tiny", recipe=recipe, seq_len=32, batch_size=4, max_steps=15, lr=3e-3, warmup_steps=2,
                      eval_every=0, eval_batches=1, log_every=1, progress=False, tensorboard=False, device="cpu",
                      out=str(tmp_path / "run"))
    Trainer(cfg, log=lambda m: None).run()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3


def test_analyze_names_what_it_does_not_measure_in_a_mixture_of_experts(tmp_path):
    from fp4train.cli import main

    out = tmp_path / "an"
    assert main(["analyze", "--model", "moe-tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--capture-every",
                 "2", "--no-progress", "--no-tensorboard", "--out", str(out)]) == 0
    r = json.loads((out / "analysis.json").read_text())
    assert set(r["not_measured"]) == {"layers.0.mlp.experts", "layers.1.mlp.experts", "layers.0.mlp.gate", "layers.1.mlp.gate"}
    assert not any(n.endswith("mlp.gate") for n in r["patterns"])
    assert "Not measured: `layers.0.mlp.experts`" in (out / "analysis.md").read_text()
