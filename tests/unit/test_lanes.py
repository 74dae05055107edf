"""Lanes of unlike speed share a step's micro-batches so that they finish together (`planner/lanes.py`): the
allocation against every allocation on small cases, its bounds, and what the planner makes of it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.lanes import allocate, lane_times, sequences
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload


def best_by_search(round_trip, period, ends, stages, total, cap):
    """The least slowest-lane time over every allocation of `total` micro-batches, each lane 1 to `cap`."""
    m = len(round_trip)
    best = np.inf
    for micro in itertools.product(range(1, min(cap, total) + 1), repeat=m):
        if sum(micro) == total:
            best = min(best, lane_times(round_trip, period, ends, np.array(micro), stages).max())
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_allocation_is_the_best_of_every_allocation(seed):
    rng = np.random.default_rng(seed)
    m, stages = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    even = int(rng.integers(1, 5))
    total = int(rng.integers(m, m * even + 1))  # the even split holds them: at least total / m each
    period = rng.uniform(0.1, 2.0, m)
    round_trip = period * stages + rng.uniform(0, 1, m)  # a round trip is at least its stages' compute
    ends = rng.uniform(0, 0.5, m) * (rng.random() < 0.5)
    micro = allocate(round_trip[None], period[None], ends[None], stages, total, even)[0]
    cap = even if even < stages else total
    assert micro.sum() == total and micro.min() >= 1 and micro.max() <= cap
    got = lane_times(round_trip, period, ends, micro, stages).max()
    assert got == pytest.approx(best_by_search(round_trip, period, ends, stages, total, cap), rel=1e-9)


def test_a_lane_twice_as_fast_takes_twice_the_micro_batches():
    period = np.array([[1.0, 1.0, 2.0, 2.0]])  # one stage: a lane's time is its micro-batches x its period
    micro = allocate(period, period, np.zeros((1, 4)), 1, 24, 6)
    assert micro.tolist() == [[8, 8, 4, 4]]
    assert lane_times(period, period, np.zeros((1, 4)), micro, 1).max() == 8.0  # the even split: 6 x 2 = 12


def test_sequences_fill_the_batch_with_the_partial_micro_batch_on_the_slowest_lane():
    shares = sequences(np.array([3, 2, 2]), 4, 25, finish=np.array([1.0, 3.0, 2.0]))
    assert shares.tolist() == [12, 5, 8] and shares.sum() == 25


def problem_of(tflops: list[float], batch: int = 24, micro_batch: int = 2) -> Problem:
    raw = {"devices": [{"id": f"d{i}", "region": "r", "tflops": t, "memory_gb": 100.0} for i, t in enumerate(tflops)],
           "regions": {"r": {"latency_ms": 0.1, "bandwidth_gbps": 100.0}}}
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=batch, micro_batch=micro_batch))


def test_the_planner_gives_fast_lanes_more_of_the_batch_and_the_plan_carries_it():
    problem = problem_of([2e-3, 2e-3, 1e-3, 1e-3])
    config = PlannerConfig(sync="allreduce", stages=1, group_size=4)
    model = make_model(problem, config, Shape(1, 4))
    report = model.report(np.array([[0, 1, 2, 3]]))
    assert report.lane_batches == (8, 8, 4, 4)  # 12 micro-batches of 2: the fast lanes 4 each, the slow ones 2
    plan = solve(problem, config, np.random.default_rng(0)).plan
    assert sorted(plan.lane_batches) == [4, 4, 8, 8] and sum(plan.lane_batches) == plan.batch
    fast = {plan.stages[0].devices.index(d) for d in ("d0", "d1")}
    assert {plan.lane_sequences(lane) for lane in fast} == {8} and plan.micro_batches == 4
    assert Plan.from_wire(plan.to_wire()) == plan
    # against every lane taking 6: the slow lanes' 3 micro-batches set that step; now 4 fast ones (2 x faster) do
    slow_micro_s = report.cost["compute_s"] / 4 * 2
    assert report.cost["total_s"] < 3 * slow_micro_s


def test_equal_lanes_keep_the_even_split_and_say_nothing_of_it():
    problem = problem_of([1e-3] * 4)
    report = make_model(problem, PlannerConfig(sync="allreduce"), Shape(1, 4)).report(np.array([[0, 1, 2, 3]]))
    assert report.lane_batches == ()
    plan = solve(problem, PlannerConfig(sync="allreduce", stages=1, group_size=4), np.random.default_rng(0)).plan
    assert plan.lane_batches == () and "lane_batches" not in plan.to_wire()


def test_a_batch_the_lanes_cannot_each_hold_a_micro_batch_of_is_split_evenly():
    problem = problem_of([2e-3, 1e-3, 1e-3], batch=4, micro_batch=2)  # 2 sequences a lane: 2 micro-batches for 3 lanes
    report = make_model(problem, PlannerConfig(sync="allreduce"), Shape(1, 3)).report(np.array([[0, 1, 2]]))
    assert report.lane_batches == ()
