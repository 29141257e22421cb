"""Loss and perplexity of a trained checkpoint on any text: ``fp4train eval``.

The text (any source ``fp4train train --data`` reads: a file, a glob, a folder, the packaged tiny-shakespeare) is
tokenized with the run's tokenizer, each document followed by the end-of-text token, concatenated and cut into
non-overlapping windows of ``seq_len + 1`` tokens (the last partial window is dropped); the loss is the mean
next-token cross-entropy over every predicted token. Two forwards:

* ``"recipe"``: the model as it trained - the run's recipe (AdaHOP with its saved calibration, LoRA-SVD layers
  with their factors, quantized attention) on the run's backend;
* ``"bf16"``: the same weights as a plain model (LoRA-SVD merged), no quantization - what an exported model gives.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

from .export import load_checkpoint, plain_model
from . import models
from .models.llama import Llama

FORWARDS = ("recipe", "bf16")


def text_windows(data: str, tokenizer, seq_len: int, *, text_field: str = "text", max_tokens: int | None = None) -> torch.Tensor:
    """``[n, seq_len + 1]`` int64 windows of ``data``'s tokens (see the module docstring)."""
    from .data import expand, iter_documents

    ids: list[int] = []
    batch: list[str] = []

    def flush():
        ids.extend(t for doc in tokenizer.encode_batch(batch) for t in (*doc, tokenizer.eot_id))
        batch.clear()

    for src in expand(data):
        for _, text in iter_documents(src, text_field):
            batch.append(text)
            if len(batch) >= 256:
                flush()
            if max_tokens and len(ids) >= max_tokens:
                break
        flush()
        if max_tokens and len(ids) >= max_tokens:
            break
    if max_tokens:
        ids = ids[:max_tokens]
    return token_windows(np.asarray(ids, dtype=np.int64), seq_len, data)


def token_windows(ids: np.ndarray, seq_len: int, what: str) -> torch.Tensor:
    """``[n, seq_len + 1]`` int64 windows of the tokens ``ids`` (the last partial window dropped)."""
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{what}: {len(ids)} tokens, fewer than one window of {seq_len + 1}; give more text or a "
                         "smaller --seq-len")
    return torch.from_numpy(np.asarray(ids[: n * (seq_len + 1)], dtype=np.int64).reshape(n, seq_len + 1))


#: how many tokens of a run's validation split ``fp4train eval`` scores when no --data and no --max-tokens is given
VALIDATION_TOKENS = 1 << 20


def validation_windows(cfg: dict, tokenizer, seq_len: int, max_tokens: int | None) -> tuple[torch.Tensor, str]:
    """The windows of the run's own validation split (the documents its training never saw: ``--val-data``, or the
    fraction held out of ``--data``), its first ``max_tokens`` tokens (default :data:`VALIDATION_TOKENS`), and a
    phrase that says what they are."""
    from .data import load_splits

    _, val = load_splits(cfg.get("data"), cfg.get("val_data"), tokenizer, val_fraction=cfg.get("val_fraction", 0.05),
                         cache_dir=cfg.get("cache_dir"), text_field=cfg.get("text_field", "text"), verbose=False)
    limit = max_tokens or VALIDATION_TOKENS
    source = cfg.get("val_data") or f"{cfg.get('data') or 'tinyshakespeare (packaged)'}, held-out documents"
    what = f"the run's validation split ({source}; the first {min(limit, len(val)):,} of its {len(val):,} tokens)"
    return token_windows(np.asarray(val.tokens[:limit]), seq_len, what), what


def build_model(ck: dict, forward: str, device: torch.device) -> Llama:
    """The checkpoint's model for ``forward`` (see the module docstring), on ``device``, in eval mode."""
    if forward not in FORWARDS:
        raise ValueError(f"--forward must be one of {FORWARDS}, got {forward!r}")
    if forward == "bf16":
        return plain_model(ck).to(device)
    model = models.from_config_dict(ck["model_config"])
    from .adahop.calibration import Calibration
    from .conversion import convert
    from .recipes import Recipe

    recipe = Recipe.from_dict(ck["recipe"])
    calibrating = False
    if ck.get("adahop_calibration"):
        recipe = Calibration.from_dict(ck["adahop_calibration"]).recipe(recipe.name, base=recipe)
    elif recipe.calibrate:
        calibrating = True  # the run stopped before calibrating: its layers were BF16, as they stay here
    model.to(device)
    convert(model, recipe, backend=ck["config"].get("backend"), numerics=ck["config"].get("numerics"), calibrating=calibrating)
    model.load_state_dict(ck["model"])
    return model.eval()


