"""Peers that compute on one device: how much each is slowed when the plan makes them compute at once.

Several peers can share one device: `hetpeer swarm` runs eight on one machine's CPU cores, and a GPU
can hold a few peers' processes. Each announces the device's opaque key (`PeerRecord.compute_key`) and
its share of it (`compute_share`): the fraction of the device it uses computing flat out at its own
pace (its threads over the cores it may run on, or 1 for a GPU; divided by an emulated slowdown, as a
slowed peer sleeps the rest of its time). Its measured TFLOPS are what it achieves alone.

Other work takes part of a shared device whether its peers train or not (their control planes, DHT
processes, a coordinator beside them): its peers measure that background load before the swarm's first
plan (`PeerRecord.compute_background`), and the rest is the device's capacity for training. While the
peers of one device that a plan puts to work ask for more than that capacity, it is shared out max-min
fairly (water-filling): every peer gets min(share, level), the level set so that the grants sum to the
capacity, and a peer is slowed by share / grant. Peers asking less than the level
run at their own pace: a slowed peer's sleep absorbs what the others take from it. The model assumes
they all compute at once, as lanes of one stage do; time one of them spends waiting on a transfer is
time the others get more, which it does not count (a bound, on the safe side).

`Sharing` holds the grouping for a problem; `slowdowns` evaluates it for batches of grids, in
O(K (n + cells log cells)) for K grids, and nothing at all for a problem whose peers each have their own device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def fair_level(demand: np.ndarray, capacity: np.ndarray | float = 1.0) -> np.ndarray:
    """Per row of `demand` (..., k): the level at which a device's `capacity` (...) is shared max-min fairly
    among the demands (each peer gets min(demand, level), summing to the capacity), or inf where the row fits.
    Zeros are peers not computing. O(k log k) a row."""
    demand = np.asarray(demand, dtype=float)
    capacity = np.asarray(capacity, dtype=float)
    ordered = np.sort(demand, axis=-1)
    k = demand.shape[-1]
    below = np.cumsum(ordered, axis=-1) - ordered  # demand of the peers below each position
    candidates = (capacity[..., None] - below) / (k - np.arange(k))  # the level if the peers from each position up are capped
    # the level is the candidate at the first position whose demand exceeds it
    capped = ordered > candidates
    first = np.where(capped.any(axis=-1), capped.argmax(axis=-1), k - 1)
    level = np.take_along_axis(candidates, first[..., None], axis=-1)[..., 0]
    return np.where(demand.sum(axis=-1) <= capacity, np.inf, level)


@dataclass(frozen=True, slots=True, eq=False)
class Sharing:
    """Which devices of a problem share one compute device. `group[i]` is device i's shared device
    (0..groups-1), or -1 for one that has its own; `share[i]` its share of it; `capacity[g]` what of shared
    device g is left to training by the other work on it."""

    group: np.ndarray  # (n,) int
    share: np.ndarray  # (n,) float in (0, 1]
    capacity: np.ndarray  # (groups,) float in (0, 1]
    # per shared device its devices' indices, a row each padded with -1: every batch of grids evaluates all
    # shared devices at once (a swarm of 10,000 peers two to a machine has 5,000 of them)
    members: np.ndarray = field(init=False, repr=False)  # (groups, most devices on one) int

    def __post_init__(self) -> None:
        order = np.argsort(self.group, kind="stable")
        order = order[self.group[order] >= 0]
        bounds = np.searchsorted(self.group[order], np.arange(len(self.capacity) + 1))
        sizes = np.diff(bounds)
        members = np.full((len(self.capacity), int(sizes.max(initial=0))), -1, dtype=np.int64)
        rows = np.repeat(np.arange(len(sizes)), sizes)
        members[rows, np.arange(len(order)) - bounds[rows]] = order
        object.__setattr__(self, "members", members)

    @staticmethod
    def from_keys(
        keys: Sequence[str | None], shares: Sequence[float], backgrounds: Sequence[float] | None = None,
        owns: Sequence[float] | None = None,
    ) -> "Sharing | None":
        """The grouping of peers by announced device key; None when no two peers share one (the common case:
        the planner then pays nothing for it). A shared device's capacity is 1 less the load that is not its
        peers' own: the median of what its peers measured busy (each its `backgrounds` plus its `owns`, in [0, 1);
        none: 0; one peer's figure does not set it) less what they all announced as their own processes'.
        Before a first plan that is their starting, device timing and link probes, which stop when they train:
        the 8 peers of `benchmarks/vs_hivemind.py` on 2 cores each read 62% to 68% other work, while the work
        that stayed as 5 of them trained (their DHT daemons, the coordinator) was about 30%, and the plan
        that counted 65% left 4 of them on standby."""
        counts = Counter(k for k in keys if k is not None)
        shared = sorted(k for k, count in counts.items() if count > 1)
        if not shared:
            return None
        index = {k: g for g, k in enumerate(shared)}
        group = np.array([index.get(k, -1) if k is not None else -1 for k in keys], dtype=np.int64)
        share = np.asarray(shares, dtype=float)
        if share.shape != group.shape or not np.all((share > 0) & (share <= 1)):
            raise ValueError(f"a share of a device must be in (0, 1], one per device, got {share.tolist()}")
        background, own = (np.zeros(len(group)) if v is None else np.asarray(v, dtype=float) for v in (backgrounds, owns))
        for name, v in (("background load", background), ("own load", own)):
            if v.shape != group.shape or not np.all((v >= 0) & (v < 1)):
                raise ValueError(f"a device's {name} must be in [0, 1), one per device, got {v.tolist()}")
        members = Sharing(group, share, np.ones(len(shared))).members
        valid = members >= 0
        index = np.maximum(members, 0)
        busy = np.nanmedian(np.where(valid, (background + own)[index], np.nan), axis=1)
        theirs = np.where(valid, own[index], 0.0).sum(axis=1)
        other = np.clip(busy - theirs, 0.0, np.nanmedian(np.where(valid, background[index], np.nan), axis=1))
        return Sharing(group, share, 1.0 - other)

    @property
    def groups(self) -> int:
        return len(self.capacity)

    def describe(self) -> str:
        """In words, for organizers: how many peers share how many devices, and what other work takes of them."""
        taken = ", ".join(f"{1 - c:.0%}" for c in self.capacity)
        return (f"{int((self.group >= 0).sum())} peers compute on {self.groups} shared device(s); other work takes {taken} "
                "of it: the plan counts their sharing")

    def subset(self, devices: np.ndarray) -> "Sharing":
        return Sharing(self.group[devices], self.share[devices], self.capacity)

    def device_slowdowns(self, members: np.ndarray) -> np.ndarray:
        """(K, n) slowdown (>= 1) of every device when the devices marked in `members` (K, n) compute at once:
        share / level where its share is over its device's level. A device not marked is given the level of
        the others, as if it joined them (what a screen of a swap from standby needs, near enough)."""
        K, n = members.shape
        valid = self.members >= 0
        index = np.maximum(self.members, 0)
        demand = members[:, index] * np.where(valid, self.share[index], 0.0)  # (K, groups, most on one)
        level = fair_level(demand, self.capacity)  # (K, groups)
        rows = np.nonzero(valid)[0]
        devices = self.members[valid]
        slowdown = np.ones((K, n))
        slowdown[:, devices] = np.maximum(1.0, self.share[devices] / level[:, rows])
        return slowdown

    def slowdowns(self, grids: np.ndarray) -> np.ndarray:
        """(K, S, m) slowdown of each cell of the grids (K, S, m) of device indices."""
        K = grids.shape[0]
        cells = grids.reshape(K, -1)
        members = np.zeros((K, len(self.group)), dtype=bool)
        members[np.arange(K)[:, None], cells] = True
        return np.take_along_axis(self.device_slowdowns(members), cells, axis=1).reshape(grids.shape)
