"""The coordinator's cheap answer to churn: mend the running plan instead of solving again.

`repair(plan, problem, config)` keeps the running plan's stages and lanes and fills each cell whose
device left (a plan device missing from `problem.device_ids`) with the live device outside the plan
(on standby, new, or left over from a lane dropped before) that gives the lowest predicted step time
under the planner's `time` model, one cell at a time: for a cell, every candidate is scored in one
batched evaluation of the grid with that candidate in the cell. A lane is dropped whole (groups stay
equal in size: a lane is one device per stage) when some empty cell has no candidate that fits memory,
or, unless the configuration fixes the number of lanes, when the plan is predicted as fast without the
lane as with it filled (one slow replacement would set the step of every lane); its surviving members go
to standby with a reason, and to later lanes' candidates. Layer splits and sync modes are the time
model's for the resulting grid, as for any plan the planner makes.

Objective: keep training on what is known to work after peers leave, in O(D K) grid evaluations
(D empty cells, K candidates; each evaluation O(S m) for S stages and m lanes) instead of a search
of the whole swarm, which at 1,000 peers needs minutes to beat the running plan.

Pure: no I/O, no clock, no randomness (ties go to the lowest device index).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, to_plan
from hetpeer.protocol.plan import MAX_STANDBY_REASONS, Plan, standby_runs

DROPPED = "its lane was dropped: a member left and no standby peer fit in its place"
SLOWER = "its lane was dropped: a member left and the plan is faster without the lane than with a standby peer in its place"
SPARE = "spare: the repaired plan did not need it"
KEPT = "kept on standby by the running plan"


def repair(plan: Plan, problem: Problem, config: PlannerConfig) -> Plan | None:
    """The running `plan` with its departed members replaced or their lanes dropped, over the live devices
    of `problem` (a plan device not in `problem.device_ids` has left). None when it cannot: no lane survives,
    the result would not fit memory, the plan does not describe the problem's model, or no member left (there
    is nothing to repair). The result has epoch `plan.epoch + 1` and the running plan's start step: the caller
    sets the step it takes effect at."""
    if plan.layers != problem.layers or plan.cost_model != "time":
        return None
    index = {d: i for i, d in enumerate(problem.device_ids)}
    cells = np.array([[index.get(d, -1) for d in stage.devices] for stage in plan.stages])  # -1: left
    if (cells >= 0).all():
        return None  # nothing left: not a plan to repair
    steady = replace(problem, current=None)  # ranking by the step time itself; the move is the caller's concern
    held = set(int(d) for d in cells.ravel() if d >= 0)
    pool = [i for i in range(problem.n) if i not in held]
    kept = [lane for lane in range(cells.shape[1]) if (cells[:, lane] >= 0).all()]
    hit = sorted((lane for lane in range(cells.shape[1]) if lane not in kept), key=lambda lane: (cells[:, lane] < 0).sum())
    dropped: dict[str, list[int]] = {DROPPED: [], SLOWER: []}
    for lane in hit:  # the lanes that lost fewest members first: the cheapest to restore
        filled = _fill_lane(steady, config, cells[:, kept], cells[:, lane], pool)
        # A lane is worth keeping only if the plan is faster with it, unless the organizer fixed the lanes' number.
        slower = (filled is not None and kept and config.group_size is None
                  and not _faster_with(steady, config, cells[:, kept], filled))
        if filled is None or slower:
            survivors = [int(d) for d in cells[:, lane] if d >= 0]
            dropped[DROPPED if filled is None else SLOWER].extend(survivors)
            pool += survivors  # idle now: candidates for the lanes still to mend
            continue
        cells[:, lane] = filled
        kept.append(lane)
        pool = [i for i in pool if i not in set(filled.tolist())]
    if not kept:
        return None
    grid = cells[:, sorted(kept)]
    report = make_model(problem, config, Shape(*grid.shape)).report(grid)  # with the current plan: move_s too
    if not report.fits_memory:
        return None  # lanes that fit one by one can overflow together once the layers are split again, or while moving
    made = to_plan(problem, plan.cost_model, grid, report)
    standby, reasons = _standby(plan, problem, grid, dropped)
    return replace(
        made, standby=standby, standby_reasons=reasons, epoch=plan.epoch + 1, start_step=plan.start_step,
        estimated_links=tuple(p for p in plan.estimated_links if p[0] in made.devices and p[1] in made.devices),
        recipe=plan.recipe,
    )


def _fill_lane(
    problem: Problem, config: PlannerConfig, kept: np.ndarray, lane: np.ndarray, pool: list[int]
) -> np.ndarray | None:
    """`lane` (one device index per stage, -1 where its device left) with every empty cell filled from `pool`,
    each by the candidate that makes the grid of `kept` lanes plus this one fastest; None when some cell has
    no candidate that fits memory. O(empty cells x candidates) grid evaluations."""
    lane = lane.copy()
    free = list(pool)
    shape = Shape(len(lane), kept.shape[1] + 1)
    model = make_model(problem, config, shape)
    for stage in np.flatnonzero(lane < 0):
        if not free:
            return None
        candidates = np.array(free)
        # Cells of this lane still empty hold the candidate too while this one is chosen: a stand-in that
        # keeps every grid evaluable; they get their own choice in turn, and the final grid is checked whole.
        trial = np.where(lane < 0, candidates[:, None], lane[None, :])  # (K, S)
        grids = np.concatenate([np.repeat(kept[None], len(candidates), axis=0), trial[:, :, None]], axis=2)
        best = int(np.argmin(model.batch_cost(grids)))
        lane[stage] = candidates[best]
        free.remove(int(candidates[best]))
    if not model.report(np.concatenate([kept, lane[:, None]], axis=1)).fits_memory:
        return None
    return lane


def _faster_with(problem: Problem, config: PlannerConfig, kept: np.ndarray, lane: np.ndarray) -> bool:
    """Whether the grid of `kept` lanes is predicted faster with `lane` added than without it."""
    grid = np.concatenate([kept, lane[:, None]], axis=1)
    with_lane = make_model(problem, config, Shape(*grid.shape)).batch_cost(grid[None])[0]
    return bool(with_lane < make_model(problem, config, Shape(*kept.shape)).batch_cost(kept[None])[0])


def _standby(
    plan: Plan, problem: Problem, grid: np.ndarray, dropped: dict[str, list[int]]
) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(standby, standby_reasons) for the repaired plan: the dropped lanes' survivors that no later lane
    took, under why their lanes were dropped, then those the running plan kept on standby under its own
    reasons (merged into one when there are too many), then the rest."""
    used = set(int(d) for d in grid.ravel())
    ids = problem.device_ids
    out_of_plan = [ids[i] for i in range(problem.n) if i not in used]
    groups = {reason: [ids[i] for i in devices if i not in used] for reason, devices in dropped.items()}
    groups = {reason: devices for reason, devices in groups.items() if devices}
    placed = {d for devices in groups.values() for d in devices}
    old = {d: reason for reason, devices in plan.reasons.items() for d in devices}
    old_reasons = list(dict.fromkeys(old[d] for d in out_of_plan if d in old and d not in placed))
    merge = len(old_reasons) > MAX_STANDBY_REASONS - 4 or any(r in (DROPPED, SLOWER, SPARE) for r in old_reasons)
    for d in out_of_plan:
        if d in placed:
            continue
        if d in old:
            groups.setdefault(KEPT if merge else old[d], []).append(d)
        elif d in plan.standby:
            groups.setdefault(KEPT, []).append(d)
        else:
            groups.setdefault(SPARE, []).append(d)
    return standby_runs(groups)
