"""Pairs that talk through a relay, and what the pairs through one relay share.

Two peers that nobody can dial, and that cannot punch a hole to each other, talk through the relay one of them
registered at: every byte goes to the relay and on to the other end. Such a pair's link is the relay's two hops
(their latencies added, the slower of their bandwidths), and the relay's own link carries it twice: in from one
end, out to the other. Every relayed pair a plan routes through one relay shares that link: a grid whose traffic
crosses k relayed pairs through relay r gives each of them at most r's capacity / k, so a relayed pair's
seconds per byte are

    max(1 / its two hops' bandwidth, k / capacity of r)

with the capacity what r's measured links carry (their median: `coordinator/policy.py`). The model assumes the k
pairs send at once, as a lane's hops do (a bound on the safe side, as `sharing.py` takes compute), and leaves
out the relay's own traffic when it trains too. A grid uses a pair for each hop between consecutive stages of a
lane and for each pair of members in a group (all-reduce's butterfly uses every pair; gossip, some of them).

`route` makes the links and the `Relays` of a problem from who is behind NAT and who relays for whom;
`Relays.load` counts, for batches of grids, the relayed pairs through each relay. A problem with no relayed
pair has no `Relays`, and the time model pays nothing for them. `behind_nat` puts a synthetic problem's devices
behind NATs, for benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hetpeer.protocol.reach import relay_score

ABSENT_LINK = (10.0, 1e3)  # (latency s, bytes/s) of a pair with no path: any plan crossing it predicts hours a step
PUBLIC, CONE, SYMMETRIC = 0, 1, 2  # `behind_nat`'s kinds of device


@dataclass(frozen=True, slots=True, eq=False)
class Relays:
    """Which pairs of a problem talk through which relay. `via[i, j]` is the relay of pair (i, j), an index into
    `names` and `capacity`, or -1 for a pair with a path of its own."""

    via: np.ndarray  # (n, n) int, symmetric
    names: tuple[str, ...]  # (R,) the relays' device ids
    capacity: np.ndarray  # (R,) bytes/s each relay's link carries, shared by the pairs through it

    def subset(self, devices: np.ndarray) -> "Relays":
        return Relays(self.via[np.ix_(devices, devices)], self.names, self.capacity)

    def load(self, grids: np.ndarray) -> np.ndarray:
        """(K, R): the relayed pairs that grids (K, S, m) route through each relay, counted once a pair (at least
        one, so that a pair moved onto a relay by a screened swap is counted as alone)."""
        K, S, m = grids.shape
        n, R = len(self.via), len(self.names)
        pairs = [(grids[:, :-1, :], grids[:, 1:, :])]  # each lane's hops
        first, second = np.triu_indices(m, 1)
        if m > 1:
            pairs.append((grids[:, :, first], grids[:, :, second]))  # each group's pairs: an all-reduce uses them all
        counts = np.zeros(K * R)
        for a, b in pairs:
            label = self.via.ravel().take(a * n + b).reshape(K, -1)
            used = label >= 0
            counts += np.bincount((np.arange(K)[:, None] * R + label)[used], minlength=K * R)
        return np.maximum(counts.reshape(K, R), 1.0)

    def seconds_per_byte(self, index: np.ndarray, per_byte: np.ndarray, load: np.ndarray) -> np.ndarray:
        """`per_byte` of the pairs at flat `index` (K, ...), those relayed given their share of their relay under
        `load` (K, R) or (1, R): a grid's, one per leading row."""
        label = self.via.ravel().take(index)
        relayed = label >= 0
        if not relayed.any():
            return per_byte
        rows = np.arange(load.shape[0]).reshape((-1,) + (1,) * (index.ndim - 1)) if load.shape[0] > 1 else 0
        share = load.ravel().take(rows * load.shape[1] + np.maximum(label, 0)) / self.capacity.take(np.maximum(label, 0))
        return np.where(relayed, np.maximum(per_byte, share), per_byte)


