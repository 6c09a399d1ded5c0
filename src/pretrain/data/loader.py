"""Fixed-length training windows from the token shards, in a deterministic seeded order.

The position in the data is one number: global samples consumed. Sample ``i`` is window
``perm_e[i mod n]`` with ``e = i div n`` and ``perm_e`` a permutation seeded by (seed, e),
so any process can compute any sample; a data-parallel rank takes its slice of every global
batch by index. The position is therefore the same whatever the layout, and resumes exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pretrain.data.errors import DataError
from pretrain.data.prepare import load_index

log = logging.getLogger("pretrain")


def check_shard(path: Path, entry: dict, dtype: np.dtype) -> None:
    """A shard file holds exactly the tokens its index entry says, or DataError naming the
    file and the command that rebuilds it (a truncated shard would otherwise train on what
    is left, an odd byte count or an empty file fail inside numpy)."""
    file = path / entry["file"]
    fix = (f"prepare the data again: move {path} aside and run "
           f"`python tools/prepare_data.py data=...` with the run's data settings")
    if not file.exists():
        raise DataError(f"{file} is missing (listed in {path / 'index.json'}); {fix}")
    size, expected = file.stat().st_size, int(entry.get("tokens", -1)) * dtype.itemsize
    if expected >= 0 and size != expected:
        raise DataError(
            f"{file} holds {size:,} bytes where {path / 'index.json'} says "
            f"{entry['tokens']:,} {dtype.name} tokens ({expected:,} bytes): the shard is "
            f"truncated or damaged; {fix}")


def check_vocab(path: Path, index: dict, vocab_size: int) -> None:
    """DataError when the data's token ids do not fit model.vocab_size."""
    if index["max_token_id"] >= vocab_size:
        raise DataError(
            f"the data in {path} has token ids up to {index['max_token_id']} (tokenizer "
            f"vocabulary {index['vocab_size']}) but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={index['vocab_size']} (or a larger padded size)")


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets)."""

    def __init__(self, path: str | Path, split: str, seq_len: int, seed: int = 0,
                 shuffle: bool = True, stream: int | None = None):
        self.path = Path(path)
        index = load_index(self.path)
        if split not in index["splits"]:
            raise DataError(f"{self.path} has no '{split}' split (has {list(index['splits'])})")
        self.index = index
        self.split = split
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        # a mixture's source k draws its own order: seeded by (seed, k, epoch)
        self.key = [seed] if stream is None else [seed, stream]
        dtype = np.dtype(index["dtype"])
        entries = index["splits"][split]["shards"]
        for entry in entries:
            check_shard(self.path, entry, dtype)
        self.shards = [np.memmap(self.path / s["file"], dtype=dtype, mode="r") for s in entries]
        counts = np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.n_windows = int(self.starts[-1])
        if self.n_windows == 0:
            tokens = sum(len(s) for s in self.shards)
            raise DataError(
                f"the '{split}' split of {self.path} has {tokens} tokens, fewer than one window "
                f"of model.seq_len+1={seq_len + 1}; use more data or a shorter model.seq_len"
            )
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def text_bytes(self) -> tuple[int, int] | None:
        """(tokens, UTF-8 bytes of the text they stand for) of this split, as preparation
        counted them (tokens include each document's EOS, bytes only its text); None for
        data prepared before preparation counted bytes."""
        entry = self.index["splits"][self.split]
        nbytes = entry.get("bytes")
        return (int(entry["tokens"]), int(nbytes)) if nbytes else None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([*self.key, epoch])
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def window(self, sample: int) -> np.ndarray:
        epoch, j = divmod(sample, self.n_windows)
        w = int(self._order(epoch)[j]) if self.shuffle else j
        shard = int(np.searchsorted(self.starts, w, side="right") - 1)
        off = (w - int(self.starts[shard])) * self.seq_len
        return self.shards[shard][off: off + self.seq_len + 1]

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples start .. start+count-1 as (inputs, targets), int64, shape (count, seq_len)."""
        rows = np.stack([self.window(start + i) for i in range(count)]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]
