"""Tokenizers: the packaged 32k byte-level BPE (trained on enwiki), a tokenizer file, or a Hub name."""

from __future__ import annotations

import hashlib
import lzma
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT = "enwiki-bpe-32k"
_EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the facts the data pipeline needs."""

    tok: object
    name: str
    fingerprint: str  # sha256 of the tokenizer JSON: part of every token-cache key
    eot_id: int

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    """``None``/``"enwiki-bpe-32k"``: the packaged BPE; a ``.json``/``.json.xz`` path; else a Hub name."""
    from tokenizers import Tokenizer

    spec = spec or DEFAULT
    if spec == DEFAULT:
        text = lzma.decompress((ASSETS / "enwiki-bpe-32k.json.xz").read_bytes()).decode("utf-8")
    elif Path(spec).is_file():
        raw = Path(spec).read_bytes()
        text = (lzma.decompress(raw) if spec.endswith(".xz") else raw).decode("utf-8")
    elif spec.endswith((".json", ".xz")):
        raise FileNotFoundError(f"tokenizer file {spec!r} does not exist")
    else:
        try:
            tok = Tokenizer.from_pretrained(spec)
        except Exception as e:  # network or name problems
            raise ValueError(
                f"could not load tokenizer {spec!r} from the Hugging Face Hub ({e}). Give a local "
                f"tokenizer.json path, or use the packaged {DEFAULT!r}"
            ) from e
        text = tok.to_str()
    tok = Tokenizer.from_str(text)
    eot = next((tok.token_to_id(t) for t in _EOT_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eot is None:
        raise ValueError(f"tokenizer {spec!r} has none of the end-of-text tokens {_EOT_CANDIDATES}; add one")
    return TextTokenizer(tok, spec, hashlib.sha256(text.encode("utf-8")).hexdigest()[:16], eot)
