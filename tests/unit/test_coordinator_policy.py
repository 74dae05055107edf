"""What the coordinator decides (pure): the problem it builds from announcements, when the running plan is
broken, when to solve, whether a new plan is worth publishing, and the step it starts at. Also the
plan's optional `estimated_links` on the wire."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from hetpeer.coordinator import policy
from hetpeer.coordinator.planner import PlannerConfig, Shape, make_model, solve
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import LinkMeasurement, PeerRecord
from hetpeer.protocol.stepcosts import StepCosts
from hetpeer.protocol.wire import SchemaError
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

WORKLOAD = Workload(preset("tiny"), batch=16, micro_batch=2, dtype="fp32")
SEQ_LEN = WORKLOAD.model.seq_len


def record(device: str, **changes) -> PeerRecord:
    fields = dict(
        device_id=device, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=16 << 30,
        address=PeerAddress(direct=("127.0.0.1", 7000)), state="training", time=0.0, epoch=1, step=10, timings=2,
    )  # fmt: skip
    fields.update(changes)
    return PeerRecord(**fields)


def link(latency_s: float, bandwidth: float) -> LinkMeasurement:
    return LinkMeasurement(latency_s, bandwidth)


def make_plan(stages: list[list[str]], *, standby: tuple[str, ...] = (), epoch: int = 1, start_step: int = 0,
              batch: int = 8, total_s: float = 1.0) -> Plan:
    """Stages of equal layer counts over the tiny model's 4 layers (1, 2 or 4 stages)."""
    per = WORKLOAD.model.layers // len(stages)
    lanes = len(stages[0])
    lane_batch = -(-batch // lanes)
    return Plan(
        cost_model="time", model="tiny", layers=WORKLOAD.model.layers, batch=batch, micro_batch=1,
        micro_batches=lane_batch, dtype="fp32",
        stages=tuple(StagePlan(s, s * per, (s + 1) * per, tuple(d), "gossip") for s, d in enumerate(stages)),
        standby=standby, cost={"total_s": total_s}, epoch=epoch, start_step=start_step,
    )  # fmt: skip


# -- build_problem --------------------------------------------------------------------------------------


def pairs(problem, estimated: np.ndarray) -> list[tuple[str, str]]:
    assert np.array_equal(estimated, estimated.T) and not estimated.diagonal().any()
    ids = problem.device_ids
    return [(ids[i], ids[j]) for i, j in zip(*np.nonzero(np.triu(estimated)))]


def test_the_problem_takes_the_median_noise_scale_of_the_peers_that_train():
    records = {"a": record("a", noise_scale=1000.0), "b": record("b", noise_scale=3000.0), "c": record("c"),
               "d": record("d", noise_scale=2000.0), "e": record("e", noise_scale=1e9, state="standby")}
    assert policy.build_problem(records, WORKLOAD, None)[0].noise_scale_tokens == 2000.0
    assert policy.build_problem({"c": record("c")}, WORKLOAD, None)[0].noise_scale_tokens is None


def test_a_link_measured_both_ways_takes_the_mean_latency_and_the_slower_direction():
    records = {
        "b": record("b", links={"a": link(0.03, 3e8)}),
        "a": record("a", links={"b": link(0.01, 1e8)}),  # a's uplink to b is the slower direction
    }
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    assert problem.device_ids == ("a", "b")
    assert problem.latency_s[0, 1] == pytest.approx(0.02) and problem.latency_s[1, 0] == pytest.approx(0.02)
    assert problem.bandwidth_bytes_per_s[0, 1] == pytest.approx(1e8)
    assert problem.bandwidth_bytes_per_s[1, 0] == pytest.approx(1e8)
    assert not estimated.any()


def test_a_link_measured_one_way_counts_for_both_directions():
    records = {"a": record("a", links={"b": link(0.01, 1e8)}), "b": record("b")}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    assert problem.latency_s[1, 0] == pytest.approx(0.01)
    assert problem.bandwidth_bytes_per_s[1, 0] == pytest.approx(1e8)
    assert not estimated.any()


def test_an_unmeasured_pair_is_guessed_no_better_than_its_worse_end_and_listed_as_estimated():
    records = {
        "e": record("e", links={"e": link(9.0, 1.0), "gone": link(9.0, 1.0)}),  # itself and a stranger: ignored
        "d": record("d", links={"a": link(0.05, 5e6), "b": link(0.07, 4e6)}),  # a slow uplink
        "c": record("c", links={"a": link(0.02, 2e8)}),
        "b": record("b", links={"c": link(0.06, 6e8)}),
        "a": record("a", links={"b": link(0.01, 1e8)}),
    }
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    assert problem.device_ids == ("a", "b", "c", "d", "e")
    assert pairs(problem, estimated) == [("a", "e"), ("b", "e"), ("c", "d"), ("c", "e"), ("d", "e")]
    a, b, c, d, e = range(5)
    # c's own links: 2e8 and 6e8 (median 4e8, latency 0.04); d's: 5e6 and 4e6 (median 4.5e6, latency 0.06)
    assert problem.bandwidth_bytes_per_s[c, d] == pytest.approx(4.5e6) and problem.latency_s[c, d] == pytest.approx(0.06)
    # e measured nothing: the median of every measured link (1e8, 2e8, 6e8, 5e6, 4e6 -> 1e8; latency 0.05)
    assert problem.bandwidth_bytes_per_s[c, e] == pytest.approx(1e8) and problem.latency_s[c, e] == pytest.approx(0.05)
    assert problem.bandwidth_bytes_per_s[d, e] == pytest.approx(4.5e6)  # d's slow uplink bounds it
    assert problem.bandwidth_bytes_per_s[a, c] == pytest.approx(2e8)  # measured figures are kept
    assert np.all(np.diag(problem.latency_s) == 0)
    assert np.all(np.isinf(np.diag(problem.bandwidth_bytes_per_s)))
    assert np.array_equal(problem.latency_s, problem.latency_s.T)
    assert np.array_equal(problem.bandwidth_bytes_per_s, problem.bandwidth_bytes_per_s.T)


def test_default_link_when_nothing_was_measured():
    records = {d: record(d) for d in ("z", "x", "y")}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    assert problem.device_ids == ("x", "y", "z")
    assert pairs(problem, estimated) == [("x", "y"), ("x", "z"), ("y", "z")]
    off = ~np.eye(3, dtype=bool)
    assert np.all(problem.latency_s[off] == policy.DEFAULT_LINK[0])
    assert np.all(problem.bandwidth_bytes_per_s[off] == policy.DEFAULT_LINK[1])


def test_compute_is_what_training_achieved_and_probes_are_corrected_by_the_swarms_efficiency():
    records = {
        "a": record("a", tflops=2.0, achieved_tflops=1.0),  # trained at half its probe
        "b": record("b", tflops=4.0, achieved_tflops=3.0),  # at three quarters
        "c": record("c", tflops=1.0, achieved_tflops=0.4),
        "d": record("d", tflops=8.0),  # not trained yet: the median efficiency, 0.5
    }
    problem, _ = policy.build_problem(records, WORKLOAD, None)
    assert problem.tflops.tolist() == [1.0, 3.0, 0.4, 4.0]
    untrained = {d: record(d, tflops=t) for d, t in (("x", 2.0), ("y", 3.0))}
    assert policy.build_problem(untrained, WORKLOAD, None)[0].tflops.tolist() == [2.0, 3.0]  # nothing to correct by


def test_compute_memory_and_the_current_plan_come_from_the_records():
    records = {
        "b": record("b", tflops=2.5, memory_bytes=3 << 30),
        "a": record("a", tflops=7.0, memory_bytes=5 << 30),
    }
    current = make_plan([["a"], ["b"]])
    problem, _ = policy.build_problem(records, WORKLOAD, current)
    assert problem.tflops.tolist() == [7.0, 2.5]
    assert problem.memory_bytes.tolist() == [float(5 << 30), float(3 << 30)]
    assert problem.current is current
    assert problem.workload == WORKLOAD


# -- broken -----------------------------------------------------------------------------------------------


def test_an_intact_plan_is_not_broken():
    plan = make_plan([["a", "b"], ["c", "d"]], standby=("e",))
    records = {d: record(d) for d in "abcde"}
    assert policy.broken(plan, records) is None
    del records["e"]  # a standby peer leaving breaks no lane
    assert policy.broken(plan, records) is None


def test_a_member_that_stopped_announcing_breaks_the_plan():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abd"}
    why = policy.broken(plan, records)
    assert why is not None and "c" in why


def test_a_member_announcing_leaving_breaks_the_plan():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abcd"}
    records["b"] = record("b", state="leaving")
    why = policy.broken(plan, records)
    assert why is not None and "b" in why


def test_a_member_waiting_under_the_current_epoch_breaks_it_but_not_under_an_older_one():
    plan = make_plan([["a", "b"], ["c", "d"]], epoch=4)
    records = {d: record(d, epoch=4) for d in "abcd"}
    records["d"] = record("d", state="waiting", epoch=3)  # still waiting for this plan: not a stall under it
    assert policy.broken(plan, records) is None
    records["d"] = record("d", state="waiting", epoch=4)
    why = policy.broken(plan, records)
    assert why is not None and "d" in why and "4" in why


# -- decide -----------------------------------------------------------------------------------------------

KNOBS = dict(min_peers=2, settle_s=4.0, replan_interval_s=60.0)


def test_decide_waits_for_enough_peers_then_for_them_to_settle():
    one = {"a": record("a")}
    assert not policy.decide(None, one, {"a": 0.0}, 100.0, 0.0, **KNOBS).solve
    two = {"a": record("a"), "b": record("b")}
    waiting = policy.decide(None, two, {"a": 0.0, "b": 99.0}, 100.0, 0.0, **KNOBS)
    assert not waiting.solve
    first = policy.decide(None, two, {"a": 0.0, "b": 96.0}, 100.0, 0.0, **KNOBS)
    assert first.solve and not first.broken


def test_the_first_plan_waits_a_while_for_the_links_between_the_peers_to_be_measured():
    records = {"a": record("a", links={"b": link(0.01, 1e8)}), "b": record("b"), "c": record("c")}
    seen = {"a": 0.0, "b": 0.0, "c": 90.0}  # settled at 94 (4 s); waits up to 10 s past that
    waiting = policy.decide(None, records, seen, 100.0, 0.0, **KNOBS, measure_wait_s=10.0)
    assert not waiting.solve and "2 link(s) between the peers not measured yet (waiting up to 4 s more)" in waiting.reason
    assert policy.decide(None, records, seen, 104.0, 0.0, **KNOBS, measure_wait_s=10.0).solve  # waited long enough
    records["c"] = record("c", links={"a": link(0.01, 1e8), "b": link(0.01, 1e8), "stranger": link(0.01, 1e8)})
    assert policy.unmeasured_pairs(records) == 0  # either end's measurement counts; strangers do not
    assert policy.decide(None, records, seen, 100.0, 0.0, **KNOBS, measure_wait_s=10.0).solve  # all measured: at once


def test_the_first_plan_waits_a_while_for_every_peer_to_time_its_device_twice():
    every = {"a": {"b": link(0.01, 1e8), "c": link(0.01, 1e8)}, "b": {"c": link(0.01, 1e8)}, "c": {}}
    records = {d: record(d, timings=1 if d == "c" else 2, links=every[d]) for d in "abc"}
    seen = {"a": 0.0, "b": 0.0, "c": 90.0}  # settled at 94, every link measured
    waiting = policy.decide(None, records, seen, 100.0, 0.0, **KNOBS, measure_wait_s=10.0)
    assert not waiting.solve and "1 peer(s) not timed twice yet (waiting up to 4 s more)" in waiting.reason
    assert policy.decide(None, records, seen, 104.0, 0.0, **KNOBS, measure_wait_s=10.0).solve  # waited long enough
    records["b"] = record("b")  # and a link not measured: both said
    both = policy.decide(None, records, seen, 100.0, 0.0, **KNOBS, measure_wait_s=10.0)
    assert "1 link(s) between the peers not measured and 1 peer(s) not timed twice yet" in both.reason
    records = {d: record(d, timings=3 if d == "c" else 2, links=every[d]) for d in "abc"}
    assert policy.decide(None, records, seen, 100.0, 0.0, **KNOBS, measure_wait_s=10.0).solve  # timed twice or more: at once
    records["d"] = record("d", timings=1)  # a newcomer to a running plan is solved for with the timing it has
    joined = policy.decide(make_plan([["a"], ["b"]], standby=("c",)), records, seen | {"d": 90.0}, 100.0, 99.0, **KNOBS,
                           measure_wait_s=10.0)
    assert joined.solve and joined.reason == "d joined"


def test_decide_solves_at_once_with_broken_when_a_member_is_gone():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abc"}
    decision = policy.decide(plan, records, {d: 0.0 for d in records}, 100.0, 99.0, **KNOBS)
    assert decision.solve and decision.broken and "d" in decision.reason


def test_a_newcomer_triggers_a_solve_only_once_settled():
    plan = make_plan([["a", "b"], ["c", "d"]], standby=("e",))
    records = {d: record(d) for d in "abcdef"}
    first_seen = {d: 0.0 for d in "abcde"} | {"f": 98.0}
    held = policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS)
    assert not held.solve
    joined = policy.decide(plan, records, first_seen, 102.0, 99.0, **KNOBS)
    assert joined.solve and not joined.broken and "f" in joined.reason


