"""The Llama-style model and convert() on it (and on Hugging Face's LlamaForCausalLM)."""

import pytest
import torch

import fp4train
from fp4train import QuantizedLinear, models


def test_presets_build_and_have_the_documented_sizes():
    expect = {"tiny": (4.0, 5.0), "20m": (18, 25), "60m": (55, 65), "125m": (115, 135), "350m": (310, 360), "1b": (950, 1150), "3b": (2700, 3100)}
    for name, (lo, hi) in expect.items():
        with torch.device("meta"):
            m = models.build(name)
        assert lo <= m.num_params() / 1e6 <= hi, name
    c = models.config("1b")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (2048, 16, 32, 8, 8192)  # Llama-3.2-1B
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        models.build("huge")


def test_causal_and_shapes():
    torch.manual_seed(0)
    m = models.build("tiny", vocab_size=100)
    idx = torch.randint(0, 100, (2, 16))
    logits = m(idx)
    assert logits.shape == (2, 16, 100)
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 100  # changing the future must not change the past
    torch.testing.assert_close(m(idx2)[:, :10], logits[:, :10], rtol=0, atol=0)
    assert m.lm_head.weight is m.embed_tokens.weight  # tied
    loss = m(idx, torch.randint(0, 100, (2, 16)))
    assert loss.ndim == 0 and 4.0 < loss.item() < 5.2  # ~ln(100) at init
    with pytest.raises(ValueError, match="exceeds max_seq_len=512"):
        m(torch.zeros(1, 600, dtype=torch.long))


def test_every_recipe_converts_and_trains_the_model():
    for name in fp4train.recipes.names():
        torch.manual_seed(0)
        m = fp4train.convert(models.build("tiny", vocab_size=128), name)
        n_q = sum(isinstance(x, QuantizedLinear) and x.spec.quantized for x in m.modules())
        if fp4train.recipes.get(name).calibrate or name == "bf16":
            assert n_q == 0  # BF16 until calibrated (AdaHOP) / never quantized
            continue
        assert n_q == 14 or (name == "nvfp4" and n_q == 7), (name, n_q)  # nvfp4 keeps the last block (of 2) BF16
        assert type(m.lm_head) is torch.nn.Linear
        idx = torch.randint(0, 128, (2, 32))
        m(idx, idx).backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_convert_on_hugging_face_llama(tiny_hf_config):
    import transformers

    cfg = tiny_hf_config(vocab_size=256)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    keys = list(hf.state_dict())
    fp4train.convert(hf, "tib2d")
    assert list(hf.state_dict()) == keys
    assert isinstance(hf.model.layers[0].mlp.up_proj, QuantizedLinear)
    assert hf.model.layers[1].self_attn.q_proj.spec.fprop.a.format == "mxfp8"
    assert type(hf.lm_head) is torch.nn.Linear
    idx = torch.randint(0, 256, (2, 16))
    out = hf(input_ids=idx, labels=idx)
    out.loss.backward()
    assert torch.isfinite(out.loss) and hf.model.layers[0].mlp.up_proj.weight.grad is not None
