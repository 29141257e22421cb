"""Mixtures of experts: transformers 5's stacked 3-D expert weights run each expert's GEMMs quantized."""

import warnings

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


def _own_linears(experts, specs):
    """Each expert's projections as quantized linears of their own (made before any seed is drawn: a new nn.Linear
    draws its initialization from torch's generator)."""
    layers = {}
    for e in range(experts.num_experts):
        layers[e] = {}
        for n, spec in specs.items():
            w = getattr(experts, n)[e].detach()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight = nn.Parameter(w.clone())
            layers[e][n] = QuantizedLinear.from_linear(lin, spec)
    return layers


@pytest.mark.parametrize("recipe", ["mxfp4", "tib2d", "nvfp4", "hadamard_mxfp4", "fp8_rowwise", "fullstack"])
def test_each_experts_gemms_are_that_expert_quantized_as_its_own_linear(recipe):
    """The experts' output and the gradients of their stacked weights and of the tokens, against each expert's two
    projections as quantized linears of their own on the tokens routed to it (by token, then choice, zero-padded to
    128 rows), bit for bit: the grouped GEMMs prepare every operand as the expert's own linear does (NVFP4's tensor
    scale per expert; stochastic rounding and random signs from the same seeds, drawn in the same order: every
    expert's first projection, then every expert's second)."""
    model = _mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fullstack: experts without LoRA-SVD
        fp4train.convert(model, recipe)
    experts = model.model.layers[0].mlp.experts
    assert experts.fp4train_experts.grouped is not None
    specs = experts.fp4train_experts.specs
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g, requires_grad=True)
    top = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(40)])  # no token for expert 3
    weights = torch.rand(40, 2, generator=g)
    torch.manual_seed(7)  # stochastic rounding and random signs draw their seeds from torch's generator, call by call
    y = experts(x, top, weights)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)

    x2 = x.detach().clone().requires_grad_()
    layers = _own_linears(experts, specs)
    torch.manual_seed(7)
    routed, hidden = {}, {}
    for e in range(3):
        tok, pos = torch.where(top == e)
        routed[e] = (tok, pos)
        xe = torch.cat([x2[tok], x2.new_zeros(-len(tok) % 128, 64)])
        hidden[e] = layers[e]["gate_up_proj"](xe)
    want = torch.zeros_like(y)
    for e, (tok, pos) in routed.items():
        gate, up = hidden[e].chunk(2, dim=-1)
        out = layers[e]["down_proj"](experts.act_fn(gate) * up)[:len(tok)] * weights[tok, pos, None]
        want.index_add_(0, tok, out)
    want.backward(dy)  # one backward, as the experts' (seeds saved by forward)
    assert torch.equal(y, want)
    assert torch.equal(x.grad, x2.grad)
    for n in specs:
        gw = torch.stack([layers[e][n].weight.grad for e in range(3)])
        assert torch.equal(getattr(experts, n).grad[:3], gw), n
        assert not getattr(experts, n).grad[3].any()  # the expert without tokens: no gradient


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", "tib2d", "fp8_rowwise"])
def test_grouped_gemms_on_the_gpu_match_the_cpu_reference(recipe, monkeypatch):
    """On CUDA one projection's three GEMMs are one ``torch._grouped_mm`` each, on BF16 splits of operands that the
    kernels prepare with the reference's bits (stochastic rounding included: the same seeds): its output and
    gradients agree with the CPU's per-expert FP32 GEMMs up to summation order and, where the grouped GEMM gives
    no FP32 output, one BF16 rounding. (One projection: through two, a rounding difference in the first moves
    the second's FP4 rounding, which the comparison should not measure.)"""
    from fp4train.backends import grouped
    from fp4train.linear.grouped_linear import GroupedLinear

    fp32_out = grouped.fp32_output("cuda")  # asked before counting the grouped GEMMs
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    spec = fp4train.recipes.get(recipe).linear
    g = torch.Generator().manual_seed(1)
    w3 = torch.randn(4, 96, 64, generator=g) * 0.05
    x = torch.randn(3 * 128, 64, generator=g)
    x[300:] = 0  # the last expert's padding rows
    dy = torch.randn(3 * 128, 96, generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        w = w3.detach().to(device).requires_grad_()
        xd = x.detach().to(device).requires_grad_()
        torch.manual_seed(7)
        y = GroupedLinear(spec, "triton" if device == "cuda" else "eager")(xd, w, None, [128, 0, 256, 0], False)
        y.backward(dy.to(device))
        results[device] = [t.detach().cpu() for t in (y, xd.grad, w.grad)]
    assert len(calls) == 3  # fprop, dgrad and wgrad: one grouped GEMM each, on the GPU only
    tol = 1e-5 if fp32_out else 8e-3
    for name, a, b in zip(("y", "dx", "dw"), results["cpu"], results["cuda"]):
        err = ((a - b).norm() / a.norm()).item()
        assert err < tol, (name, err, fp32_out)
    assert not results["cuda"][2][[1, 3]].any()  # experts without tokens


@pytest.mark.parametrize("factors", ["none", "nvfp4", "fp8"])
def test_one_grouped_gemm_applies_each_experts_factors_to_its_own_output(factors):
    """The grouped computation (one ``torch._grouped_mm`` of BF16 values, then each expert's factors) on the CPU,
    against the dense epilogue applied expert by expert: small integer values make every product sum exact in
    BF16, so the two agree bit for bit - any mix-up of experts, rows, columns or factors shows."""
    from fp4train.backends import grouped
    from fp4train.backends.emulated import scale_output

    g = torch.Generator().manual_seed(0)
    ints = lambda *shape: torch.randint(-2, 3, shape, generator=g).to(torch.bfloat16)  # noqa: E731
    scale = lambda n: torch.rand(n, generator=g) + 0.5 if factors == "fp8" else None  # noqa: E731
    div = lambda: torch.rand((), generator=g) * 100 + 1 if factors == "nvfp4" else None  # noqa: E731
    split = lambda rows, cols: (ints(rows, cols), scale(rows), div())  # noqa: E731
    sizes, n, k = [16, 48, 32], 24, 32
    for of_splits, join, a_shape, b_shape in ((grouped.rows_of_splits, torch.cat, lambda m: (m, k), lambda m: (n, k)),
                                              (grouped.inner_of_splits, torch.stack, lambda m: (n, m), lambda m: (k, m))):
        a_ops, b_ops = [split(*a_shape(m)) for m in sizes], [split(*b_shape(m)) for m in sizes]
        want = join([scale_output(a[0].float() @ b[0].float().T, a[1], b[1], a[2], b[2], torch.float32)
                     for a, b in zip(a_ops, b_ops)])
        assert torch.equal(of_splits(a_ops, b_ops, torch.float32), want), of_splits.__name__


@pytest.mark.parametrize("grouped", [True, False])
def test_a_compiled_model_runs_its_quantized_experts_eagerly(grouped, monkeypatch):
    """Under ``torch.compile`` the quantized experts (grouped, or looped where they cannot be grouped) run outside
    the compiled graph: their groups' sizes are read on the host every step, and tracing their per-expert
    preparation would break the graph at every call and recompile for every size. The block's output and
    gradients are the eager ones."""
    from fp4train.linear import experts, grouped_linear
    from fp4train.models.moe import MoE

    cls = grouped_linear.GroupedLinear if grouped else experts._Gemm
    traced, real = [], cls.__call__

    def spy(self, *args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", spy)
    torch.manual_seed(0)
    block = MoE(64, 32, 4, 2)
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)
    block = fp4train.convert(block, "tib2d")
    if not grouped:
        block.experts.fp4train_experts.grouped = None
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    results = []
    for run in (block, torch.compile(block, backend="eager")):
        xi = x.clone().requires_grad_()
        torch.manual_seed(5)
        y = run(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad))
    torch._dynamo.reset()
    assert traced and not any(traced)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
