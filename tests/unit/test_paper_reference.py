"""The paper's reference costs (Yuan et al., NeurIPS 2022, from the authors' scheduler code): 64 V100s in
8 groups of 8, c_DP = 0.65e9 bytes, c_PP = 0.471248e9 bytes, for the five shipped scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer import scenarios
from hetpeer.coordinator.planner import PlannerConfig, Shape, solve
from hetpeer.coordinator.planner.baselines import blocks_grid, strided_grid
from hetpeer.coordinator.planner.dtfm import DtfmCost
from hetpeer.coordinator.planner.grid import Aligner

SHAPE = Shape(8, 8)

# scenario: (blocks, strided) exact cost in seconds
REFERENCE = {
    "datacenter-on-demand": (16.981, 3.440),
    "datacenter-spot": (49.504, 49.504),
    "multi-datacenter": (17.648, 16.087),
    "regional": (39.241, 34.802),
    "world-wide": (59.437, 49.218),
}


def test_every_scenario_has_a_reference():
    assert set(REFERENCE) == set(scenarios.NAMES)


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_blocks_and_strided_match_the_authors(name, scenario_problem):
    problem = scenario_problem(name, paper_bytes=True)
    assert problem.n == 64
    model = DtfmCost(problem, SHAPE)
    aligner = Aligner(model.link_cost)
    blocks, strided = REFERENCE[name]
    assert model.batch_cost(aligner.align(blocks_grid(SHAPE))[None])[0] == pytest.approx(blocks, abs=1e-3)
    assert model.batch_cost(aligner.align(strided_grid(SHAPE))[None])[0] == pytest.approx(strided, abs=1e-3)


def test_reference_assignments():
    blocks, strided = blocks_grid(SHAPE), strided_grid(SHAPE)
    for k in range(8):
        assert blocks[k].tolist() == list(range(8 * k, 8 * k + 8))
        assert strided[k].tolist() == list(range(k, 64, 8))


@pytest.mark.parametrize("name, reached", [("datacenter-on-demand", 3.440), ("world-wide", 49.218)])
def test_search_reaches_the_best_reference(name, reached, scenario_problem):
    problem = scenario_problem(name, paper_bytes=True)
    config = PlannerConfig(cost_model="dtfm", stages=8, group_size=8, time_budget_s=1.0)
    solution = solve(problem, config, np.random.default_rng(0))
    assert solution.shape == SHAPE
    assert solution.plan.standby == ()
    assert solution.report.cost["total_s"] <= reached + 1e-3
    # The plan's cost is the exact cost of its partition: aligning it again cannot lower it.
    model = DtfmCost(problem, SHAPE)
    realigned = model.batch_cost(Aligner(model.link_cost).align(solution.grid)[None])[0]
    assert solution.report.cost["total_s"] <= realigned + 1e-9