@torch.no_grad()
def evaluate(run: str | Path, data: str | None, *, checkpoint: str | Path | None = None, trust: bool = False,
             forward: str = "recipe", seq_len: int | None = None, batch_size: int | None = None,
             max_tokens: int | None = None, device: str = "auto", log=print, progress: bool = False) -> dict:
    """``{"loss", "ppl", "tokens", ...}`` of ``run``'s checkpoint on ``data`` (see the module docstring); ``trust``: load
    ``checkpoint`` although no manifest lists it. Text the run trained on is evaluated too, with a warning that the
    loss is then not a held-out one."""
    from .data import load_tokenizer
    from .devices import resolve_device

    for name, v, low in (("--seq-len", seq_len, 1), ("--batch-size", batch_size, 1), ("--max-tokens", max_tokens, 2)):
        if v is not None and v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    ck = load_checkpoint(run, checkpoint, trust=trust)
    cfg = ck["config"]
    dev = resolve_device(device)
    seq_len = seq_len or cfg["seq_len"]
    batch_size = batch_size or cfg["batch_size"]
    if seq_len > ck["model_config"]["max_seq_len"]:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {ck['model_config']['max_seq_len']}")
    seen = trained_on(cfg, data) if data is not None else []
    if seen:
        print(f"fp4train: warning: the run trained on {', '.join(seen)}: a loss on it is not a held-out loss (--data names "
              "other text)", file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(cfg.get("tokenizer"))
    if data is None:
        windows, scored = validation_windows(cfg, tokenizer, seq_len, max_tokens)
    else:
        windows = text_windows(data, tokenizer, seq_len, text_field=cfg.get("text_field", "text"), max_tokens=max_tokens)
        scored = data
    model = build_model(ck, forward, dev)
    amp = torch.bfloat16 if dev.type == "cuda" else None
    total, n = 0.0, 0
    starts = range(0, len(windows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="eval", unit="batch", dynamic_ncols=True, mininterval=0.5, leave=False)
    for i in starts:
        w = windows[i:i + batch_size].to(dev)
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            loss = model(w[:, :-1], w[:, 1:])
        if not torch.isfinite(loss):
            raise ValueError(f"the loss is {loss.item()} on windows {i}..{i + len(w) - 1}: the checkpoint's forward is not finite")
        total += loss.float().item() * w[:, 1:].numel()
        n += w[:, 1:].numel()
    res = {"run": str(run), "step": ck["step"], "data": scored, "forward": forward,
           "recipe": ck["recipe"]["name"], "seq_len": seq_len, "tokens": n, "loss": total / n,
           "ppl": math.exp(min(total / n, 50))}
    log(f"fp4train: {res['recipe']} step {res['step']} on {res['data']} ({n:,} tokens, {forward} forward): "
        f"loss {res['loss']:.4f}, perplexity {res['ppl']:.2f}")
    return res


def trained_on(cfg: dict, data: str | None) -> list[str]:
    """The files of ``data`` that the run of config ``cfg`` trained on (its training split's files; with no
    validation data of its own, a run trains on all but a fraction of each file's documents)."""
    from .data.sources import expand, identity, split_sources

    try:
        train, _ = split_sources(cfg.get("data"), cfg.get("val_data"))
        mine = {identity(f) for f in train}
        return [Path(f).name if f != "shakespeare" else "the packaged tiny-shakespeare" for f in expand(data)
                if identity(f) in mine]
    except (ValueError, OSError):  # the run's data is no longer where it was: nothing to compare with
        return []


def generate(run: str | Path, prompt: str, **kw) -> str:
    """``prompt`` continued by the run's model: :func:`generate_pieces` joined."""
    return "".join(generate_pieces(run, prompt, **kw))


@torch.no_grad()
def generate_pieces(run: str | Path, prompt: str, *, max_new_tokens: int = 50, temperature: float = 0.8, top_k: int = 50,
                    seed: int = 0, checkpoint: str | Path | None = None, trust: bool = False, device: str = "auto"):
    """``prompt`` continued by the run's model (plain forward, LoRA-SVD merged), yielded as the text of each new token
    as it comes: top-k sampling at ``temperature`` (0: greedy), seeded. At most the model's context length of new
    tokens. A smoke look at what a model learned, not a serving path (no KV cache). Everything is checked and the
    model loaded before the first piece."""
    from .data import load_tokenizer
    from .devices import resolve_device

    if max_new_tokens < 1 or temperature < 0 or not math.isfinite(temperature) or top_k < 1:
        raise ValueError("--max-new-tokens and --top-k must be >= 1 and --temperature a finite number >= 0")
    ck = load_checkpoint(run, checkpoint, trust=trust)
    limit = ck["model_config"]["max_seq_len"]
    if max_new_tokens > limit:
        raise ValueError(f"--max-new-tokens {max_new_tokens} is more than the model's context of {limit} tokens; give at "
                         f"most {limit}")
    dev = resolve_device(device)
    model = build_model(ck, "bf16", dev)
    tokenizer = load_tokenizer(ck["config"].get("tokenizer"))
    ids = tokenizer.encode_batch([prompt])[0] or [tokenizer.eot_id]
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.tensor([ids], device=dev)
    shown = ""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -limit:])[0, -1].float()
        if temperature == 0:
            nxt = logits.argmax()
        else:
            vals, pos = logits.topk(min(top_k, logits.numel()))
            nxt = pos[torch.multinomial(torch.softmax(vals / temperature, -1), 1, generator=g)[0]]
        if nxt.item() == tokenizer.eot_id:
            break
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
        text = tokenizer.decode(idx[0, len(ids):].tolist())  # whole: a token may end inside a character
        if text.startswith(shown) and not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
    text = tokenizer.decode(idx[0, len(ids):].tolist())
    if text != shown and text.startswith(shown):
        yield text[len(shown):]
