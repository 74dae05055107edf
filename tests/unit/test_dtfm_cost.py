"""The paper's communication cost (Yuan et al. 2022, Eqs. 1-4) on examples computed by hand, and the
exact cost of a partition against a brute force written here from the formulas."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, solve
from hetpeer.coordinator.planner.baselines import exhaustive
from hetpeer.coordinator.planner.dtfm import DtfmCost
from hetpeer.coordinator.planner.grid import Aligner
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

WORKLOAD = Workload(preset("tiny"), batch=8)


def linked(ids: list[str], links: dict[tuple[str, str], tuple[float, float]]) -> Topology:
    """Devices in one region, every pair given as a device link (latency ms, bandwidth Gbit/s)."""
    return Topology.from_wire(
        {
            "devices": [{"id": d, "region": "r"} for d in ids],
            "regions": {"r": {"latency_ms": 1000.0, "bandwidth_gbps": 0.001}},  # never used
            "links": [
                {"a": a, "b": b, "latency_ms": ms, "bandwidth_gbps": gbps} for (a, b), (ms, gbps) in links.items()
            ],
        }
    )


# 8 Gbit/s = 1e9 bytes/s, 4 = 0.5e9, 2 = 0.25e9, 1 = 0.125e9.
FOUR = linked(
    ["d0", "d1", "d2", "d3"],
    {
        ("d0", "d1"): (10.0, 8.0),
        ("d2", "d3"): (20.0, 4.0),
        ("d0", "d2"): (0.0, 8.0),
        ("d0", "d3"): (5.0, 2.0),
        ("d1", "d2"): (5.0, 4.0),
        ("d1", "d3"): (1.0, 1.0),
    },
)
C_DP, C_PP = 1e9, 0.25e9


@pytest.fixture(scope="module")
def four():
    problem = Problem.from_topology(FOUR, WORKLOAD, dp_bytes=C_DP, pp_bytes=C_PP)
    return problem, DtfmCost(problem, Shape(2, 2))


def test_four_devices_matrices_by_hand(four):
    _, model = four
    # group cost 2 (latency + c_DP / (m bandwidth)), m = 2
    assert model.group_cost[0, 1] == pytest.approx(2 * (0.010 + 1e9 / (2 * 1e9)))  # 1.02
    assert model.group_cost[2, 3] == pytest.approx(2 * (0.020 + 1e9 / (2 * 0.5e9)))  # 2.04
    assert model.group_cost[3, 2] == model.group_cost[2, 3]
    # link cost latency + c_PP / bandwidth
    assert model.link_cost[0, 2] == pytest.approx(0.25)
    assert model.link_cost[0, 3] == pytest.approx(0.005 + 1.0)
    assert model.link_cost[1, 2] == pytest.approx(0.005 + 0.5)
    assert model.link_cost[1, 3] == pytest.approx(0.001 + 2.0)


def test_four_devices_two_groups_by_hand(four):
    problem, model = four
    grid = np.array([[0, 1], [2, 3]])  # groups {d0, d1} then {d2, d3}; lanes d0->d2, d1->d3
    dp, pp = model.parts(grid[None])
    # DP = max(DP({d0,d1}) = 1.02, DP({d2,d3}) = 2.04); own pairing: max(0.25, 2.001)
    assert dp[0] == pytest.approx(2.04)
    assert pp[0] == pytest.approx(2.001)
    assert model.batch_cost(grid[None])[0] == pytest.approx(2.04 + 2 * 2.001)

    # Bottleneck matching: {d0-d2, d1-d3} -> max(0.25, 2.001); {d0-d3, d1-d2} -> max(1.005, 0.505) = 1.005.
    aligned = Aligner(model.link_cost).align(grid)
    assert sorted(map(sorted, aligned.tolist())) == [[0, 1], [2, 3]]
    assert {frozenset(lane) for lane in aligned.T.tolist()} == {frozenset({0, 3}), frozenset({1, 2})}
    exact = 2.04 + 2 * 1.005  # 4.05
    assert model.batch_cost(aligned[None])[0] == pytest.approx(exact)
    report = model.report(aligned)
    assert report.cost["dp_s"] == pytest.approx(2.04)
    assert report.cost["pp_s"] == pytest.approx(2 * 1.005)
    assert report.cost["total_s"] == pytest.approx(exact)
    assert report.objective == pytest.approx(exact)

    # The other partitions: {d0,d2},{d1,d3} has DP 2 (0.001 + 4) = 8.002; {d0,d3},{d1,d2} has DP 4.01 and
    # bottleneck 1.02, so 6.05. The hand-computed one is the optimum, and the search and exhaustive find it.
    _, best = exhaustive(problem, model)
    assert best == pytest.approx(exact)
    solution = solve(problem, PlannerConfig(cost_model="dtfm", stages=2, group_size=2, time_budget_s=1.0),
                     np.random.default_rng(0))
    assert solution.report.cost["total_s"] == pytest.approx(exact)
    groups = {frozenset(stage.devices) for stage in solution.plan.stages}
    assert groups == {frozenset({"d0", "d1"}), frozenset({"d2", "d3"})}
    assert {frozenset(lane) for lane in solution.plan.lanes} == {frozenset({"d0", "d3"}), frozenset({"d1", "d2"})}


def test_dp_is_the_worst_member_sum_not_the_worst_pair():
    three = linked(["x", "y", "z"], {("x", "y"): (0.0, 8.0), ("x", "z"): (0.0, 4.0), ("y", "z"): (10.0, 2.0)})
    problem = Problem.from_topology(three, WORKLOAD, dp_bytes=3e9, pp_bytes=1e9)
    model = DtfmCost(problem, Shape(1, 3))
    # c_DP / m = 1e9: x-y costs 2 (0 + 1) = 2, x-z 2 (0 + 2) = 4, y-z 2 (0.01 + 4) = 8.02.
    # Sums: x 6, y 10.02, z 12.02 -> DP = 12.02 (the worst pair alone would be 8.02).
    dp, pp = model.parts(np.array([[[0, 1, 2]]]))
    assert dp[0] == pytest.approx(12.02)
    assert pp[0] == 0.0
    assert model.report(np.array([[2, 0, 1]])).cost["total_s"] == pytest.approx(12.02)


def test_single_device_groups_follow_the_shortest_path():
    three = linked(["p", "q", "r"], {("p", "q"): (0.0, 8.0), ("q", "r"): (0.0, 8.0), ("p", "r"): (0.0, 1.0)})
    problem = Problem.from_topology(three, WORKLOAD, dp_bytes=1e9, pp_bytes=1e9)
    model = DtfmCost(problem, Shape(3, 1))
    grid = np.array([[0], [2], [1]])  # p -> r -> q: 8 + 1
    assert model.batch_cost(grid[None])[0] == pytest.approx(2 * 9.0)
    aligned = Aligner(model.link_cost).align(grid)
    assert aligned[1, 0] == 1  # q in the middle: p -> q -> r (or reversed) costs 1 + 1
    assert model.batch_cost(aligned[None])[0] == pytest.approx(2 * 2.0)
    assert model.report(aligned).sync == ("none", "none", "none")


def test_default_bytes_follow_the_workload():
    problem = Problem.from_topology(FOUR, Workload(preset("gpt3-xl"), batch=512))
    model = DtfmCost(problem, Shape(2, 2))
    h = 2048
    # 24 layers over 2 stages: 12 layers of fp16 gradients; each lane carries 256 sequences of seq x h fp16.
    assert model.dp_bytes == 12 * (12 * h * h + 13 * h) * 2
    assert model.pp_bytes == 256 * 2048 * h * 2
    assert model.report(np.array([[0, 1], [2, 3]])).layers == (12, 12)


def test_report_spreads_layers_evenly_with_the_remainder_in_the_middle():
    problem = Problem.from_topology(FOUR, Workload(preset("tiny", 10), batch=8), dp_bytes=C_DP, pp_bytes=C_PP)
    report = DtfmCost(problem, Shape(4, 1)).report(np.array([[0], [1], [2], [3]]))
    assert report.layers == (2, 3, 3, 2)
    assert report.sync == ("none",) * 4


# -- the exact cost of a partition, brute force -------------------------------------------------


def random_problem(n: int, rng: np.random.Generator) -> Problem:
    latency = rng.uniform(0.001, 0.1, size=(n, n))
    bandwidth = rng.uniform(1e8, 3e9, size=(n, n))
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    ids = tuple(f"g{i}" for i in range(n))
    return Problem(ids, latency, bandwidth, WORKLOAD, dp_bytes=0.5e9, pp_bytes=0.2e9)


def exact_cost(problem: Problem, groups: list[list[int]]) -> float:
    """DP + 2 PP of a partition, straight from the paper's definitions (no grid, no matrices)."""
    lat, bw = problem.latency_s, problem.bandwidth_bytes_per_s
    m = len(groups[0])

    def dp_of(group):
        return max(
            sum(2 * (lat[d, e] + problem.dp_bytes / (m * bw[d, e])) for e in group if e != d) for d in group
        )

    def link(d, e):
        return lat[d, e] + problem.pp_bytes / bw[d, e]

    def weight(a, b):
        return min(max(link(d, e) for d, e in zip(a, perm)) for perm in itertools.permutations(b))

    pp = min(
        sum(weight(groups[x], groups[y]) for x, y in zip(order, order[1:]))
        for order in itertools.permutations(range(len(groups)))
    )
    return max(dp_of(g) for g in groups) + 2 * pp


