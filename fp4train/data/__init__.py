"""Data: tokenizer, document sources, the token cache and packed, resumable batches."""

from .loader import PackedBatches, eval_batches
from .sources import expand, iter_documents, split_sources
from .tokenizer import DEFAULT as DEFAULT_TOKENIZER
from .tokenizer import TextTokenizer, load_tokenizer
from .tokens import TokenSplit, default_cache_dir, load_splits

__all__ = [
    "DEFAULT_TOKENIZER",
    "PackedBatches",
    "TextTokenizer",
    "TokenSplit",
    "default_cache_dir",
    "eval_batches",
    "expand",
    "iter_documents",
    "load_splits",
    "load_tokenizer",
    "split_sources",
]
