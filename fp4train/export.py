"""A trained run's weights as a plain model: fp4train's Llama, or a Hugging Face ``LlamaForCausalLM`` folder.

``load_model(run)`` rebuilds the run's model from a checkpoint with plain ``nn.Linear`` layers: the weights as
trained, LoRA-SVD layers merged into one weight (``W_res + beta * B A``). ``export_hf(run, out)`` writes that
model as a Hugging Face folder - ``config.json``, ``model.safetensors`` and the run's tokenizer - which
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads with the same logits as fp4train's forward (the
module names and the rotate-half RoPE are Hugging Face Llama's).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .linear.lora_svd import RESIDUAL
from . import models
from .models.llama import Llama, LlamaConfig


def load_checkpoint(run: str | Path, checkpoint: str | Path | None = None, *, trust: bool = False) -> dict:
    """The newest verified checkpoint of ``run`` (or ``checkpoint``; ``trust``: although no manifest lists it), on the
    CPU; a sharded one with its model's whole tensors read from the shards (the optimizer's are not needed here)."""
    from .checkpoint import MANIFEST, Checkpoints, read_tensors

    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"--run {run} is not a run directory (fp4train train --out DIR writes one)")
    if checkpoint is None and not (run / MANIFEST).exists():
        runs = sorted(p.name for p in (run / "runs").iterdir() if p.is_dir()) if (run / "runs").is_dir() else []
        if runs:
            raise ValueError(f"--run {run} is a comparison's folder: give one of its runs, e.g. --run {run / 'runs' / runs[0]} "
                             f"({', '.join(runs[:6])}{', ...' if len(runs) > 6 else ''})")
        raise ValueError(f"--run {run} holds no checkpoint (no {MANIFEST}): give the --out of an fp4train train run that "
                         "wrote one, or --checkpoint FILE")
    ck = Checkpoints(run, choose_with="--checkpoint").load(checkpoint, trust=trust)
    if "sharded" in ck:
        ck["model"] = read_tensors(ck["sharded"], "model")
    return ck


def merged_state_dict(ck: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights with every LoRA-SVD layer merged: its ``weight`` holds ``W`` (the residual and
    the factors dropped); in a checkpoint from before the residual had a key of its own, ``weight`` is the residual:
    ``weight <- weight + beta * lora_b @ lora_a``."""
    sd = dict(ck["model"])
    beta = ((ck.get("recipe") or {}).get("lora_svd") or {}).get("beta", 1.0)
    for key in [k for k in sd if k.endswith(".lora_a")]:
        base = key[: -len(".lora_a")]
        a, b = sd.pop(key), sd.pop(base + ".lora_b")
        if sd.pop(base + "." + RESIDUAL, None) is None:
            w = sd[base + ".weight"]
            sd[base + ".weight"] = (w.float() + beta * (b.float() @ a.float())).to(w.dtype)
    return sd


def plain_model(ck: dict) -> Llama:
    """The checkpoint's model with plain linears and the trained weights (LoRA-SVD merged), FP32, in eval mode."""
    model = models.from_config_dict(ck["model_config"])
    model.load_state_dict({k: v.float() for k, v in merged_state_dict(ck).items()})
    return model.eval()


def load_model(run: str | Path, checkpoint: str | Path | None = None, *, trust: bool = False) -> tuple[Llama, dict]:
    """(the run's :func:`plain_model`; the checkpoint)."""
    ck = load_checkpoint(run, checkpoint, trust=trust)
    return plain_model(ck), ck


def hf_config(cfg: LlamaConfig, eot_id: int):
    """The transformers config of an fp4train Llama: ``LlamaConfig``, or ``MixtralConfig`` for a mixture of experts
    (the same module names and router arithmetic)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import MixtralConfig

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
                  bos_token_id=eot_id, eos_token_id=eot_id)
    if cfg.n_experts:
        return MixtralConfig(**common, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                             router_aux_loss_coef=cfg.router_aux_loss_coef, sliding_window=None)
    return HFLlamaConfig(**common, attention_bias=False, mlp_bias=False)


def export_hf(run: str | Path, out: str | Path, *, checkpoint: str | Path | None = None, trust: bool = False,
              dtype: str = "bfloat16") -> Path:
    """Write ``run``'s trained model as a Hugging Face ``LlamaForCausalLM`` (``MixtralForCausalLM``: a mixture of
    experts) folder ``out`` (new or empty). It is
    written beside ``out`` under a temporary name and renamed when complete: ``out`` holds a whole export or none.
    The files take the permissions the process's umask gives."""
    try:
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        raise ValueError(f"export writes a Hugging Face folder and needs transformers: pip install 'fp4train[hf]' ({e})") from e
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty; export into a new or empty folder")
    missing = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    created = missing[-1] if missing else None  # the topmost folder above --out made here (removed if the export fails)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise ValueError(f"--out {out} cannot be written: {e.strerror or e}") from None
    try:
        model, ck = load_model(run, checkpoint, trust=trust)
        from .data import load_tokenizer

        tok = load_tokenizer(ck["config"].get("tokenizer"))
        if tok.vocab_size > model.config.vocab_size:
            raise ValueError(f"the run's tokenizer has {tok.vocab_size} tokens but the model {model.config.vocab_size}")
        if isinstance(model, Llama):
            hf = AutoModelForCausalLM.from_config(hf_config(model.config, tok.eot_id))
            sd = {k if k.startswith("lm_head") else f"model.{k}": v for k, v in model.state_dict().items()}
            missing, unexpected = hf.load_state_dict(sd, strict=False)
            missing = [k for k in missing if not (model.config.tie_embeddings and k == "lm_head.weight")]
            if missing or unexpected:
                raise RuntimeError(f"export: the Hugging Face model does not match fp4train's (missing {missing}, unexpected {unexpected})")
        else:  # trained from --hf-config: the model is a Hugging Face one already
            hf = model.hf
        hf.to(getattr(torch, dtype))
        hf.save_pretrained(tmp, safe_serialization=True)
        eot = tok.tok.id_to_token(tok.eot_id)
        PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=eot, bos_token=eot).save_pretrained(tmp)
        _umask_permissions(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


def _umask_permissions(folder: Path) -> None:
    """Give every file in ``folder`` the mode a new file gets under this process's umask (some writers create
    theirs owner-only, through a temporary file)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)
