"""A Hugging Face causal LM built from its config (random initialization), trained by fp4train like its own Llama.

``fp4train train --hf-config CONFIG`` trains any architecture transformers builds with ``AutoModelForCausalLM``
(Llama, Qwen2, Mistral, Phi-3, GPT-2, Mixtral, Qwen2-MoE, ...): :class:`HFCausalLM` gives it the interface the
trainer, evaluation and export use - ``model(idx)`` gives logits, ``model(idx, targets)`` the mean cross-entropy -
and a ``config`` whose ``to_dict()`` a checkpoint keeps, from which :func:`from_config_dict` rebuilds it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


def load_config(path: str | Path):
    """The transformers config in ``path`` (a ``config.json`` file or the folder that holds one)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ValueError("--hf-config needs transformers: pip install 'fp4train[hf]'")
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"--hf-config {path}: no such file{' (the folder has no config.json)' if p.is_dir() else ''}")
    try:
        d = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"--hf-config {file}: not JSON ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"--hf-config {file}: a transformers config names its model_type (e.g. \"llama\"); this one does not")
    return config_from_dict(d, origin=str(file))


def config_from_dict(d: dict, origin: str = "the checkpoint"):
    import transformers

    d = dict(d)
    kind = d.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(kind, **d)
    except ValueError as e:
        raise ValueError(f"--hf-config {origin}: transformers {transformers.__version__} does not know model_type {kind!r} ({e})") from None


@dataclasses.dataclass
class HFModelConfig:
    """What fp4train reads of a Hugging Face model's config, and the config itself (``hf``, as a dict)."""

    hf: dict
    vocab_size: int
    max_seq_len: int
    n_layers: int

    def to_dict(self) -> dict:
        return {"hf_config": self.hf, "vocab_size": self.vocab_size, "max_seq_len": self.max_seq_len, "n_layers": self.n_layers}


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


class HFCausalLM(nn.Module):
    """``HFCausalLM(config)(idx[, targets])`` -> logits ``[B, T, V]`` or the mean cross-entropy loss, for the
    transformers causal LM ``config`` describes (random initialization, ``hf``)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModelForCausalLM

        try:
            self.hf = AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            raise ValueError(f"--hf-config: {type(config).__name__} has no causal LM in transformers "
                             f"(AutoModelForCausalLM): {str(e).splitlines()[0][:200]}") from None
        n_layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, k)), 0)
        self.config = HFModelConfig(config.to_dict(), int(config.vocab_size), _max_positions(config) or 1 << 30, int(n_layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self, *, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.hf.get_input_embeddings().weight.numel() if non_embedding else n


#: encoder families whose causal-LM class is causal only when the config says so, and the field that says it
_DECODER_FIELD = {"xlm": "causal"}


def check_config(path: str | Path, *, seq_len: int | None = None):
    """The transformers config at ``path``, refused (``ValueError``, one line naming the field to change) unless it
    describes a causal language model fp4train can train: a decoder-only architecture with a causal LM class
    (``AutoModelForCausalLM``), a vocabulary, and positions for ``seq_len``. An encoder family that transformers also
    builds as a causal LM (BERT, RoBERTa, ...) must say so (``is_decoder``); an encoder-decoder config is refused.
    Nothing is built: the trainer calls this before it tokenizes or builds anything."""
    config = load_config(path)
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise ValueError(f"--hf-config {path}: {type(config).__name__} has no vocab_size: not a language model's config")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"--hf-config {path}: model_type {config.model_type!r} has no causal LM in transformers "
                         "(AutoModelForCausalLM); fp4train trains causal language models")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"--hf-config {path}: \"is_encoder_decoder\": true - an encoder-decoder config, and fp4train trains "
                         "decoder-only causal LMs; set it to false (and \"is_decoder\": true) to train the decoder alone")
    field = _DECODER_FIELD.get(config.model_type, "is_decoder")
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, field, False):
        raise ValueError(f"--hf-config {path}: {config.model_type!r} is an encoder (every position attends to every other), "
                         f"and \"{field}\" is not true: as a causal LM each position would see its own target; set "
                         f"\"{field}\": true in the config, or train a decoder architecture")
    limit = _max_positions(config)
    if seq_len is not None and limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the positions of --hf-config {path} ({limit}); use a shorter "
                         "--seq-len or raise max_position_embeddings (n_positions for GPT-2) in the config")
    return config


def build(path: str | Path, *, vocab_size: int, seq_len: int, log=print) -> HFCausalLM:
    """The model of the config at ``path`` (checked by :func:`check_config`) for a tokenizer of ``vocab_size`` tokens
    and sequences of ``seq_len``: a smaller vocabulary than the tokenizer's is raised to it (said in ``log``). The
    model built is probed for causality (:func:`check_causal`)."""
    config = check_config(path, seq_len=seq_len)
    if config.vocab_size < vocab_size:
        log(f"fp4train: --hf-config {path}: vocab_size {config.vocab_size} raised to the tokenizer's {vocab_size}")
        config.vocab_size = vocab_size
    model = HFCausalLM(config)
    check_causal(model, f"--hf-config {path}")
    return model


def check_causal(model: nn.Module, what: str, length: int = 8) -> None:
    """Refuse a model whose logits at a position move when a later token changes: its attention is not causal, and
    trained as a causal LM every position would see its own target. One forward of two ``length``-token sequences
    that differ in their last token, in eval mode (no dropout), on the model's device."""
    p = next(model.parameters())
    vocab = model.config.vocab_size
    idx = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(p.device)
    other = idx.clone()
    other[0, -1] = (idx[0, -1] + 1) % vocab
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a, b = model(idx).float(), model(other).float()
    finally:
        model.train(training)
    moved = (a[:, :-1] - b[:, :-1]).abs().max().item()
    if moved > 1e-3 * max(1.0, a.abs().max().item()):
        raise ValueError(f"{what}: the model's logits at earlier positions change with a later token (by {moved:.3g}): its "
                         "attention is not causal, so as a causal LM every position would see its own target; make the "
                         "config a decoder's (\"is_decoder\": true for encoder architectures)")


def from_config_dict(d: dict) -> HFCausalLM:
    """The model a checkpoint's ``model_config`` (:meth:`HFModelConfig.to_dict`) describes, freshly initialized."""
    return HFCausalLM(config_from_dict(d["hf_config"]))
