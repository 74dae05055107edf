"""The search's moves on a grid: the descent (swaps, then exchanges of stages between lanes, in turn),
whole-lane reordering, and the kicks out of a local optimum (nudges, perturbations). `search.py`
drives them.

The local search swaps two devices (between groups, between lanes, or with a standby device),
taking the best swap for a few devices at a time: candidates are screened by the cost model's cheap
estimate and the best few confirmed exactly; for large swarms the candidates are the devices most
attached to the device's group plus a random sample. Where swaps stop, the descent exchanges runs
of stages between two lanes (each group keeps its devices; the cost model screens the exchanges of
every pair of lanes with one of the slowest at once) and swaps again around the lanes that changed,
until neither improves.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np

from hetpeer.coordinator.planner.costmodel import IMPROVEMENT, CostModel
from hetpeer.coordinator.planner.problem import Problem

CONFIRMED = 3  # screened swaps confirmed with the exact cost per cell
CELLS_PER_MOVE = 8  # cells whose swaps one move screens together
NUDGE_SWAPS = 3  # random swaps of a nudge: few enough that a descent around them is cheap
EXCHANGES_CONFIRMED = 8  # screened lane exchanges confirmed with the exact cost per step of a descent


def nudge(grid: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A light kick: a copy of `grid` with `NUDGE_SWAPS` random swaps (cells, or a cell and a standby
    device), and the cells a descent should look at after it, those sharing a stage or a lane with a
    changed cell, as an (S, m) mask. A descent from there revisits a few rows and lanes, not the
    whole grid, so a nudge costs a small part of a full local search."""
    S, m = grid.shape
    nudged, touched = _random_swaps(grid, np.setdiff1d(np.arange(n), grid.ravel()), NUDGE_SWAPS, rng)
    look = np.zeros((S, m), dtype=bool)
    look[touched // m, :] = True
    look[:, touched % m] = True
    return nudged, look


def _random_swaps(
    grid: np.ndarray, standby: np.ndarray, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A copy of `grid` after `count` random swaps, each of a random cell with a random cell or standby
    device, and the flat indices of the cells the swaps touched."""
    cells = grid.size
    pool = np.concatenate([grid.ravel(), standby])
    touched = []
    for _ in range(count):
        a, b = int(rng.integers(cells)), int(rng.integers(len(pool)))
        pool[a], pool[b] = pool[b], pool[a]
        touched += [a, b] if b < cells else [a]
    return pool[:cells].reshape(grid.shape), np.array(touched, dtype=np.int64)


def reorder_lanes(
    model: CostModel, grid: np.ndarray, cost: float, max_candidates: int, rng: np.random.Generator
) -> tuple[np.ndarray, float]:
    """Swap whole lanes while that helps. Lane order sets who all-reduces or gossips with whom in
    every group; changing it cell by cell would break the lanes, so single swaps never find it."""
    m = grid.shape[1]
    pairs = np.array([(a, b) for a in range(m) for b in range(a + 1, m)], dtype=np.int64).reshape(-1, 2)
    for _ in range(m):
        trial_pairs = pairs if len(pairs) <= max_candidates else pairs[rng.choice(len(pairs), max_candidates)]
        if len(trial_pairs) == 0:
            break
        batch = np.repeat(grid[None], len(trial_pairs), axis=0)
        rows = np.arange(len(trial_pairs))
        batch[rows, :, trial_pairs[:, 0]], batch[rows, :, trial_pairs[:, 1]] = (
            grid[:, trial_pairs[:, 1]].T, grid[:, trial_pairs[:, 0]].T,
        )
        costs = model.batch_cost(batch)
        best = int(np.argmin(costs))
        if costs[best] >= cost - IMPROVEMENT * abs(cost):
            break
        grid, cost = batch[best], float(costs[best])
    return grid, cost


def descend(
    problem: Problem,
    model: CostModel,
    grid: np.ndarray,
    cost: float,
    max_candidates: int,
    rng: np.random.Generator,
    deadline: float,
    clock: Callable[[], float] = time.perf_counter,
    look: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Local search by swaps and by exchanges of stages between lanes, in turn, until neither improves
    or time is up. The two reach different grids: a swap moves one device, an exchange moves a run
    of stages from lane to lane at once (at 1024 devices, a swap descent that had stopped at 1.847 s
    per step went on to 1.827 by exchanges and to 1.801 by both from there). After exchanges,
    swaps look again only at the lanes that changed; `look` (S, m) limits the first swaps."""
    while True:
        grid, cost = local_search(problem, model, grid, cost, max_candidates, rng, deadline, clock, look)
        grid, cost, changed = exchange_lanes(model, grid, cost, deadline, clock)
        if not changed.any() or clock() > deadline:
            return grid, cost
        look = np.zeros(grid.shape, dtype=bool)
        look[:, changed] = True


def exchange_lanes(
    model: CostModel, grid: np.ndarray, cost: float, deadline: float, clock: Callable[[], float] = time.perf_counter
) -> tuple[np.ndarray, float, np.ndarray]:
    """Best-exchange descent: while time is left, the best few exchanges the model screens are
    confirmed with the exact cost and the best taken if it improves. Returns the grid, its cost and
    which lanes changed (m,)."""
    changed = np.zeros(grid.shape[1], dtype=bool)
    while clock() < deadline:
        offered = model.exchanges(grid, EXCHANGES_CONFIRMED)
        if len(offered) == 0:
            break
        costs = model.batch_cost(offered)
        best = int(np.argmin(costs))
        if not costs[best] < cost - IMPROVEMENT * abs(cost):
            break
        changed |= (offered[best] != grid).any(axis=0)
        grid, cost = offered[best], float(costs[best])
    return grid, cost, changed


def local_search(
    problem: Problem,
    model: CostModel,
    grid: np.ndarray,
    cost: float,
    max_candidates: int,
    rng: np.random.Generator,
    deadline: float,
    clock: Callable[[], float] = time.perf_counter,
    look: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """Best-swap descent until no cell looked at can improve or time is up. A move looks at a few
    cells at once (`CELLS_PER_MOVE`) and takes the best swap of any of them: candidates are screened
    by the model's cheap estimate and the best few per cell confirmed exactly, all in one call each,
    since at a thousand devices a call's fixed cost outweighs its work. After a swap, only the cells
    sharing a stage or a lane with the two moved cells are looked at again; a cell whose own gain
    lost to a better swap of the same move rests until then, so a descent can stop short of a strict
    local optimum (nudges and later descents revisit it). `look` (S, m) limits the first cells
    looked at (default: all). A move costs
    O(CELLS_PER_MOVE * max_candidates) screens and O(CELLS_PER_MOVE * CONFIRMED) exact costs."""
    S, m = grid.shape
    grid = grid.copy()
    cells = S * m
    standby = np.setdiff1d(np.arange(problem.n), grid.ravel())
    # Mean group cost of every device to each stage's group, refreshed for the rows a swap changes;
    # needed only when a cell has more swap partners (every other device) than are screened.
    attachment = model.group_cost[:, grid].mean(axis=2) if problem.n - 1 > max_candidates else None
    # "don't look" bits: cells whose surroundings have not changed rest
    look = np.ones(cells, dtype=bool) if look is None else look.ravel().copy()
    while look.any() and clock() < deadline:
        waiting = (cell for cell in rng.permutation(cells).tolist() if look[cell])  # read as it goes
        while clock() < deadline:
            chunk = list(itertools.islice(waiting, CELLS_PER_MOVE))
            if not chunk:
                break
            look[chunk] = False
            parts = [(cell, _candidates(grid, standby, attachment, cell, max_candidates, rng)) for cell in chunk]
            if len(parts[0][1]) == 0:  # a single device and no standby: nothing to swap
                return grid, cost
            move = _best_swap(model, grid, cost, standby, parts)
            if move is None:
                continue
            cell, target, grid, cost = move
            for moved in (cell, target) if target < cells else (cell,):
                look.reshape(S, m)[moved // m, :] = True
                look.reshape(S, m)[:, moved % m] = True
            if attachment is not None:
                rows = [cell // m] + ([target // m] if target < cells else [])
                attachment[:, rows] = model.group_cost[:, grid[rows]].mean(axis=2)
    return grid, cost


def _best_swap(
    model: CostModel, grid: np.ndarray, cost: float, standby: np.ndarray, parts: list[tuple[int, np.ndarray]]
) -> tuple[int, int, np.ndarray, float] | None:
    """The best improving swap of any cell in `parts` (each with its swap partners), as (cell,
    partner, new grid, its cost), or None. The screen holds the layer split, which the exact cost
    re-balances (mostly for the better): each cell's best few are confirmed when the screen promises
    it a gain, else its best one. A standby partner swapped in is written back into `standby`."""
    cells = grid.size
    swaps = [_swapped(grid, standby, cell, targets) for cell, targets in parts]
    batch = np.concatenate([swapped for swapped, _ in swaps])
    screened = model.screen(grid, batch, np.concatenate([changed for _, changed in swaps]))
    shortlists, offset = [], 0
    for _, targets in parts:
        own = screened[offset : offset + len(targets)]
        confirmed = CONFIRMED if own.min() < cost else 1
        shortlists.append(offset + np.argsort(own, kind="stable")[:confirmed])
        offset += len(targets)
    shortlist = np.concatenate(shortlists)
    trial = model.batch_cost(batch[shortlist])
    if not trial.min() < cost - IMPROVEMENT * abs(cost):
        return None
    best = int(shortlist[np.argmin(trial)])
    cell = int(np.concatenate([np.full(len(targets), cell) for cell, targets in parts])[best])
    target = int(np.concatenate([targets for _, targets in parts])[best])
    if target >= cells:
        standby[target - cells] = grid.flat[cell]
    return cell, target, batch[best].copy(), float(trial.min())


def _swapped(grid: np.ndarray, standby: np.ndarray, cell: int, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copies of `grid` with `cell` swapped with each target (a cell index, or S*m + a standby
    index), and the two cells each changes (equal for a standby device brought in)."""
    cells = grid.size
    batch = np.repeat(grid[None], len(targets), axis=0)
    flat = batch.reshape(len(targets), cells)
    here = flat[:, cell].copy()
    in_grid = targets < cells
    cell_targets = targets[in_grid]
    flat[in_grid, cell] = flat[in_grid, cell_targets]
    flat[np.flatnonzero(in_grid), cell_targets] = here[in_grid]
    flat[~in_grid, cell] = standby[targets[~in_grid] - cells]
    changed = np.stack([np.full(len(targets), cell), np.where(in_grid, targets, cell)], axis=1)
    return batch, changed


def _candidates(grid, standby, attachment, cell, limit, rng) -> np.ndarray:
    """Swap partners for `cell`: cell indices below S*m, standby devices as S*m + their index.
    Beyond `limit`, half are the devices most attached to the cell's group, half at random."""
    S, m = grid.shape
    cells = S * m
    everything = np.concatenate([np.delete(np.arange(cells), cell), cells + np.arange(len(standby))])
    if len(everything) <= limit:
        return everything
    devices = np.concatenate([grid.ravel(), standby])[everything]
    near = everything[np.argpartition(attachment[devices, cell // m], limit // 2)[: limit // 2]]
    return np.concatenate([near, everything[rng.integers(len(everything), size=limit - len(near))]])


def perturb(grid: np.ndarray, n: int, group_cost: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A kick out of a local optimum that single swaps cannot leave: a copy of `grid` with either a
    whole lane replaced by a tight cluster of standby devices (a random standby device and those it
    is best connected to: a well-placed site can take over a lane only all at once), or a few
    random swaps (cells, or a cell and a standby device)."""
    S, m = grid.shape
    standby = np.setdiff1d(np.arange(n), grid.ravel())
    if len(standby) >= S and rng.random() < 0.5:
        centre = standby[rng.integers(len(standby))]
        cluster = standby[np.argsort(group_cost[centre, standby], kind="stable")[:S]]
        kicked = grid.copy()
        kicked[:, rng.integers(m)] = cluster
        return kicked
    return _random_swaps(grid, standby, max(2, S * m // 8), rng)[0]