def test_a_known_standby_peer_is_no_newcomer():
    plan = make_plan([["a", "b"], ["c", "d"]], standby=("e",))
    records = {d: record(d) for d in "abcde"}
    assert not policy.decide(plan, records, {d: 0.0 for d in records}, 100.0, 99.0, **KNOBS).solve


def test_a_newcomer_the_running_plan_was_kept_without_waits_for_the_periodic_re_solve():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abcdf"}
    first_seen = {d: 0.0 for d in records}
    assert policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS).solve  # "f joined": solved once
    kept = policy.decide(plan, records, first_seen, 102.0, 100.0, **KNOBS, considered={"f"})
    assert not kept.solve, kept.reason  # not a solve every round for the same peer
    assert policy.decide(plan, records, first_seen, 160.0, 100.0, **KNOBS, considered={"f"}).solve  # periodic
    g = records | {"g": record("g")}
    joined = policy.decide(plan, g, first_seen | {"g": 0.0}, 102.0, 100.0, **KNOBS, considered={"f"})
    assert joined.solve and "g" in joined.reason and "f" not in joined.reason


def test_a_plan_made_on_estimated_links_is_solved_again_once_they_are_measured():
    plan = replace(make_plan([["a", "b"]], standby=("c",)), estimated_links=(("a", "b"), ("a", "c")))
    records = {d: record(d) for d in "abc"}
    first_seen = {d: 0.0 for d in records}
    assert not policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS).solve
    records["a"] = record("a", links={"b": link(0.01, 1e8)})
    assert not policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS).solve  # one of two measured
    records["c"] = record("c", links={"a": link(0.01, 1e8)})  # either end may have measured it
    measured = policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS)
    assert measured.solve and not measured.broken and "2 link(s) it estimated" in measured.reason
    assert not policy.decide(plan, records, first_seen, 100.0, 99.0, **KNOBS, estimates_rechecked=True).solve


