"""How a lane's hops carry activations and their gradients: the codec pairs the planner may choose from, what
each costs in loss (measured), and what each costs a hop in time (wire bytes, and encoding and decoding).

A hop between two stages sends each micro-batch's activation forward and its gradient back. In a codec pair
(FORWARD, BACKWARD) the activation travels in FORWARD and the gradient in BACKWARD. With `--compress auto` the
planner takes, for every hop of every lane, the pair that makes that hop shortest,

    x = wire bytes forward and back / 2 x seconds per byte of the link + (encode and decode work) / 2

(the mean of the two directions, as the time model counts a hop), among the pairs whose measured loss effect
is within `QUALITY_BUDGET`. A fixed `--compress FORWARD/BACKWARD` is the one pair everywhere.

`LOSS_GAP` is measured by `benchmarks/compression.py --part quality` (the `small` preset on 2 stages x 2
lanes, 600 steps, the same data, seed and weights for every pair of a seed): each pair's validation loss
against raw's, at equal tokens, averaged over two seeds (docs/compression.md). `WORK_S_PER_VALUE` is one
CPU thread's encode plus decode time per value (`--part speed`, an activation of 1 x 1024 x 1600 values); a
GPU encodes faster (int8 at 13 GB/s on the H200, about 15 times that thread: docs/pipeline.md), so on GPU
peers the planner counts more work than there is, and errs towards less compression.
"""

from __future__ import annotations

import numpy as np

from hetpeer.protocol.frame import CODECS, bytes_per_value

AUTO = ("auto", "auto")
# (forward, backward) -> validation loss over raw's - 1 at equal tokens, the mean over seeds 0 and 1
# (benchmarks/compression.py --part quality)
LOSS_GAP: dict[tuple[str, str], float] = {
    ("raw", "raw"): 0.0,
    ("bf16", "bf16"): 0.0457,
    ("int8", "int8"): 0.0345,
    ("int4", "int8"): 0.0091,
    ("int4", "int4"): 0.0160,
}
# auto takes pairs that cost at most this share of the loss: the measurement's resolution (the same pair lands
# up to 7 points apart on two seeds), so no pair measured so far is left out
QUALITY_BUDGET = 0.05
# codec -> seconds per value to encode and decode on one CPU thread (benchmarks/compression.py --part speed)
WORK_S_PER_VALUE: dict[str, float] = {"raw": 0.0, "fp16": 8.94e-10, "bf16": 6.74e-10, "int8": 5.86e-09, "int4": 1.41e-08}


def candidates(compress: tuple[str, str]) -> list[tuple[str, str]]:
    """The pairs a hop may take: the one given, or with auto those within the budget."""
    if compress == AUTO:
        return [pair for pair, gap in LOSS_GAP.items() if gap <= QUALITY_BUDGET]
    if len(compress) != 2 or any(codec not in CODECS for codec in compress):
        raise ValueError(f"compress must be auto or a (forward, backward) pair of {', '.join(CODECS)}, got {compress!r}")
    return [compress]


class HopCodecs:
    """The hop costs of `candidates(compress)` for a micro-batch of `values` values per activation in `dtype`."""

    def __init__(self, compress: tuple[str, str], values: float, dtype: str) -> None:
        self.pairs = candidates(compress)
        wire = np.array([[values * bytes_per_value(dtype, codec) for codec in pair] for pair in self.pairs])  # (P, 2)
        self.mean_bytes, self.peak_bytes = wire.mean(axis=1), wire.max(axis=1)
        self.work_s = np.array([values * sum(WORK_S_PER_VALUE[codec] for codec in pair) / 2 for pair in self.pairs])

    def cheapest(self, per_byte: np.ndarray) -> np.ndarray:
        """Each link's round-trip occupancy in its best pair, one pair at a time (for (n, n) matrices)."""
        best = self.mean_bytes[0] * per_byte + self.work_s[0]
        for mean_bytes, work_s in zip(self.mean_bytes[1:], self.work_s[1:]):
            np.minimum(best, mean_bytes * per_byte + work_s, out=best)
        return best

    def occupancy(self, per_byte: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For links of `per_byte` seconds per byte (any shape): each hop's occupancy in a round trip (the mean
        of its two directions), in the period (the larger direction), and the index of the pair chosen."""
        if len(self.pairs) == 1:
            mean = self.mean_bytes[0] * per_byte + self.work_s[0]
            return mean, self.peak_bytes[0] * per_byte + self.work_s[0], np.zeros(np.shape(per_byte), dtype=np.int64)
        each = self.mean_bytes * per_byte[..., None] + self.work_s  # (..., P)
        choice = each.argmin(axis=-1)
        mean = np.take_along_axis(each, choice[..., None], axis=-1)[..., 0]
        return mean, self.peak_bytes[choice] * per_byte + self.work_s[choice], choice
