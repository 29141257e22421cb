"""A quantized linear is one set of torch.library ops (fp4train/linear/op.py), eagerly and compiled: under
torch.compile no graph break, the same bits as eager, its saved operands packed and visible to the compiler."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train import models
from fp4train.adahop import Relative, Strategy
from fp4train.adahop.calibration import gemm_spec
from fp4train.linear import QuantizedLinear
from fp4train.linear.op import LayerConfig, config_key, parse
from fp4train.recipes import LinearSpec

RECIPES = ["mxfp4", "tib2d", "nvfp4", "fp8_rowwise", "hadamard_mxfp4"]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss_and_grads(m, fwd, idx, seed):
    torch.manual_seed(seed)  # the stochastic-rounding seeds each layer draws follow it
    m.zero_grad()
    loss = fwd(idx[:, :-1], idx[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("backend", ["emulated", "fp8_blockwise"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_layers_give_the_eager_bits(recipe, backend, fresh_dynamo):
    """fullgraph=True: the compiler refuses any graph break. Output and every gradient equal the
    eager layers' bit for bit, stochastic rounding included (each layer draws its seed where eager
    does); a ReLU between them keeps the compiler's own float order out of the comparison."""
    torch.manual_seed(0)
    numerics = "triton" if backend == "fp8_blockwise" else "eager"
    m = fp4train.convert(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)), recipe, backend=backend, numerics=numerics)
    x = torch.randn(64, 128)

    def run(fwd, seed):
        torch.manual_seed(seed)
        m.zero_grad()
        xg = x.clone().requires_grad_()
        y = fwd(xg)
        y.square().sum().backward()
        return [y.detach(), xg.grad] + [p.grad.clone() for p in m.parameters()]

    eager, compiled = run(m, 5), run(torch.compile(m, fullgraph=True), 5)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    if recipe in ("tib2d", "nvfp4", "hadamard_mxfp4"):  # seeded recipes: another seed, other gradient bits
        assert not torch.equal(run(torch.compile(m, fullgraph=True), 6)[1], compiled[1])  # dX: rounded stochastically


@pytest.mark.parametrize("recipe", ["mxfp4", "tib2d"])
def test_compiled_model_is_one_graph(recipe, fresh_dynamo):
    """A whole converted Llama compiles with fullgraph=True; loss and gradients match eager up to
    the compiler's float order in the unquantized parts (which moves BF16 as much: ~1e-6)."""
    torch.manual_seed(0)
    m = models.build("tiny")
    fp4train.convert(m, recipe)
    idx = torch.randint(0, m.config.vocab_size, (2, 33))
    eager = _loss_and_grads(m, m, idx, 5)
    compiled = _loss_and_grads(m, torch.compile(m, fullgraph=True), idx, 5)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
    for a, b in zip(eager[1], compiled[1]):
        assert float((a - b).norm() / a.norm()) < 1e-4


def _iht_wgrad_spec():
    return LinearSpec(gemm_spec(Strategy.PLAIN, "none", "none", 4), gemm_spec(Strategy.IHT, "none", "none", 4),
                      gemm_spec(Strategy.IHT, "none", "none", 4))


def _oe_spec():
    return LinearSpec(gemm_spec(Strategy.OE, Relative.INNER, Relative.OUTER, k=4), gemm_spec(Strategy.OE, "outer", "inner", 4),
                      gemm_spec(Strategy.OE, "inner", "inner", 4))


@pytest.mark.parametrize("recipe", RECIPES)
def test_seed_output_is_a_cpu_scalar_only_where_the_spec_draws_a_seed(recipe):
    """A spec without stochastic rounding or random signs outputs an int64 scalar on X's device as its seed (a
    graph of such layers then holds no CPU tensor, and CUDA graphs can capture it), which backward does not read;
    a seeded spec the CPU scalar its backward reads. X on the meta device stands for a GPU's (on the CPU both
    are CPU tensors). Both give the eager bits (test_compiled_layers_give_the_eager_bits)."""
    from fp4train.linear.op import _seed_output, _seed_value

    torch.manual_seed(0)
    q = fp4train.convert(nn.Sequential(nn.Linear(128, 96)), recipe, backend="fp8_blockwise", numerics="triton")[0]
    assert q.spec.needs_seed == (recipe in ("tib2d", "nvfp4", "hadamard_mxfp4"))
    cfg = parse(q._config)
    seed = _seed_output(cfg, 12345, torch.empty(4, 128, device="meta"))
    assert seed.shape == () and seed.dtype == torch.int64
    if q.spec.needs_seed:
        assert seed.device.type == "cpu" and _seed_value(cfg, seed) == 12345
    else:
        assert seed.device.type == "meta" and _seed_value(cfg, seed) == 0
    x = torch.randn(64, 128, requires_grad=True)  # the op itself outputs what _seed_output makes
    _, out, *_ = torch.ops.fp4train.quantized_linear(x, q.weight, q.bias, q._config, torch.float32, True, True, [])
    assert out.shape == () and out.dtype == torch.int64 and out.device == x.device


