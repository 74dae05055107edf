"""The plan as text, as `hetpeer plan` prints it without --json."""

from __future__ import annotations

from dataclasses import replace

from hetpeer.coordinator.planner.render import format_plan
from hetpeer.protocol.plan import Plan, StagePlan


def plan(total_s: float) -> Plan:
    return Plan(
        cost_model="dtfm", model="tiny", layers=4, batch=8, micro_batch=1, micro_batches=4, dtype="fp16",
        stages=(StagePlan(0, 0, 2, ("a", "b"), "allreduce"), StagePlan(1, 2, 4, ("c", "d"), "allreduce")),
        standby=("e",), cost={"dp_s": total_s / 2, "pp_s": total_s / 2, "total_s": total_s},
    )  # fmt: skip


def test_text_names_stages_lanes_standby_and_baselines():
    text = format_plan(plan(2.0), {"blocks": 4.0, "random": None}, 7)
    assert "2 stages x 2 lanes, 1 on standby" in text
    assert "lane 0: a -> c" in text and "lane 1: b -> d" in text
    assert "standby:\n  1 without a stated reason (e)" in text
    assert "blocks" in text and "2.00x this plan" in text
    assert "random (mean of 7)" in text and "does not fit in memory" in text


def test_stages_that_recompute_are_named_with_how_many_layers():
    recomputing = replace(plan(2.0), stages=(StagePlan(0, 0, 2, ("a", "b"), "allreduce", recompute=1),
                                             StagePlan(1, 2, 4, ("c", "d"), "allreduce")))
    text = format_plan(recomputing, {"blocks": 4.0, "random": None}, 7)
    recomputed = text.split("recomputed in the backward pass")[1]
    assert "stage 0: 1 of its 2 layers" in recomputed and "stage 1:" not in recomputed
    # two holders a stage: a check that fails is reported, and nobody can decide it
    assert "stage 0: checked in a pair" in text and "stage 1: checked in a pair" in text
    assert "recomputed" not in format_plan(plan(2.0), {"blocks": 4.0, "random": None}, 7)


def test_a_plan_that_costs_nothing_can_be_printed():
    """The paper's cost of a one-device swarm is 0 s (no sync, no hops): the ratio must not divide by it."""
    text = format_plan(plan(0.0), {"blocks": 0.0, "random": 0.0}, 10)
    assert "this plan" in text and "blocks" in text
