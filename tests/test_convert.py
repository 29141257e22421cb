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
    with pytest.raises(ValueError, match="unknown recipe 'mxfp5'; available: adahop, adahop_measured, adahop_plain, bf16, fp8_rowwise"):
        fp4train.convert(Tiny(), "mxfp5")
    with pytest.raises(ValueError, match="unknown GEMM backend 'cuda'"):
        fp4train.convert(Tiny(), "mxfp4", backend="cuda")


class _Experts(nn.Module):
    """A mixture of experts' stacked expert weights, as transformers 5 keeps them."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 64, 32))


def test_convert_reports_every_weight_bearing_module_and_strict_refuses_what_it_skips():
    def model():
        torch.manual_seed(0)
        return nn.ModuleDict(dict(embed=nn.Embedding(10, 32), proj=nn.Linear(32, 64), head=nn.Linear(64, 10),
                                  conv=nn.Conv2d(3, 8, 3), experts=_Experts()))

    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"conv \(Conv2d\): skipped - a convolution \(Conv2d\)(.|\n)*experts \(_Experts\): "
                                         r"skipped - a _Experts with weights of 3 or more dims that fp4train does not recognise"):
        fp4train.convert(m, "mxfp4", filter=lambda n, _: n != "head", strict=True)
    assert all(type(x) is nn.Linear for x in (m.proj, m.head))  # refused before anything changed
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    with pytest.warns(UserWarning, match=r"1 layers converted, 2 kept in high precision, 2 skipped \(Conv2d x1, _Experts x1\)"):
        fp4train.convert(m, "mxfp4", filter=lambda n, _: n != "head")
    status = {e.name: e.status for e in m.fp4train_conversion.entries}
    assert status == {"proj": "converted", "head": "high precision", "embed": "high precision", "conv": "skipped",
                      "experts": "skipped"}
    assert "fprop mxfp4 x mxfp4" in str(m.fp4train_conversion)


def test_gpt2_conv1d_is_converted_as_the_transposed_linear_it_is():
    transformers = pytest.importorskip("transformers")
    from fp4train.linear.conv1d import QuantizedConv1D
    from fp4train.linear.module import QuantizedLinear

    conv = transformers.pytorch_utils.Conv1D(48, 32)  # 32 -> 48, weight [32, 48]
    m = fp4train.convert(nn.Sequential(conv), "nvfp4")
    layer = m[0]
    assert isinstance(layer, QuantizedConv1D) and layer.weight is conv.weight and m.fp4train_conversion.of("converted")
    lin = nn.Linear(32, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    ql = QuantizedLinear.from_linear(lin, layer.spec)
    x = torch.randn(2, 16, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(5)
    y = layer(x)
    torch.manual_seed(5)
    y2 = ql(x2)
    assert torch.equal(y, y2)  # the same quantized GEMMs, the same bits
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(conv.weight.grad, lin.weight.grad.T) and torch.equal(x.grad, x2.grad)
    assert set(m.state_dict()) == {"0.weight", "0.bias"} and m.state_dict()["0.weight"].shape == (32, 48)
    fp4train.unconvert(m)
    assert type(m[0]) is type(conv) and m[0].weight is conv.weight


def test_gpt2_conv1d_takes_lora_svd_as_the_transposed_linear_it_is():
    """fullstack on a Conv1D: the split, the forward and the gradients of LoRA-SVD on the same weight as a linear,
    bit for bit; the weight stays [in, out]; the state dict and unconvert give the merged Conv1D."""
    import transformers

    from fp4train.linear.lora_svd import LoRASVDConv1D, LoRASVDLinear

    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs
    lin = nn.Linear(32, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    m, ref = nn.Sequential(conv), nn.Sequential(lin)
    fp4train.convert(m, "fullstack")
    fp4train.convert(ref, "fullstack")
    assert type(m[0]) is LoRASVDConv1D and type(ref[0]) is LoRASVDLinear and m[0].weight.shape == (32, 48)
    assert torch.equal(m[0].weight.T, ref[0].weight) and torch.equal(m[0].lora_a, ref[0].lora_a)
    x = torch.randn(4, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.manual_seed(5)  # the stochastic-rounding seeds come from torch's generator
    y = m(x)
    torch.manual_seed(5)
    y2 = ref(x2)
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(m[0].weight.grad.T, ref[0].weight.grad) and torch.equal(m[0].lora_b.grad, ref[0].lora_b.grad)
    assert torch.equal(x.grad, x2.grad)
    sd = m.state_dict()
    assert torch.equal(sd["0.weight"], ref[0].merged_weight().T) and sd["0.weight_residual"].shape == (32, 48)
    fp4train.unconvert(m)
    assert type(m[0]) is type(conv) and torch.equal(m[0].weight, ref[0].merged_weight().T)


def test_adahop_calibrates_any_model_through_one_public_entry(tiny_hf_config):
    import transformers

    cfg = tiny_hf_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = [torch.randint(0, 128, (2, 32)) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"fp4train.calibrate\(model, batches\)"):
        fp4train.convert(transformers.LlamaForCausalLM(cfg), "adahop")  # uncalibrated: the warning names the entry
    cal = fp4train.calibrate(model, ids)
    assert cal.steps == 3 and all(p.grad is None for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 14 and not any(m.uncalibrated for m in layers) and all(m.spec.quantized for m in layers)
    model(ids[0], labels=ids[0]).loss.backward()  # trains in FP4 now
    with pytest.raises(ValueError, match="does not calibrate"):
        fp4train.calibrate(model, ids, recipe="mxfp4")
    with pytest.raises(ValueError, match="got no batches"):
        fp4train.calibrate(transformers.LlamaForCausalLM(cfg), [])


def test_a_calibrating_recipe_refuses_layers_it_could_not_run_before_calibrating():
    """AdaHOP's layers run BF16 until calibration picks their strategies; a layer no strategy can run (a 64 -> 1 gate)
    is refused before the first calibration step, not after the calibration."""
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    taken = []

    def batches():
        for _ in range(3):
            taken.append(1)
            yield torch.randn(4, 64)

    with pytest.raises(ValueError, match=r"1 \(Linear 64->1\)"):
        fp4train.calibrate(m, batches(), loss=lambda model, x: model(x).sum())
    assert not taken and all(type(x) is nn.Linear for x in m)


def test_a_tied_lm_head_stays_in_high_precision_whatever_its_name():
    """BERT's MLM decoder is called cls.predictions.decoder: found by its weight, tied to the word embeddings."""
    emb = nn.Embedding(64, 32)
    decoder = nn.Linear(32, 64)
    decoder.weight = emb.weight
    m = nn.ModuleDict(dict(embeddings=emb, body=nn.Linear(32, 32), decoder=decoder))
    fp4train.convert(m, "mxfp4")
    assert type(m["decoder"]) is nn.Linear and isinstance(m["body"], QuantizedLinear)
    assert "tied to the input embedding" in str(m.fp4train_conversion)
    untied = nn.ModuleDict(dict(embeddings=nn.Embedding(64, 32), decoder=nn.Linear(32, 64), body=nn.Linear(32, 32)))
    fp4train.convert(untied, "mxfp4")  # not tied, not named lm_head, but shaped [vocab, hidden] outside the blocks
    assert type(untied["decoder"]) is nn.Linear and isinstance(untied["body"], QuantizedLinear)
    assert "the LM head (its output is the vocabulary" in str(untied.fp4train_conversion)
    blocks = nn.ModuleDict(dict(embeddings=nn.Embedding(64, 32), layers=nn.ModuleList([nn.Linear(32, 64)])))
    fp4train.convert(blocks, "mxfp4")  # an MLP as wide as the vocabulary inside a block is no head
    assert isinstance(blocks["layers"][0], QuantizedLinear)


def test_a_skipped_modules_reason_is_its_kind_not_the_number_of_its_weights_dims():
    """A convolution or a bilinear layer (3-dim weights, like stacked experts) is reported as what it is."""
    from fp4train.conversion_report import unhandled_reason

    assert unhandled_reason(nn.Conv1d(4, 8, 3)).startswith("a convolution (Conv1d)")
    assert unhandled_reason(nn.Bilinear(4, 4, 8)).startswith("a bilinear layer (Bilinear")
    assert unhandled_reason(nn.MultiheadAttention(8, 2)).startswith("PyTorch's MultiheadAttention")
    assert "3 or more dims" in unhandled_reason(_Experts())
    assert not any("3 or more dims" in unhandled_reason(m) for m in (nn.Conv1d(4, 8, 3), nn.Bilinear(4, 4, 8)))