def partitions(items: list[int], size: int):
    """Every partition of items into unordered groups of `size`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in others]
        for tail in partitions(remaining, size):
            yield [[first, *others], *tail]


@pytest.mark.parametrize("stages, group_size", [(4, 2), (2, 4), (2, 3)])
def test_aligned_grid_costs_the_exact_cost_of_its_partition(stages, group_size):
    rng = np.random.default_rng(stages * 10 + group_size)
    n = stages * group_size
    problem = random_problem(n, rng)
    model = DtfmCost(problem, Shape(stages, group_size))
    aligner = Aligner(model.link_cost)
    for _ in range(5):
        grid = rng.permutation(n).reshape(stages, group_size)
        expected = exact_cost(problem, grid.tolist())
        aligned = aligner.align(grid)
        assert sorted(map(sorted, aligned.tolist())) == sorted(map(sorted, grid.tolist()))
        assert model.batch_cost(aligned[None])[0] == pytest.approx(expected, rel=1e-12)
        # The grid's own order and pairing can only cost more.
        assert model.batch_cost(grid[None])[0] >= expected * (1 - 1e-12)


@pytest.mark.parametrize("stages, group_size", [(4, 2), (2, 4)])
def test_exhaustive_is_the_best_partition(stages, group_size):
    problem = random_problem(8, np.random.default_rng(7 + stages))
    model = DtfmCost(problem, Shape(stages, group_size))
    grid, cost = exhaustive(problem, model)
    best = min(exact_cost(problem, groups) for groups in partitions(list(range(8)), group_size))
    assert cost == pytest.approx(best, rel=1e-12)
    assert model.batch_cost(grid[None])[0] == pytest.approx(cost)
    assert math.isfinite(cost)
