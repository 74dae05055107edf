"""Shared fixtures: the paper's scenario problems, and a checker for the invariants of a solved plan."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from hetpeer import scenarios
from hetpeer.coordinator.planner import Problem, Solution
from hetpeer.protocol.plan import SYNC_MODES, Plan
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

# The paper's c_DP and c_PP for GPT-3 XL (bytes), as in the authors' scheduler configuration.
PAPER_DP_BYTES = 0.65e9
PAPER_PP_BYTES = 0.471248e9


@functools.lru_cache(maxsize=None)
def _scenario_problem(name: str, paper_bytes: bool) -> Problem:
    topology = Topology.from_wire(scenarios.load(name))
    workload = Workload(preset("gpt3-xl"), batch=512)
    if paper_bytes:
        return Problem.from_topology(topology, workload, dp_bytes=PAPER_DP_BYTES, pp_bytes=PAPER_PP_BYTES)
    return Problem.from_topology(topology, workload)


@pytest.fixture(scope="session")
def scenario_problem():
    """scenario_problem(name, paper_bytes=False) -> Problem for gpt3-xl, batch 512 (cached; treat as read-only)."""

    def make(name: str, paper_bytes: bool = False) -> Problem:
        return _scenario_problem(name, paper_bytes)

    return make


def _check_plan(problem: Problem, solution: Solution) -> None:
    plan, report, grid = solution.plan, solution.report, solution.grid
    layers = problem.layers

    # Every layer exactly once, stages contiguous and in order.
    covered = [layer for stage in plan.stages for layer in range(stage.layer_start, stage.layer_end)]
    assert covered == list(range(layers))
    assert all(stage.layer_end > stage.layer_start for stage in plan.stages)
    assert [stage.index for stage in plan.stages] == list(range(len(plan.stages)))
    assert tuple(stage.layers for stage in plan.stages) == report.layers

    # Equal groups, no device twice, standby disjoint, every device of the problem accounted for.
    sizes = {len(stage.devices) for stage in plan.stages}
    assert sizes == {solution.shape.group_size}
    assert len(plan.stages) == solution.shape.stages
    placed = [d for stage in plan.stages for d in stage.devices]
    assert len(placed) == len(set(placed))
    assert len(plan.standby) == len(set(plan.standby))
    assert not set(placed) & set(plan.standby)
    assert sorted(placed + list(plan.standby)) == sorted(problem.device_ids)

    # Lanes are the columns of the stages, and the grid is what the plan names.
    for l, lane in enumerate(plan.lanes):
        assert len(lane) == len(plan.stages)
        for s, device in enumerate(lane):
            assert device == plan.stages[s].devices[l]
    assert grid.shape == (solution.shape.stages, solution.shape.group_size)
    for s, stage in enumerate(plan.stages):
        assert stage.devices == tuple(problem.device_ids[int(d)] for d in grid[s])
        assert stage.sync in SYNC_MODES

    assert report.fits_memory
    assert np.isfinite(plan.total_s) and plan.total_s >= 0
    if plan.cost_model == "time":  # compute always takes time; the paper's cost of one device is 0
        assert plan.total_s > 0
    assert plan.layers == layers
    # Every lane takes its share of the batch (an even one, rounded up, or its own by its speed), at least a sequence.
    shares = [plan.lane_sequences(lane) for lane in range(plan.group_size)]
    assert min(shares) >= 1 and (sum(shares) == plan.batch if plan.lane_batches else shares == [-(-plan.batch // plan.group_size)] * plan.group_size)
    assert plan.micro_batches == max(len(plan.micro_batch_sizes(lane)) for lane in range(plan.group_size))

    # The wire form round-trips, through JSON text too.
    wire = plan.to_wire()
    assert Plan.from_wire(wire).to_wire() == wire
    assert Plan.from_wire(json.loads(json.dumps(wire))).to_wire() == wire
    assert Plan.from_wire(wire) == plan


@pytest.fixture(scope="session")
def check_plan():
    """check_plan(problem, solution): assert every invariant a peer relies on."""
    return _check_plan
