"""LoRA-SVD linears: the split, its gradients against float64, realignment, state dicts, unconvert."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.linear.lora_svd import LoRASVDLinear, realign, svd_factors
from fp4train.recipes.spec import LoRASVDSpec, Recipe

NVFP4 = fp4train.recipes.get("nvfp4")


def _lora_recipe(rank=8, beta=0.5, linear=None):
    return Recipe("lora_test", linear=NVFP4.linear if linear is None else linear, lora_svd=LoRASVDSpec(rank=rank, beta=beta))


def _model(seed=0, k=64, n=48):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(k, n, bias=True))
    with torch.no_grad():  # a weight with a dominant low-rank part, as trained weights have
        u, v = torch.randn(n, 4), torch.randn(4, k)
        m[0].weight.add_(u @ v * 0.3)
    return m


def test_split_keeps_the_weight_and_puts_the_principal_subspace_in_the_factors():
    m = _model()
    w = m[0].weight.detach().clone()
    fp4train.convert(m, _lora_recipe())
    layer = m[0]
    assert isinstance(layer, LoRASVDLinear)
    assert torch.allclose(layer.merged_weight(), w, atol=1e-5)
    # the residual has the top singular directions removed: its norm is well below W's
    assert layer.weight.norm() < 0.5 * w.norm()
    # beta scales the factors, not their product
    b, a = svd_factors(w, 8, 2.0)
    b1, a1 = svd_factors(w, 8, 1.0)
    assert torch.allclose(2.0 * b @ a, b1 @ a1, atol=1e-4)


def test_layer_weight_keeps_its_identity_so_an_optimizer_made_before_keeps_it():
    m = _model()
    w = m[0].weight
    fp4train.convert(m, _lora_recipe())
    assert m[0].weight is w


def test_forward_is_the_quantized_residual_plus_the_low_rank_branch():
    m = _model()
    fp4train.convert(m, _lora_recipe())
    layer = m[0]
    x = torch.randn(32, 64)
    plain = fp4train.QuantizedLinear.from_linear(nn.Linear(64, 48), layer.spec)
    plain.weight, plain.bias = layer.weight, layer.bias
    want = plain(x) + layer.beta * (x @ layer.lora_a.T) @ layer.lora_b.T
    assert torch.equal(layer(x), want)


def test_gradients_are_the_chain_rule_of_the_split_against_float64():
    """The layer's gradients are those of W = W_res + beta B A: dW_res = G, dA = beta B^T G, dB = beta G A^T and
    dX = dY W, within the floors of the residual's (FP8 rowwise) GEMMs."""
    spec_fp8 = fp4train.recipes.get("fp8_rowwise").linear  # quantized: a LoRA-SVD layer
    m = _model()
    fp4train.convert(m, _lora_recipe(linear=spec_fp8))
    layer = m[0]
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 48)
    layer(x).backward(dy)
    w64 = layer.weight.double().detach()
    a64, b64 = layer.lora_a.double().detach(), layer.lora_b.double().detach()
    g = dy.double().T @ x.double().detach()
    w_eff = w64 + layer.beta * b64 @ a64
    sq = lambda e, r: (e - r).norm() / r.norm()  # noqa: E731
    # FP8 rowwise GEMMs: the floors are FP8's (about 3-6% relative), the split adds nothing on top
    assert sq(layer.weight.grad.double(), g) < 0.08
    assert sq(layer.lora_a.grad.double(), layer.beta * b64.T @ g) < 0.08
    assert sq(layer.lora_b.grad.double(), layer.beta * g @ a64.T) < 0.08
    assert sq(x.grad.double(), dy.double() @ w_eff) < 0.08
    # and the projections are of the very G the residual got (no second, different weight gradient)
    gq = layer.weight.grad.double()
    assert torch.allclose(layer.lora_a.grad.double(), layer.beta * b64.T @ gq, rtol=1e-4, atol=1e-6)
    assert torch.allclose(layer.lora_b.grad.double(), layer.beta * gq @ a64.T, rtol=1e-4, atol=1e-6)


