"""Bottleneck matching and open-loop TSP against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment
from scipy.sparse.csgraph import minimum_spanning_tree

from hetpeer.coordinator.planner.graph import HELD_KARP_MAX, bottleneck_matching, path_cost, shortest_path_order


def brute_bottleneck(weights: np.ndarray) -> float:
    m = weights.shape[0]
    return min(max(weights[r, c] for r, c in enumerate(perm)) for perm in itertools.permutations(range(m)))


def check_matching(weights: np.ndarray, value: float, col_of_row: np.ndarray) -> None:
    m = weights.shape[0]
    assert sorted(np.asarray(col_of_row).tolist()) == list(range(m))
    assert weights[np.arange(m), col_of_row].max() == value


@pytest.mark.parametrize("seed", range(30))
def test_bottleneck_matching_5x5_vs_all_permutations(seed):
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0, 10, size=(5, 5))
    value, col_of_row = bottleneck_matching(weights)
    assert value == brute_bottleneck(weights)
    check_matching(weights, value, col_of_row)


@pytest.mark.parametrize("seed", range(30))
def test_bottleneck_matching_with_ties(seed):
    rng = np.random.default_rng(100 + seed)
    weights = rng.integers(0, 4, size=(5, 5)).astype(float)  # few distinct values: many ties
    value, col_of_row = bottleneck_matching(weights)
    assert value == brute_bottleneck(weights)
    check_matching(weights, value, col_of_row)


def test_bottleneck_matching_small_cases():
    assert bottleneck_matching(np.array([[3.0]]))[0] == 3.0
    # The row minima (1, 1) suggest 1, but both rows want column 0.
    weights = np.array([[1.0, 5.0], [1.0, 9.0]])
    value, col_of_row = bottleneck_matching(weights)
    assert value == 5.0
    assert col_of_row.tolist() == [1, 0]
    # All equal: any permutation will do.
    value, col_of_row = bottleneck_matching(np.full((4, 4), 2.0))
    assert value == 2.0 and sorted(col_of_row.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("m, seed", [(30, 0), (30, 1), (40, 2)])
def test_bottleneck_matching_large_is_optimal(m, seed):
    """Beyond brute force: the value is used by the matching, and no perfect matching exists below it
    (checked with scipy's assignment solver on 0/1 costs, an independent algorithm)."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0, 1, size=(m, m))
    if seed == 1:
        weights = np.round(weights * 5) / 5  # ties
    value, col_of_row = bottleneck_matching(weights)
    check_matching(weights, value, col_of_row)
    below = (weights >= value).astype(float)  # using any of these costs 1
    rows, cols = linear_sum_assignment(below)
    assert below[rows, cols].sum() >= 1


def brute_path(weights: np.ndarray) -> float:
    n = weights.shape[0]
    return min(path_cost(weights, list(order)) for order in itertools.permutations(range(n)))


@pytest.mark.parametrize("n", range(1, 8))
@pytest.mark.parametrize("symmetric", [True, False])
def test_held_karp_vs_all_permutations(n, symmetric):
    rng = np.random.default_rng(n + 10 * symmetric)
    for _ in range(3):
        weights = rng.uniform(0, 10, size=(n, n))
        if symmetric:
            weights = (weights + weights.T) / 2
        np.fill_diagonal(weights, 0.0)
        cost, order = shortest_path_order(weights)
        assert sorted(order) == list(range(n))
        assert cost == pytest.approx(path_cost(weights, order))
        assert cost == pytest.approx(brute_path(weights))


def test_held_karp_with_ties():
    weights = np.ones((6, 6))
    np.fill_diagonal(weights, 0.0)
    cost, order = shortest_path_order(weights)
    assert cost == 5.0 and sorted(order) == list(range(6))


def test_path_cost():
    weights = np.arange(16, dtype=float).reshape(4, 4)
    assert path_cost(weights, [2, 0, 3]) == weights[2, 0] + weights[0, 3]
    assert path_cost(weights, [1]) == 0.0


def nearest_neighbour_from_0(weights: np.ndarray) -> float:
    n = weights.shape[0]
    order, free = [0], set(range(1, n))
    while free:
        nxt = min(free, key=lambda j: (weights[order[-1], j], j))
        order.append(nxt)
        free.remove(nxt)
    return path_cost(weights, order)


@pytest.mark.parametrize("n, seed", [(HELD_KARP_MAX + 1, 0), (20, 1), (30, 2)])
def test_heuristic_beyond_held_karp(n, seed):
    rng = np.random.default_rng(seed)
    points = rng.uniform(0, 100, size=(n, 2))
    weights = np.linalg.norm(points[:, None] - points[None], axis=2)
    cost, order = shortest_path_order(weights)
    assert sorted(order) == list(range(n))
    assert cost == pytest.approx(path_cost(weights, order))
    assert cost <= nearest_neighbour_from_0(weights) + 1e-9
    # An open path is a spanning tree, so it weighs at least the minimum spanning tree.
    assert cost >= minimum_spanning_tree(weights).sum() - 1e-9
    # And it is 2-opt optimal: no reversal of a sub-path shortens it.
    for i in range(n - 1):
        for j in range(i + 1, n):
            candidate = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
            assert path_cost(weights, candidate) >= cost - 1e-9


def test_heuristic_finds_the_line():
    """Points on a line in shuffled order: the best open path walks the line end to end."""
    n = 24
    rng = np.random.default_rng(3)
    x = rng.permutation(n).astype(float)
    weights = np.abs(x[:, None] - x[None])
    cost, order = shortest_path_order(weights)
    assert cost == pytest.approx(n - 1)
    assert sorted(order) == list(range(n))
