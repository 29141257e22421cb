"""Roles of a model's linears found from the model (a traced forward pass and the embedding's shape), not from names."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train import models
from fp4train.linear.module import QuantizedLinear
from fp4train.recipes import Override
from fp4train.roles import linear_roles

Q, K, V, O, HEAD = (frozenset({r}) for r in ("query", "key", "value", "attn_output", "lm_head"))
QKV = Q | K | V


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    t = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**t, num_key_value_heads=2))
    if name == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**t, num_key_value_heads=2, pad_token_id=0))
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4))
    return transformers.BertForMaskedLM(transformers.BertConfig(**t))


#: per architecture: (layer-name template -> roles), "{i}" the block; the LM head's name
EXPECTED = {
    "llama": ({"model.layers.{i}.self_attn.q_proj": Q, "model.layers.{i}.self_attn.k_proj": K,
               "model.layers.{i}.self_attn.v_proj": V, "model.layers.{i}.self_attn.o_proj": O}, "lm_head"),
    "phi3": ({"model.layers.{i}.self_attn.qkv_proj": QKV, "model.layers.{i}.self_attn.o_proj": O}, "lm_head"),
    "gpt2": ({"transformer.h.{i}.attn.c_attn": QKV, "transformer.h.{i}.attn.c_proj": O}, "lm_head"),
    "bert": ({"bert.encoder.layer.{i}.attention.self.query": Q, "bert.encoder.layer.{i}.attention.self.key": K,
              "bert.encoder.layer.{i}.attention.self.value": V, "bert.encoder.layer.{i}.attention.output.dense": O},
             "cls.predictions.decoder"),
}


def _expected(name: str) -> dict:
    per_block, head = EXPECTED[name]
    return {n.format(i=i): r for i in range(2) for n, r in per_block.items()} | {head: HEAD}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_roles_are_traced_through_a_forward_pass_and_leave_the_model_as_it_was(name):
    """Separate and fused Q/K/V projections, the output projection and the LM head (tied or not) of four
    architectures: exactly these linears have roles, and the probe changes nothing in the model."""
    model = _hf(name)
    model.train()
    impl = model.config._attn_implementation
    before = {k: v.clone() for k, v in model.state_dict().items()}
    roles = linear_roles(model)
    assert roles.how == "forward" and dict(roles) == _expected(name)
    assert model.training and model.config._attn_implementation == impl
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_fp4trains_llama_has_its_roles_with_either_attention():
    """fp4train's own Llama, with SDPA and with the NVFP4 attention op (a converted fullstack model)."""
    want = {f"layers.{i}.self_attn.{p}": r for i in range(2) for p, r in
            (("q_proj", Q), ("k_proj", K), ("v_proj", V), ("o_proj", O))} | {"lm_head": HEAD}
    model = models.Llama(models.config("tiny", vocab_size=256, n_layers=2))
    assert dict(linear_roles(model)) == want
    fp4train.convert(model, "fullstack")
    assert dict(linear_roles(model)) == want


def test_tib2d_gives_fused_and_differently_named_q_and_k_projections_mxfp8():
    """tib2d's Q/K override by role: Phi-3's fused qkv_proj and BERT's query/key run MXFP8, V and the rest MXFP4."""
    phi3 = fp4train.convert(_hf("phi3"), "tib2d")
    fmt = lambda m: m.spec.fprop.a.format  # noqa: E731
    assert fmt(phi3.model.layers[0].self_attn.qkv_proj) == "mxfp8" and fmt(phi3.model.layers[0].self_attn.o_proj) == "mxfp4"
    bert = fp4train.convert(_hf("bert"), "tib2d")
    att = bert.bert.encoder.layer[1].attention.self
    assert (fmt(att.query), fmt(att.key), fmt(att.value)) == ("mxfp8", "mxfp8", "mxfp4")
    assert type(bert.cls.predictions.decoder) is nn.Linear  # the tied LM head stays high precision


def test_a_model_that_cannot_be_traced_matches_roles_by_name_and_says_so():
    model = nn.ModuleDict(dict(q_proj=nn.Linear(64, 64), up=nn.Linear(64, 64)))
    with pytest.warns(UserWarning, match="could not trace them through ModuleDict: the model has no token embedding"):
        fp4train.convert(model, "tib2d")
    assert model["q_proj"].spec.fprop.a.format == "mxfp8" and model["up"].spec.fprop.a.format == "mxfp4"


def test_role_overrides_are_checked_and_round_trip():
    with pytest.raises(ValueError, match="unknown role 'queries'; roles are query, key, value, attn_output, lm_head"):
        Override("role:queries")
    r = fp4train.recipes.get("tib2d")
    assert fp4train.recipes.Recipe.from_dict(r.to_dict()) == r and r.roles_named() == {"query", "key", "lm_head"}
    hp_out = r.replace(overrides=(*r.overrides, Override("role:attn_output")))
    model = fp4train.convert(models.Llama(models.config("tiny", vocab_size=256, n_layers=2)), hp_out)
    assert type(model.layers[0].self_attn.o_proj) is nn.Linear and isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
