"""Packed fixed-length sequences in a seeded, resumable order.

The token stream of a split is cut into non-overlapping windows of ``seq_len + 1`` tokens
(inputs and next-token targets; window ``i`` starts at ``i * seq_len``). Each epoch visits
every window once in the order ``randperm(n_windows)`` drawn from a generator seeded with
``(seed, epoch)``, so the order depends on the seed alone. The position is
``(epoch, cursor)``: :meth:`PackedBatches.state_dict` saves it, and a resumed run continues
the same order mid-epoch. A last partial batch of an epoch is dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from .tokens import TokenSplit


class PackedBatches:
    def __init__(self, split: TokenSplit, seq_len: int, batch_size: int, seed: int, *, rank: int = 0, world: int = 1):
        """``rank``/``world``: this process's share of each batch (data parallel): rows ``rank * b / world`` to
        ``(rank + 1) * b / world`` of the same global batch, so order and position do not depend on ``world``."""
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        if batch_size % world:
            raise ValueError(f"batch size {batch_size} does not split over {world} processes")
        self.rank, self.world = rank, world
        self.n_windows = max(0, (len(split) - 1) // seq_len)
        if self.n_windows < batch_size:
            raise ValueError(
                f"the {split.name} split has {_tokens(len(split))}: {self.n_windows} windows of {seq_len + 1}, "
                f"fewer than one batch of {batch_size}; use more data, a shorter --seq-len or a smaller --batch-size"
            )
        self.epoch, self.cursor = 0, 0
        self._perm = None

    def _order(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.n_windows, generator=g))
        return self._perm[1]

    def window_starts(self, windows: torch.Tensor) -> np.ndarray:
        return windows.numpy().astype(np.int64) * self.seq_len

    def next_windows(self) -> torch.Tensor:
        """The window indices of the next batch (advances the position)."""
        if self.cursor + self.batch_size > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
        w = self._order()[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return w

    def gather(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.split.tokens[s : s + T + 1], dtype=np.int64) for s in self.window_starts(windows)])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 ``[batch_size / world, seq_len]``: this process's rows of the next global batch."""
        w = self.next_windows()
        share = self.batch_size // self.world
        return self.gather(w[self.rank * share:(self.rank + 1) * share])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "n_windows": self.n_windows}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("seed", "seq_len", "batch_size", "n_windows"):
            if sd[k] != getattr(self, k):
                raise ValueError(f"data position was saved with {k}={sd[k]}, this run has {getattr(self, k)}; resume with the same data settings")
        self.epoch, self.cursor = sd["epoch"], sd["cursor"]


def eval_batches(split: TokenSplit, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches`` batches of windows in order (the same every evaluation)."""
    n_windows = max(0, (len(split) - 1) // seq_len)
    n = min(n_batches * batch_size, n_windows)
    if n == 0:
        raise ValueError(
            f"the validation split has {_tokens(len(split))}, too few for one window of {seq_len + 1}: give validation "
            "text with --val-data, hold out more documents with a larger --val-fraction, or use a shorter --seq-len"
        )
    loader = PackedBatches.__new__(PackedBatches)
    loader.split, loader.seq_len = split, seq_len
    out = []
    for i in range(0, n, batch_size):
        out.append(loader.gather(torch.arange(i, min(i + batch_size, n))))
    return out


def _tokens(n: int) -> str:
    return f"{n:,} token{'' if n == 1 else 's'}"
