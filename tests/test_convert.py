"""convert(): swaps nn.Linear in place, parameters shared, state_dict unchanged, clear refusals."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train import QuantizedLinear


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d)
        self.down_proj = nn.Linear(2 * d, d)


class Tiny(nn.Module):
    def __init__(self, d=64, n=4, vocab=100):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.embed_tokens(idx)
        for b in self.layers:
            h = h + b.down_proj(torch.relu(b.up_proj(h + b.q_proj(h) * b.k_proj(h).sigmoid())))
        return self.lm_head(h)


def test_swaps_linears_shares_parameters_keeps_state_dict():
    m = Tiny()
    keys = list(m.state_dict())
    params = {n: p for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    fp4train.convert(m, "mxfp4")
    assert list(m.state_dict()) == keys
    assert all(p is params[n] for n, p in m.named_parameters())
    assert isinstance(m.layers[0].up_proj, QuantizedLinear) and m.layers[0].up_proj.recipe_name == "mxfp4"
    assert type(m.lm_head) is nn.Linear and type(m.embed_tokens) is nn.Embedding
    loss = m(torch.randint(0, 100, (2, 8))).float().pow(2).mean()
    loss.backward()
    opt.step()  # the optimizer built before convert still owns the same parameters
    m.load_state_dict(m.state_dict())


def test_filter_and_reconvert():
    m = Tiny()
    fp4train.convert(m, "mxfp4", filter=lambda name, mod: "down_proj" not in name)
    assert type(m.layers[0].down_proj) is nn.Linear and isinstance(m.layers[0].up_proj, QuantizedLinear)
    fp4train.convert(m, "nvfp4")  # a converted model can be converted again
    assert m.layers[0].up_proj.recipe_name == "nvfp4"
    assert type(m.layers[3].up_proj) is nn.Linear  # nvfp4 keeps the last 15% of blocks (1 of 4) high precision


def test_tib2d_puts_q_and_k_in_mxfp8():
    m = fp4train.convert(Tiny(), "tib2d")
    assert m.layers[1].q_proj.spec.fprop.a.format == "mxfp8"
    assert m.layers[1].up_proj.spec.fprop.a.format == "mxfp4"


def test_converted_model_trains():
    torch.manual_seed(0)
    m = fp4train.convert(Tiny(), "hadamard_mxfp4")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    idx = torch.randint(0, 100, (4, 16))
    losses = []
    for _ in range(30):
        logits = m(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 100), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_refuses_bad_shapes_naming_every_module_and_the_fix():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 64))
    with pytest.raises(ValueError) as e:
        fp4train.convert(m, "mxfp4")
    msg = str(e.value)
    assert "recipe 'mxfp4' cannot run these layers" in msg
    assert "1 (Linear 64->40): out_features (N)=40 is not a multiple of 32" in msg
    assert "2 (Linear 40->64): in_features (K)=40 is not a multiple of 32" in msg
    assert "Fix:" in msg and "filter=" in msg
    assert all(type(x) is nn.Linear for x in m)  # nothing swapped


def test_refuses_bare_linear_unknown_recipe_and_backend():
    with pytest.raises(TypeError, match="wrap a bare nn.Linear"):
        fp4train.convert(nn.Linear(32, 32), "mxfp4")
    with pytest.raises(ValueError, match="unknown recipe 'mxfp5'; available: adahop, adahop_measured, bf16, fp8_rowwise"):
        fp4train.convert(Tiny(), "mxfp5")
    with pytest.raises(ValueError, match="unknown GEMM backend 'cuda'"):
        fp4train.convert(Tiny(), "mxfp4", backend="cuda")