def test_decide_re_solves_periodically_and_otherwise_holds():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abcd"}
    first_seen = {d: 0.0 for d in records}
    assert not policy.decide(plan, records, first_seen, 159.0, 100.0, **KNOBS).solve
    periodic = policy.decide(plan, records, first_seen, 160.0, 100.0, **KNOBS)
    assert periodic.solve and not periodic.broken


def test_a_periodic_re_solve_waits_for_the_running_plans_own_steps_up_to_one_more_interval():
    plan = make_plan([["a", "b"], ["c", "d"]])
    records = {d: record(d) for d in "abcd"}
    first_seen = {d: 0.0 for d in records}
    early = policy.decide(plan, records, first_seen, 160.0, 100.0, **KNOBS, plan_measured=False)
    assert not early.solve and "not measured" in early.reason  # figures of the steps around its start, not its own
    assert policy.decide(plan, records, first_seen, 220.0, 100.0, **KNOBS, plan_measured=False).solve  # not for ever
    assert policy.decide(plan, records, first_seen, 160.0, 100.0, **KNOBS, plan_measured=True).solve
    # what a solve is due for at once does not wait: a member gone, a newcomer
    broken = policy.decide(plan, {d: record(d) for d in "abc"}, first_seen, 160.0, 100.0, **KNOBS, plan_measured=False)
    assert broken.solve and broken.broken
    joined = policy.decide(plan, records | {"e": record("e")}, first_seen | {"e": 0.0}, 160.0, 100.0, **KNOBS,
                           plan_measured=False)
    assert joined.solve and "e" in joined.reason


# -- worth_it ---------------------------------------------------------------------------------------------

BROKEN = policy.Decision(True, "d stopped announcing", broken=True)
PERIODIC = policy.Decision(True, "periodic re-solve")


def test_a_broken_plan_is_always_replaced():
    assert policy.worth_it(BROKEN, 5.0, 1.0, 0.1, same=True)[0]
    assert policy.worth_it(BROKEN, 5.0, None, 0.1, same=False)[0]


