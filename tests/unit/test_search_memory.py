"""A search goes on from an earlier one's memory: what it found is not lost, the time it had adds up, and peers
that left since are replaced while grids that lost too many of theirs are forgotten. Budgets run on a clock
that ticks per reading, so that what a search does in them does not depend on the machine's load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetpeer.coordinator.planner import Memory, PlannerConfig, Problem, Shape, solve
from hetpeer.coordinator.planner.search import FORGET_SHARE, Remembered, _recall
from tests.unit.test_solve_determinism import TickingClock, problem as swarm


def problem(devices: int = 40, seed: int = 3) -> Problem:
    return swarm(devices, 5, seed)


def run(p: Problem, budget_s: float, seed: int, memory: Memory | None = None, **config):
    return solve(p, PlannerConfig(time_budget_s=budget_s, **config), np.random.default_rng(seed), clock=TickingClock(0.001),
                 memory=memory)


def test_rounds_never_lose_the_best_plan_and_their_time_adds_up():
    p = problem()
    first = run(p, 0.5, 0)
    memory, best = first.memory, first.report.objective
    assert memory.shapes and memory.shapes[0].shape == first.shape
    for seed in range(1, 5):
        again = run(p, 0.5, seed, memory)
        assert again.report.objective <= best * (1 + 1e-9)
        assert again.memory.searched_s > memory.searched_s  # each round's time is added to what the shapes had
        memory, best = again.memory, again.report.objective


def test_a_round_without_time_answers_with_what_the_last_one_found():
    p = problem()
    searched = run(p, 0.5, 0)
    resumed = run(p, 1e-6, 1, searched.memory)
    fresh = run(p, 1e-6, 1)
    assert resumed.report.objective <= searched.report.objective * (1 + 1e-9)
    assert fresh.report.objective > searched.report.objective  # without the memory, a seed as it was constructed


def test_devices_that_left_are_replaced_and_grids_that_lost_too_many_are_forgotten():
    p = problem()
    ids = p.device_ids
    kept = [ids[i] for i in range(8)]
    gone = [f"gone-{i}" for i in range(8)]
    one_lost = ((kept[0], kept[1]), (kept[2], gone[0]))  # a quarter lost: within FORGET_SHARE, mended
    most_lost = ((gone[1], gone[2]), (gone[3], kept[3]))  # three quarters lost: forgotten
    assert 1 / 4 <= FORGET_SHARE < 3 / 4
    memory = Memory((Remembered(Shape(2, 2), (one_lost, most_lost), 1.0),
                     Remembered(Shape(2, 1), (((gone[4],), (gone[5],)),), 1.0),  # every grid forgotten: the shape too
                     Remembered(Shape(4, 1), (((kept[4],), (kept[5],), (kept[6],), (kept[7],)),), 1.0)))
    shapes = [Shape(2, 2), Shape(2, 1)]  # 4 x 1 is no longer searched: not recalled
    recalled = _recall(memory, p, shapes, np.random.default_rng(0))
    assert [shape for shape, _, _ in recalled] == [Shape(2, 2)]
    (grid,) = recalled[0][1]
    assert grid.shape == (2, 2) and len(set(grid.ravel().tolist())) == 4 and grid.max() < p.n
    assert [ids[i] for i in grid.ravel()[:3]] == [kept[0], kept[1], kept[2]]  # what stayed stays where it was
    assert ids[grid[1, 1]] not in kept[:3]


def test_a_remembered_plan_over_peers_that_changed_still_gives_a_valid_plan(check_plan):
    p = problem(40)
    first = run(p, 0.5, 0)
    survivors = np.setdiff1d(np.arange(p.n), first.grid.ravel()[:3])  # three planned peers left
    smaller = p.subset(survivors)
    again = run(smaller, 0.3, 1, first.memory)
    check_plan(smaller, again)
    assert not set(again.plan.devices) - set(smaller.device_ids)


@pytest.mark.parametrize("stages", [2, 4])
def test_memory_of_a_shape_no_longer_allowed_is_not_used(stages, check_plan):
    p = problem(16)
    remembered = run(p, 0.3, 0, stages=2, group_size=4).memory
    solution = run(p, 0.3, 1, remembered, stages=stages, group_size=8 // stages)
    check_plan(p, solution)
    assert solution.shape == Shape(stages, 8 // stages)
    assert solution.memory.shapes[0].shape == Shape(stages, 8 // stages)


def four(seed: int = 5) -> Problem:
    """Four devices on which two lanes of two stages beat one (5.9 s against 7.8 s a step)."""
    return problem(8, seed).subset(np.arange(4))


def test_a_shape_the_swarm_grows_back_into_is_searched_again():
    # a peer of a 2 x 2 leaves, a round solves the three that stay (2 x 2 no longer fits), the peer comes back:
    # the round after must weigh 2 x 2 again, not only the 2 x 1 the last round remembered
    full = four()
    first = run(full, 0.3, 0, stages=2)
    assert first.shape == Shape(2, 2)
    left = run(full.subset(np.array([0, 1, 3])), 0.3, 1, first.memory, stages=2)
    assert left.shape == Shape(2, 1) and [entry.shape for entry in left.memory.shapes] == [Shape(2, 1)]
    back = run(full, 0.3, 2, left.memory, stages=2)
    assert back.shape == Shape(2, 2)
    assert back.report.objective <= first.report.objective * (1 + 1e-9)
    assert {entry.shape for entry in back.memory.shapes} == {Shape(2, 1), Shape(2, 2)}


def test_a_remembered_shape_that_lost_out_is_tried_again_when_the_peer_that_made_it_lose_returns():
    # five devices, one slow: 2 x 2 of the fast four, the slow one on standby; a fast one leaves, and 2 x 2 would
    # need the slow one, so 2 x 1 wins that round (its lane's one micro-batch alone outlasts a 2 x 1 step: a lane
    # 10x slower would still pay, taking fewer of the step's micro-batches); the fast one returns: 2 x 2 must win
    # again in one round
    p = problem(8, 5).subset(np.arange(5))
    tflops = p.tflops.copy()
    tflops[4] = tflops[:4].min() / 1000
    p = replace(p, tflops=tflops)
    first = run(p, 0.3, 0, stages=2)
    assert first.shape == Shape(2, 2) and first.plan.standby == (p.device_ids[4],)
    left = run(p.subset(np.array([0, 1, 2, 4])), 0.3, 1, first.memory, stages=2)
    assert left.shape == Shape(2, 1) and Shape(2, 2) in [entry.shape for entry in left.memory.shapes]
    back = run(p, 0.3, 2, left.memory, stages=2)
    assert back.shape == Shape(2, 2) and back.report.objective <= first.report.objective * (1 + 1e-9)


def test_a_shape_whose_remembered_grids_were_all_forgotten_is_scored_again():
    full = four()
    ids = full.device_ids
    gone = [f"gone-{i}" for i in range(4)]
    memory = Memory((Remembered(Shape(2, 1), (((ids[0],), (ids[1],)),), 1.0),
                     Remembered(Shape(2, 2), (((gone[0], gone[1]), (gone[2], gone[3])),), 1.0)),
                    frozenset({Shape(2, 1), Shape(2, 2)}))
    assert [shape for shape, _, _ in _recall(memory, full, [Shape(2, 1), Shape(2, 2)], np.random.default_rng(0))] == [Shape(2, 1)]
    again = run(full, 0.3, 1, memory, stages=2)
    assert again.shape == Shape(2, 2)


def test_a_settled_search_rests_until_the_swarm_changes():
    p = swarm(8, 3, 11)
    config = PlannerConfig(time_budget_s=30.0)  # settles (three restarts in a row found nothing) long before
    first = solve(p, config, np.random.default_rng(0))
    assert first.memory.stale >= config.search.restarts and first.memory.best == pytest.approx(first.report.objective)
    clock = TickingClock(0.001)
    rested = solve(p, config, np.random.default_rng(1), clock=clock, memory=first.memory)
    assert rested.generations == 0 and rested.plan.to_wire() == first.plan.to_wire()
    assert rested.memory == first.memory and clock.reads <= 2  # no time spent: the budget and the deadline only
    # a link measured again: the same grid costs more, and the search goes on
    slower = replace(p, bandwidth_bytes_per_s=p.bandwidth_bytes_per_s * 0.5)
    again = solve(slower, config, np.random.default_rng(1), memory=first.memory)
    assert again.generations > 0 and again.memory.searched_s > first.memory.searched_s
    # a peer left: the search goes on over the rest
    fewer = p.subset(np.arange(1, p.n))
    assert solve(fewer, config, np.random.default_rng(1), memory=first.memory).generations > 0


def test_a_search_cut_by_its_deadline_has_not_settled():
    p = problem()
    cut = run(p, 0.05, 0)
    assert cut.memory.stale < PlannerConfig().search.restarts
    assert run(p, 0.05, 1, cut.memory).memory.searched_s > cut.memory.searched_s  # it searched on


def test_rounds_too_short_to_settle_alone_settle_together_and_then_rest():
    p = swarm(8, 3, 11)
    memory, spent = None, []
    for seed in range(60):  # rounds of 0.4 s on a clock of 1 ms a reading: no round affords three restarts
        clock = TickingClock(0.001)
        done = solve(p, PlannerConfig(time_budget_s=0.4), np.random.default_rng(seed), clock=clock, memory=memory)
        assert memory is not None or done.memory.stale < 3  # the first round alone does not settle
        memory = done.memory
        spent.append(clock.reads)
        if done.generations == 0:
            break
    else:
        pytest.fail(f"60 rounds did not settle; restarts in a row without a better grid: {memory.stale}")
    assert memory.stale >= 3 and spent[-1] <= 2 and max(spent[:-1]) > 100
