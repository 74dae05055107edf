"""On 8 devices every grid can be tried: the search must get within 1% of the optimum, and cannot beat it."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.baselines import exhaustive
from hetpeer.coordinator.planner.synthetic import random_topology
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

SEEDS = [0, 1, 2]
CASES = [("dtfm", 2, 4), ("dtfm", 4, 2), ("time", 2, 4), ("time", 4, 2), ("time", 2, 3)]


def problem(seed: int, cost_model: str) -> Problem:
    topology = Topology.from_wire(random_topology(8, 3, np.random.default_rng(seed)))
    if cost_model == "dtfm":
        return Problem.from_topology(topology, Workload(preset("gpt3-xl"), batch=64))
    return Problem.from_topology(topology, Workload(preset("tiny", 8), batch=16))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cost_model, stages, group_size", CASES)
def test_search_matches_exhaustive(seed, cost_model, stages, group_size, check_plan):
    tiny = problem(seed, cost_model)
    config = PlannerConfig(cost_model=cost_model, stages=stages, group_size=group_size, time_budget_s=2.0)
    model = make_model(tiny, config, Shape(stages, group_size))
    _, optimum = exhaustive(tiny, model)

    solution = solve(tiny, config, np.random.default_rng(seed))
    check_plan(tiny, solution)
    found = solution.report.objective
    assert found >= optimum * (1 - 1e-9)
    assert found <= optimum * 1.01
    if (stages, group_size) == (2, 3):
        assert len(solution.plan.standby) == 2
