"""Full-Stack FP4's quantized attention: the reference against SDPA, the Triton kernels against the reference
(the CPU interpreter here at small shapes; a CUDA GPU at model shapes), and the switch on models."""

import math

import pytest
import torch
import torch.nn.functional as F

import fp4train
import fp4train.models
from fp4train.attention import nvfp4_attention, quantize_ds, quantize_heads, reference, set_attention


def _inputs(b=1, h=4, hkv=2, t=100, d=64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, t, d, generator=g).to(device) for n in (h, hkv, hkv))
    do = torch.randn(b, h, t, d, generator=g).to(device)
    return q, k, v, do


def _grads(fn, q, k, v, do):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _sdpa(q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("causal", [True, False])
def test_reference_math_without_quantization_is_attention(causal, sqnr):
    """Unquantized values with unit divisors: the reference's forward is SDPA's (mask, GQA, LSE)."""
    q, k, v, _ = _inputs()
    one = torch.tensor(1.0)
    o, lse = reference.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), one, one, one, causal=causal, scale=0.125)
    want = _sdpa(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), causal)
    assert sqnr(want, o.float()) > 40  # only P's BF16 rounding before P V


def test_reference_against_sdpa_within_nvfp4_floors(sqnr):
    """Stated floors (measured: 16.9 dB forward, 14.2 / 14.4 / 19.4 dB for dQ / dK / dV on Gaussian inputs)."""
    q, k, v, do = _inputs()
    got = _grads(lambda *a: nvfp4_attention(*a, impl="reference"), q, k, v, do)
    want = _grads(_sdpa, q, k, v, do)
    floors = (15.0, 12.0, 12.0, 17.0)
    for name, x, ref, floor in zip(("O", "dQ", "dK", "dV"), got, want, floors):
        assert sqnr(ref, x) > floor, name
    # and worse than BF16 attention would be: the quantization is really there
    assert sqnr(want[0], got[0]) < 30


def _unquantized_ds(ds):
    return ds.float(), torch.ones_like(ds, dtype=torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_without_quantization_is_attentions_gradient(causal, sqnr, monkeypatch):
    """With Q/K/V unquantized (unit divisors) and dS left as it is, the reference's backward is attention's exact
    gradient up to P's and dO's BF16 rounding (> 40 dB; a dP off by 5% lands near 26 dB)."""
    q, k, v, do = _inputs()
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    one = torch.tensor(1.0)
    monkeypatch.setattr(reference, "quantize_ds", _unquantized_ds)
    o, lse = reference.forward(qb, kb, vb, one, one, one, causal=causal, scale=0.125)
    got = reference.backward(do, o, lse, qb, kb, vb, one, one, one, causal=causal, scale=0.125)
    want = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, scale=0.125, enable_gqa=True),
                  qb.float(), kb.float(), vb.float(), do.bfloat16().float())[1:]
    for name, x, ref in zip(("dQ", "dK", "dV"), got, want):
        assert sqnr(ref, x) > 40, name


def test_reference_quantizes_q_k_v_and_ds(sqnr, monkeypatch):
    """The forward is exact attention of the NVFP4-quantized Q, K and V (V included: > 40 dB against that, while
    an unquantized V lands near NVFP4's error); the backward quantizes dS (without it dQ and dK move by NVFP4's
    error, not by rounding)."""
    q, k, v, do = _inputs()
    (qv, dq), (kv, dk), (vv, dv) = (quantize_heads(x) for x in (q, k, v))
    want = _sdpa(qv.float() / dq, kv.float() / dk, vv.float() / dv)
    got = nvfp4_attention(q, k, v, impl="reference")
    assert sqnr(want, got.float()) > 40
    assert sqnr(_sdpa(qv.float() / dq, kv.float() / dk, v), got.float()) < 30  # V's quantization shows
    quantized = _grads(lambda *a: nvfp4_attention(*a, impl="reference"), q, k, v, do)
    monkeypatch.setattr(reference, "quantize_ds", _unquantized_ds)
    plain = _grads(lambda *a: nvfp4_attention(*a, impl="reference"), q, k, v, do)
    assert sqnr(plain[1], quantized[1]) < 35 and sqnr(plain[2], quantized[2]) < 35  # dQ, dK: dS was quantized
    assert torch.equal(plain[3], quantized[3])  # dV = P^T dO does not read dS


def test_quantize_heads_is_nvfp4_along_the_head_dim():
    q = torch.randn(2, 3, 20, 32)
    values, div = quantize_heads(q)
    want = fp4train.fake_quantize(q.reshape(-1, 32), "nvfp4", axis=1).reshape(q.shape)
    assert values.dtype == torch.bfloat16 and torch.equal(values.float() / div, want)