@pytest.mark.parametrize("recipe", RECIPES + ["adahop_oe"])
def test_graph_op_fake_shapes_schema_and_autograd(recipe):
    """torch.library.opcheck: the fake (shape) implementation agrees with the real one - the saved
    packed layouts the reference describes are the ones the backend writes - and autograd is registered."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 96)
    if recipe == "adahop_oe":  # X saved as the input itself (outlier extraction in wgrad picks rows of X)
        q = QuantizedLinear.from_linear(lin, _oe_spec())
    else:
        q = fp4train.convert(nn.Sequential(lin), recipe, backend="fp8_blockwise", numerics="triton")[0]
    x = torch.randn(64, 128)
    for save_x, save_w in ((True, True), (True, False), (False, True)):  # W wants dW, X wants dX
        w = q.weight.detach().requires_grad_(save_x)
        torch.library.opcheck(torch.ops.fp4train.quantized_linear.default,
                              (x.requires_grad_(save_w), w, q.bias, q._config, torch.float32, save_x, save_w, []))


def test_adahop_outlier_layer_compiles_to_the_eager_bits(fresh_dynamo):
    torch.manual_seed(1)
    q = QuantizedLinear.from_linear(nn.Linear(128, 96), _oe_spec())
    x = torch.randn(40, 128)
    x[:, [3, 50, 77]] *= 30
    outs = []
    for fwd in (q, torch.compile(q, fullgraph=True)):
        q.zero_grad()
        xg = x.clone().requires_grad_()
        fwd(xg).square().sum().backward()
        outs.append((xg.grad, q.weight.grad.clone(), q.bias.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def _saved_bytes(fwd, x, params) -> int:
    """Bytes of the tensors autograd keeps for backward (distinct storages), parameters left out."""
    seen, skip = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd(x)
    return sum(seen.values())


def test_compiled_model_keeps_x_packed(fresh_dynamo):
    """The compiled graph saves what eager saves - X as FP4 codes + scales, not BF16 - plus the
    compiler's own choices (here: the ReLU's mask), far below the unquantized model's."""
    torch.manual_seed(0)
    x = torch.randn(256, 512, requires_grad=True)

    def mlp(recipe):
        m = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 512, bias=False))
        return fp4train.convert(m, recipe) if recipe != "bf16" else m

    m = mlp("bf16")
    bf16 = _saved_bytes(torch.compile(m), x, m.parameters())
    m = mlp("mxfp4")
    eager, compiled = _saved_bytes(m, x, m.parameters()), _saved_bytes(torch.compile(m, fullgraph=True), x, m.parameters())
    assert compiled <= eager * 1.2 and compiled < bf16 / 2, (compiled, eager, bf16)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES + ["adahop_oe"])
def test_graph_op_on_the_gpu_gives_the_eager_bits(recipe, fresh_dynamo):
    """On the GPU (triton backend: the kernels' packed layouts, FP8 GEMMs), under BF16 autocast: the
    fake layouts are the kernels' (opcheck), and a compiled pair of layers gives the eager bits."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)).cuda()
    if recipe == "adahop_oe":
        m[0] = QuantizedLinear.from_linear(m[0], _oe_spec(), backend="fp8_blockwise", numerics="triton")
        m[2] = QuantizedLinear.from_linear(m[2], _oe_spec(), backend="fp8_blockwise", numerics="triton")
    else:
        fp4train.convert(m, recipe, backend="fp8_blockwise", numerics="triton")
    x = torch.randn(256, 512, device="cuda")
    torch.library.opcheck(torch.ops.fp4train.quantized_linear.default,
                          (x.clone().requires_grad_(), m[0].weight, m[0].bias, m[0]._config, torch.bfloat16, True, True, []),
                          test_utils=("test_schema", "test_faketensor"))
    if m[0]._prep is not None:  # the shared preparation's fake layouts are the kernels'
        torch.library.opcheck(torch.ops.fp4train.prepare_x.default, (x, m[0]._prep, torch.bfloat16),
                              test_utils=("test_schema", "test_faketensor"))

    def run(fwd, seed):
        torch.manual_seed(seed)
        m.zero_grad()
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fwd(xg)
        y.float().square().sum().backward()
        return [y.detach(), xg.grad] + [p.grad.clone() for p in m.parameters()]

    eager, compiled = run(m, 5), run(torch.compile(m, fullgraph=True), 5)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


class _Siblings(nn.Module):
    """Three layers reading one input, as q/k/v do."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(128, 128), nn.Linear(128, 256), nn.Linear(128, 128)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)  # exact: no float order of the compiler's in the comparison


