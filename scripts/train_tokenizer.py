"""Train fp4train's default tokenizer: a 32k byte-level BPE on the English Wikipedia shards.

    python scripts/train_tokenizer.py [--data ../shared/data/enwiki] [--vocab 32000]

Reads only the *training* shards (``train-*.jsonl.xz``; the validation shard is never seen),
trains with Hugging Face ``tokenizers`` and writes the tokenizer JSON, xz-compressed, to
``fp4train/data/assets/enwiki-bpe-32k.json.xz`` (loaded by ``fp4train.data.load_tokenizer``).
Special token: ``<|endoftext|>`` (id 0), placed between documents.
"""

from __future__ import annotations

import argparse
import glob
import json
import lzma
import os
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"


def texts(paths):
    for p in paths:
        with lzma.open(p, "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.environ.get("FP4TRAIN_ENWIKI", str(ROOT.parent / "shared/data/enwiki")))
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=ROOT / "fp4train/data/assets/enwiki-bpe-32k.json.xz")
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.data, "train-*.jsonl.xz")))
    if not paths:
        raise SystemExit(f"no train-*.jsonl.xz shards under {args.data}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    t0 = time.time()
    tok.train_from_iterator(texts(paths), trainer=trainer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(lzma.compress(tok.to_str().encode("utf-8"), preset=9))
    print(f"trained on {len(paths)} shards in {time.time() - t0:.0f}s: vocab {tok.get_vocab_size()}, wrote {args.out}")


if __name__ == "__main__":
    main()
