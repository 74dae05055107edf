"""Where a group pays for outer steps, and how many steps apart (sync "outer": `peer/gossip/outer.py`).

A group with outer steps trains apart for H steps, then ring-all-reduces its stages' parameter change in
fp16 (`OUTER_CODEC`) and takes one outer step. The exchange overlaps the next D steps' compute (the plan's
`outer_delay`: the fewest steps that hide it, at most `MAX_DELAY_SHARE` of H, since an outer step that lands
later costs loss: docs/gossip.md), so it shows max(0, ring - D x step) / H a step. Training apart costs quality that every-step sync does not (docs/gossip.md measures it
by H), so the planner spends it only where every-step sync is a real share of the step:

- `auto` sync with outer steps allowed (`outer_every` given) takes them for a group whose best
  every-step sync shows more than `WORTH` of the lane's step, when they cost less;
- H is the organizer's, or (`OUTER_AUTO`) the fewest steps that bring the ring under `TARGET` of the
  lane's step, within [`MIN_EVERY`, `MAX_EVERY`]: the bounds within which outer steps were measured to
  train within 3% of every-step sync (docs/gossip.md).

Pure numpy over (K, S) arrays: one entry per grid and group.
"""

from __future__ import annotations

import numpy as np

from hetpeer.protocol.modelspec import DTYPE_BYTES
from hetpeer.protocol.plan import OUTER_CODEC

OUTER_AUTO = 0  # `outer_every` that asks the planner to choose H per group
WORTH = 0.10  # every-step sync must show more than this share of a step before outer steps are worth their quality
TARGET = 0.02  # H is chosen to bring the amortised ring under this share of a step
MIN_EVERY, MAX_EVERY = 10, 50
MAX_DELAY_SHARE = 0.1  # D <= H / 10 (at least 1): at H = 50, D = 5 cost +0.8 points of loss, D = 10 +1.6, 49 +4.0


def ring_share(dtype: str) -> float:
    """The outer ring's bytes over an every-step all-reduce's (which moves parameters in the training dtype)."""
    return DTYPE_BYTES[OUTER_CODEC] / DTYPE_BYTES[dtype]


def choose(
    every_s: np.ndarray, ring_s: np.ndarray, lane_s: np.ndarray, sync: str, outer_every: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group, from its every-step sync's exposed seconds, its outer ring's seconds (both (K, S)) and the
    slowest lane's seconds (K,): (exposed sync seconds, whether it takes outer steps, H and D (0 where not))."""
    if outer_every is None and sync != "outer":
        none = np.zeros(every_s.shape, dtype=np.int64)
        return every_s, np.zeros(every_s.shape, dtype=bool), none, none
    lane = lane_s[:, None]
    if outer_every:
        h = np.full(every_s.shape, outer_every, dtype=np.int64)
    else:
        wanted = np.ceil(ring_s / np.maximum(TARGET * lane, 1e-12))
        h = np.clip(wanted, MIN_EVERY, MAX_EVERY).astype(np.int64)
    most = np.maximum(1, np.floor(MAX_DELAY_SHARE * h)).astype(np.int64)
    d = np.minimum(most, np.ceil(ring_s / np.maximum(lane, 1e-12))).astype(np.int64)
    amortised = np.maximum(ring_s - d * lane, 0.0) / h
    if sync == "outer":
        use = ring_s > 0  # every group of more than one
    else:
        use = (every_s > WORTH * lane) & (amortised < every_s)
    return np.where(use, amortised, every_s), use, np.where(use, h, 0), np.where(use, d, 0)
