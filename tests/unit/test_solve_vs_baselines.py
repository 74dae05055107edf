"""The search is never worse than the baselines it is printed beside, under the same cost model."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.baselines import baseline_costs, blocks_grid, random_grids
from hetpeer.coordinator.planner.grid import Aligner
from hetpeer.coordinator.planner.synthetic import random_topology
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def random_problem(devices: int, regions: int, seed: int) -> Problem:
    raw = random_topology(devices, regions, np.random.default_rng(seed))
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("gpt3-xl", 8), batch=64))


CASES = [
    ("world-wide", PlannerConfig(cost_model="dtfm", stages=8, group_size=8, time_budget_s=0.5)),
    ("regional", PlannerConfig(cost_model="time", time_budget_s=1.0)),
    ("random-16", PlannerConfig(cost_model="time", time_budget_s=0.5)),
    ("random-16", PlannerConfig(cost_model="dtfm", time_budget_s=0.5)),
]


@pytest.mark.parametrize("name, config", CASES, ids=[f"{n}-{c.cost_model}" for n, c in CASES])
def test_never_worse_than_blocks_or_random(name, config, scenario_problem):
    problem = random_problem(16, 4, 3) if name == "random-16" else scenario_problem(name, paper_bytes=True)
    solution = solve(problem, config, np.random.default_rng(0))
    model = make_model(problem, config, solution.shape)
    objective = solution.report.objective
    assert model.batch_cost(solution.grid[None])[0] == pytest.approx(objective)

    blocks = blocks_grid(solution.shape)
    assert objective <= model.batch_cost(blocks[None])[0] + 1e-9
    assert objective <= model.batch_cost(Aligner(model.link_cost).align(blocks)[None])[0] + 1e-9
    randoms = random_grids(problem, solution.shape, 200, np.random.default_rng(1))
    assert objective <= model.batch_cost(randoms).min() + 1e-9


def test_baseline_costs_are_the_blocks_and_mean_random_totals():
    problem = random_problem(8, 2, 5)
    config = PlannerConfig(cost_model="time")
    model = make_model(problem, config, Shape(2, 3))
    costs = baseline_costs(problem, model, 20, np.random.default_rng(9))
    assert costs["blocks"] == pytest.approx(model.report(np.array([[0, 1, 2], [3, 4, 5]])).cost["total_s"])
    grids = random_grids(problem, Shape(2, 3), 20, np.random.default_rng(9))
    totals = [model.report(grid).cost["total_s"] for grid in grids]
    assert costs["random"] == pytest.approx(np.mean(totals))


def test_random_grids_are_valid_and_vary():
    problem = random_problem(8, 2, 6)
    grids = random_grids(problem, Shape(2, 3), 50, np.random.default_rng(0))
    assert grids.shape == (50, 2, 3)
    for grid in grids:
        assert len(set(grid.ravel().tolist())) == 6
        assert set(grid.ravel().tolist()) <= set(range(8))
    assert len({tuple(g.ravel()) for g in grids}) > 1
