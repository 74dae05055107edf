"""The order a swarm reads its training windows in: without replacement, whatever the plan's shape.

A corpus is a list of shards of tokens; shard s holds `counts[s]` windows of `seq_len + 1` tokens (window i
is tokens [i L, i L + L + 1), so consecutive windows share one token: the label of one is the first input
of the next). The swarm reads one sequence of window positions 0, 1, 2, ...: step t of a plan that starts
at step S with data position P reads positions [P + (t - S) R, P + (t - S + 1) R), R being the plan's rows a
step (every lane's sequences), lane l the l-th slice of them (`Plan.lane_offset`). Position p is window
`locate(p)` of epoch p // W (W windows in all): each epoch visits every window exactly once, so a swarm that
carries P through its plan changes and checkpoints neither repeats nor skips one.

Within an epoch the shards are visited in an order drawn from (seed, epoch), in blocks of `block_shards`
consecutive shards whose windows are shuffled together (drawn from (seed, epoch, block)): a peer needs only
the block's shards while it reads it, and the next block's before it gets there, never the whole corpus
(MosaicML Streaming's shuffle blocks are the same idea). `locate` of n positions costs O(n log shards)
after a block's permutation (O(block windows)) is drawn; the last few blocks' are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

BLOCK_SHARDS = 4  # shards whose windows are shuffled together
KEPT_BLOCKS = 4  # block permutations kept, so that steps reading across a block's end draw none again


class OrderError(ValueError):
    """Shard window counts or positions that give no order."""


class WindowOrder:
    """Positions -> (shard, window) for shards holding `counts` windows each, reproducible from `seed`."""

    def __init__(self, counts: Sequence[int], seed: int = 0, block_shards: int = BLOCK_SHARDS) -> None:
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 1 or counts.size == 0 or (counts < 0).any():
            raise OrderError(f"window counts must be a non-empty list of counts >= 0, got {counts.tolist()}")
        if block_shards < 1 or seed < 0:
            raise OrderError(f"block_shards must be >= 1 and seed >= 0, got {block_shards}, {seed}")
        self.counts, self.seed, self.block_shards = counts, int(seed), int(block_shards)
        self.windows = int(counts.sum())
        if self.windows == 0:
            raise OrderError("no shard holds a whole window: the corpus is shorter than one sequence and its label")
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def locate(self, positions: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The shard and the window within it of each position (int64 arrays shaped like `positions`)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise OrderError(f"positions must be >= 0, got {int(positions.min())}")
        shards = np.empty_like(positions)
        windows = np.empty_like(positions)
        flat = positions.reshape(-1)
        for epoch in np.unique(flat // self.windows):
            chosen = np.flatnonzero(flat // self.windows == epoch)
            s, w = self._locate_in_epoch(int(epoch), flat[chosen] % self.windows)
            shards.reshape(-1)[chosen], windows.reshape(-1)[chosen] = s, w
        return shards, windows

    def blocks_at(self, position: int) -> tuple[list[int], list[int]]:
        """The shards of the block that `position` is in, and of the block after it (the next epoch's first, after
        an epoch's last): what a peer reading there needs now, and soon."""
        epoch, rank = divmod(position, self.windows)
        shard_order, block_ends = self._epoch(epoch)
        block = int(np.searchsorted(block_ends, rank, side="right"))
        members = lambda order, b: [int(s) for s in order[b * self.block_shards : (b + 1) * self.block_shards]]
        if block + 1 < block_ends.size:
            return members(shard_order, block), members(shard_order, block + 1)
        return members(shard_order, block), members(self._epoch(epoch + 1)[0], 0)

    def _locate_in_epoch(self, epoch: int, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard_order, block_ends = self._epoch(epoch)
        blocks = np.searchsorted(block_ends, ranks, side="right")
        shards = np.empty_like(ranks)
        windows = np.empty_like(ranks)
        for block in np.unique(blocks):
            chosen = np.flatnonzero(blocks == block)
            first_shard = int(block) * self.block_shards
            members = shard_order[first_shard : first_shard + self.block_shards]
            block_start = int(block_ends[block - 1]) if block > 0 else 0
            picked = self._block(epoch, int(block), int(block_ends[block]) - block_start)[ranks[chosen] - block_start]
            member_ends = np.cumsum(self.counts[members])
            member = np.searchsorted(member_ends, picked, side="right")
            shards[chosen] = members[member]
            windows[chosen] = picked - np.concatenate([[0], member_ends])[member]
        return shards, windows

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and the running window count at each block's end."""
        if epoch not in self._epochs:
            shard_order = np.random.default_rng([self.seed, epoch]).permutation(self.counts.size)
            per_block = np.add.reduceat(self.counts[shard_order], np.arange(0, self.counts.size, self.block_shards))
            self._epochs[epoch] = (shard_order, np.cumsum(per_block))
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _block(self, epoch: int, block: int, size: int) -> np.ndarray:
        key = (epoch, block)
        if key not in self._blocks:
            self._blocks[key] = np.random.default_rng([self.seed, epoch, block, 1]).permutation(size)
            while len(self._blocks) > KEPT_BLOCKS:
                self._blocks.popitem(last=False)
        self._blocks.move_to_end(key)
        return self._blocks[key]

