"""Solved plans keep every invariant a peer relies on, for both cost models, on the paper's scenarios
and on random topologies; and problems without a plan say why."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, solve
from hetpeer.coordinator.planner.synthetic import random_topology
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def random_problem(devices: int, regions: int, seed: int, workload: Workload, **kwargs) -> Problem:
    raw = random_topology(devices, regions, np.random.default_rng(seed))
    return Problem.from_topology(Topology.from_wire(raw), workload, **kwargs)


@pytest.mark.parametrize(
    "name, config",
    [
        ("world-wide", PlannerConfig(cost_model="time", time_budget_s=1.0)),
        ("regional", PlannerConfig(cost_model="dtfm", time_budget_s=0.5)),
        ("multi-datacenter", PlannerConfig(cost_model="time", stages=4, allow_standby=False, sync="gossip",
                                           time_budget_s=0.5)),
    ],
    ids=["world-wide-time", "regional-dtfm", "multi-datacenter-time-fixed"],
)
def test_scenario_plans_are_valid(name, config, scenario_problem, check_plan):
    problem = scenario_problem(name)
    solution = solve(problem, config, np.random.default_rng(0))
    check_plan(problem, solution)
    assert solution.plan.cost_model == config.cost_model
    if config.cost_model == "dtfm" or not config.allow_standby:
        assert solution.plan.standby == ()
    if config.stages is not None:
        assert len(solution.plan.stages) == config.stages
    if config.sync == "gossip":
        assert {stage.sync for stage in solution.plan.stages} == {"gossip"}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("cost_model", ["time", "dtfm"])
def test_random_topology_plans_are_valid(seed, cost_model, check_plan):
    problem = random_problem(12, 3, seed, Workload(preset("gpt3-xl", 8), batch=64))
    solution = solve(problem, PlannerConfig(cost_model=cost_model, time_budget_s=0.5), np.random.default_rng(seed))
    check_plan(problem, solution)
    if cost_model == "dtfm":
        assert solution.shape.devices == 12


def test_plan_with_a_current_plan_is_valid(check_plan):
    workload = Workload(preset("tiny", 8), batch=16)
    first = solve(random_problem(10, 3, 4, workload), PlannerConfig(time_budget_s=0.5), np.random.default_rng(0))
    problem = random_problem(10, 3, 4, workload, current=first.plan)
    again = solve(problem, PlannerConfig(time_budget_s=0.5), np.random.default_rng(1))
    check_plan(problem, again)
    assert "move_s" in again.plan.cost


def test_current_plan_with_other_layers_is_refused():
    workload = Workload(preset("tiny", 8), batch=16)
    first = solve(random_problem(6, 2, 4, workload), PlannerConfig(time_budget_s=0.3), np.random.default_rng(0))
    other = random_problem(6, 2, 4, Workload(preset("tiny", 6), batch=16), current=first.plan)
    with pytest.raises(PlanningError, match="8 layers"):
        solve(other, PlannerConfig(time_budget_s=0.3), np.random.default_rng(0))


@pytest.mark.parametrize(
    "config, words",
    [
        (PlannerConfig(cost_model="dtfm", stages=5, time_budget_s=0.2), "no shape fits 64 devices"),
        (PlannerConfig(stages=5, allow_standby=False, time_budget_s=0.2), "no shape fits 64 devices"),
        (PlannerConfig(stages=25, time_budget_s=0.2), "between 1 and the model's 24 layers"),
        (PlannerConfig(stages=8, group_size=9, time_budget_s=0.2), "no shape fits"),
    ],
)
def test_no_shape_fits(config, words, scenario_problem):
    with pytest.raises(PlanningError, match=words):
        solve(scenario_problem("world-wide"), config, np.random.default_rng(0))


def test_shapes_with_and_without_standby():
    problem = random_problem(6, 2, 0, Workload(preset("tiny", 4), batch=8))
    exact = {(s.stages, s.group_size) for s in problem.shapes(None, None, allow_standby=False)}
    assert exact == {(1, 6), (2, 3), (3, 2)}  # 6 = S x m with S <= 4 layers
    loose = {(s.stages, s.group_size) for s in problem.shapes(None, None, allow_standby=True)}
    assert loose == {(s, m) for s in range(1, 5) for m in range(1, 7) if s * m <= 6}


def test_nothing_fits_in_memory():
    raw = {
        # each holds a layer (1.01 GB), together not the model's 22.7 GB (one of 0.5 GB would be left out first)
        "devices": [{"id": f"d{i}", "region": "r", "tflops": 100.0, "memory_gb": 2.0} for i in range(4)],
        "regions": {"r": {"latency_ms": 1.0, "bandwidth_gbps": 10.0}},
    }
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("gpt3-xl"), batch=64))
    with pytest.raises(PlanningError, match="nothing fits in memory"):
        solve(problem, PlannerConfig(time_budget_s=0.3), np.random.default_rng(0))


@pytest.mark.parametrize("cost_model", ["time", "dtfm"])
def test_a_single_device_gets_the_whole_model(cost_model, check_plan):
    """One peer alone is a valid swarm: one stage, one lane, every layer."""
    raw = {
        "devices": [{"id": "solo", "region": "r", "tflops": 100.0, "memory_gb": 80.0}],
        "regions": {"r": {"latency_ms": 1.0, "bandwidth_gbps": 10.0}},
    }
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny"), batch=8))
    solution = solve(problem, PlannerConfig(cost_model=cost_model, time_budget_s=0.3), np.random.default_rng(0))
    check_plan(problem, solution)
    assert solution.plan.lanes == (("solo",),)
    assert solution.report.layers == (4,)
