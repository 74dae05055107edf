"""The time model uses what the paper left out: faster devices take more layers, hopeless ones sit out."""

from __future__ import annotations

import numpy as np

from hetpeer.coordinator.planner import PlannerConfig, Problem, solve
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def one_region(tflops: list[float]) -> Topology:
    """Devices on a fast local network, so compute decides."""
    return Topology.from_wire(
        {
            "devices": [{"id": f"d{i}", "region": "r", "tflops": t, "memory_gb": 80.0} for i, t in enumerate(tflops)],
            "regions": {"r": {"latency_ms": 0.01, "bandwidth_gbps": 100.0}},
        }
    )


def test_twice_as_fast_group_gets_more_layers(check_plan):
    # d1 and d3 are twice as fast as d0 and d2.
    problem = Problem.from_topology(one_region([1e-3, 2e-3, 1e-3, 2e-3]), Workload(preset("tiny", 8), batch=8))
    solution = solve(problem, PlannerConfig(stages=2, group_size=2, time_budget_s=1.0), np.random.default_rng(0))
    check_plan(problem, solution)
    groups = {frozenset(stage.devices): stage.layers for stage in solution.plan.stages}
    fast, slow = frozenset({"d1", "d3"}), frozenset({"d0", "d2"})
    assert set(groups) == {fast, slow}  # mixing would make both stages as slow as the slow devices
    assert groups[fast] > groups[slow]


def test_hopeless_device_is_left_on_standby(check_plan):
    problem = Problem.from_topology(one_region([1.0, 1.0, 0.01, 1.0, 1.0]), Workload(preset("tiny", 8), batch=8))
    solution = solve(problem, PlannerConfig(time_budget_s=1.0), np.random.default_rng(0))
    check_plan(problem, solution)
    assert solution.plan.standby == ("d2",)

    # Without standby it must take part, and the step is slower for it.
    forced = solve(problem, PlannerConfig(allow_standby=False, time_budget_s=1.0), np.random.default_rng(0))
    check_plan(problem, forced)
    assert "d2" in forced.plan.devices
    assert forced.plan.total_s > solution.plan.total_s