def test_lora_svd_lowers_the_nvfp4_weight_error_on_a_low_rank_plus_noise_weight():
    m = _model(k=256, n=256)
    w = m[0].weight.detach().clone()
    q_plain = fp4train.fake_quantize(w, "nvfp4", axis=1)
    fp4train.convert(m, _lora_recipe(rank=16, beta=1.0))
    layer = m[0]
    q_res = fp4train.fake_quantize(layer.weight.detach(), "nvfp4", axis=1) + layer.beta * layer.lora_b @ layer.lora_a
    err_plain = (q_plain - w).norm() / w.norm()
    err_lora = (q_res.detach() - w).norm() / w.norm()
    assert err_lora < 0.9 * err_plain


def test_realign_leaves_the_function_unchanged_and_resets_the_factors_optimizer_state():
    m = _model()
    fp4train.convert(m, _lora_recipe())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(8, 64)
    for _ in range(3):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    layer = m[0]
    before = layer.merged_weight()
    old_a = layer.lora_a.detach().clone()
    assert realign(m, opt, seed=3) == 1
    assert torch.allclose(layer.merged_weight(), before, atol=1e-5)  # W unchanged up to FP32 rounding
    # the factors are W's principal subspace (not W_res's): beta B A is near W's best rank-r approximation
    sv = torch.linalg.svdvals(before.double())
    r = layer.lora_a.shape[0]
    tail = float(sv[r:].square().sum().sqrt())
    assert float((before.double() - layer.beta * (layer.lora_b @ layer.lora_a).double()).norm()) < 1.05 * tail
    assert not torch.equal(layer.lora_a, old_a)  # the factors moved (training moved W off the old subspace)
    assert layer.lora_a not in opt.state and layer.lora_b not in opt.state and layer.weight in opt.state
    # the high-precision function is the same
    lin = layer.to_linear()
    assert torch.allclose(lin(x), x @ before.T + layer.bias, atol=1e-4)


def test_state_dict_round_trips_and_unconvert_merges():
    m = _model()
    fp4train.convert(m, _lora_recipe())
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert {"0.weight", "0.weight_residual", "0.bias", "0.lora_a", "0.lora_b"} <= set(sd)
    m2 = fp4train.convert(_model(seed=5), _lora_recipe())
    m2.load_state_dict(sd)
    x = torch.randn(4, 64)
    assert torch.equal(m2(x), m(x))
    merged = m[0].merged_weight()
    fp4train.unconvert(m)
    assert type(m[0]) is nn.Linear and torch.allclose(m[0].weight, merged)


def test_state_dict_gives_a_plain_model_the_merged_weight_and_a_converted_one_its_residual():
    """The state dict holds W under ``weight`` (what a plain linear holds) and W_res under ``weight_residual``: a
    plain model loading it with strict=False gets the trained weight, never the residual; strict=True names the
    extra keys; a converted model gets its residual back bit for bit; a state dict from before the residual had
    its own key (``weight`` = W_res) still loads as it was saved."""
    m = _model()
    fp4train.convert(m, _lora_recipe())
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    assert torch.equal(sd["0.weight"], m[0].merged_weight().to(sd["0.weight"].dtype))
    assert torch.equal(sd["0.weight_residual"], m[0].weight.detach())
    plain = _model(seed=5)
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert not missing and set(unexpected) == {"0.weight_residual", "0.lora_a", "0.lora_b"}
    assert torch.equal(plain[0].weight, m[0].merged_weight())
    with pytest.raises(RuntimeError, match="weight_residual"):
        _model(seed=5).load_state_dict(sd)
    conv = fp4train.convert(_model(seed=6), _lora_recipe())
    conv.load_state_dict(sd)
    assert all(torch.equal(getattr(conv[0], n), getattr(m[0], n)) for n in ("weight", "lora_a", "lora_b", "bias"))
    earlier = {k: v for k, v in sd.items() if k != "0.weight_residual"} | {"0.weight": sd["0.weight_residual"]}
    old = fp4train.convert(_model(seed=7), _lora_recipe())
    old.load_state_dict(earlier)
    assert torch.equal(old[0].weight, m[0].weight)


