"""Lanes of unlike speed: how many of a step's micro-batches each lane takes, so that they finish together.

A lane of S stages under 1F1B takes T(M) = C + (M - 1) P(M) + E for M micro-batches (`timemodel.py`): C its round
trip, P its period (its bottleneck; once M > S also a round trip per S micro-batches), E what it does once a step
beyond them (a tied head's exchange). T grows with M, so giving each of the step's N micro-batches in turn to the
lane that would finish it soonest minimises the slowest lane, the step. The same answer comes from the level:
the least t by which the lanes' further micro-batches (each lane's first is its own, whatever it costs) make up
the rest of the N, each lane as many as finish by t. That level is found by bisection, for every grid of a batch
at once, in O(K m log(1 / tolerance)).

A lane takes at least one micro-batch (a lane with nothing to do would be a device on standby) and, where the
even split gives lanes fewer micro-batches than stages, no more than the even split: the memory model counts the
activations of min(M, S - s) micro-batches in flight at stage s, and a lane past the even M would hold more.

Pure numpy; no I/O.
"""

from __future__ import annotations

import numpy as np

# Halvings of the level's bracket (from 0 to the even split's step): to 1/4096 of it. The lanes' micro-batches that
# end inside what is left of the bracket are a few too many, which the fix-up after it gives back, latest first.
BISECTIONS = 12
ROUNDING = 1e-9  # of a micro-batch's time: what floating point may take off a lane's time at the level
TINY_S = 1e-30  # a period no lane has: keeps a zero one from dividing


def lane_times(round_trip: np.ndarray, period: np.ndarray, ends: np.ndarray, micro: np.ndarray, stages: int) -> np.ndarray:
    """Seconds of lanes (...) taking `micro` (...) micro-batches each."""
    beyond = np.maximum(period, round_trip / stages)  # past S micro-batches, a round trip per S of them
    return round_trip + (micro - 1) * np.where(micro > stages, beyond, period) + ends


def _holding(round_trip: np.ndarray, period: np.ndarray, ends: np.ndarray, stages: int, cap: float):
    """held(level): the micro-batches each lane (..., m) finishes by `level` (..., 1), the M with T(M) <= level, at
    most `cap` (a micro-batch that ends within rounding of the level counts as finished by it)."""
    start = round_trip + ends
    per_period = 1 / np.maximum(period, TINY_S)
    per_beyond = 1 / np.maximum(np.maximum(period, round_trip / stages), TINY_S)

    def held(level: np.ndarray) -> np.ndarray:
        room = level - start
        low = np.minimum(np.maximum(np.floor(room * per_period + ROUNDING) + 1, 0), stages)  # M <= S, at the period
        high = np.maximum(np.floor(room * per_beyond + ROUNDING) + 1 - stages, 0)  # M > S: only once all S fit
        return np.minimum(low + high, cap)

    return held


def allocate(round_trip: np.ndarray, period: np.ndarray, ends: np.ndarray, stages: int, total: int,
             even: int) -> np.ndarray:
    """Micro-batches per lane (..., m), `total` in all on each leading index, that minimise the slowest lane's time
    (`lane_times`); `even` is what each lane takes in the even split, at least total / m."""
    m = round_trip.shape[-1]
    if m == 1:
        return np.full(round_trip.shape, total, dtype=np.int64)
    cap = float(even) if even < stages else float(total - m + 1)
    held = _holding(round_trip, period, ends, stages, cap)
    # Each lane's first micro-batch is its own whatever it costs (at least one each): the level is where the lanes'
    # further ones, taken in the order they would finish, make up the rest.
    low = np.zeros(round_trip.shape[:-1] + (1,))
    high = lane_times(round_trip, period, ends, np.minimum(even, cap) * np.ones(round_trip.shape), stages).max(
        axis=-1, keepdims=True)  # the even split's: it holds them all
    for _ in range(BISECTIONS):
        middle = 0.5 * (low + high)
        enough = np.maximum(held(middle), 1).sum(axis=-1, keepdims=True) >= total
        high, low = np.where(enough, middle, high), np.where(enough, low, middle)
    micro = np.maximum(held(high), 1).astype(np.int64)
    # Past the level the lanes hold a few more than `total`: the latest to finish give one back each, as often as it
    # takes (and where rounding left them short, the lanes that would finish another soonest take it). Each round
    # moves at least one lane of every index still off: the caps leave room both ways.
    while True:
        excess = micro.sum(axis=-1, keepdims=True) - total
        if not excess.any():
            break
        slowest = np.where(micro > 1, lane_times(round_trip, period, ends, micro, stages), -np.inf)
        soonest = np.where(micro < cap, lane_times(round_trip, period, ends, micro + 1, stages), np.inf)
        give = _ranks(-slowest) < excess
        take = _ranks(soonest) < -excess
        micro = micro - (give & (micro > 1)) + (take & (micro < cap))
    return micro


def _ranks(values: np.ndarray) -> np.ndarray:
    """Each value's place (0 first) in ascending order along the last axis, ties by position."""
    return np.argsort(np.argsort(values, axis=-1, kind="stable"), axis=-1, kind="stable")


def sequences(micro: np.ndarray, micro_batch: int, batch: int, finish: np.ndarray) -> np.ndarray:
    """Sequences per lane (m,) from its micro-batches (m,) of `micro_batch`: `batch` in all, the one partial
    micro-batch (where micro-batches do not divide the batch) on the lane that finishes last (`finish`, (m,))."""
    share = micro * micro_batch
    share[int(np.argmax(finish))] -= int(share.sum()) - batch
    return share