@pytest.mark.parametrize("recipe", ["mxfp4", "tib2d", "fp8_rowwise", "hadamard_mxfp4", "adahop_iht_wgrad"])
def test_layers_reading_one_input_share_one_prepare_op(recipe, fresh_dynamo, monkeypatch):
    """X's preparation for fprop and wgrad is its own deterministic op, so the compiler merges the
    siblings' calls into one (as the eager memo does): X prepared once per step, the eager bits."""
    from fp4train import backends

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on the GPU, or interpreted on a CPU
    if recipe == "adahop_iht_wgrad":  # AdaHOP layers with the same strategies for X (plain fprop, IHT wgrad)
        from fp4train.linear.shared_input import SharedInput

        m, memo = _Siblings().to(dev), SharedInput()  # layers made one by one share a memo when given one
        for n in ("q", "k", "v"):
            setattr(m, n, QuantizedLinear.from_linear(getattr(m, n), _iht_wgrad_spec(), backend="fp8_blockwise", numerics="triton", shared_input=memo))
    else:
        m = fp4train.convert(_Siblings().to(dev), recipe, backend="fp8_blockwise", numerics="triton")
    be = backends.get("fp8_blockwise").operands
    calls = []
    # what prepares X for fprop (along K, axis 1) - once per input when shared
    name = "operand_pair" if recipe in ("mxfp4", "tib2d", "fp8_rowwise") else "operand"
    real = getattr(be, name)

    x_storage = {}

    def counted(*a, **k):
        if a[0].untyped_storage().data_ptr() == x_storage["ptr"] and (name == "operand_pair" or k.get("axis") == 1):
            calls.append(1)  # X (not dY) prepared for fprop
        return real(*a, **k)

    monkeypatch.setattr(be, name, counted)
    x = torch.randn(64, 128, device=dev)

    def run(fwd):
        torch.manual_seed(3)
        m.zero_grad()
        xg = x.clone().requires_grad_()
        x_storage["ptr"] = xg.untyped_storage().data_ptr()
        fwd(xg).square().sum().backward()
        return [xg.grad] + [p.grad.clone() for p in m.parameters()]

    eager = run(m)
    assert len(calls) == 1  # the eager memo
    compiled_model = torch.compile(m, fullgraph=True)
    run(compiled_model)  # compiles (the fake implementation runs nothing real)
    calls.clear()
    compiled = run(compiled_model)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("recipe,kind", [("mxfp4", "PAIR"), ("tib2d", "PAIR"), ("fp8_rowwise", "FP8_ROWWISE"),
                                         ("hadamard_mxfp4", "FOLD"), ("adahop_iht_wgrad", "FOLD")])
def test_prepare_op_fake_layouts(recipe, kind):
    """The shared X preparation's fake layouts are the backend's (opcheck), for each kind; the layers reading
    one input share it (the sibling test below counts the calls)."""
    from fp4train.linear import op as graph_op
    from fp4train.linear.op import prep_fits, prep_kind

    kind = getattr(graph_op, kind)
    if recipe == "adahop_iht_wgrad":  # an AdaHOP layer: plain fprop, IHT on wgrad
        q = QuantizedLinear.from_linear(nn.Linear(128, 96), _iht_wgrad_spec(), backend="fp8_blockwise", numerics="triton")
    else:
        q = fp4train.convert(nn.Sequential(nn.Linear(128, 96)), recipe, backend="fp8_blockwise", numerics="triton")[0]
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on the GPU, or interpreted on a CPU
    q, x = q.to(dev), torch.randn(64, 128, device=dev)
    cfg = parse(q._prep)
    assert q._prep is not None and prep_kind(cfg.spec, cfg.backend_name, cfg.numerics) == kind and prep_fits(x, q._layer_config)
    for dt in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.fp4train.prepare_x.default, (x, q._prep, dt))
    if kind == graph_op.PAIR:
        assert not prep_fits(x[:48], q._layer_config)  # M not a multiple of 32: X is prepared inside the layer's op