def route(latency: np.ndarray, bandwidth: np.ndarray, behind: np.ndarray, relay: np.ndarray, direct: np.ndarray,
          capacity: np.ndarray, ids: tuple[str, ...]) -> Relays | None:
    """Pairs of devices both `behind` (n,) NAT whose pair is not `direct` (n, n: punched, or no path at all), in
    place: through the relay of either (`relay` (n,): the index of a device's relay, -1 for none), the better of
    the two where both have one; their two hops' latency and bandwidth. `capacity` (n,): what each device's link
    carries as a relay. The pairs' `Relays`, or None where no pair is relayed. O(devices behind NAT^2)."""
    nat = np.flatnonzero(behind)
    via_latency, via_bandwidth = np.full(latency.shape, np.inf), np.zeros(bandwidth.shape)  # [i, j]: through j's relay
    through = np.full(latency.shape, -1, dtype=np.int64)
    for j in nat:
        r = relay[j]
        if r >= 0:
            via_latency[nat, j] = latency[nat, r] + latency[r, j]
            via_bandwidth[nat, j] = np.minimum(bandwidth[nat, r], bandwidth[r, j])
            through[nat, j] = r
    # the better of the two relays; a tie goes to the relay of the device later in the order, both ways
    own = (via_bandwidth > via_bandwidth.T) | ((via_bandwidth == via_bandwidth.T) & np.triu(np.ones((len(behind),) * 2, dtype=bool), 1))
    best_latency = np.where(own, via_latency, via_latency.T)
    best_bandwidth = np.where(own, via_bandwidth, via_bandwidth.T)
    best_through = np.where(own, through, through.T)
    pair = np.outer(behind, behind) & (best_bandwidth > 0) & ~direct
    np.fill_diagonal(pair, False)
    latency[pair], bandwidth[pair] = best_latency[pair], best_bandwidth[pair]
    if not pair.any():
        return None
    used = np.unique(best_through[pair])
    label = np.full(len(behind), -1, dtype=np.int64)
    label[used] = np.arange(len(used))
    via = np.where(pair, label[np.maximum(best_through, 0)], -1)
    return Relays(via, tuple(ids[r] for r in used), np.asarray(capacity, dtype=float)[used])


def behind_nat(problem, kinds: np.ndarray):
    """`problem` (a `Problem` with no relays) with its devices behind NAT as `kinds` (n,) says: `PUBLIC`, `CONE`
    (punches holes to other cone devices) or `SYMMETRIC` (reaches other NATed devices only through a relay). Each
    NATed device registers at the public one it scores highest (`protocol.reach.relay_score`, weighed by its link to
    it, as peers pick); a relay's capacity is the median of its links. NATed pairs with neither a hole nor a relay
    get `ABSENT_LINK`."""
    kinds = np.asarray(kinds)
    latency, bandwidth = problem.latency_s.copy(), problem.bandwidth_bytes_per_s.copy()
    ids, n = problem.device_ids, problem.n
    behind, public = kinds != PUBLIC, np.flatnonzero(kinds == PUBLIC)
    relay = np.full(n, -1, dtype=np.int64)
    for i in np.flatnonzero(behind):
        if len(public):
            relay[i] = public[int(np.argmax([relay_score(ids[i], ids[r], bandwidth[i, r]) for r in public]))]
    punched = np.outer(kinds == CONE, kinds == CONE)
    absent = np.outer(behind, behind) & ~punched & ~np.outer(relay >= 0, relay >= 0)
    np.fill_diagonal(absent, False)
    latency[absent], bandwidth[absent] = ABSENT_LINK
    links = np.where(np.eye(n, dtype=bool), np.nan, bandwidth)
    capacity = np.nan_to_num(np.nanmedian(links, axis=1), nan=1.0) if n > 1 else np.ones(n)
    relays = route(latency, bandwidth, behind, relay, punched | absent, capacity, ids)
    return dataclasses.replace(problem, latency_s=latency, bandwidth_bytes_per_s=bandwidth, relays=relays)

