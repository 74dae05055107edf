"""Graph routines inside the cost models: bottleneck perfect matching and open-loop TSP.

Both are pure functions of a weight matrix and deterministic.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

HELD_KARP_MAX = 16  # exact TSP up to this many nodes: O(2^n n^2) time, O(2^n n) memory
_KUHN_MAX = 24  # below this a plain augmenting-path search beats building a sparse matrix


def _perfect_matching(allowed: np.ndarray) -> np.ndarray | None:
    """A perfect matching using only allowed (row, column) pairs, as column-of-row, or None."""
    m = allowed.shape[0]
    if m > _KUHN_MAX:
        match = maximum_bipartite_matching(csr_matrix(allowed), perm_type="column")
        return match if (match >= 0).all() else None
    options = [np.flatnonzero(row).tolist() for row in allowed]
    row_of_col = [-1] * m

    def augment(row: int, seen: list[bool]) -> bool:
        for col in options[row]:
            if not seen[col]:
                seen[col] = True
                if row_of_col[col] < 0 or augment(row_of_col[col], seen):
                    row_of_col[col] = row
                    return True
        return False

    for row in range(m):
        if not augment(row, [False] * m):
            return None
    col_of_row = np.empty(m, dtype=np.int64)
    col_of_row[row_of_col] = np.arange(m)
    return col_of_row


def bottleneck_matching(weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Perfect matching of rows to columns that minimises the largest weight it uses.

    Returns (that largest weight, column of each row). Binary search over the distinct weights from
    the lower bound max(max row minimum, max column minimum), which is usually the answer already;
    each probe is one bipartite matching, so O(log(m^2)) matchings.
    """
    values = np.unique(weights)
    lower = max(weights.min(axis=1).max(), weights.min(axis=0).max())
    lo = int(np.searchsorted(values, lower))
    match = _perfect_matching(weights <= values[lo])
    if match is not None:
        return float(values[lo]), match
    lo, hi = lo + 1, len(values) - 1
    best = _perfect_matching(weights <= values[hi])
    assert best is not None, "a complete bipartite graph always has a perfect matching"
    while lo < hi:
        mid = (lo + hi) // 2
        match = _perfect_matching(weights <= values[mid])
        if match is None:
            lo = mid + 1
        else:
            hi, best = mid, match
    return float(values[hi]), best


def shortest_path_order(weights: np.ndarray) -> tuple[float, list[int]]:
    """Open-loop TSP: the cheapest order visiting every node once, free to start and end anywhere.

    Exact (Held-Karp) up to HELD_KARP_MAX nodes; beyond, the best nearest-neighbour path from every
    start, improved by 2-opt until no reversal helps: O(n^3) per pass.
    """
    n = weights.shape[0]
    if n == 1:
        return 0.0, [0]
    if n <= HELD_KARP_MAX:
        return _held_karp(weights)
    return _two_opt(weights, _nearest_neighbour(weights))


def path_cost(weights: np.ndarray, order: list[int]) -> float:
    return float(sum(weights[a, b] for a, b in zip(order, order[1:])))


def _held_karp(weights: np.ndarray) -> tuple[float, list[int]]:
    n = weights.shape[0]
    full = (1 << n) - 1
    cost = np.full((1 << n, n), np.inf)
    parent = np.full((1 << n, n), -1, dtype=np.int8)
    for j in range(n):
        cost[1 << j, j] = 0.0
    masks = np.arange(1 << n)
    popcount = np.array([bin(mask).count("1") for mask in range(1 << n)])
    for size in range(2, n + 1):
        sized = masks[popcount == size]
        for j in range(n):
            ends_here = sized[(sized >> j) & 1 == 1]
            before = cost[ends_here ^ (1 << j)] + weights[:, j]  # (masks, previous node)
            best = before.argmin(axis=1)
            cost[ends_here, j] = before[np.arange(len(ends_here)), best]
            parent[ends_here, j] = best
    last = int(cost[full].argmin())
    total = float(cost[full, last])
    order, mask = [last], full
    while parent[mask, order[-1]] >= 0:
        previous = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(previous)
    return total, order[::-1]


def _nearest_neighbour(weights: np.ndarray) -> list[int]:
    n = weights.shape[0]
    best_order, best_cost = list(range(n)), np.inf
    for start in range(n):
        order, free = [start], np.ones(n, dtype=bool)
        free[start] = False
        for _ in range(n - 1):
            row = np.where(free, weights[order[-1]], np.inf)
            nxt = int(row.argmin())
            order.append(nxt)
            free[nxt] = False
        cost = path_cost(weights, order)
        if cost < best_cost:
            best_order, best_cost = order, cost
    return best_order


def _two_opt(weights: np.ndarray, order: list[int]) -> tuple[float, list[int]]:
    """Reverse sub-paths while that shortens the path (an end may move: the path is open)."""
    order = list(order)
    improved = True
    while improved:
        improved = False
        for i in range(len(order) - 1):
            for j in range(i + 1, len(order)):
                candidate = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                if path_cost(weights, candidate) < path_cost(weights, order) - 1e-12:
                    order, improved = candidate, True
    return path_cost(weights, order), order