def test_reconvert_to_high_precision_merges_the_split():
    m = _model()
    w = m[0].weight.detach().clone()
    fp4train.convert(m, _lora_recipe())
    fp4train.convert(m, Recipe("hp", overrides=(fp4train.recipes.Override("*", None),)))
    assert type(m[0]) is nn.Linear and torch.allclose(m[0].weight, w, atol=1e-5)


def test_oversampled_svd_leaves_a_residual_nearer_the_optimal_tail():
    """A flat spectrum (the case where the range finder misses most): sampling 8 directions beyond the rank leaves a
    residual nearer the optimal rank-r tail (Eckart-Young) than sampling the rank alone, and keeps rank r."""
    from fp4train.linear.lora_svd import svd_factors

    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(256, 256, generator=g))
    v, _ = torch.linalg.qr(torch.randn(192, 192, generator=g))
    s = torch.linspace(1.0, 0.5, 192)  # flat: no gap after rank 16
    w = (u[:, :192] * s) @ v.T
    optimal = float(s[16:].square().sum().sqrt())
    excess = {}
    for over in (0, 8):
        b, a = svd_factors(w, 16, 1.0, niter=2, seed=1, oversample=over)
        assert b.shape == (256, 16) and a.shape == (16, 192)
        excess[over] = float((w - b @ a).norm()) / optimal - 1
    assert excess[8] < 0.85 * excess[0] and excess[0] > 0.005, excess  # measured: 1.1% -> 0.8% above the optimum


def test_lora_factors_train_at_their_learning_rate_multiplier():
    """The trainer's optimizer puts LoRA-SVD factors in a group of their own at lora_lr_multiplier x the learning rate
    (2x by default, as Full-Stack FP4); a multiplier of 1 (runs saved before it) keeps the groups as they were."""
    from fp4train.train.config import TrainConfig
    from fp4train.train.optimizer import make_optimizer

    m = _model()
    fp4train.convert(m, _lora_recipe())
    layer = m[0]
    for opt_name in ("adamw", "qadamw", "qroot"):
        cfg = TrainConfig(optimizer=opt_name, lr=1e-3)
        opt = make_optimizer(m, cfg, torch.device("cpu"), compiled=False)
        lora = [g for g in opt.param_groups if any(p is layer.lora_a for p in g["params"])]
        assert len(lora) == 1 and lora[0]["lr"] == 2e-3 and {id(p) for p in lora[0]["params"]} == {id(layer.lora_a), id(layer.lora_b)}
        assert not lora[0].get("muon", False)  # AdamW, not Root, on the factors
        assert all(g["lr"] == 1e-3 for g in opt.param_groups if g is not lora[0])
    opt = make_optimizer(m, TrainConfig(optimizer="adamw", lr=1e-3, lora_lr_multiplier=1.0), torch.device("cpu"), compiled=False)
    assert len(opt.param_groups) == 2 and all(g["lr"] == 1e-3 for g in opt.param_groups)


@pytest.mark.parametrize("bad", [dict(rank=0), dict(beta=0.0), dict(realign_every=-1), dict(rank=True), dict(oversample=-1)])
def test_bad_lora_svd_fields_are_refused(bad):
    with pytest.raises(ValueError, match="LoRA-SVD"):
        LoRASVDSpec(**bad)


def test_recipe_with_lora_svd_round_trips_through_json():
    r = _lora_recipe()
    assert Recipe.from_json(r.to_json()) == r


def test_export_merges_checkpoints_of_either_state_dict_format():
    """``export.merged_state_dict``: W from a checkpoint whose ``weight`` is W already (with ``weight_residual``) and
    from an earlier one whose ``weight`` is the residual."""
    from fp4train.export import merged_state_dict

    m = _model()
    fp4train.convert(m, _lora_recipe())
    sd = m.state_dict()
    recipe = {"lora_svd": {"beta": 0.5}}
    want = m[0].merged_weight()
    now = merged_state_dict({"model": sd, "recipe": recipe})
    earlier = merged_state_dict({"model": {k: v for k, v in sd.items() if k != "0.weight_residual"}
                                 | {"0.weight": sd["0.weight_residual"]}, "recipe": recipe})
    for got in (now, earlier):
        assert set(got) == {"0.weight", "0.bias"}
        torch.testing.assert_close(got["0.weight"], want, rtol=0, atol=1e-6)