def test_the_first_plan_is_published():
    assert policy.worth_it(PERIODIC, 5.0, None, 0.1, same=False)[0]


def test_the_same_plan_is_never_republished():
    publish, why = policy.worth_it(PERIODIC, 0.01, 1.0, 0.1, same=True)
    assert not publish and why


def test_a_new_plan_must_beat_the_running_one_by_the_gain():
    assert policy.worth_it(PERIODIC, 0.89, 1.0, 0.1, same=False)[0]
    assert not policy.worth_it(PERIODIC, 0.91, 1.0, 0.1, same=False)[0]
    assert not policy.worth_it(PERIODIC, 1.2, 1.0, 0.1, same=False)[0]
    assert policy.worth_it(PERIODIC, 0.99, 1.0, 0.0, same=False)[0]
    assert not policy.worth_it(PERIODIC, 0.6, 1.0, 0.5, same=False)[0]


def test_a_repaired_plan_gives_way_to_any_better_plan_but_not_a_worse_one():
    assert policy.worth_it(PERIODIC, 0.99, 1.0, 0.1, same=False, repaired=True)[0]
    assert not policy.worth_it(PERIODIC, 1.01, 1.0, 0.1, same=False, repaired=True)[0]
    assert not policy.worth_it(PERIODIC, 0.5, 1.0, 0.1, same=True, repaired=True)[0]


# -- start_step -------------------------------------------------------------------------------------------


def test_the_first_plan_starts_at_step_zero():
    assert policy.start_step(None, {"a": record("a", step=50)}, False, 2.0, SEQ_LEN) == 0


def test_a_broken_plan_is_replaced_just_past_the_furthest_peer_under_it():
    plan = make_plan([["a", "b"], ["c", "d"]], epoch=3)
    records = {
        "a": record("a", epoch=3, step=10), "b": record("b", epoch=3, step=12),
        "c": record("c", epoch=2, step=500),  # a peer still under an older plan counts no step of this one
    }  # fmt: skip
    assert policy.start_step(plan, records, True, 2.0, SEQ_LEN) == 13


def test_the_step_never_goes_back_when_the_peers_that_reached_it_left():
    plan = make_plan([["a", "b"]], standby=("c",), epoch=3, start_step=40)
    records = {
        "a": record("a", epoch=3, step=200, state="leaving"), "b": record("b", epoch=3, step=199, state="leaving"),
        "c": record("c", epoch=3, step=0, state="standby"),
    }  # fmt: skip
    assert policy.start_step(plan, records, True, 2.0, SEQ_LEN) == 201
    assert policy.start_step(plan, {"c": records["c"]}, True, 2.0, SEQ_LEN) == 41  # nothing seen: the plan's own start


def test_a_plan_never_starts_below_the_step_the_swarm_reached_before():
    plan = make_plan([["a", "b"]], standby=("c", "d"), epoch=3, start_step=0)
    standby = {d: record(d, epoch=3, step=0, state="standby") for d in "cd"}  # the trained peers left long ago
    assert policy.start_step(plan, standby, True, 2.0, SEQ_LEN) == 1  # what the records alone say
    assert policy.start_step(plan, standby, True, 2.0, SEQ_LEN, reached=80) == 81
    assert policy.start_step(plan, standby, False, 2.0, SEQ_LEN, reached=80) > 81
    assert policy.start_step(None, standby, True, 2.0, SEQ_LEN, reached=80) == 81  # no running plan read back
    assert policy.start_step(None, standby, True, 2.0, SEQ_LEN) == 0


def test_layers_no_live_peer_holds_are_named():
    layers = WORKLOAD.model.layers  # 4
    records = {"a": record("a", layers=(0, 2)), "b": record("b", layers=(0, 2), state="standby")}
    assert policy.orphaned_layers(records, layers) == [(2, 4)]
    records["c"] = record("c", layers=(2, 4), state="leaving")  # leaving takes its copy along
    assert policy.orphaned_layers(records, layers) == [(2, 4)]
    records["d"] = record("d", layers=(3, 4), state="standby")
    assert policy.orphaned_layers(records, layers) == [(2, 3)]
    records["e"] = record("e", layers=(1, 3))
    assert policy.orphaned_layers(records, layers) == []
    assert policy.orphaned_layers({"x": record("x", layers=None)}, layers) == [(0, 4)]
    assert policy.orphaned_layers({"x": record("x", layers=(1, 2))}, layers) == [(0, 1), (2, 4)]


def test_the_furthest_step_counts_leaving_peers_under_the_plan_only():
    plan = make_plan([["a", "b"]], standby=("c",), epoch=3, start_step=40)
    assert policy.furthest_step(plan, {}) == 40
    records = {
        "a": record("a", epoch=3, step=90, state="leaving"), "b": record("b", epoch=3, step=88),
        "c": record("c", epoch=2, step=500, state="standby"),
    }  # fmt: skip
    assert policy.furthest_step(plan, records) == 90


def lead(heartbeat_s: float, tokens_per_s: float, plan: Plan | None = None) -> int:
    plan = plan or make_plan([["a", "b"], ["c", "d"]], epoch=3)
    records = {d: record(d, epoch=3, step=20, tokens_per_s=tokens_per_s) for d in plan.devices}
    return policy.start_step(plan, records, False, heartbeat_s, SEQ_LEN) - 20


def test_a_planned_switch_leads_by_a_few_heartbeats_of_steps():
    plan = make_plan([["a", "b"], ["c", "d"]], epoch=3)
    tokens_per_s = plan.lane_sequences(0) * SEQ_LEN / 0.5  # a step takes 0.5 s
    ahead = lead(2.0, tokens_per_s, plan)
    heartbeats_of_steps = policy.LEAD_HEARTBEATS * 2.0 / 0.5
    assert ahead >= heartbeats_of_steps  # every peer reads the plan before its lane gets there
    assert ahead < heartbeats_of_steps + 5
    assert lead(8.0, tokens_per_s, plan) > ahead  # slower heartbeats: further ahead
    assert lead(2.0, tokens_per_s * 4, plan) > ahead  # faster steps: further ahead


