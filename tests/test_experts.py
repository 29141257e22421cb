"""Mixtures of experts: transformers 5's stacked 3-D expert weights run each expert's GEMMs quantized."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.conversion_report import CONVERTED, HIGH_PRECISION, SKIPPED
from fp4train.linear.module import QuantizedLinear

transformers = pytest.importorskip("transformers")

T = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _mixtral():
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**T, num_local_experts=4, num_experts_per_tok=2))


def _qwen2_moe():
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**T, num_experts=4, num_experts_per_tok=2,
                                                                        moe_intermediate_size=64,
                                                                        shared_expert_intermediate_size=64))


@pytest.mark.parametrize("recipe", ["mxfp4", "tib2d"])
def test_each_experts_gemms_are_that_expert_quantized_as_its_own_linear(recipe):
    """The experts' output and the gradients of their stacked weights and of the tokens, against each expert's two
    projections as quantized linears of their own on the tokens routed to it, bit for bit (tib2d's stochastic
    rounding of the gradients draws the same seeds in the same order)."""
    model = _mixtral()
    fp4train.convert(model, recipe)
    experts = model.model.layers[0].mlp.experts
    spec = experts.fp4train_experts.specs
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g, requires_grad=True)
    top = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=g)
    torch.manual_seed(7)  # stochastic rounding draws its seeds from torch's generator, call by call
    y = experts(x, top, weights)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)

    x2 = x.detach().clone().requires_grad_()
    want = torch.zeros_like(y)
    grads = {n: torch.zeros_like(getattr(experts, n)) for n in ("gate_up_proj", "down_proj")}
    per_expert = {}
    for e in range(4):  # made first: a new nn.Linear draws its initialization from torch's generator
        per_expert[e] = {}
        for n in grads:
            w = getattr(experts, n)[e].detach()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight = nn.Parameter(w.clone())
            per_expert[e][n] = QuantizedLinear.from_linear(lin, spec[n])
    torch.manual_seed(7)
    for e, layers in per_expert.items():
        pos, tok = torch.where((top == e).T)  # the experts' order of rows: by choice rank, then token (tiles see it)
        gate, up = layers["gate_up_proj"](x2[tok]).chunk(2, dim=-1)
        out = layers["down_proj"](experts.act_fn(gate) * up) * weights[tok, pos, None]
        want.index_add_(0, tok, out)
    want.backward(dy)  # one backward, as the experts' (seeds drawn in the same order)
    for e, layers in per_expert.items():
        for n in grads:
            grads[n][e] = layers[n].weight.grad
    assert torch.equal(y, want)
    assert torch.equal(x.grad, x2.grad)
    for n, gw in grads.items():
        assert torch.equal(getattr(experts, n).grad, gw), n


@pytest.mark.parametrize("make", [_mixtral, _qwen2_moe])
def test_experts_convert_with_the_router_in_high_precision_and_unconvert(make):
    model = make()
    impl = model.config._experts_implementation
    keys = set(model.state_dict())
    fp4train.convert(model, "nvfp4", strict=True)
    report = model.fp4train_conversion
    assert not report.of(SKIPPED)
    kinds = {e.kind: e.status for e in report.entries}
    assert kinds[type(model.model.layers[0].mlp.experts).__name__] == CONVERTED
    assert kinds[type(model.model.layers[0].mlp.gate).__name__] == HIGH_PRECISION  # the router
    assert "router" in str(report) and model.config._experts_implementation == "fp4train"
    assert set(model.state_dict()) == keys  # the experts' parameters stay where they were
    fp4train.unconvert(model)
    assert model.config._experts_implementation == impl
    assert not any(hasattr(m, "fp4train_experts") for m in model.modules())


def test_experts_kept_in_high_precision_by_a_recipe_override():
    model = _mixtral()
    rec = fp4train.recipes.get("mxfp4")
    rec = rec.replace(overrides=(*rec.overrides, fp4train.recipes.Override("*.experts.*")))
    fp4train.convert(model, rec)
    e = next(x for x in model.fp4train_conversion.entries if x.kind == "MixtralExperts")
    assert e.status == HIGH_PRECISION and model.config._experts_implementation != "fp4train"


def test_a_lora_svd_recipe_says_its_experts_run_without_the_low_rank_branch():
    """fullstack's LoRA-SVD covers linear layers: its experts are quantized without it, in the report and a warning."""
    model = _mixtral()
    with pytest.warns(UserWarning, match="without LoRA-SVD"):
        fp4train.convert(model, "fullstack")
    entry = next(e for e in model.fp4train_conversion.entries if e.name.endswith("layers.0.mlp.experts"))
    assert entry.status == CONVERTED and "without LoRA-SVD" in entry.detail


@pytest.mark.parametrize("rows", [40, 256])  # padded to 128-row groups, and a whole number of groups as it is
def test_an_experts_gemm_on_any_token_count_is_its_quantized_linear(rows):
    model = _mixtral()
    fp4train.convert(model, "mxfp4")
    experts = model.model.layers[0].mlp.experts
    gemm = experts.fp4train_experts.gemms["down_proj"]
    w = experts.down_proj[1].detach()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = nn.Parameter(w.clone())
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(gemm(x, w, None), QuantizedLinear.from_linear(lin, gemm.spec)(x))
