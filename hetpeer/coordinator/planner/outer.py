"""What outer steps cost a group, and how many steps apart (sync "outer": `peer/gossip/outer.py`).

A group with outer steps trains apart for H steps, then ring-all-reduces its stages' parameter change in
fp16 (`OUTER_CODEC`) and takes one outer step. The exchange overlaps the next D steps' compute (the plan's
`outer_delay`: the fewest steps that hide it, at most `MAX_DELAY_SHARE` of H, since an outer step that lands
later costs loss: docs/gossip.md), so it shows max(0, ring - D x step) / H a step.

H is the organizer's, or (`OUTER_AUTO`) the fewest steps that bring the ring under `TARGET` of the lane's step,
within [`MIN_EVERY`, `MAX_EVERY`]: the bounds within which outer steps were measured to train within 3% of
every-step sync (docs/gossip.md). Training apart costs steps; whether a group takes outer steps is the time
model's choice by time to loss (`quality.py` prices the steps).

Pure numpy over (K, S) arrays: one entry per grid and group.
"""

from __future__ import annotations

import numpy as np

from hetpeer.protocol.modelspec import DTYPE_BYTES
from hetpeer.protocol.plan import OUTER_CODEC

OUTER_AUTO = 0  # `outer_every` that asks the planner to choose H per group
TARGET = 0.02  # H is chosen to bring the amortised ring under this share of a step
MIN_EVERY, MAX_EVERY = 10, 50
MAX_DELAY_SHARE = 0.1  # D <= H / 10 (at least 1): at H = 50, D = 5 cost +0.8 points of loss, D = 10 +1.6, 49 +4.0


def ring_share(dtype: str) -> float:
    """The outer ring's bytes over an every-step all-reduce's (which moves parameters in the training dtype)."""
    return DTYPE_BYTES[OUTER_CODEC] / DTYPE_BYTES[dtype]


def schedule(ring_s: np.ndarray, lane_s: np.ndarray, outer_every: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, from its outer ring's seconds (K, S) and the slowest lane's seconds (K,): (the exposed seconds
    outer steps cost a step, H and D)."""
    lane = lane_s[:, None]
    if outer_every:
        h = np.full(ring_s.shape, outer_every, dtype=np.int64)
    else:
        wanted = np.ceil(ring_s / np.maximum(TARGET * lane, 1e-12))
        h = np.clip(wanted, MIN_EVERY, MAX_EVERY).astype(np.int64)
    most = np.maximum(1, np.floor(MAX_DELAY_SHARE * h)).astype(np.int64)
    d = np.minimum(most, np.ceil(ring_s / np.maximum(lane, 1e-12))).astype(np.int64)
    return np.maximum(ring_s - d * lane, 0.0) / h, h, d
