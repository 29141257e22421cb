"""Every architecture a user brings, under every FP4 recipe: tiny random-init Hugging Face models (transformers 5),
converted, trained 20 steps on the CPU, unconverted. The whole matrix is in the slow set; CI runs one recipe per
architecture, rotating."""

import warnings

import pytest
import torch

import fp4train
from fp4train.conversion_report import CONVERTED, SKIPPED

transformers = pytest.importorskip("transformers")

T = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**T, num_key_value_heads=2)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**T, num_key_value_heads=2)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**T, num_key_value_heads=2, sliding_window=8)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**T, num_key_value_heads=2, pad_token_id=0)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**T, attention_probs_dropout_prob=0.0,
                                                                         hidden_dropout_prob=0.0)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**T, num_key_value_heads=2, num_local_experts=4,
                                                                                  num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **T, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64)),
}
RECIPES = ("mxfp4", "nvfp4", "tib2d", "adahop", "fullstack")
#: CI's share: one recipe per architecture, rotating
CI = {(a, RECIPES[i % len(RECIPES)]) for i, a in enumerate(ARCHS)}


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (2, 32), generator=g) for _ in range(2)]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("arch,recipe", [pytest.param(a, r, marks=() if (a, r) in CI else pytest.mark.slow)
                                         for a in ARCHS for r in RECIPES])
def test_an_architecture_converts_trains_and_unconverts(arch, recipe):
    torch.manual_seed(0)
    model = ARCHS[arch]()
    impl = model.config._attn_implementation
    batches = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing warned
        if recipe == "fullstack" and arch in ("mixtral", "qwen2_moe"):  # experts without LoRA-SVD: said (test_experts)
            warnings.filterwarnings("ignore", message=".*without LoRA-SVD")
        if recipe == "adahop":
            fp4train.calibrate(model, batches)
        else:
            fp4train.convert(model, recipe, strict=True)
    report = model.fp4train_conversion
    assert not report.of(SKIPPED) and len(report.of(CONVERTED)) >= 8, report
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        loss = _loss(model, batches[step % 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    fp4train.unconvert(model)
    assert not any(isinstance(m, fp4train.QuantizedLinear) for m in model.modules())
    assert model.config._attn_implementation == impl and not any(hasattr(m, "fp4train_experts") for m in model.modules())
    fresh = ARCHS[arch]()
    assert set(model.state_dict()) == set(fresh.state_dict())  # the architecture's own state dict again
    fresh.load_state_dict(model.state_dict())
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=batches[0]).logits, model(input_ids=batches[0]).logits)