def test_stochastic_or_unshareable_x_has_no_shared_op():
    """nvfp4's wgrad X draws random Hadamard signs and AdaHOP's outlier layers pick from X itself:
    nothing to share, X is prepared inside each layer's op."""
    assert fp4train.convert(nn.Sequential(nn.Linear(128, 96)), "nvfp4", backend="fp8_blockwise", numerics="triton")[0]._prep is None
    assert QuantizedLinear.from_linear(nn.Linear(128, 96), _oe_spec(), backend="fp8_blockwise", numerics="triton")._prep is None
    assert fp4train.convert(nn.Sequential(nn.Linear(128, 96)), "mxfp4", backend="emulated")[0]._prep is None


@pytest.mark.parametrize("recipe", RECIPES + ["adahop_oe"])
def test_config_key_names_the_spec_in_any_process(recipe):
    """The ops name a layer's spec by its JSON, not a process-local index: Inductor caches compiled
    graphs on disk with the ops' arguments baked in, and another process must read the same spec."""
    spec = _oe_spec() if recipe == "adahop_oe" else fp4train.recipes.get(recipe).linear
    cfg = LayerConfig(spec, "fp8_blockwise", "triton", device_seeds=True)
    key = config_key(cfg)
    parse.cache_clear()  # as in a fresh process that loads a cached graph
    assert parse(key) == cfg


def test_triton_numerics_leave_cpu_tensors_to_the_reference(monkeypatch):
    """A layer with "triton" numerics given CPU tensors (outside Triton's interpreter) takes the reference
    path (it would launch a Triton kernel on CPU tensors), with the reference's bits."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 96)
    ref_layer = QuantizedLinear.from_linear(lin, fp4train.recipes.get("mxfp4").linear)
    q = QuantizedLinear.from_linear(lin, fp4train.recipes.get("mxfp4").linear, numerics="triton")
    x = torch.randn(64, 128)
    ref = ref_layer(x)
    from fp4train.kernels import mx_values

    def no_kernel(*a, **k):
        raise AssertionError("a Triton kernel was given CPU tensors")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors now unusable by the kernels
    monkeypatch.setattr(mx_values, "mxfp4_values", no_kernel)
    assert torch.equal(q(x), ref)


def test_dynamic_shapes_compile_once_and_keep_the_eager_bits(fresh_dynamo):
    """compile(dynamic=True): one graph for any token count - where the shared preparation fits (64
    tokens) and where it does not (48: not a multiple of 32, so X is prepared inside the layer's op)."""
    torch.manual_seed(0)
    m = fp4train.convert(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)), "mxfp4", backend="fp8_blockwise", numerics="triton")
    c = torch.compile(m, dynamic=True, fullgraph=True)
    for tokens in (64, 48, 96):
        x = torch.randn(tokens, 128)
        outs = []
        for fwd in (m, c):
            m.zero_grad()
            xg = x.clone().requires_grad_()
            y = fwd(xg)
            y.square().sum().backward()
            outs.append([y.detach(), xg.grad, m[0].weight.grad.clone()])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), tokens


def test_backend_state_is_allocated_when_a_layer_arrives_on_a_device(monkeypatch):
    """The triton backend's inexact counter exists on the weight's device once a layer is made or moved, before
    any call: made lazily inside the first call of a model compiled with mode="reduce-overhead", it would sit in
    the CUDA-graph pool without being a graph output, which cudagraph trees refuse (AdaHOP on the H200)."""
    backend = fp4train.backends.get("fp8_blockwise").operands
    monkeypatch.setattr(backend, "inexact", None)
    q = fp4train.convert(nn.Sequential(nn.Linear(128, 96)), "mxfp4", backend="fp8_blockwise", numerics="triton")[0]
    assert backend.inexact is not None and backend.inexact.device == q.weight.device
    monkeypatch.setattr(backend, "inexact", None)
    q.to(torch.float64)  # any move goes through nn.Module._apply
    assert backend.inexact is not None and backend.inexact.device == q.weight.device
    monkeypatch.setattr(backend, "inexact", None)
    q.to("meta")  # no storage: nothing to allocate there
    assert backend.inexact is None


