"""Devices that cannot matter are left out before the search and named in the plan's standby reasons; the plan
schema's reasons are checked like the rest of a plan."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, solve, synthetic
from hetpeer.coordinator.planner.solve import SPARE
from hetpeer.protocol.plan import MAX_STANDBY_REASONS, Plan, StagePlan, standby_runs
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.wire import SchemaError
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

WORKLOAD = Workload(preset("gpt3-xl"), batch=64)


def problem_with(extra: list[dict], devices: int = 12, seed: int = 0) -> Problem:
    raw = synthetic.random_topology(devices, 3, np.random.default_rng(seed))
    raw["devices"] += [{"region": "r0", **device} for device in extra]
    return Problem.from_topology(Topology.from_wire(raw), WORKLOAD)


PI = {"id": "pi", "tflops": 0.01, "memory_gb": 4.0}  # a Raspberry Pi 4
SMALL = {"id": "small", "tflops": 100.0, "memory_gb": 0.5}  # fast, but one layer's state is about 1 GB


def test_too_small_and_too_slow_devices_are_left_out_and_named():
    problem = problem_with([PI, SMALL])
    solution = solve(problem, PlannerConfig(time_budget_s=1.0), np.random.default_rng(0))
    reasons = solution.plan.reasons
    assert [r.split(":")[0] for r in reasons] == ["too small", "too slow", "spare"][: len(reasons)]
    small, slow = (next(ids for r, ids in reasons.items() if r.startswith(word)) for word in ("too small", "too slow"))
    assert small == ("small",) and slow == ("pi",)
    assert set(solution.plan.standby) == set(problem.device_ids) - set(solution.plan.devices)
    assert reasons.get(SPARE, ()) == tuple(d for d in solution.plan.standby if d not in ("pi", "small"))
    assert solution.pruned.reference_s > solution.plan.total_s * 0.999  # the reference is a plan, never better
    assert Plan.from_wire(json.loads(json.dumps(solution.plan.to_wire()))) == solution.plan


def test_a_pruned_device_is_one_the_search_would_not_use_anyway():
    """Without pruning, a converged search on a small swarm leaves the same devices out."""
    problem = problem_with([PI, SMALL], devices=6, seed=2)
    config = PlannerConfig(time_budget_s=30.0)
    pruned = solve(problem, config, np.random.default_rng(1))
    unpruned = solve(problem, replace(config, prune=False), np.random.default_rng(1))
    assert not {"pi", "small"} & set(unpruned.plan.devices)
    assert unpruned.plan.standby_reasons == ()  # reasons are stated where the planner pruned
    assert pruned.plan.total_s <= unpruned.plan.total_s * 1.0001


def test_a_fixed_shape_prunes_only_what_is_too_small():
    # four GPUs for the 2 x 2 grid: the Pi's 4 GB hold no stage of GPT-3 XL with its activations and embedding gradient
    problem = problem_with([PI, SMALL], devices=4)
    solution = solve(problem, PlannerConfig(stages=2, group_size=2, time_budget_s=0.5), np.random.default_rng(0))
    assert set(solution.plan.reasons) <= {next(iter(solution.plan.reasons)), SPARE}
    assert solution.pruned.too_slow.size == 0 and solution.pruned.too_small.size == 1


def test_a_swarm_of_devices_too_small_for_a_layer_is_an_error_naming_why():
    raw = synthetic.random_topology(4, 1, np.random.default_rng(0))
    for device in raw["devices"]:
        device["memory_gb"] = 0.5
    problem = Problem.from_topology(Topology.from_wire(raw), WORKLOAD)
    with pytest.raises(PlanningError, match="no device can hold a stage: 4 too small"):
        solve(problem, PlannerConfig(time_budget_s=0.5), np.random.default_rng(0))


def test_the_dtfm_model_and_no_standby_use_every_device():
    problem = problem_with([PI])
    solution = solve(problem, PlannerConfig(allow_standby=False, time_budget_s=0.5), np.random.default_rng(0))
    assert "pi" in solution.plan.devices and solution.pruned is None


# -- standby reasons on the wire ----------------------------------------------------------------------------


def plan(standby=("c", "d", "e"), reasons=()) -> Plan:
    return Plan(cost_model="time", model="tiny", layers=4, batch=4, micro_batch=1, micro_batches=2, dtype="fp32",
                stages=(StagePlan(0, 0, 2, ("a", "b"), "gossip"), StagePlan(1, 2, 4, ("f", "g"), "gossip")),
                standby=standby, standby_reasons=reasons)  # fmt: skip


def test_standby_reasons_are_runs_over_the_standby_list():
    standby, runs = standby_runs({"too slow: x": ["d"], "spare": ["c", "e"], "too small: y": []})
    marked = plan(standby, runs)
    assert marked.standby == ("d", "c", "e") and runs == (("too slow: x", 1), ("spare", 2))
    assert marked.reasons == {"too slow: x": ("d",), "spare": ("c", "e")}
    wire = marked.to_wire()
    assert wire["standby_reasons"] == [["too slow: x", 1], ["spare", 2]]
    assert Plan.from_wire(json.loads(json.dumps(wire))) == marked
    assert "standby_reasons" not in plan().to_wire() and plan().reasons == {}


@pytest.mark.parametrize(
    "reasons, words",
    [
        ((("spare", 2),), "cover 2 devices but 3"),
        ((("spare", 2), ("slow", 2)), "cover 4 devices but 3"),
        ((("spare", 1), ("spare", 2)), "states a reason twice"),
        ((("", 3),), "printable"),
        ((("bad\x1b[2J", 3),), "printable"),
        ((("x" * 201, 3),), "printable"),
        ((("spare", 0), ("slow", 3)), "at least one"),
        (tuple((f"r{i}", 1) for i in range(MAX_STANDBY_REASONS + 1)), "at most"),
    ],
)
def test_bad_standby_reasons_are_refused(reasons, words):
    with pytest.raises(SchemaError, match=words):
        plan(reasons=reasons)


@pytest.mark.parametrize("raw", ["spare", [["spare"]], [["spare", "3"]], [[3, 3]], [["spare", 3, 1]], [["spare", True]]])
def test_standby_reasons_of_the_wrong_form_are_refused_naming_the_field(raw):
    wire = plan().to_wire() | {"standby_reasons": raw}
    with pytest.raises(SchemaError, match=r"^plan\.standby_reasons"):
        Plan.from_wire(wire)


def test_a_step_overhead_shifts_the_bound_a_slow_device_is_held_to_alike():
    """A fixed overhead (a coordinator's learned one may be below 0) adds to every plan's step, so it adds to the
    bound a slow device is held to too: a device just fast enough to be kept stays kept whatever it is."""
    from hetpeer.coordinator.planner.solve import _prune

    plain = _prune(problem_with([PI]), PlannerConfig())
    w, config = WORKLOAD, PlannerConfig()
    least_per_tflops = -(-w.batch // min(w.batch, 13)) * 3 * w.layer_fwd_flops_per_seq / 1e12
    edge = {"id": "edge", "tflops": least_per_tflops / (0.75 * plain.reference_s), "memory_gb": 80.0}  # 3/4 of the bound
    for overhead in (0.0, -0.5 * plain.reference_s, plain.reference_s):
        problem = replace(problem_with([PI, edge]), step_overhead_s=overhead)
        pruned = _prune(problem, config)
        assert [problem.device_ids[d] for d in pruned.too_slow] == ["pi"]
        assert pruned.reference_s == pytest.approx(overhead + _prune(replace(problem, step_overhead_s=0.0), config).reference_s)
