"""The planner on several worker processes (`planner/islands.py`): the same plan for a seed and a worker count where
the search finishes within its budget, memories that later solves go on from with any worker count, and a worker
that fails or dies named in the error."""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import replace

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, SearchConfig, make_model, solve
from hetpeer.coordinator.planner.islands import Archipelago, IslandError, Islands, search_islands
from hetpeer.coordinator.planner.problem import PlanningError
from tests.unit.test_solve_determinism import problem

QUICK = SearchConfig(patience=8, restarts=1)  # converges in a fraction of the budget: nothing hits a deadline


def run(p, workers: int, seed: int = 7, memory=None, islands=None):
    config = PlannerConfig(time_budget_s=60.0, workers=workers, search=QUICK)
    return solve(p, config, np.random.default_rng(seed), memory=memory, islands=islands)


def epochs(p, islands) -> list[str]:
    said: list[str] = []
    config = PlannerConfig(time_budget_s=60.0, workers=2, search=QUICK)
    solve(p, config, np.random.default_rng(7), progress=said.append, islands=islands)
    return [line for line in said if line.startswith("epoch")]


def test_the_same_seed_and_worker_count_give_the_same_plan():
    small = problem(10, 3, 5)
    with Islands(2) as islands:  # kept between solves, as a coordinator keeps them between rounds
        first, second = run(small, 2, islands=islands), run(small, 2, islands=islands)
    assert first.plan.to_wire() == second.plan.to_wire()
    assert isinstance(first.memory, Archipelago) and len(first.memory.memories) == 2
    # the best island's memory first, its best grid leading every island's population
    leader = first.memory.memories[0].shapes[0]
    assert leader.shape == first.shape
    assert all(m.shapes[0].population[0] == leader.population[0] for m in first.memory.memories)


def test_a_later_solve_goes_on_from_the_islands_with_any_worker_count():
    small = problem(10, 3, 6)
    islands = run(small, 2)
    for workers in (1, 3):
        again = run(small, workers, seed=8, memory=islands.memory)
        assert again.report.objective <= islands.report.objective * (1 + 1e-9)


def test_a_worker_that_fails_is_named_with_its_traceback():
    small = problem(6, 2, 1)
    shapes = small.shapes(None, None, True)
    broken = functools.partial(int)  # int(shape): a TypeError in the worker
    with Islands(2) as islands, pytest.raises(IslandError, match=r"island 2 failed:(.|\n)*TypeError"):
        search_islands(small, shapes, functools.partial(make_model, small, PlannerConfig()), broken, QUICK,
                       np.random.default_rng(0), 1.0, islands)


def test_a_problem_a_worker_finds_no_plan_for_is_a_planning_error_and_the_workers_stay():
    small = problem(6, 2, 1)
    shapes = small.shapes(None, None, True)
    unplannable = functools.partial(make_model, replace(small, tflops=None), PlannerConfig())  # no compute speeds
    with Islands(2) as islands:
        with pytest.raises(PlanningError, match="needs tflops"):
            search_islands(small, shapes, functools.partial(make_model, small, PlannerConfig()), unplannable, QUICK,
                           np.random.default_rng(0), 1.0, islands)
        assert run(small, 2, islands=islands).plan.total_s > 0  # started again for the next solve
        # the first island finds no plan while the others search: their answers do not reach the next solve
        with pytest.raises(PlanningError, match="needs tflops"):
            search_islands(small, shapes, unplannable, functools.partial(make_model, small, PlannerConfig()), QUICK,
                           np.random.default_rng(0), 1.0, islands)
        assert epochs(problem(6, 2, 3), islands) == epochs(problem(6, 2, 3), None)  # each island's best, as a fresh pool's


def test_a_worker_killed_before_the_solve_is_an_island_error():
    small = problem(6, 2, 2)
    with Islands(2) as islands:
        islands.start()
        islands._processes[0].kill()
        islands._processes[0].wait()
        with pytest.raises(IslandError, match="island 2"):
            run(small, 2, islands=islands)


def test_a_worker_that_does_not_answer_in_time_is_left_out_and_its_late_answer_passed_over():
    small = problem(6, 2, 4)
    with Islands(2) as islands:
        islands.start()
        stopped = islands._processes[0]
        os.kill(stopped.pid, signal.SIGSTOP)  # as a worker still importing, or starved of a core, would be
        try:
            said: list[str] = []
            config = PlannerConfig(time_budget_s=1.0, workers=2, search=QUICK)  # waited for until then, and LATE_S
            alone = solve(small, config, np.random.default_rng(7), progress=said.append, islands=islands)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        assert "epoch 1 of 1: island 2 of 2 did not answer in time: left out" in said
        assert any(line.endswith("(" + f"{alone.report.objective:.4g}" + ", late)") for line in said), said
        # the next solve passes over the late answer: the same worker, the same islands' bests as a fresh pool's
        assert epochs(problem(6, 2, 3), islands) == epochs(problem(6, 2, 3), None)
        assert islands._processes == [stopped] and stopped.poll() is None
