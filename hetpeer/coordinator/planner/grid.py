"""Operators on grids (rows = stages, columns = lanes): alignment, construction, crossover.

Every operator returns a new array and leaves its inputs unchanged; randomness comes from the
`numpy.random.Generator` passed in.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from hetpeer.coordinator.planner.graph import bottleneck_matching, shortest_path_order
from hetpeer.coordinator.planner.problem import Shape


class Aligner:
    """Orders a grid's rows by open-loop TSP over bottleneck-matching weights between rows, and
    chains lanes along the matchings, so that the grid's own pairing is the best one.

    Matchings are cached by the unordered pair of row sets: a search revisits the same groups often.
    `link_cost` must be symmetric.
    """

    def __init__(self, link_cost: np.ndarray) -> None:
        self.link_cost = link_cost
        self._pairs: dict[tuple[bytes, bytes], tuple[float, dict[int, int]]] = {}

    def pair(self, a: np.ndarray, b: np.ndarray) -> tuple[float, dict[int, int]]:
        """Bottleneck weight between rows a and b, and the matching as device of a -> device of b."""
        sa, sb = np.sort(a), np.sort(b)
        key = (sa.tobytes(), sb.tobytes())
        if key not in self._pairs:
            value, column = bottleneck_matching(self.link_cost[np.ix_(sa, sb)])
            forward = {int(x): int(y) for x, y in zip(sa, sb[column])}
            self._pairs[key] = (value, forward)
            self._pairs[(key[1], key[0])] = (value, {y: x for x, y in forward.items()})
        return self._pairs[key]

    def align(self, grid: np.ndarray) -> np.ndarray:
        stages = grid.shape[0]
        if stages == 1:
            return grid.copy()
        weights = np.zeros((stages, stages))
        for i in range(stages):
            for j in range(i + 1, stages):
                weights[i, j] = weights[j, i] = self.pair(grid[i], grid[j])[0]
        _, order = shortest_path_order(weights)
        aligned = np.empty_like(grid)
        aligned[0] = grid[order[0]]
        for k in range(1, stages):
            partner = self.pair(grid[order[k - 1]], grid[order[k]])[1]
            aligned[k] = [partner[int(d)] for d in aligned[k - 1]]
        return aligned


def chain_order(link_cost: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """Devices in a greedy nearest-neighbour chain, so that neighbours in the chain are close."""
    remaining = list(devices[1:])
    chain = [int(devices[0])]
    while remaining:
        costs = link_cost[chain[-1], remaining]
        chain.append(int(remaining.pop(int(np.argmin(costs)))))
    return np.array(chain)


def layouts(shape: Shape, ordered: np.ndarray) -> list[np.ndarray]:
    """Two grids from devices in a meaningful order: consecutive devices share a group
    ("clustered", as blocks are) or a lane ("strided")."""
    S, m = shape.stages, shape.group_size
    return [ordered.reshape(S, m).copy(), ordered.reshape(m, S).T.copy()]


def tiers(shape: Shape, fastest: np.ndarray, chain: np.ndarray) -> list[np.ndarray]:
    """Two grids whose groups are tiers of speed: the `shape.devices` first of `fastest` (devices, fastest first),
    cut into stages of like speed, each stage's devices in the order of `chain` so that a lane's devices sit at
    like places of it; fastest stage first, and last. A stage runs at its slowest member's pace (the layer split
    follows it), so mixing generations slows every stage, and single swaps cannot sort them (taking one slow
    device out of a group with three changes nothing): on a swarm of unlike GPUs these seeds tell which shapes
    can leave the slow ones out."""
    S, m = shape.stages, shape.group_size
    rank = np.empty(len(chain), dtype=np.int64)
    rank[chain] = np.arange(len(chain))
    rows = fastest[: S * m].reshape(S, m)
    grid = np.take_along_axis(rows, np.argsort(rank[rows], axis=1, kind="stable"), axis=1)
    return [grid, grid[::-1].copy()]


def crossover(
    first: np.ndarray, second: np.ndarray, n: int, group_cost: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """A child partition that keeps what both parents agree on and stays balanced.

    The second parent's rows are first matched to the first's by overlap (Hungarian), so that
    "group 3" means the same in both. Devices the parents disagree on take either parent's group at
    random; overfull groups then shed the members least attached to them (highest mean group cost)
    and short groups take the unplaced devices most attached to them. Standby is group -1.
    """
    S, m = first.shape
    label_a = np.full(n, -1)
    label_b = np.full(n, -1)
    for s in range(S):
        label_a[first[s]] = s
        label_b[second[s]] = s
    both = (label_a >= 0) & (label_b >= 0)
    overlap = np.zeros((S, S))
    np.add.at(overlap, (label_a[both], label_b[both]), 1)
    # the most shared devices: an assignment by csgraph's matching (scipy.optimize's would add 0.2 s of imports to
    # every `hetpeer plan`, half of the planner's); one more on every edge keeps the graph complete
    rows, cols = min_weight_full_bipartite_matching(csr_matrix(overlap + 1), maximize=True)
    relabel = np.empty(S, dtype=np.int64)
    relabel[cols] = rows
    label_b = np.where(label_b >= 0, relabel[label_b], -1)

    child = np.where(rng.random(n) < 0.5, label_a, label_b)
    members = [list(np.flatnonzero(child == s)) for s in range(S)]
    for s in range(S):
        while len(members[s]) > m:
            row = members[s]
            attachment = group_cost[np.ix_(row, row)].sum(axis=1)
            child[row.pop(int(np.argmax(attachment)))] = -1
    for s in sorted(range(S), key=lambda s: -len(members[s])):
        while len(members[s]) < m:
            free = np.flatnonzero(child == -1)
            if members[s]:
                pick = free[int(np.argmin(group_cost[np.ix_(free, members[s])].mean(axis=1)))]
            else:
                pick = free[int(rng.integers(len(free)))]
            child[pick] = s
            members[s].append(int(pick))
    return np.array([sorted(row) for row in members])