def test_the_lead_is_capped():
    assert lead(1000.0, 1e12) == policy.MAX_LEAD_STEPS


def test_without_a_measured_pace_the_lead_follows_the_plans_predicted_step():
    slow = make_plan([["a", "b"], ["c", "d"]], epoch=3, total_s=10.0)
    fast = make_plan([["a", "b"], ["c", "d"]], epoch=3, total_s=0.1)
    assert lead(2.0, 0.0, fast) > lead(2.0, 0.0, slow) >= 2


def test_the_pace_of_peers_outside_the_plan_does_not_count():
    plan = make_plan([["a", "b"], ["c", "d"]], standby=("e",), epoch=3)
    records = {d: record(d, epoch=3, step=20, tokens_per_s=1000.0) for d in plan.devices}
    alone = policy.start_step(plan, records, False, 2.0, SEQ_LEN)
    records["e"] = record("e", epoch=3, step=20, tokens_per_s=1e9)
    assert policy.start_step(plan, records, False, 2.0, SEQ_LEN) == alone


# -- predicted_step_s -------------------------------------------------------------------------------------


def four_records(tflops=(1.0, 0.5, 2.0, 1.0)) -> dict[str, PeerRecord]:
    ids = ("p0", "p1", "p2", "p3")
    records = {}
    for i, d in enumerate(ids):
        links = {o: link(0.001 * (1 + i + j), 1e8 / (1 + abs(i - j))) for j, o in enumerate(ids) if o != d}
        records[d] = record(d, tflops=tflops[i], links=links)
    return records


def test_the_running_report_of_a_solved_plan_is_what_the_planner_predicted():
    problem, _ = policy.build_problem(four_records(), WORKLOAD, None)
    config = PlannerConfig(cost_model="time", time_budget_s=0.5)
    solution = solve(problem, config, np.random.default_rng(0))
    assert np.array_equal(policy.grid_of(solution.plan, problem.device_ids), solution.grid)
    running = policy.running_report(problem, config, solution.plan)
    assert running.cost["total_s"] == pytest.approx(solution.report.cost["total_s"], rel=1e-9)
    assert solution.plan.total_s == pytest.approx(solution.report.cost["total_s"], rel=1e-9)


def test_the_running_plan_is_judged_by_the_objective_a_new_plan_is_judged_by():
    # departures cost every plan: a new plan's objective carries them, so the running plan's must too, or a swarm
    # that lost a peer keeps its smaller repaired plan when the peer comes back (its bare step looks cheaper)
    config = PlannerConfig(cost_model="time", time_budget_s=0.5)
    problem, _ = policy.build_problem(four_records(), WORKLOAD, None, departure_stall=0.05)
    solution = solve(problem, config, np.random.default_rng(0))
    running = policy.running_report(problem, config, solution.plan)
    assert running.objective == pytest.approx(solution.report.objective, rel=1e-9)
    assert running.objective >= running.cost["total_s"] * (1 + 0.05 * len(solution.plan.devices))
    assert policy.worth_it(policy.Decision(True, "periodic re-solve"), running.objective * 0.99, running.objective, 0.0,
                           False)[0]
    assert not policy.worth_it(policy.Decision(True, "periodic re-solve"), running.objective * 1.01, running.objective,
                               0.0, False)[0]


def test_the_running_plan_is_predicted_slower_on_slower_peers():
    config = PlannerConfig(cost_model="time", time_budget_s=0.5)
    problem, _ = policy.build_problem(four_records(), WORKLOAD, None)
    plan = solve(problem, config, np.random.default_rng(0)).plan
    slower, _ = policy.build_problem(four_records(tflops=(0.1, 0.05, 0.2, 0.1)), WORKLOAD, None)
    assert (policy.running_report(slower, config, plan).cost["total_s"]
            > policy.running_report(problem, config, plan).cost["total_s"])


def test_the_running_plan_is_predicted_in_its_own_codecs_not_those_the_configuration_would_choose_now():
    """A plan published with int4 hops (its links were slow then) is judged in int4, whatever auto would take on
    the links as they are now: the coordinator compares new plans against the plan the swarm runs."""
    config = PlannerConfig(cost_model="time", time_budget_s=0.5, compress=("raw", "raw"), stages=2)
    problem, _ = policy.build_problem(four_records(), WORKLOAD, None)
    plan = solve(problem, config, np.random.default_rng(0)).plan
    assert all(stage.codecs(lane) == ("raw", "raw") for stage in plan.stages for lane in range(plan.group_size))
    compressed = plan.with_codecs("int4", "int4")
    running = policy.running_report(problem, config, compressed)
    assert running.codecs and all(pair == ("int4", "int4") for hop in running.codecs for pair in hop)
    as_planned = policy.running_report(problem, replace(config, compress=("int4", "int4")), compressed)
    assert running.cost["total_s"] == pytest.approx(as_planned.cost["total_s"], rel=1e-12)
    assert running.cost["total_s"] != pytest.approx(policy.running_report(problem, config, plan).cost["total_s"])


