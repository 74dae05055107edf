"""Training data from a prepared corpus (`hetpeer data prepare`): windows read from memory-mapped shards.

`ShardedCorpus.batch(position, n, L)` gives the windows at positions [position, position + n) of the
swarm's order (`order.py`) over every training shard's windows of L + 1 tokens. Each window is one `pread`
from its shard's file (at most `OPEN_SHARDS` files open at a time): nothing of a shard is held in the
peer's memory but the windows of the batch, so its memory stays flat however large the corpus (the
kernel's page cache keeps what it reads often). The shards of the order's block it reads and of the next
one are fetched in the background, and kept from the cache's eviction. Validation windows come from the validation shards, the same ones
every time: documents `prepare` set aside, never in a training shard (a corpus prepared without any
holds out its last training shard instead, the same on every peer).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from hetpeer.peer.data.corpus import Batch, CorpusError
from hetpeer.peer.data.fetch import ShardStore
from hetpeer.protocol.dataset import Shard
from hetpeer.peer.data.order import BLOCK_SHARDS, WindowOrder

OPEN_SHARDS = 2 * BLOCK_SHARDS
VALIDATION_SEED = 1 << 30  # validation's order is its own, apart from every training seed


class ShardedCorpus:
    """The training and validation windows of a prepared corpus held in `store`."""

    def __init__(self, store: ShardStore, source: str) -> None:
        self.store, self.source = store, source
        self.manifest = store.manifest
        self.vocab = self.manifest.vocab
        # a corpus prepared with no validation document holds out its last training shard instead (every peer alike)
        self.train, self.held_out = self.manifest.train, self.manifest.validation
        if not self.held_out and len(self.train) > 1:
            self.train, self.held_out = self.train[:-1], self.train[-1:]
        self._orders: dict[tuple[str, int, int], WindowOrder] = {}
        self._files: OrderedDict[str, int] = OrderedDict()  # shard file -> an open descriptor

    @property
    def description(self) -> str:
        return f"{self.manifest.describe()}, dataset {self.store.name[:16]}... from {self.source}"

    def windows(self, seq_len: int) -> int:
        """Training windows of `seq_len` + 1 tokens: one epoch of the swarm's order."""
        return int(sum(_windows(s, seq_len) for s in self.train))

    def batch(self, position: int, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        if position < 0 or sequences < 1 or seq_len < 1 or seed < 0:
            raise CorpusError(f"position and seed must be >= 0, sequences and seq_len >= 1; got {position}, {sequences}, "
                              f"{seq_len}, {seed}")
        order = self._order("train", seq_len, seed)
        shards, windows = order.locate(np.arange(position, position + sequences))
        now, after = order.blocks_at(position + sequences - 1)
        # open files need no pin: a descriptor outlives its file's deletion
        self.store.pin([self.train[s].file for s in {*shards.tolist(), *now, *after}])
        self.store.prefetch(self.train[s] for s in [*now, *after])
        return self._read(self.train, shards, windows, seq_len)

    def validation_batch(self, sequences: int, seq_len: int, seed: int = 0) -> Batch:
        if not self.held_out:
            raise CorpusError(f"the prepared corpus {self.source} holds no validation shard and only one training shard to "
                              "hold out: prepare more text, or with --validation above 0")
        shards, windows = self._order("validation", seq_len, VALIDATION_SEED + seed).locate(np.arange(sequences))
        return self._read(self.held_out, shards, windows, seq_len)

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])
        self.store.close()

    def _order(self, split: str, seq_len: int, seed: int) -> WindowOrder:
        key = (split, seq_len, seed)
        if key not in self._orders:
            group = self.train if split == "train" else self.held_out
            counts = [_windows(s, seq_len) for s in group]
            if not sum(counts):
                raise CorpusError(f"no {split} shard of {self.source} holds {seq_len + 1} tokens, one sequence and its label")
            self._orders[key] = WindowOrder(counts, seed)
        return self._orders[key]

    def _read(self, group: tuple[Shard, ...], shards: np.ndarray, windows: np.ndarray, seq_len: int) -> Batch:
        dtype = self.manifest.numpy_dtype
        size = (seq_len + 1) * dtype.itemsize
        rows = np.empty((shards.size, seq_len + 1), dtype=np.int64)
        for row, (s, w) in enumerate(zip(shards.tolist(), windows.tolist())):
            data = os.pread(self._open(group[s]), size, w * seq_len * dtype.itemsize)
            if len(data) != size:
                raise CorpusError(f"shard {group[s].file} ended early: it is shorter than its manifest says")
            rows[row] = np.frombuffer(data, dtype=dtype.newbyteorder("<"))
        return Batch(rows[:, :-1], rows[:, 1:])

    def _open(self, shard: Shard) -> int:
        if shard.file not in self._files:
            self._files[shard.file] = os.open(self.store.path(shard), os.O_RDONLY)
            while len(self._files) > OPEN_SHARDS:
                os.close(self._files.popitem(last=False)[1])
        self._files.move_to_end(shard.file)
        return self._files[shard.file]


def _windows(shard: Shard, seq_len: int) -> int:
    return max(0, (shard.tokens - 1) // seq_len)
