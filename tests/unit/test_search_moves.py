"""The search's moves: each keeps a grid valid and never makes it worse where it claims to improve."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetpeer import scenarios
from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.moves import (
    NUDGE_SWAPS,
    _best_swap,
    descend,
    exchange_lanes,
    local_search,
    nudge,
    perturb,
    reorder_lanes,
)
from hetpeer.coordinator.planner.search import _start_order
from hetpeer.coordinator.planner.synthetic import random_topology
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def problem(n: int, seed: int) -> Problem:
    raw = random_topology(n, 4, np.random.default_rng(seed))
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 8), batch=32))


def start(n: int, shape: Shape, seed: int, config: PlannerConfig = PlannerConfig()):
    """A problem, its cost model, a random grid of the shape and its cost."""
    p = problem(n, seed)
    model = make_model(p, config, shape)
    rng = np.random.default_rng(seed)
    grid = rng.permutation(n)[: shape.devices].reshape(shape.stages, shape.group_size)
    return p, model, rng, grid, float(model.batch_cost(grid[None])[0])


@pytest.mark.parametrize("seed", range(5))
def test_reordering_lanes_keeps_lanes_whole_and_never_hurts(seed):
    _, model, rng, grid, cost = start(12, Shape(2, 5), seed, PlannerConfig(sync="gossip"))
    reordered, new_cost = reorder_lanes(model, grid, cost, 64, rng)
    assert new_cost <= cost
    assert new_cost == pytest.approx(float(model.batch_cost(reordered[None])[0]))
    assert sorted(map(tuple, grid.T)) == sorted(map(tuple, reordered.T))  # the same lanes, reordered
    # No single lane swap improves the result any further.
    for a, b in itertools.combinations(range(5), 2):
        swapped = reordered.copy()
        swapped[:, [a, b]] = swapped[:, [b, a]]
        assert model.batch_cost(swapped[None])[0] >= new_cost - 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_kicks_give_valid_grids(seed):
    _, model, rng, grid, _ = start(12, Shape(3, 2), seed)
    kicked = perturb(grid, 12, model.group_cost, rng)
    assert kicked.shape == grid.shape
    assert len(set(kicked.ravel())) == 6 and set(kicked.ravel()) <= set(range(12))
    assert not np.shares_memory(kicked, grid)


def test_a_lane_kick_brings_in_a_tight_standby_cluster():
    p = problem(12, 3)
    model = make_model(p, PlannerConfig(), Shape(3, 2))
    grid = np.arange(6).reshape(3, 2)
    standby = set(range(6, 12))
    lane_kicks = 0
    for seed in range(40):
        kicked = perturb(grid, 12, model.group_cost, np.random.default_rng(seed))
        for lane in range(2):
            incoming = set(int(d) for d in kicked[:, lane])
            if incoming <= standby and (kicked[:, 1 - lane] == grid[:, 1 - lane]).all():
                lane_kicks += 1
                # A tight cluster: some incoming device and the standby devices it is best
                # connected to, nothing else.
                others = sorted(standby)
                assert any(
                    incoming == {others[k] for k in np.argsort(model.group_cost[c, others], kind="stable")[:3]}
                    for c in incoming
                )
    assert lane_kicks > 0


@pytest.mark.parametrize("limit", [64, 6])  # 6: fewer screened than partners, the sampled path
@pytest.mark.parametrize("seed", range(5))
def test_local_search_never_makes_a_grid_worse(seed, limit):
    p, model, rng, grid, cost = start(16, Shape(3, 4), seed)
    better, new_cost = local_search(p, model, grid, cost, limit, rng, deadline=np.inf)
    assert new_cost <= cost
    assert new_cost == pytest.approx(float(model.batch_cost(better[None])[0]))
    assert len(set(better.ravel())) == 12


@pytest.mark.parametrize("seed", range(5))
def test_lane_exchanges_keep_every_group_and_never_hurt(seed):
    _, model, _, grid, cost = start(30, Shape(4, 5), seed)
    exchanged, new_cost, changed = exchange_lanes(model, grid, cost, deadline=np.inf)
    assert new_cost <= cost and new_cost == pytest.approx(float(model.batch_cost(exchanged[None])[0]))
    assert all(set(row) == set(own) for row, own in zip(exchanged, grid))  # stages moved between lanes only
    assert changed.tolist() == (exchanged != grid).any(axis=0).tolist()
    # a random grid of lanes across regions has runs of stages worth exchanging
    assert new_cost < cost and changed.sum() >= 2
    # where it stops, none of the exchanges the model offers is better
    offered = model.exchanges(exchanged, 8)
    assert len(offered) == 0 or model.batch_cost(offered).min() >= new_cost * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_a_descent_stops_where_neither_swaps_nor_exchanges_improve(seed):
    p, model, rng, grid, cost = start(30, Shape(4, 5), seed)
    better, new_cost = descend(p, model, grid, cost, 64, rng, deadline=np.inf)
    assert new_cost < cost and new_cost == pytest.approx(float(model.batch_cost(better[None])[0]))
    assert len(set(better.ravel())) == 20
    assert exchange_lanes(model, better, new_cost, deadline=np.inf)[1] == new_cost


def test_the_paper_cost_offers_no_exchanges():
    """dtfm's lanes cost their boundaries' slowest links, which alignment already minimises."""
    _, model, _, grid, _ = start(12, Shape(3, 2), 0, PlannerConfig(cost_model="dtfm", allow_standby=False))
    assert model.exchanges(grid, 8).shape == (0, 3, 2)


def test_world_wide_lanes_find_their_gossip_order():
    """World-wide, 8 stages x 5 lanes: lanes inside single regions, and the lanes ordered so that
    gossip partners are close. One region per lane, in file order, is the plan to beat; reaching it
    takes whole-lane moves (a cell swap breaks a lane)."""
    p = Problem.from_topology(
        Topology.from_wire(scenarios.load("world-wide")), Workload(preset("gpt3-xl"), batch=512)
    )
    config = PlannerConfig(stages=8, group_size=5, time_budget_s=10)
    reference = np.array([[8 + s, 16 + s, 40 + s, 48 + s, 56 + s] for s in range(8)])  # virginia .. ireland
    target = make_model(p, config, Shape(8, 5)).report(reference).objective
    solution = solve(p, config, np.random.default_rng(0))
    assert solution.report.objective <= target


def test_starts_descend_from_the_best_seed_every_other_time():
    ranked = [np.full((1, 1), k) for k in range(4)]
    assert [int(g[0, 0]) for g in _start_order(ranked, 7)] == [0, 1, 0, 2, 0, 3, 0]
    assert [int(g[0, 0]) for g in _start_order(ranked[:2], 5)] == [0, 1, 0, 1, 0]
    assert [int(g[0, 0]) for g in _start_order(ranked[:1], 3)] == [0, 0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_a_move_takes_the_best_swap_of_the_cells_it_looks_at(seed):
    """With every stage holding one layer the screen is exact, so the move must be the best swap
    of all the cells' partners, found by trying each (or none when no swap improves)."""
    n, shape = 20, Shape(8, 2)
    p = problem(n, seed)
    model = make_model(p, PlannerConfig(), shape)
    rng = np.random.default_rng(seed)
    grid = rng.permutation(n)[: shape.devices].reshape(shape.stages, shape.group_size)
    cost = float(model.batch_cost(grid[None])[0])
    standby = np.setdiff1d(np.arange(n), grid.ravel())
    cells = [int(c) for c in rng.choice(shape.devices, size=3, replace=False)]
    everyone = [np.concatenate([np.delete(np.arange(16), c), 16 + np.arange(len(standby))]) for c in cells]
    tried = []
    for cell, targets in zip(cells, everyone):
        for target in targets:
            swapped = np.concatenate([grid.ravel(), standby])
            swapped[[cell, target]] = swapped[[target, cell]]
            tried.append(float(model.batch_cost(swapped[:16].reshape(8, 2)[None])[0]))
    best_cost = min(tried)
    kept = standby.copy()
    move = _best_swap(model, grid, cost, kept, list(zip(cells, everyone)))
    if best_cost >= cost:
        assert move is None
        return
    _, _, new_grid, new_cost = move
    assert new_cost == pytest.approx(best_cost, rel=1e-12)
    assert new_cost == pytest.approx(float(model.batch_cost(new_grid[None])[0]), rel=1e-12)
    assert set(new_grid.ravel()) | set(kept) == set(range(n))  # a device swapped in left standby