def test_the_codec_rates_peers_announce_price_their_hops_a_gpu_peer_s_below_a_cpu_peer_s():
    """Two records, one lane of two stages over a 1 Gbit/s link, int8 both ways: the pair that announced GPU rates
    (ten times a CPU thread's) is predicted a shorter step than the pair that announced CPU rates, by the codec
    work the time model counts at their rates: a quarter of each end's rate per codec, a hop's encodings and
    decodings; the lane is bound by its hop, so M + 1 times a step (twice in its round trip, once in each of its
    M - 1 periods)."""
    config = PlannerConfig(cost_model="time", stages=2, group_size=1, compress=("int8", "int8"), allow_standby=False)

    def predicted(rate: float) -> float:
        costs = StepCosts(int8_s_per_value=rate)
        records = {"a": record("a", step_costs=costs, links={"b": link(0.01, 1.25e8)}),
                   "b": record("b", step_costs=costs, links={"a": link(0.01, 1.25e8)})}
        problem, _ = policy.build_problem(records, WORKLOAD, None)
        return make_model(problem, config, Shape(2, 1)).report(np.array([[0], [1]])).cost["total_s"]

    cpu, gpu = predicted(6e-9), predicted(6e-10)
    values = WORKLOAD.micro_batch * SEQ_LEN * WORKLOAD.model.hidden
    micro = WORKLOAD.batch // WORKLOAD.micro_batch
    assert gpu < cpu
    assert cpu - gpu == pytest.approx((micro + 1) * values * (6e-9 - 6e-10), rel=1e-9)


