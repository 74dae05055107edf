"""The coordinator's bounded history: samples thinned evenly over the whole run, each plan's measured pace,
joins and leaves as events (a crowd joining at once as one), and frozen snapshots for other threads."""

from __future__ import annotations

from statistics import median

import pytest

from hetpeer.coordinator.history import CHURN_PRIOR_S, CHURN_WINDOW_S, MAX_WINDOWS, NAMED_AT_MOST, WINDOW_STEPS, History, Pace
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import PeerRecord


def record(device: str, state: str = "training") -> PeerRecord:
    return PeerRecord(device_id=device, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=1,
                      address=PeerAddress(direct=("127.0.0.1", 7000)), state=state, time=0.0)


def plan(epoch: int, start_step: int = 0, total_s: float = 0.5) -> Plan:
    return Plan(cost_model="time", model="tiny", layers=4, batch=4, micro_batch=2, micro_batches=1, dtype="fp32",
                stages=(StagePlan(0, 0, 4, ("a", "b"), "gossip"),), cost={"total_s": total_s}, epoch=epoch,
                start_step=start_step)


def observe(history: History, now: float, peers=None, running=None, step: int = 0) -> None:
    history.observe(now, peers or {}, running, now if running else None, step, 1.0, None, 10.0)


def test_a_long_run_is_thinned_evenly_and_keeps_its_start_and_end():
    history = History(max_samples=64)
    for second in range(10_000):
        observe(history, float(second), step=second)
    times = [s.time for s in history.samples]
    assert len(times) <= 64 and times[0] < 300  # the first minutes are still there
    assert times[-1] == 9_999  # and the latest round
    gaps = [b - a for a, b in zip(times, times[1:-1])]
    assert max(gaps) <= 2 * min(gaps)  # an even resolution, not a recent window
    assert history.interval_s >= 64


def test_each_plan_measures_its_own_pace_from_its_first_step_on():
    history = History()
    first, second = plan(1), plan(2, start_step=10, total_s=2.0)
    observe(history, 0.0, running=first, step=0)  # switching in: not a step of this plan yet
    for i in range(1, 11):
        observe(history, 5.0 + i, running=first, step=i)  # one step a second once it runs
    for i in range(11, 15):
        observe(history, 20.0 + 4 * (i - 10), running=second, step=i)  # four seconds a step
    by_epoch = {p.epoch: p for p in history.snapshot().plans}
    assert by_epoch[1].measured_step_s == pytest.approx(1.0) and by_epoch[1].steps == 10
    assert by_epoch[2].measured_step_s == pytest.approx(4.0) and by_epoch[2].predicted_step_s == 2.0
    assert [e.kind for e in history.events].count("plan") == 2


def test_a_plans_pace_is_the_mean_window_of_ten_steps_or_more_stalls_left_out():
    pace = Pace()
    assert pace.step_s is None and pace.add(0.0, 5).step_s is None  # no step run yet
    clock = 0.0
    for step in range(0, 101):
        # a step of 0.1 s, every tenth 0.5 s (a gossip round late), and 60 s stalled once (a lane waiting)
        clock += 0.5 if step % 10 == 9 else 60.0 if step == 55 else 0.1
        pace = pace.add(clock, step)
    assert len(pace.windows) == 10
    assert pace.step_s == pytest.approx((9 * 0.1 + 0.5) / 10)  # the slow steps paid, the stall left out
    # a slow step every 15 steps lands in two windows of ten out of three: the median window is a slow one
    periodic = Pace()
    for step in range(0, 301):
        periodic = periodic.add(step * 0.1 + 0.4 * (step // 15), step)
    assert median(periodic.windows) == pytest.approx(0.14)
    assert periodic.step_s == pytest.approx((300 * 0.1 + 20 * 0.4) / 300)  # the swarm's rate over the plan
    short = Pace().add(0.0, 0).add(1.0, 2).add(4.0, 3)
    assert short.windows == () and short.step_s == pytest.approx(4 / 3)  # under one window: its mean so far
    for _ in range(MAX_WINDOWS + 5):
        short = short.add(short.last[0] + 1.0, short.last[1] + WINDOW_STEPS)
    assert len(short.windows) == MAX_WINDOWS  # bounded


def test_joins_and_leaves_are_events_and_a_crowd_is_one():
    history = History()
    crowd = {f"p{i}": record(f"p{i}") for i in range(NAMED_AT_MOST + 3)}
    observe(history, 1.0, crowd)
    observe(history, 2.0, {**crowd, "p0": record("p0", "leaving")})
    observe(history, 3.0, {d: r for d, r in crowd.items() if d not in ("p0", "p1")})
    texts = [(e.kind, e.text) for e in history.events]
    assert texts[0] == ("join", f"{len(crowd)} peers joined: p0, p1, p2, p3, p4 and 3 more")
    assert ("leave", "p0 left") in texts and ("leave", "p1 stopped announcing") in texts
    assert not any("p0 stopped" in text for _, text in texts)  # it said it was leaving: not said twice
    with pytest.raises(ValueError, match="event kind"):
        history.event(4.0, "gossip", "not a kind")


def test_a_snapshot_does_not_change_as_rounds_go_on_and_bounds_hold():
    history = History(max_samples=8, max_events=3, max_plans=2)
    observe(history, 0.0)
    frozen = history.snapshot()
    for epoch in range(1, 6):
        observe(history, float(epoch), running=plan(epoch), step=epoch)
    assert len(frozen.samples) == 1 and frozen.version < history.version
    now = history.snapshot()
    assert [p.epoch for p in now.plans] == [4, 5] and len(now.events) == 3
    history.observe(9.0, {}, None, None, 9, float("nan"), None, float("inf"))  # sums past the largest float
    assert (history.samples[-1].loss, history.samples[-1].tokens_per_s) == (None, None)
    history.observe(20.0, {}, None, None, 10, 2.0, None, 5.0, 4096.0)
    latest = history.snapshot().to_wire()
    assert latest["sample_fields"][-1] == "noise_scale" and latest["samples"][-1][-1] == 4096.0
    wire = now.to_wire()
    assert wire["sample_fields"][:2] == ["time", "step"] and len(wire["samples"][0]) == len(wire["sample_fields"])


def test_departures_are_counted_per_peer_and_second_over_the_last_hour_from_a_prior_without_any():
    def present(names: str, state: str = "training") -> dict:
        return {name: record(name, state) for name in names}

    history = History()
    assert history.departure_rate() == 0.0  # nothing seen yet
    observe(history, 0.0, present("abcd"))
    observe(history, 100.0, present("abcd"))  # 400 peer-seconds, nobody left
    assert history.departure_rate() == 0.0
    observe(history, 200.0, {**present("ab"), **present("c", "leaving")})  # d stopped announcing, c says it leaves
    assert history.departure_rate() == pytest.approx(2 / (800 + CHURN_PRIOR_S))
    observe(history, 300.0, present("ab"))  # c gone after saying so: not counted twice
    assert history.departure_rate() == pytest.approx(2 / (1100 + CHURN_PRIOR_S))
    observe(history, 300.0 + CHURN_WINDOW_S, present("ab"))  # the departures are older than the window now
    assert history.departure_rate() == 0.0