@pytest.mark.parametrize("recipe", ["tib2d", "nvfp4"])
def test_device_seeds_drive_the_op_and_its_backward(monkeypatch, recipe):
    """convert(device_seeds=True): a seeded layer's op draws its seed from the device's stream (each call a new
    one, shape (1,) on X's device: no CPU tensor in the graph), and its backward uses that seed - the same stream
    state gives the same gradients, another state other ones; a spec without seeds draws none. nvfp4: its
    wgrad's random Hadamard signs come from the device seed too (signs from the seed's keys)."""
    from fp4train import counter_rng, device_seeds

    monkeypatch.setattr(device_seeds, "_STREAMS", {})
    torch.manual_seed(0)
    q = fp4train.convert(nn.Sequential(nn.Linear(128, 128)), recipe, backend="fp8_blockwise", numerics="triton", device_seeds=True)[0]
    stream = device_seeds._STREAMS[torch.device("cpu")]  # made when the layer was
    assert parse(q._config).seeded_on_device
    unseeded = fp4train.convert(nn.Sequential(nn.Linear(128, 128)), "mxfp4", backend="fp8_blockwise", numerics="triton", device_seeds=True)[0]
    assert not parse(unseeded._config).seeded_on_device  # no seed to draw
    assert recipe != "nvfp4" or q.spec.wgrad.transform.random_signs
    x = torch.randn(128, 128)
    state = stream.state_dict()

    def op_grads():
        xi, w = x.clone().requires_grad_(), q.weight.detach().clone().requires_grad_()
        y, seed, *_ = torch.ops.fp4train.quantized_linear(xi, w, q.bias, q._config, torch.float32, True, True, [])
        y.backward(torch.ones_like(y) + torch.linspace(0, 1, y.numel()).reshape(y.shape))
        return seed, y, xi.grad, w.grad

    s1, y1, dx1, dw1 = op_grads()
    s2, *_ = op_grads()
    assert s1.shape == (1,) and s1.dtype == torch.int64 and s1.device == x.device and s1.item() != s2.item()
    assert s1.item() == counter_rng.derive_seed(state["base"], state["count"] + 1)
    stream.load_state_dict(state)
    s3, y3, dx3, dw3 = op_grads()
    assert s3.item() == s1.item() and torch.equal(y3, y1) and torch.equal(dx3, dx1) and torch.equal(dw3, dw1)
    stream.load_state_dict(state)  # another seed, other stochastic rounding of dY: other gradients
    stream.next()
    _, _, dx4, _ = op_grads()
    assert not torch.equal(dx4, dx1)


def test_compiled_model_with_device_seeds_is_one_graph_and_draws_a_seed_per_layer_call(fresh_dynamo, monkeypatch):
    """With device seeds a whole tib2d Llama still compiles with fullgraph=True; each step draws one seed per
    seeded layer call from the device's stream (the count moves by that many), and its loss matches the
    host-seeded model's (the forward rounds to nearest: seeds only move the gradients)."""
    from fp4train import device_seeds

    monkeypatch.setattr(device_seeds, "_STREAMS", {})
    torch.manual_seed(0)
    m = models.build("tiny")
    torch.manual_seed(0)
    m_dev = models.build("tiny")
    fp4train.convert(m, "tib2d")
    fp4train.convert(m_dev, "tib2d", device_seeds=True)
    idx = torch.randint(0, m.config.vocab_size, (2, 33))
    host = _loss_and_grads(m, torch.compile(m, fullgraph=True), idx, 5)
    torch._dynamo.reset()
    stream = device_seeds._STREAMS[torch.device("cpu")]
    calls = sum(isinstance(mod, QuantizedLinear) and mod.spec.needs_seed for mod in m_dev.modules())
    compiled = torch.compile(m_dev, fullgraph=True)
    for step in (1, 2):
        loss, grads = _loss_and_grads(m_dev, compiled, idx, 5)
        assert int(stream.count) == step * calls and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(loss, host[0], rtol=1e-5, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(grads, host[1]))  # other draws than the host seeds'