def test_the_links_a_plan_uses_are_its_lane_hops_and_its_groups_exponential_graph():
    plan = make_plan([["a", "b", "c", "d", "e"], ["f", "g", "h", "i", "j"]])
    lanes = {("a", "f"), ("b", "g"), ("c", "h"), ("d", "i"), ("e", "j")}
    first = {("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("a", "e"),  # shift 1: the ring
             ("a", "c"), ("b", "d"), ("c", "e"), ("a", "d"), ("b", "e")}  # shifts 2 and 4 (mod 5)
    second = {tuple(sorted("fghij"[ord(x) - ord("a")] for x in pair)) for pair in first}
    assert plan.links == lanes | first | second
    assert make_plan([["a"], ["b"]]).links == {("a", "b")}


def test_only_the_estimated_links_a_plan_uses_are_named():
    records = {d: record(d, links={"b": link(0.01, 1e8)} if d == "a" else {}) for d in "abcd"}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    plan = make_plan([["a", "b"]], standby=("c", "d"))  # one stage: its group a-b, which is measured
    assert policy.estimated_links(plan, problem.device_ids, estimated) == ()
    plan = make_plan([["a", "c"], ["b", "d"]])
    assert policy.estimated_links(plan, problem.device_ids, estimated) == (("a", "c"), ("b", "d"), ("c", "d"))


def test_a_plan_names_at_most_so_many_estimated_links(monkeypatch):
    records = {d: record(d) for d in "abcd"}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    plan = make_plan([["a", "c"], ["b", "d"]])
    assert len(policy.estimated_links(plan, problem.device_ids, estimated)) == 4
    monkeypatch.setattr(policy, "MAX_ESTIMATED_LINKS", 2)
    assert policy.estimated_links(plan, problem.device_ids, estimated) == (("a", "b"), ("a", "c"))


def test_build_problem_agrees_with_pair_by_pair_rules_on_a_random_swarm():
    """The vectorised matrices against the rules applied one pair at a time."""
    rng = np.random.default_rng(3)
    names = [f"p{i:02d}" for i in range(30)]
    links = {d: {} for d in names}
    for _ in range(60):
        a, b = rng.choice(names, 2, replace=False)
        links[a][b] = link(float(rng.uniform(0.001, 0.2)), float(rng.uniform(1e6, 1e9)))
    records = {d: record(d, links=links[d]) for d in names}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    seen = lambda a, b: [links[x][y] for x, y in ((a, b), (b, a)) if y in links[x]]  # noqa: E731
    measured = [(a, b, m) for a in names for b in names if a != b for m in [seen(a, b)] if m]
    typical = {}
    for d in names:
        mine = [m for a, b, m in measured if a == d]
        typical[d] = (np.median([np.mean([x.latency_s for x in m]) for m in mine]),
                      np.median([min(x.bandwidth_bytes_per_s for x in m) for m in mine])) if mine else None
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if a == b:
                continue
            found = seen(a, b)
            assert estimated[i, j] == (not found)
            if found:
                want = (np.mean([x.latency_s for x in found]), min(x.bandwidth_bytes_per_s for x in found))
            else:
                want = (max(typical[a][0], typical[b][0]), min(typical[a][1], typical[b][1]))
            assert (problem.latency_s[i, j], problem.bandwidth_bytes_per_s[i, j]) == pytest.approx(want)


# -- Plan.estimated_links on the wire ---------------------------------------------------------------------


def test_estimated_links_round_trip():
    plan = make_plan([["a", "b"], ["c", "d"]])
    assert "estimated_links" not in plan.to_wire()  # optional: plans without it read as before
    marked = replace(plan, estimated_links=(("a", "d"), ("b", "c")))
    wire = marked.to_wire()
    assert wire["estimated_links"] == [["a", "d"], ["b", "c"]]
    again = Plan.from_wire(json.loads(json.dumps(wire)))
    assert again == marked and again.estimated_links == (("a", "d"), ("b", "c"))
    assert Plan.from_wire(plan.to_wire()).estimated_links == ()


@pytest.mark.parametrize(
    "bad, where",
    [
        ([["a"]], "plan.estimated_links[0]"),
        ([["a", "b", "c"]], "plan.estimated_links[0]"),
        (["ab"], "plan.estimated_links[0]"),
        ([["a", 5]], "plan.estimated_links[0][1]"),
        ("a,b", "plan.estimated_links"),
    ],
)
def test_a_malformed_estimated_link_is_refused(bad, where):
    wire = make_plan([["a", "b"], ["c", "d"]]).to_wire()
    wire["estimated_links"] = bad
    with pytest.raises(SchemaError) as error:
        Plan.from_wire(wire)
    assert error.value.path == where
    assert str(error.value).startswith(where)


# -- resuming from the peers' checkpoints ------------------------------------------------------------------


def fresh(device: str, checkpoint=None, **changes) -> PeerRecord:
    """A peer just started again: it holds no layers yet, only (maybe) a checkpoint."""
    return record(device, **{"state": "waiting", "epoch": -1, "step": 0, "checkpoint": checkpoint, **changes})


def test_checkpoints_make_the_plan_a_swarm_resumes_with():
    peers = {"a": fresh("a", (0, 2, 40, 640)), "b": fresh("b", (2, 4, 40, 640)), "c": fresh("c", (0, 2, 38, 608)),
             "d": fresh("d", (2, 4, 40, 640)), "e": fresh("e", (0, 2, 40, 640)), "f": fresh("f")}
    found = policy.resume_from_checkpoints(peers, 4)
    # two lanes: the thinner stage has two holders; of layers 0-1 the two at the highest step
    assert found.stages == ((0, 2, ("a", "e")), (2, 4, ("b", "d")))
    assert found.step == 40 and found.standby == ("c", "f")
    assert found.data_position == 640  # the swarm's position at that step goes on from where it stopped


def test_layers_no_checkpoint_holds_are_named():
    peers = {"a": fresh("a", (0, 1, 10, 160)), "b": fresh("b", (2, 4, 10, 160)), "c": fresh("c", (0, 1, 10, 160), state="leaving")}
    found = policy.resume_from_checkpoints(peers, 4)
    assert isinstance(found, str)
    assert "no live peer holds a checkpoint of layers 1-1" in found and "a layers 0-0 (step 10)" in found
    assert "c layers" not in found  # a leaving peer takes its checkpoint with it
    assert "layers 0-3" in policy.resume_from_checkpoints({"x": fresh("x")}, 4)


def test_a_longer_range_wins_a_tie_and_ranges_past_the_model_are_ignored():
    peers = {"a": fresh("a", (0, 4, 7, 112)), "b": fresh("b", (0, 2, 7, 112)), "c": fresh("c", (0, 6, 9, 144))}
    found = policy.resume_from_checkpoints(peers, 4)
    assert found.stages == ((0, 4, ("a",)),) and found.step == 7 and found.standby == ("b", "c")


def test_a_tiling_the_most_held_range_does_not_start_is_still_found():
    """Layers 0-1 have the most holders, but nothing starts at layer 2; layer 0 alone and then 1-3 tile the model."""
    peers = {"a": fresh("a", (0, 2, 5, 80)), "b": fresh("b", (0, 2, 5, 80)), "c": fresh("c", (0, 1, 5, 80)), "d": fresh("d", (1, 4, 5, 80))}
    found = policy.resume_from_checkpoints(peers, 4)
    assert found.stages == ((0, 1, ("c",)), (1, 4, ("d",))) and found.standby == ("a", "b")


def test_a_pair_that_neither_side_can_dial_has_no_path_and_is_no_estimate():
    records = {d: record(d, reachable=r) for d, r in (("a", "none"), ("b", "none"), ("c", "direct"))}
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    i, j, k = (problem.device_ids.index(d) for d in "abc")
    assert (problem.latency_s[i, j], problem.bandwidth_bytes_per_s[i, j]) == policy.ABSENT_LINK
    assert not estimated[i, j] and estimated[i, k]  # a-c: not measured, guessed as before
    assert problem.bandwidth_bytes_per_s[i, k] > 1e6 and problem.latency_s[i, i] == 0.0


def test_without_path_names_the_pairs_a_plan_needs_that_have_none():
    records = {d: record(d, reachable=r) for d, r in (("a", "none"), ("b", "direct"), ("c", "none"))}
    assert policy.without_path(make_plan([["a", "b"], ["b2", "c"]]), records) == []  # b2: no record, no claim
    assert policy.without_path(make_plan([["a"], ["c"]]), records) == [("a", "c")]  # lane neighbours
    assert policy.without_path(make_plan([["b", "a", "c"]]), records) == [("a", "c")]  # group members
    assert policy.least_served([("a", "c"), ("c", "d")]) == "c"
    assert policy.least_served([("b", "a")]) == "a"  # a tie: the first by id


@pytest.mark.parametrize("seed", range(6))
def test_the_search_puts_a_peer_others_can_dial_between_two_that_nobody_can(seed):
    """Three stages of one lane: only the order with the public peer in the middle gives every hop a path."""
    records = {d: record(d, reachable=r) for d, r in (("a", "direct"), ("b", "none"), ("c", "none"))}
    workload = Workload(preset("tiny"), batch=4, micro_batch=2, dtype="fp32")
    problem, _ = policy.build_problem(records, replace(workload, model=replace(workload.model, layers=3)), None)
    plan = solve(problem, PlannerConfig(stages=3, group_size=1, time_budget_s=0.2), np.random.default_rng(seed)).plan
    assert plan.lanes[0][1] == "a", plan.lanes


def test_two_peers_behind_nat_reach_each_other_through_a_relay_at_its_two_hops():
    """a and b cannot be dialled; b registered at relay r: a-b costs a-r plus r-b, at the slower of the two."""
    records = {
        "a": record("a", reachable="none", links={"r": link(0.02, 50e6)}),
        "b": record("b", reachable="via:r", links={"r": link(0.03, 20e6)}),
        "c": record("c", reachable="none", links={"r": link(0.01, 80e6)}),
        "r": record("r", reachable="direct"),
    }
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    i = {d: problem.device_ids.index(d) for d in records}
    assert problem.latency_s[i["a"], i["b"]] == pytest.approx(0.05) == problem.latency_s[i["b"], i["a"]]
    assert problem.bandwidth_bytes_per_s[i["a"], i["b"]] == 20e6 and not estimated[i["a"], i["b"]]
    assert problem.bandwidth_bytes_per_s[i["c"], i["b"]] == 20e6
    assert (problem.latency_s[i["a"], i["c"]], problem.bandwidth_bytes_per_s[i["a"], i["c"]]) == policy.ABSENT_LINK
    # the planner knows both relayed pairs cross r, whose link (its typical one: the median of the links measured
    # to it) they share
    relays = problem.relays
    assert relays.names == ("r",) and relays.capacity.tolist() == [50e6]
    assert relays.via[i["a"], i["b"]] == relays.via[i["c"], i["b"]] == 0 and relays.via[i["a"], i["c"]] == -1
    assert policy.without_path(make_plan([["a"], ["b"]]), records) == []  # through b's relay
    assert policy.without_path(make_plan([["a"], ["c"]]), records) == [("a", "c")]


def test_two_peers_behind_nats_that_keep_ports_are_a_direct_link_punched_not_a_relay_or_no_path():
    """a, b and c punch holes (each behind its own router); d cannot (its NAT changes ports); b also registered at
    relay r: its pair with a is still the punched link as measured, not r's two hops."""
    def home(device: str, host: str, **changes) -> PeerRecord:
        return record(device, **{"address": PeerAddress(direct=(host, 7000)), "punch": 40000, "reachable": "none", **changes})

    records = {
        "a": home("a", "198.51.100.1", links={"b": link(0.004, 90e6), "r": link(0.02, 50e6)}),
        "b": home("b", "198.51.100.2", links={"r": link(0.03, 20e6)}, reachable="via:r"),
        "c": home("c", "198.51.100.3"),
        "d": home("d", "198.51.100.4", punch=0),
        "e": home("e", "198.51.100.3"),  # behind c's router: one public address
        "r": record("r", reachable="direct"),
    }
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    i = {d: problem.device_ids.index(d) for d in records}
    assert problem.latency_s[i["a"], i["b"]] == pytest.approx(0.004) and problem.bandwidth_bytes_per_s[i["a"], i["b"]] == 90e6
    assert not estimated[i["a"], i["b"]] and estimated[i["a"], i["c"]]  # a-c: punchable, not measured yet, guessed
    assert problem.bandwidth_bytes_per_s[i["a"], i["c"]] > 1e6
    for pair in (("a", "d"), ("c", "d"), ("c", "e")):
        assert (problem.latency_s[i[pair[0]], i[pair[1]]], problem.bandwidth_bytes_per_s[i[pair[0]], i[pair[1]]]) == policy.ABSENT_LINK
    assert problem.bandwidth_bytes_per_s[i["d"], i["b"]] == 20e6  # d reaches b through b's relay
    assert policy.without_path(make_plan([["a"], ["c"]]), records) == []
    assert policy.without_path(make_plan([["c"], ["e"]]), records) == [("c", "e")]
    assert policy.without_path(make_plan([["a", "c"], ["d", "b"]]), records) == [("a", "d")]  # d-b: through b's relay
    # a hole that would not punch (each reports the other): no path but b's relay
    records["a"], records["b"] = replace(records["a"], unreachable=("b",)), replace(records["b"], unreachable=("a",))
    problem, _ = policy.build_problem(records, WORKLOAD, None)
    assert problem.latency_s[i["a"], i["b"]] == pytest.approx(0.05) and problem.bandwidth_bytes_per_s[i["a"], i["b"]] == 20e6
    records["a"], records["c"] = replace(records["a"], unreachable=("c",)), replace(records["c"], unreachable=("a",))
    assert policy.without_path(make_plan([["a"], ["c"]]), records) == [("a", "c")]


@pytest.mark.parametrize("seed", range(3))
def test_the_planners_mask_of_punched_pairs_is_the_records_own_rule(seed):
    rng = np.random.default_rng(seed)
    records = {f"p{k}": record(f"p{k}", address=PeerAddress(direct=(f"10.0.0.{rng.integers(4)}", 7000)),
                               punch=int(rng.choice([0, 40000])), reachable=str(rng.choice(["none", "direct", "via:p0"])))
               for k in range(12)}
    ids = sorted(records)
    mask = policy._punched(records, ids)
    expected = np.array([[a != b and records[a].punches_with(records[b]) for b in ids] for a in ids])
    assert (mask == expected).all() and mask.any() and not mask.all()


def test_a_pair_whose_peers_each_report_they_could_not_reach_the_other_has_no_path_from_then_on():
    """A firewall the reach check did not see: a lane stalled on it, and the next plan does not pair them again.
    One side's report is not enough: the neighbours of a peer that died and came back report it for a while."""
    records = {d: record(d, reachable="direct") for d in "abc"}
    records["a"] = replace(records["a"], unreachable=("c", "b"))
    records["c"] = replace(records["c"], unreachable=("a",))
    problem, estimated = policy.build_problem(records, WORKLOAD, None)
    i = {d: problem.device_ids.index(d) for d in "abc"}
    assert (problem.latency_s[i["c"], i["a"]], problem.bandwidth_bytes_per_s[i["c"], i["a"]]) == policy.ABSENT_LINK
    assert problem.bandwidth_bytes_per_s[i["a"], i["b"]] > 1e6  # only a says so: b came back, say
    assert policy.without_path(make_plan([["c"], ["a"]]), records) == [("a", "c")]
    assert policy.without_path(make_plan([["a"], ["b"]]), records) == []
    # how they failed, in the words the organizer reads (each side's, once each; a record without how: lost)
    records["a"] = replace(records["a"], unreachable_how=("punch", "refused"))
    records["c"] = replace(records["c"], unreachable_how=("punch",))
    assert policy.failure_words(records, "a", "c") == policy.failure_words(records, "c", "a") == "no hole punched"
    assert policy.failure_words(records, "b", "a") == "refused (a reset)"
    assert policy.failure_words(records, "b", "c") == ""