@pytest.mark.parametrize("seed", range(20))
def test_a_nudge_swaps_a_few_cells_and_looks_only_around_them(seed):
    grid = np.random.default_rng(seed).permutation(100)[:80].reshape(8, 10)
    nudged, look = nudge(grid, 100, np.random.default_rng(seed))
    assert nudged.shape == grid.shape and not np.shares_memory(nudged, grid)
    assert len(set(nudged.ravel())) == 80 and set(nudged.ravel()) <= set(range(100))
    changed = np.argwhere(nudged != grid)
    assert len(changed) <= 2 * NUDGE_SWAPS
    for row, lane in changed:  # every changed cell is looked at again, with its stage and its lane
        assert look[row, :].all() and look[:, lane].all()
    # ... and nothing else: what is looked at is whole stages and lanes, one of each per swapped cell
    rows, lanes = look.all(axis=1), look.all(axis=0)
    assert (look == (rows[:, None] | lanes[None, :])).all()
    assert rows.sum() <= 2 * NUDGE_SWAPS and lanes.sum() <= 2 * NUDGE_SWAPS


@pytest.mark.parametrize("seed", range(5))
def test_a_descent_looks_only_at_the_cells_it_is_told(seed):
    p, model, rng, grid, cost = start(16, Shape(3, 4), seed)
    resting, same_cost = local_search(p, model, grid, cost, 64, rng, deadline=np.inf, look=np.zeros((3, 4), bool))
    assert np.array_equal(resting, grid) and same_cost == cost
    look = np.zeros((3, 4), bool)
    look[1, :] = True
    better, new_cost = local_search(p, model, grid, cost, 64, rng, deadline=np.inf, look=look)
    assert new_cost <= cost
    assert new_cost == pytest.approx(float(model.batch_cost(better[None])[0]))
    assert len(set(better.ravel())) == 12
