"""The planner's outer steps: a group takes them only where the organizer allows them and every-step sync
is a real share of its step, H comes from its link within the measured bounds, and the plan carries it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.outer import MAX_EVERY, MIN_EVERY, OUTER_AUTO, TARGET, WORTH
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload

SEQ, HIDDEN, VOCAB = 64, 64, 256
LAYER_FLOPS = SEQ * (24 * HIDDEN * HIDDEN + 4 * SEQ * HIDDEN)
HEAD_FLOPS = SEQ * 2 * HIDDEN * VOCAB
STAGE_BYTES = (4 * (12 * HIDDEN * HIDDEN + 13 * HIDDEN) + VOCAB * HIDDEN + SEQ * HIDDEN + VOCAB * HIDDEN + 2 * HIDDEN) * 2


def two_lanes(tflops: float, gbps: float, dtype: str = "bf16") -> Problem:
    raw = {"devices": [{"id": f"d{i}", "region": "r", "tflops": tflops, "memory_gb": 100.0} for i in range(2)],
           "regions": {"r": {"latency_ms": 5.0, "bandwidth_gbps": gbps}}}
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=4, dtype=dtype))


def report(problem: Problem, **config):
    return make_model(problem, PlannerConfig(stages=1, group_size=2, **config), Shape(1, 2)).report(np.array([[0, 1]]))


def by_hand(tflops: float, gbps: float, dtype_bytes: int = 2) -> tuple[float, float, float]:
    """(lane seconds, every-step sync's exposed seconds (auto's pick), the outer ring's seconds)."""
    latency_s, bandwidth = 0.005, gbps * 1e9 / 8
    lane_s = 2 * (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / (tflops * 1e12)
    stage_bytes = STAGE_BYTES / 2 * dtype_bytes
    allreduce = 2 * (latency_s + stage_bytes / (2 * bandwidth))
    gossip = max(0.0, latency_s + stage_bytes / bandwidth - lane_s)
    every = gossip if allreduce > gossip + 0.02 * lane_s else allreduce
    return lane_s, every, allreduce * 2 / dtype_bytes  # the change travels in fp16


def exposed(ring: float, lane_s: float, h: int) -> tuple[int, float]:
    """(D, seconds a step): the exchange overlaps the fewest steps that hide it, at most a tenth of H."""
    d = min(max(1, h // 10), math.ceil(ring / lane_s))
    return d, max(0.0, ring - d * lane_s) / h


def test_a_slow_group_takes_outer_steps_with_h_from_its_link_by_hand():
    lane_s, every, ring = by_hand(1.0, 0.01)
    assert every > WORTH * lane_s  # sync is most of this step
    h = min(MAX_EVERY, max(MIN_EVERY, math.ceil(ring / (TARGET * lane_s))))
    d, sync_s = exposed(ring, lane_s, h)
    assert d == max(1, h // 10) and sync_s > 0  # this link is so slow that overlap hides only part of the ring
    got = report(two_lanes(1.0, 0.01), outer_every=OUTER_AUTO)
    assert got.sync == ("outer",) and got.outer_every == (h,) and got.outer_delay == (d,)
    assert got.cost["sync_s"] == pytest.approx(sync_s, rel=1e-9)
    assert got.cost["total_s"] == pytest.approx(lane_s + sync_s, rel=1e-9)


def test_an_exchange_shorter_than_the_window_overlaps_the_fewest_steps_that_hide_it():
    lane_s, _, ring = by_hand(0.02, 1.0)
    got = report(two_lanes(0.02, 1.0), sync="outer", outer_every=50)
    d = math.ceil(ring / lane_s)
    assert 1 < d < 5 and got.outer_delay == (d,) and got.cost["sync_s"] == 0.0


def test_the_ring_counts_the_change_in_fp16_whatever_the_training_dtype():
    lane_s, _, ring = by_hand(1.0, 0.01, dtype_bytes=4)
    got = report(two_lanes(1.0, 0.01, dtype="fp32"), outer_every=20)
    assert got.sync == ("outer",) and got.outer_every == (20,)
    assert got.cost["sync_s"] == pytest.approx(exposed(ring, lane_s, 20)[1], rel=1e-9)


def test_a_group_whose_sync_is_a_small_share_of_its_step_keeps_syncing_every_step():
    lane_s, every, _ = by_hand(1e-3, 1.0)
    assert every < WORTH * lane_s
    got = report(two_lanes(1e-3, 1.0), outer_every=OUTER_AUTO)
    assert got.sync in (("gossip",), ("allreduce",)) and got.outer_every == (0,)
    assert got.cost["sync_s"] == pytest.approx(every, rel=1e-9)


def test_without_the_organizers_leave_no_group_takes_outer_steps():
    assert report(two_lanes(1.0, 0.01)).sync != ("outer",)


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
