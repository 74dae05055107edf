"""The planner's sync modes by time to loss: each group takes all-reduce, gossip or outer steps as (step x steps
factor) says, H comes from its link within the measured bounds, outer steps only where the organizer allows them
and their state fits, and the plan carries it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.outer import MAX_EVERY, MIN_EVERY, OUTER_AUTO, TARGET
from hetpeer.coordinator.planner.quality import TABLE
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload

SEQ, HIDDEN, VOCAB = 64, 64, 256
LAYER_FLOPS = SEQ * (24 * HIDDEN * HIDDEN + 4 * SEQ * HIDDEN)
HEAD_FLOPS = SEQ * 2 * HIDDEN * VOCAB
STAGE_BYTES = (4 * (12 * HIDDEN * HIDDEN + 13 * HIDDEN) + VOCAB * HIDDEN + SEQ * HIDDEN + VOCAB * HIDDEN + 2 * HIDDEN) * 2


def two_lanes(tflops: float, gbps: float, dtype: str = "bf16", memory_gb: float = 100.0) -> Problem:
    raw = {"devices": [{"id": f"d{i}", "region": "r", "tflops": tflops, "memory_gb": memory_gb} for i in range(2)],
           "regions": {"r": {"latency_ms": 5.0, "bandwidth_gbps": gbps}}}
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=4, dtype=dtype))


def report(problem: Problem, **config):
    return make_model(problem, PlannerConfig(stages=1, group_size=2, **config), Shape(1, 2)).report(np.array([[0, 1]]))


LANE_TOKENS = 2 * SEQ  # a batch of 4 over 2 lanes


def by_hand(tflops: float, gbps: float, dtype_bytes: int = 2) -> tuple[float, float, float, float]:
    """(lane seconds, all-reduce's seconds, gossip's exposed seconds, the outer ring's seconds)."""
    latency_s, bandwidth = 0.005, gbps * 1e9 / 8
    lane_s = 2 * (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / (tflops * 1e12)
    stage_bytes = STAGE_BYTES / 2 * dtype_bytes
    allreduce = latency_s + stage_bytes / bandwidth  # robust (the default): each member's stage to the other, one round
    gossip = max(0.0, latency_s + stage_bytes / bandwidth - lane_s)
    return lane_s, allreduce, gossip, allreduce * 2 / dtype_bytes  # the change travels in fp16


def auto_h(ring: float, lane_s: float) -> int:
    return min(MAX_EVERY, max(MIN_EVERY, math.ceil(ring / (TARGET * lane_s))))


def fastest_to_loss(lane_s: float, options: dict[str, tuple[float, float]]) -> str:
    """The mode whose (lane + sync) x steps factor is least; options: mode -> (sync seconds, factor)."""
    return min(options, key=lambda mode: (lane_s + options[mode][0]) * options[mode][1])


def exposed(ring: float, lane_s: float, h: int) -> tuple[int, float]:
    """(D, seconds a step): the exchange overlaps the fewest steps that hide it, at most a tenth of H."""
    d = min(max(1, h // 10), math.ceil(ring / lane_s))
    return d, max(0.0, ring - d * lane_s) / h


def test_a_slow_group_takes_outer_steps_with_h_from_its_link_by_hand():
    lane_s, allreduce, gossip, ring = by_hand(1.0, 0.01)
    h = auto_h(ring, lane_s)
    d, sync_s = exposed(ring, lane_s, h)
    assert d == max(1, h // 10) and sync_s > 0  # this link is so slow that overlap hides only part of the ring
    factor = TABLE.factor("outer", 2, LANE_TOKENS, h)
    options = {"allreduce": (allreduce, 1.0), "gossip": (gossip, TABLE.factor("gossip", 2, LANE_TOKENS)), "outer": (sync_s, factor)}
    assert fastest_to_loss(lane_s, options) == "outer"
    got = report(two_lanes(1.0, 0.01))  # outer steps are allowed by default
    assert got.sync == ("outer",) and got.outer_every == (h,) and got.outer_delay == (d,)
    assert got.cost["sync_s"] == pytest.approx(sync_s, rel=1e-9)
    assert got.cost["total_s"] == pytest.approx(lane_s + sync_s, rel=1e-9)
    assert got.steps_factor == pytest.approx(factor)


def test_an_exchange_shorter_than_the_window_overlaps_the_fewest_steps_that_hide_it():
    lane_s, _, _, ring = by_hand(0.02, 0.5)
    got = report(two_lanes(0.02, 0.5), sync="outer", outer_every=50)
    d = math.ceil(ring / lane_s)
    assert 1 < d < 5 and got.outer_delay == (d,) and got.cost["sync_s"] == 0.0


def test_the_ring_counts_the_change_in_fp16_whatever_the_training_dtype():
    lane_s, _, _, ring = by_hand(1.0, 0.01, dtype_bytes=4)
    got = report(two_lanes(1.0, 0.01, dtype="fp32"), outer_every=20)
    assert got.sync == ("outer",) and got.outer_every == (20,)
    assert got.cost["sync_s"] == pytest.approx(exposed(ring, lane_s, 20)[1], rel=1e-9)


@pytest.mark.parametrize("tflops, gbps", [(1e-3, 1.0), (0.05, 0.1), (0.5, 0.05), (1.0, 0.01)])
def test_each_group_takes_the_mode_with_the_least_time_to_loss(tflops, gbps):
    lane_s, allreduce, gossip, ring = by_hand(tflops, gbps)
    h = auto_h(ring, lane_s)
    options = {"allreduce": (allreduce, 1.0), "gossip": (gossip, TABLE.factor("gossip", 2, LANE_TOKENS)),
               "outer": (exposed(ring, lane_s, h)[1], TABLE.factor("outer", 2, LANE_TOKENS, h))}
    mode = fastest_to_loss(lane_s, options)
    got = report(two_lanes(tflops, gbps))
    assert got.sync == (mode,) and got.steps_factor == pytest.approx(options[mode][1])
    assert got.cost["sync_s"] == pytest.approx(options[mode][0], rel=1e-9)
    # forced to one mode, the same figures for it
    for forced in ("allreduce", "gossip"):
        alone = report(two_lanes(tflops, gbps), sync=forced)
        assert alone.sync == (forced,) and alone.cost["sync_s"] == pytest.approx(options[forced][0], rel=1e-9)
        assert alone.cost["total_s"] * alone.steps_factor >= got.cost["total_s"] * got.steps_factor * (1 - 1e-9)


def test_a_fast_link_keeps_all_reduce_whose_steps_are_worth_most():
    lane_s, allreduce, gossip, _ = by_hand(1e-4, 10.0)
    assert allreduce < 0.02 * lane_s and gossip == 0  # gossip would hide its exchange, but its steps are worth less
    assert TABLE.factor("gossip", 2, LANE_TOKENS) > 1 + allreduce / lane_s
    got = report(two_lanes(1e-4, 10.0), outer_every=None)
    assert got.sync == ("allreduce",) and got.steps_factor == 1.0


def test_departures_stall_groups_that_wait_for_every_member_and_gossip_only_a_lane():
    """At the churn a coordinator observes (x = devices x departures a device-second x the stall of one), a plan whose
    groups all gossip loses 1 / m of that (only the departed peer's lane stops); any other loses all of it."""
    from dataclasses import replace

    lane_s, allreduce, gossip, _ = by_hand(1e-4, 10.0)
    calm = report(two_lanes(1e-4, 10.0), outer_every=None)
    assert calm.sync == ("allreduce",)  # as above: all-reduce's steps are worth more
    g = TABLE.factor("gossip", 2, LANE_TOKENS)
    for stall in (1e-3, 0.05, 10.0):
        x = 2 * stall
        churned = make_model(replace(two_lanes(1e-4, 10.0), departure_stall=stall), PlannerConfig(
            stages=1, group_size=2, outer_every=None), Shape(1, 2)).report(np.array([[0, 1]]))
        expected = "gossip" if (lane_s + gossip) * g * (1 + x / 2) < (lane_s + allreduce) * (1 + x) else "allreduce"
        assert churned.sync == (expected,)
        assert churned.steps_factor == pytest.approx(g if expected == "gossip" else 1.0)  # departures are not steps
        worth = g * (1 + x / 2) if expected == "gossip" else 1 + x
        assert churned.objective == pytest.approx(calm.objective / calm.cost["total_s"] * churned.cost["total_s"] * worth,
                                                  rel=1e-9)
    assert expected == "gossip"  # where departures stall a plan most of the time, losing one lane of two is cheaper


def test_without_the_organizers_leave_no_group_takes_outer_steps():
    assert report(two_lanes(1.0, 0.01), outer_every=None).sync != ("outer",)


def test_outer_steps_are_taken_only_where_their_state_fits():
    """The anchor, outer momentum and change take 12 bytes a parameter more than an every-step group's exchange: a
    device with room for the second but not the first syncs every step."""
    workload = Workload(preset("tiny", 4), batch=4, dtype="bf16")
    need = workload.stage_memory(4, first=True, last=True, in_flight=1, micro_batch=2, group_size=2)
    bytes_ = sum(need.values())
    roomy = report(two_lanes(1.0, 0.01, memory_gb=bytes_ * 10 / 1e9))
    tight = report(two_lanes(1.0, 0.01, memory_gb=(bytes_ + 4 * preset("tiny", 4).params) / 0.9 / 1e9))
    assert roomy.sync == ("outer",) and tight.sync != ("outer",) and tight.fits_memory


def test_sync_outer_gives_every_group_outer_steps_every_h_it_is_told():
    got = report(two_lanes(1e-3, 1.0), sync="outer", outer_every=7)
    assert got.sync == ("outer",) and got.outer_every == (7,)
    assert report(two_lanes(1e-3, 1.0), sync="outer").outer_every == (MIN_EVERY,)  # the link is fast: H at its floor


def test_a_solved_plan_carries_h_per_group_and_parses():
    solution = solve(two_lanes(1.0, 0.01), PlannerConfig(stages=1, group_size=2, outer_every=OUTER_AUTO, time_budget_s=0.5),
                     np.random.default_rng(0))
    stage = solution.plan.stages[0]
    assert stage.sync == "outer" and MIN_EVERY <= stage.outer_every <= MAX_EVERY and 0 < stage.outer_delay <= stage.outer_every // 10
    assert Plan.from_wire(solution.plan.to_wire()) == solution.plan


@pytest.mark.parametrize("config, words", [
    (dict(outer_every=-1), "outer steps must be 1 to 10000 steps apart"),
    (dict(outer_every=10_001), "got 10001"),
    (dict(cost_model="dtfm", outer_every=10), "time cost model only"),
    (dict(cost_model="dtfm", sync="outer"), "time cost model only"),
])
def test_outer_settings_the_planner_cannot_use_are_refused(config, words):
    with pytest.raises(ValueError, match=words):
        PlannerConfig(**config)