def test_quantize_ds_is_nvfp4_per_64x64_tile():
    ds = torch.randn(2, 100, 130) * torch.logspace(-6, 0, 130)  # columns at very different scales
    values, div = quantize_ds(ds)
    got = values / div
    for i0 in range(0, 100, 64):
        for j0 in range(0, 130, 64):
            tile = ds[0, i0:i0 + 64, j0:j0 + 64]
            pad = torch.nn.functional.pad(tile, (0, -tile.shape[1] % 16))
            want = fp4train.fake_quantize(pad, "nvfp4", axis=1)[:, :tile.shape[1]]
            assert torch.equal(got[0, i0:i0 + 64, j0:j0 + 64], want), (i0, j0)
    assert torch.equal(values, values.bfloat16().float())  # q * sb: exact in BF16


@pytest.fixture
def kernel():
    """The Triton attention kernels (the reference above imports none: without Triton these tests skip, saying so)."""
    pytest.importorskip("triton")
    from fp4train.kernels import attention

    return attention


@pytest.mark.parametrize("causal,d,t", [(True, 64, 100), (False, 32, 64)])
def test_triton_kernels_match_the_reference(causal, d, t, sqnr, kernel):
    """The kernels (on the CPU through Triton's interpreter, which the test setup switches on): forward within P's BF16 rounding; given the same saved tensors the
    backward's dQ/dK differ from the reference only in FP32 summation order, dV within P's BF16 rounding."""
    q, k, v, do = _inputs(t=t, d=d, device="cuda" if torch.cuda.is_available() else "cpu")
    (qv, dq), (kv, dk), (vv, dv) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    args = (qv.contiguous(), kv.contiguous(), vv.contiguous(), dq, dk, dv)
    o, lse = reference.forward(*args, causal=causal, scale=0.125)
    o2, lse2 = kernel.forward(*args, causal=causal, scale=0.125)
    assert sqnr(o.float(), o2.float()) > 40
    assert torch.allclose(lse2, lse, atol=1e-5, rtol=1e-6)
    g = reference.backward(do, o, lse, *args, causal=causal, scale=0.125)
    g2 = kernel.backward(do, o, lse, *args, causal=causal, scale=0.125)
    assert sqnr(g[0], g2[0]) > 100 and sqnr(g[1], g2[1]) > 100
    assert sqnr(g[2], g2[2]) > 40


@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_backward_sums_the_same_dq(causal, sqnr, kernel):
    """Under torch.use_deterministic_algorithms the backward writes per-key-tile dQ partials (no atomics) and sums
    them after: the same dQ up to FP32 summation order, identical dK/dV, and the same bits when repeated."""
    q, k, v, do = _inputs(t=160, d=32, device="cuda" if torch.cuda.is_available() else "cpu")  # 3 key tiles, one partial
    (qv, dq), (kv, dk), (vv, dv) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    args = (qv.contiguous(), kv.contiguous(), vv.contiguous(), dq, dk, dv)
    o, lse = kernel.forward(*args, causal=causal, scale=0.125)
    g = kernel.backward(do, o, lse, *args, causal=causal, scale=0.125)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        d1 = kernel.backward(do, o, lse, *args, causal=causal, scale=0.125)
        d2 = kernel.backward(do, o, lse, *args, causal=causal, scale=0.125)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for a, b in zip(d1, d2))
    assert torch.equal(d1[1], g[1]) and torch.equal(d1[2], g[2])
    assert sqnr(g[0], d1[0]) > 100


def test_bad_shapes_are_refused_with_the_fix():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="multiple of k's"):
        nvfp4_attention(q[:, :3], k, v, impl="reference")
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_attention(q[..., :24], k[..., :24], v[..., :24], impl="reference")
    with pytest.raises(ValueError, match="impl"):
        nvfp4_attention(q, k, v, impl="cuda")


def test_convert_with_fullstack_switches_llama_attention_and_unconvert_restores_it():
    model = fp4train.models.build("tiny")
    fp4train.convert(model, "fullstack")
    attn = [m for m in model.modules() if isinstance(m, fp4train.models.llama.Attention)]
    assert attn and all(m.attention == "nvfp4" for m in attn)
    idx = torch.randint(0, model.config.vocab_size, (2, 64))
    loss = model(idx, idx)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    fp4train.unconvert(model)
    assert all(m.attention == "sdpa" for m in attn)


def test_set_attention_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match="no attention"):
        set_attention(torch.nn.Sequential(torch.nn.Linear(4, 4)), "nvfp4")


