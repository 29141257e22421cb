"""Models: a Llama-3-style decoder and its size presets; any Hugging Face causal LM from its config (:mod:`.hf`)."""

from __future__ import annotations

import dataclasses

from .llama import Llama, LlamaConfig

#: Size presets. Feature dims are multiples of 128 (whole blocks for every recipe, and
#: aligned for 128-wide FP8 GEMM tiles). ``1b``/``3b`` use Llama-3.2-1B/3B transformer shapes
#: (the vocabulary comes from the tokenizer). Names are approximate sizes with a 32k vocab.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512),
    "20m": LlamaConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024),
    "60m": LlamaConfig(dim=512, n_layers=14, n_heads=8, n_kv_heads=4, ffn_dim=1536),
    "125m": LlamaConfig(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, ffn_dim=2048),
    "350m": LlamaConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    # mixtures of experts (fp4train.models.moe): every block's feed-forward is n_experts SwiGLU experts of ffn_dim,
    # two per token (by total parameters: moe-20m has 20m's attention, moe-1b 1b's)
    "moe-tiny": LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512, n_experts=4),
    "moe-20m": LlamaConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=128, n_experts=8),
    "moe-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=1024, n_experts=8),
}


def names() -> list[str]:
    return list(PRESETS)


def config(name: str, **overrides) -> LlamaConfig:
    """A preset's config with fields replaced (e.g. ``vocab_size`` from the tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def build(name: str, **overrides) -> Llama:
    return Llama(config(name, **overrides))


def from_config_dict(d: dict):
    """The model a checkpoint's ``model_config`` describes (fp4train's Llama, or a Hugging Face model trained from
    ``--hf-config``: :mod:`fp4train.models.hf`), freshly initialized."""
    if "hf_config" in d:
        from .hf import from_config_dict as hf_model

        return hf_model(d)
    return Llama(LlamaConfig(**d))


__all__ = ["Llama", "LlamaConfig", "PRESETS", "build", "config", "from_config_dict", "names"]
