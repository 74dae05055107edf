"""The same seed gives the same plan when the search converges; with a deadline it stops and still
answers (anytime), reading only the clock it is given."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, SearchConfig, solve
from hetpeer.coordinator.planner.synthetic import random_topology
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def problem(devices: int, regions: int, seed: int, layers: int = 8) -> Problem:
    raw = random_topology(devices, regions, np.random.default_rng(seed))
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("gpt3-xl", layers), batch=64))


class TickingClock:
    """Advances `step` seconds every time it is read."""

    def __init__(self, step: float) -> None:
        self.step, self.now, self.reads = step, 0.0, 0

    def __call__(self) -> float:
        self.now += self.step
        self.reads += 1
        return self.now


def test_same_seed_same_plan_with_a_generous_budget():
    small = problem(8, 3, 11)
    config = PlannerConfig(cost_model="time", time_budget_s=30.0)  # converges long before
    first = solve(small, config, np.random.default_rng(42))
    second = solve(small, config, np.random.default_rng(42))
    assert first.plan.to_wire() == second.plan.to_wire()
    assert np.array_equal(first.grid, second.grid)
    assert first.generations == second.generations


def test_same_seed_same_plan_when_the_clock_never_runs_out():
    small = problem(10, 3, 12)
    for cost_model in ("time", "dtfm"):
        config = PlannerConfig(cost_model=cost_model, time_budget_s=1.0)
        plans = [solve(small, config, np.random.default_rng(7), clock=lambda: 0.0).plan.to_wire() for _ in range(2)]
        assert plans[0] == plans[1]


def test_search_stops_at_the_deadline_of_the_injected_clock(check_plan):
    larger = problem(16, 4, 13)
    clock = TickingClock(step=0.01)
    config = PlannerConfig(cost_model="time", time_budget_s=1.0)
    solution = solve(larger, config, np.random.default_rng(0), clock=clock)
    check_plan(larger, solution)
    # About 100 readings fit in the budget: far too few to run out of patience, so the search ran to
    # the deadline, and must then notice it within a bounded number of further readings.
    assert solution.generations < SearchConfig().patience
    deadline_reads = 1.0 / 0.01
    assert deadline_reads <= clock.reads <= deadline_reads + 100


def test_search_answers_even_if_the_deadline_passes_at_once(check_plan):
    larger = problem(16, 4, 14)
    clock = TickingClock(step=100.0)  # every reading is past the deadline
    for cost_model in ("time", "dtfm"):
        solution = solve(larger, PlannerConfig(cost_model=cost_model, time_budget_s=1.0), np.random.default_rng(0),
                         clock=clock)
        check_plan(larger, solution)
        assert solution.generations == 0


def test_progress_reports_each_searched_shape():
    lines: list[str] = []
    config = PlannerConfig(cost_model="dtfm", stages=2, group_size=4, time_budget_s=0.5)
    solve(problem(8, 3, 15), config, np.random.default_rng(0), progress=lines.append)
    assert lines and all("2 stages x 4 lanes" in line for line in lines)


def test_a_converged_search_restarts_until_restarts_in_a_row_find_nothing_better():
    """Restarts begin where the search without them ends (the same seed draws the same numbers until
    then), so they can only improve the plan; the search stops after `restarts` restarts in a row that
    found nothing better, long before a generous budget."""
    larger = problem(24, 4, 16)
    results = {}
    for restarts in (0, 3):
        lines: list[str] = []
        config = PlannerConfig(time_budget_s=60.0, search=SearchConfig(restarts=restarts))
        results[restarts] = solve(larger, config, np.random.default_rng(3), progress=lines.append)
        restart_lines = [line for line in lines if "restart" in line]
        if restarts == 0:
            assert restart_lines == []
            continue
        assert len(restart_lines) >= restarts
        last_best = max((k for k, line in enumerate(restart_lines) if "(best)" in line), default=-1)
        assert len(restart_lines) - 1 - last_best == restarts
    assert results[3].report.objective <= results[0].report.objective
    assert results[3].generations > results[0].generations


def test_search_settings_are_checked():
    for bad in ({"restarts": -1}, {"nudges": 1.5}, {"nudges": -0.1}, {"population": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SearchConfig(**bad)