def test_hugging_face_llama_runs_the_nvfp4_attention(sqnr, monkeypatch):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    idx = torch.randint(0, 128, (1, 48))
    with torch.no_grad():
        want = model(idx).logits
    assert set_attention(model, "nvfp4") == 2
    calls = []
    orig = reference.forward
    monkeypatch.setattr(reference, "forward", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    with torch.no_grad():
        got = model(idx).logits
    assert len(calls) == 2  # each layer's attention ran ours
    assert 10 < sqnr(want, got) < 60


def test_attention_is_one_op_inside_a_compiled_graph():
    """The attention is a torch.library op with a fake implementation and registered autograd: a compiled model keeps
    it in its graph (fullgraph: no break), with the eager call's values and gradients; opcheck checks the op."""
    from fp4train.attention import attention_op

    q, k, v, do = _inputs(t=48, d=32)
    want = _grads(lambda *a: nvfp4_attention(*a, impl="reference"), q, k, v, do)
    compiled = torch.compile(lambda *a: nvfp4_attention(*a, impl="reference"), fullgraph=True, backend="aot_eager")
    got = _grads(compiled, q, k, v, do)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    torch.library.opcheck(attention_op, (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, True, 0.125, "reference"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _unquantized(monkeypatch):
    """The NVFP4 attention with quantization off: Q, K, V as their BF16 values, unit divisors."""
    import fp4train.attention as attention

    monkeypatch.setattr(attention, "quantize_heads", lambda x: (x.to(torch.bfloat16), torch.ones((), device=x.device)))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_hugging_face_masks_are_honoured(arch, sqnr, monkeypatch, tiny_hf_config):
    """Padding (Llama, left-padded) and a sliding window (Mistral, window 8): with quantization off the NVFP4 attention
    is SDPA's up to P's BF16 rounding, and tokens a query may not see change nothing of its output, bit for bit."""
    import transformers

    kw = dict(hidden_size=128, intermediate_size=256, max_position_embeddings=64)
    if arch == "llama":
        model_cls, cfg = transformers.LlamaForCausalLM, tiny_hf_config(**kw)
    else:
        model_cls, cfg = transformers.MistralForCausalLM, tiny_hf_config("MistralConfig", sliding_window=8, **kw)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    idx = torch.randint(0, 128, (2, 24))
    am = torch.ones(2, 24, dtype=torch.long)
    if arch == "llama":
        am[0, :5] = 0  # left padding of the first row
    unseen = (0, slice(0, 5)) if arch == "llama" else (1, slice(0, 1))  # padded tokens; token 0, outside the last query's window
    seen = (slice(None), slice(5, None)) if arch == "llama" else (slice(None), slice(23, None))
    with torch.no_grad():
        want = model(idx, attention_mask=am).logits
    set_attention(model, "nvfp4")
    _unquantized(monkeypatch)
    other = idx.clone()
    other[unseen] = (other[unseen] + 1) % 128
    with torch.no_grad():
        got, got_other = (model(x, attention_mask=am).logits for x in (idx, other))
    row = unseen[0]
    assert sqnr(want[row][seen[1]], got[row][seen[1]]) > 35
    assert torch.equal(got[row][seen[1]], got_other[row][seen[1]])


def test_masked_attention_gives_padding_rows_zeros_not_nans():
    q, k, v, do = _inputs(t=16, d=32)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    mask[..., :4] = False  # keys 0-3 padding: queries 0-3 see nothing (causal)
    o, *grads = _grads(lambda *a: nvfp4_attention(*a, mask=mask), q, k, v, do)
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
    assert (o[:, :, :4] == 0).all() and (grads[1][:, :, :4] == 0).all()  # padded keys get no gradient
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        nvfp4_attention(q, k, v, mask=mask.float())
    with pytest.raises(ValueError, match="take no mask"):
        nvfp4_attention(q, k, v, mask=mask, impl="triton")


def test_hugging_face_attention_refuses_what_it_does_not_implement():
    from fp4train.attention import _hf_attention

    q, k, v, _ = _inputs(t=16, d=32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="attention dropout to 0 .attention_dropout, attn_pdrop"):
        _hf_attention(module, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"does not implement the attention argument\(s\) \['softcap'\]"):
        _hf_attention(module, q, k, v, None, softcap=30.0)
    out, _ = _hf_attention(module, q, k, v, None, position_ids=torch.arange(16), sliding_window=None)
    assert out.shape == (1, 16, 4, 32)


def test_unconvert_gives_a_hugging_face_model_its_attention_back(tiny_hf_config):
    import transformers

    cfg = tiny_hf_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    idx = torch.randint(0, 128, (1, 32))
    with torch.no_grad():
        want = model(idx).logits
    fp4train.convert(model, "fullstack")
    assert model.config._attn_implementation == "fp4train_nvfp4"
    fp4train.unconvert(model)
    assert model.config._attn_implementation == "eager"  # what it had, not SDPA
    with torch.no_grad():
        got = model(idx).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # LoRA-SVD merged back: W_res + B A
