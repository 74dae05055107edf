"""What a peer measures: an emulated slower accelerator is that much slower, whom it probes, and its links
to other peers over the in-process transport (bounded in time and bytes; a silent or lying peer cannot
stall or fool it); and the machine profile it announces."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from in_threads import outcomes
from hetpeer.peer.daemon.measure import (
    DATA,
    DATA_ACK,
    PING,
    PONG,
    RESOLUTION_S,
    LinkHistory,
    LinkProber,
    ProbeError,
    ProbeLimits,
    Transfer,
    describe_links,
    estimate_link,
    pick_targets,
)
from hetpeer.peer.probe import MachineProfile, Slowdown, block_tflops, time_per_call, cgroup_free_bytes, profile_machine
from hetpeer.peer.ratelimit import Rate
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.inbox import Late
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.records import MAX_LINKS, LinkMeasurement
from hetpeer.protocol.modelspec import preset
from test_ratelimit import Clock

WORK_S = 0.05
REAL_SLEEP = time.sleep  # the work inside a block sleeps with this; `sleeps` records only what Slowdown adds

# Wall-clock bounds below are lower bounds (a busy machine only adds time) or hang guards.


@pytest.fixture
def sleeps(monkeypatch):
    """(thread name, seconds) of every time.sleep a Slowdown takes."""
    recorded: list[tuple[str, float]] = []

    def sleep(seconds: float) -> None:
        recorded.append((threading.current_thread().name, seconds))
        REAL_SLEEP(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return recorded


def timed(slowdown: Slowdown, work_s: float = WORK_S) -> float:
    started = time.perf_counter()
    with slowdown:
        REAL_SLEEP(work_s)
    return time.perf_counter() - started


def test_a_slowdown_of_one_adds_nothing(sleeps):
    assert WORK_S <= timed(Slowdown(1)) < 5.0
    assert timed(Slowdown(1.0), 0.0) < 5.0
    assert sleeps == []


def test_a_slowdown_of_three_makes_a_block_take_about_three_times_as_long(sleeps):
    slowdown = Slowdown(3)
    for _ in range(2):  # reusable
        total_s = timed(slowdown)
        [(_, slept_s)] = sleeps
        sleeps.clear()
        # three times the fastest run of the work (at least the work's own time): it sleeps at most twice this run
        assert 3 * WORK_S <= total_s < 5.0
        assert slept_s <= 2 * (total_s - slept_s) + 1e-6


def test_a_run_slowed_by_the_host_is_not_slowed_three_times_more(sleeps):
    slowdown = Slowdown(3)
    timed(slowdown, WORK_S)
    fastest_s = sleeps[0][1] / 2  # the first run slept twice its own time, however busy the host was
    noisy_s = timed(slowdown, 2 * WORK_S)  # the same work, on a busier host: the emulated device is no slower
    assert 3 * WORK_S <= noisy_s < 3 * 2 * WORK_S
    assert sleeps[-1][1] <= 3 * fastest_s - 2 * WORK_S + 1e-6  # three times the fastest, less what it took
    other_s = timed(slowdown.of("other work"), 2 * WORK_S)  # another key: its own fastest
    assert other_s >= 3 * 2 * WORK_S


def test_a_slowdown_times_each_threads_blocks_on_their_own(sleeps):
    slowdown = Slowdown(3)

    def later() -> float:
        REAL_SLEEP(0.05)
        return timed(slowdown.of("long"), 0.3)

    # the first block starts before the second and ends inside it: one shared stack would mix their starts
    first, second = outcomes([lambda: timed(slowdown.of("short"), 0.1), later], 10.0)
    slept = dict(sleeps)
    assert len(slept) == 2 and len(set(slept.values())) == 2
    short_s, long_s = sorted(slept.values())
    assert 0.2 <= short_s < long_s and long_s >= 0.6
    assert first >= 0.3 and second >= 0.9


def test_a_slowdown_also_delays_a_block_that_raises(sleeps):
    slowdown = Slowdown(3)
    started = time.perf_counter()
    with pytest.raises(KeyError):
        with slowdown:
            REAL_SLEEP(WORK_S)
            raise KeyError("boom")
    assert time.perf_counter() - started >= 3 * WORK_S
    assert len(sleeps) == 1 and sleeps[0][1] >= 2 * WORK_S


@pytest.mark.parametrize("factor", [0.5, 0, -2, math.nan, math.inf])
def test_an_invalid_slowdown_factor_is_a_value_error(factor):
    with pytest.raises(ValueError, match="slowdown factor"):
        Slowdown(factor)


# -- pick_targets -----------------------------------------------------------------------------------

KNOWN = [f"p{i}" for i in range(20)]


def test_preferred_peers_come_first_in_order_and_never_me():
    chosen = pick_targets("p0", KNOWN, ["p5", "p0", "p3", "p5", "outsider"], 6, np.random.default_rng(0))
    assert chosen[:3] == ["p5", "p3", "outsider"]
    assert len(chosen) == 6 == len(set(chosen)) and "p0" not in chosen
    assert set(chosen[3:]) <= set(KNOWN) - {"p0", "p5", "p3"}


def test_neighbours_fill_at_most_half_so_every_link_gets_measured():
    rng = np.random.default_rng(1)
    group = [f"p{i}" for i in range(1, 9)]
    chosen = pick_targets("p0", KNOWN, group, 4, rng)
    assert chosen[:2] == ["p1", "p2"] and set(chosen[2:]) <= set(KNOWN) - set(group) - {"p0"}
    measured: list[str] = []
    for round_ in range(10):  # neighbours every round, the others in turn: all 19 within ten rounds of 2 new each
        chosen = pick_targets("p0", KNOWN, group, 4, rng, measured)
        measured = [p for p in measured if p not in chosen] + chosen  # oldest first, as LinkHistory keeps them
    assert set(measured) == set(KNOWN) - {"p0"}
    assert pick_targets("p0", KNOWN[:4], ["p3", "p2", "p1"], 4, rng) == ["p3", "p2", "p1"]  # no one else: all of them


def test_never_measured_peers_come_before_the_least_recently_measured():
    rng = np.random.default_rng(2)
    measured = [p for p in KNOWN if p not in ("p0", "p7", "p8")]  # p1 oldest
    assert sorted(pick_targets("p0", KNOWN, [], 2, rng, measured)) == ["p7", "p8"]
    assert pick_targets("p0", KNOWN, [], 4, rng, measured)[2:] == ["p1", "p2"]
    assert pick_targets("p0", KNOWN, [], 3, rng, ["gone", "p0"] + measured)[2:] == ["p1"]  # only known peers, never me


def test_k_bounds_the_targets():
    rng = np.random.default_rng(1)
    assert pick_targets("p0", ["p7", "p8", "p9"], ["p9", "p8", "p7"], 2, rng) == ["p9", "p8"]
    assert pick_targets("p0", KNOWN, ["p9"], 0, rng) == []
    everyone = pick_targets("p0", KNOWN + ["p0"], [], 100, rng)
    assert sorted(everyone) == sorted(KNOWN[1:])
    assert pick_targets("p0", ["p0"], [], 3, rng) == []
    with pytest.raises(ValueError, match="k must not be negative, got -1"):
        pick_targets("p0", KNOWN, [], -1, rng)


def test_the_same_seed_picks_the_same_targets_whatever_the_order_given():
    shuffled = list(reversed(KNOWN))
    first = pick_targets("p3", KNOWN, ["p1"], 5, np.random.default_rng(42))
    assert pick_targets("p3", shuffled, ["p1"], 5, np.random.default_rng(42)) == first
    samples = {tuple(pick_targets("p3", KNOWN, [], 5, np.random.default_rng(seed))) for seed in range(10)}
    assert len(samples) > 1  # the seed matters
    rng = np.random.default_rng(7)
    before = rng.bit_generator.state
    pick_targets("p3", KNOWN, ["p1", "p2"], 5, rng, [p for p in KNOWN if p not in ("p1", "p2", "p3")])
    assert rng.bit_generator.state == before  # no draw when every other peer was measured before


# -- estimate_link and LinkHistory ------------------------------------------------------------------


def test_the_median_and_fastest_pings_and_the_median_frame_make_the_estimate():
    link = estimate_link([0.002, 0.001, 0.005], [Transfer(0.030), Transfer(0.011), Transfer(0.050)], 1_000_000)
    assert link.latency_s == pytest.approx(0.0015)  # the median ping less half the fastest: 2 ms - 0.5 ms
    assert link.bandwidth_bytes_per_s == pytest.approx(1e6 / 0.029)  # 1 MB in the median 30 ms less the 1 ms ping


@pytest.mark.parametrize("ping_s, latency_s", [
    ([0.080, 0.080, 0.080], 0.040),  # pings that never wait: half the round trip, the network's one way
    ([0.080, 0.084, 0.500], 0.044),  # one ping held up does not count; the usual 4 ms of waiting does
    ([0.003, 0.006, 0.007], 0.0045),  # a short link: the hand-offs' usual wait is most of a hop
])
def test_latency_is_a_typical_round_trip_less_one_network_crossing(ping_s, latency_s):
    link = estimate_link(ping_s, [Transfer(0.1)], 1_000_000)
    assert link.latency_s == pytest.approx(latency_s)
    assert link.latency_s >= min(ping_s) / 2  # never below what the fastest ping allows


def test_what_crossed_while_a_frame_arrived_is_the_link():
    # 0.9 MB of the frame after its first read and 1.5 MB of training frames beside it, in 24 ms: 100 MB/s,
    # whatever the round trips (the answers queued behind the receiver's own traffic)
    frames = [Transfer(0.090, 0.9e6, 1.5e6, 0.024), Transfer(0.060, 0.9e6, 1.5e6, 0.024), Transfer(0.2, 0.9e6, 1.5e6, 0.024)]
    assert estimate_link([0.030], frames, 1_000_000).bandwidth_bytes_per_s == pytest.approx(100e6)


def test_a_frame_its_receiver_could_not_time_counts_by_its_round_trip():
    for untimed in (Transfer(0.021), Transfer(0.021, 0.1e6, 5e6, 0.001), Transfer(0.021, 0.9e6, 0.0, 0.0)):
        # no timing; most of the frame came with its header (one burst); no time between first read and end
        assert estimate_link([0.001], [untimed], 1_000_000).bandwidth_bytes_per_s == pytest.approx(1e6 / 0.020)


def test_a_transfer_lost_in_timing_noise_reads_as_fast_not_infinite():
    for frame in (Transfer(0.001), Transfer(0.0009), Transfer(0.001 + RESOLUTION_S / 10)):
        link = estimate_link([0.001], [frame], 1_000_000)
        assert link.bandwidth_bytes_per_s == pytest.approx(1_000_000 / RESOLUTION_S)


@pytest.mark.parametrize("ping_s, data, size", [([], [Transfer(0.1)], 10), ([0.1], [], 10), ([0.1], [Transfer(0.2)], 0)])
def test_estimate_link_needs_round_trips_and_a_size(ping_s, data, size):
    with pytest.raises(ValueError, match="need pings"):
        estimate_link(ping_s, data, size)


def test_a_peer_announces_the_median_of_its_last_rounds():
    history = LinkHistory(rounds=3)
    for bandwidth in (1e8, 1.2e8, 1.1e8):
        history.add({"p": LinkMeasurement(0.01, bandwidth)})
    assert history.current() == {"p": LinkMeasurement(0.01, 1.1e8)}
    history.add({"p": LinkMeasurement(5.0, 1e3)})  # one round spoiled by a stalled machine
    assert history.current() == {"p": LinkMeasurement(0.01, 1.1e8)}
    history.add({"p": LinkMeasurement(5.0, 1e3)})  # a link that really changed is followed
    assert history.current() == {"p": LinkMeasurement(5.0, 1e3)}


def test_before_three_rounds_the_fastest_counts():
    history = LinkHistory(rounds=3)
    history.add({"p": LinkMeasurement(0.012, 3.6e5)})  # measured while the machine was still starting up
    assert history.current() == {"p": LinkMeasurement(0.012, 3.6e5)}
    history.add({"p": LinkMeasurement(0.006, 1.2e7)})
    assert history.current() == {"p": LinkMeasurement(0.006, 1.2e7)}  # not the mean of the two
    history.add({"p": LinkMeasurement(0.007, 1.1e7)})
    assert history.current() == {"p": LinkMeasurement(0.007, 1.1e7)}  # three rounds: the median again


def test_link_history_keeps_the_most_recently_measured_peers_and_forgets_those_gone():
    history = LinkHistory(limit=3)
    for peer in ("a", "b", "c"):
        history.add({peer: LinkMeasurement(0.01, 1e8)})
    history.add({"a": LinkMeasurement(0.01, 1e8)})  # a is measured again: b is now the oldest
    history.add({"d": LinkMeasurement(0.01, 1e8)})
    assert set(history.current()) == {"a", "c", "d"}
    assert history.oldest_first() == ["c", "a", "d"]  # whom to measure again first
    history.keep_only(["a", "x"])
    assert set(history.current()) == {"a"}
    assert LinkHistory().limit == MAX_LINKS  # a record carries no more


def test_links_are_described_for_people_in_peer_order():
    links = {"p2": LinkMeasurement(0.0123, 4.8e6), "p1": LinkMeasurement(0.0003, 2.4e9), "p3": LinkMeasurement(1.0, 512.0)}
    assert describe_links(links) == "p1 0.30 ms 2.4 GB/s, p2 12.30 ms 4.8 MB/s, p3 1000.00 ms 512 B/s"


def test_link_history_refuses_nonsense_settings():
    for bad in (dict(rounds=0), dict(limit=-1)):
        with pytest.raises(ValueError, match="need rounds"):
            LinkHistory(**bad)


# -- LinkProber -------------------------------------------------------------------------------------


@pytest.fixture
def swarm():
    """Probers "a", "b" and "c" on one hub, each transport screening with its prober's `accept`."""
    hub = MemoryHub()
    probers = {}
    for name in "abc":
        transport = MemoryTransport(name, hub)
        prober = LinkProber(transport, name, max_probe_bytes=256 << 10)
        transport.set_policy(prober.accept)
        transport.start()
        prober.install()
        probers[name] = prober
    yield hub, probers
    for prober in probers.values():
        prober.uninstall()
        prober.transport.shutdown()


def assert_sane(link, budget_s: float, elapsed_s: float) -> None:
    assert math.isfinite(link.latency_s) and 0 < link.latency_s < budget_s
    assert math.isfinite(link.bandwidth_bytes_per_s) and link.bandwidth_bytes_per_s > 0
    assert elapsed_s < budget_s + 2.0  # the budget bounds waiting; a busy machine adds some work


@pytest.mark.parametrize("budget_bytes", [1 << 20, 1000, 4])
def test_a_link_is_measured_within_its_budgets(swarm, budget_bytes):
    _, probers = swarm
    started = time.perf_counter()
    link = probers["a"].measure("b", budget_bytes=budget_bytes, budget_s=2.0)
    assert_sane(link, 2.0, time.perf_counter() - started)
    assert not probers["a"].transport.inbox.rejections and not probers["b"].transport.inbox.rejections


def test_peers_probing_each_other_at_once_get_their_own_replies(swarm):
    _, probers = swarm
    a, b, c = probers["a"], probers["b"], probers["c"]
    results = outcomes([lambda: a.measure("b"), lambda: a.measure("c"), lambda: b.measure("a"), lambda: c.measure("a")], 20.0)
    for link in results:
        assert not isinstance(link, BaseException), link
        assert_sane(link, 2.0, 0.0)
    assert all(not p.transport.inbox.misbehaving for p in probers.values())


def test_a_peer_cannot_probe_itself_or_with_no_budget(swarm):
    _, probers = swarm
    with pytest.raises(ValueError, match="a cannot probe itself"):
        probers["a"].measure("a")
    for bad in (dict(budget_bytes=3), dict(budget_s=0.0), dict(budget_s=math.nan), dict(pings=0)):
        with pytest.raises(ValueError, match="need budget_bytes"):
            probers["a"].measure("b", **bad)
    with pytest.raises(ValueError, match="max_probe_bytes"):
        LinkProber(probers["a"].transport, "a", max_probe_bytes=3)


def test_a_peer_that_does_not_answer_is_a_probe_error_within_the_budget(swarm):
    _, probers = swarm
    probers["b"].uninstall()  # b is up but no longer answers probes
    started = time.perf_counter()
    with pytest.raises(ProbeError, match="a: b did not answer probe \\d+ within 0.3 s"):
        probers["a"].measure("b", budget_s=0.3)
    assert 0.3 <= time.perf_counter() - started < 3.0
    assert probers["a"]._replies == {}  # nothing left waiting


def test_an_unreachable_peer_is_a_probe_error_at_once(swarm):
    hub, probers = swarm
    hub.unplug("c")
    started = time.perf_counter()
    with pytest.raises(ProbeError, match="a: cannot probe c"):
        probers["a"].measure("c", budget_s=5.0)
    with pytest.raises(ProbeError, match="cannot probe nobody"):
        probers["a"].measure("nobody", budget_s=5.0)
    assert time.perf_counter() - started < 3.0  # no waiting for an answer that cannot come
    assert set(probers["a"].measure_many(["c", "b", "nobody"], budget_s=1.0)) == {"b"}


def header(micro: int, n: int = 1, *, kind: str = "probe", dtype: str = "fp32", sender: str = "b", step: int = 1,
           shape: tuple[int, ...] | None = None) -> FrameHeader:
    return FrameHeader(kind=kind, dtype=dtype, shape=shape or (n,), sender=sender, step=step, micro=micro)


def test_accept_takes_requests_within_limits(swarm):
    _, probers = swarm
    a = probers["a"]
    assert a.accept(header(PING)) is None
    assert a.accept(header(DATA, (256 << 10) // 4)) is None


@pytest.mark.parametrize(
    "frame, reason",
    [
        (dict(micro=PING, kind="activation"), "activation is not a probe frame"),
        (dict(micro=4), "probe micro 4 is not one of 0-3"),
        (dict(micro=PING, dtype="fp16"), "probe frames are raw fp32, got fp16"),
        (dict(micro=PING, dtype="int32"), "raw fp32"),
        (dict(micro=PING, shape=(1, 1)), "1-D"),
        (dict(micro=PING, n=2), "probe micro 0 carries 1 to 1 float32s, got 2"),
        (dict(micro=DATA, n=(256 << 10) // 4 + 1), f"carries 1 to {(256 << 10) // 4} float32s"),
        (dict(micro=DATA, shape=(0,)), "got 0"),
        (dict(micro=DATA_ACK, n=1), "probe micro 3 carries 4 to 4 float32s, got 1"),
        (dict(micro=PONG, n=2), "carries 1 to 1"),
    ],
)
def test_accept_refuses_what_a_probe_is_not(swarm, frame, reason):
    _, probers = swarm
    refusal = probers["a"].accept(header(**frame))
    assert refusal is not None and reason in refusal


def test_an_unsolicited_reply_is_refused_and_counted_but_a_late_one_is_not(swarm):
    _, probers = swarm
    a, b = probers["a"], probers["b"]
    never_sent = a.accept(header(PONG, step=10**12))
    assert never_sent == "reply to a probe never sent" and not isinstance(never_sent, Late)
    a.measure("b", budget_bytes=64, budget_s=1.0)  # issues probe ids
    late = a.accept(header(PONG, step=1))
    assert isinstance(late, Late)
    # over the transport: b sends a pong no one asked for, then one to a probe long given up
    b.transport.send("a", "probe", torch.zeros(1), step=10**12, micro=PONG)
    b.transport.send("a", "probe", torch.zeros(4), step=1, micro=DATA_ACK)
    assert a.transport.inbox.misbehaving["b"] == 1
    assert a.transport.inbox.late == 1
    assert a._replies == {}


def limited(swarm, limits: ProbeLimits = ProbeLimits()) -> tuple[LinkProber, Clock]:
    """b again, answering probes within `limits` on a clock that moves only when the test moves it."""
    _, probers = swarm
    old = probers["b"]
    old.uninstall()
    clock = Clock()
    b = probers["b"] = LinkProber(old.transport, "b", max_probe_bytes=old.max_probe_bytes, limits=limits, clock=clock)
    b.transport.set_policy(b.accept)
    b.install()
    return b, clock


def test_the_default_limits_let_a_peer_measure_four_times_back_to_back(swarm):
    b, _ = limited(swarm)
    a = swarm[1]["a"]
    for _ in range(4):  # the largest measurements b takes, with time standing still
        assert_sane(a.measure("b", budget_bytes=1 << 20, budget_s=2.0), 2.0, 0.0)
    assert b.transport.inbox.late == 0 and not b.transport.inbox.misbehaving
    assert b.received.rate.burst == 4 * 4 * (256 << 10) and b.frames.rate == Rate(16.0, 64.0)


def test_probes_past_the_limit_are_refused_late_then_counted_and_answered_again_after_a_while(swarm):
    b, clock = limited(swarm, ProbeLimits(frames=Rate(per_s=2.0, burst=4.0)))
    reasons = [b.accept(header(PING, sender="a")) for _ in range(9)]
    assert reasons[:4] == [None] * 4
    assert all(isinstance(r, Late) for r in reasons[4:8])  # up to a burst past: no one's fault
    assert reasons[8] == "over 4 probes at once or 2 a second from a"  # a flood: counted
    assert b.accept(header(PING, sender="c")) is None  # every sender has its own allowance
    assert b.accept(header(PONG, sender="a", step=10**12)) == "reply to a probe never sent"  # replies are not charged
    clock.now += (1 - b.frames.available("a")) / 2.0
    assert b.accept(header(PING, sender="a")) is None
    # over the transport, the inbox counts them: a probes b with time standing still
    a = swarm[1]["a"]
    with pytest.raises(ProbeError, match="b did not answer"):
        a.measure("b", budget_bytes=64, budget_s=0.3)
    assert b.transport.inbox.late + sum(b.transport.inbox.misbehaving.values()) > 0


def test_probe_bytes_are_limited_apart_from_probe_frames(swarm):
    b, clock = limited(swarm, ProbeLimits(measurements_per_s=0.5, burst_measurements=1.0))  # 1 MiB at once, 512 KiB/s
    frame = header(DATA, (256 << 10) // 4, sender="a")  # 256 KiB
    assert [b.accept(frame) for _ in range(4)] == [None] * 4
    refused = b.accept(frame)
    assert isinstance(refused, Late) and refused == "over 1 MiB of probes at once or 512 KiB/s from a"
    clock.now += 0.5  # 256 KiB back: the refused frame's, charged all the same
    assert b.accept(frame) is not None
    clock.now += 1.0
    assert b.accept(frame) is None
    with pytest.raises(ValueError, match="probe limits"):
        ProbeLimits(measurements_per_s=0.0)


def test_a_wrong_reply_does_not_complete_a_probe(swarm):
    """A reply from another peer, or of the wrong kind, is not the one a probe waits for."""
    _, probers = swarm
    a, b, c = probers["a"], probers["b"], probers["c"]
    b.uninstall()  # b stays silent; c tries to answer for it

    def answer_for_b() -> None:
        time.sleep(0.1)  # a is waiting for b's pong by now
        with a._arrived:
            [(_, probe_id, _)] = a._replies
        c.transport.send("a", "probe", torch.zeros(1), step=probe_id, micro=PONG)

    results = outcomes([lambda: a.measure("b", budget_s=0.5), answer_for_b], 10.0)
    assert isinstance(results[0], ProbeError) and results[1] is None
    assert a.transport.inbox.late == 1  # refused: not the peer it asked


def test_a_receivers_claim_of_other_traffic_is_held_to_what_was_sent(swarm, caplog):
    """b claims that 1 TB of a's other frames arrived beside each probe frame, though a sent it nothing
    else: a does not believe it, and reads the link by its own frames."""
    _, probers = swarm
    a, b = probers["a"], probers["b"]

    def lying(header, tensor):
        reply = tensor if header.micro == PING else torch.tensor([float(tensor.numel()), tensor.numel() * 4.0, 1e12, 0.0])
        b.transport.send(header.sender, "probe", reply, step=header.step, micro=header.micro + 1)

    b.transport.inbox.handlers["probe"] = lying
    with caplog.at_level(logging.INFO, logger="hetpeer.peer"):
        link = a.measure("b", budget_bytes=1 << 20, budget_s=2.0)
    assert_sane(link, 2.0, 0.0)
    assert link.bandwidth_bytes_per_s < 1e11  # in-process frames, read by a's own: a few GB/s at most
    assert "a: b claims" in caplog.text and "at most 0 could" in caplog.text


# -- the machine ------------------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """torch on one thread: on a busy 2-core machine, two spinning threads make a tiny block's time swing 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_machine_on_cpu_names_the_machine_and_measures_it(one_thread):
    spec = preset("tiny")
    profile = profile_machine(spec, micro_batch=1, dtype="fp32", device="cpu", seconds=0.2)
    assert profile.device_name.startswith("cpu: ") and profile.device_name.endswith("x1")
    assert math.isfinite(profile.tflops) and profile.tflops > 0
    assert profile.memory_bytes > 0
    # Each slowed pass takes 10 times its own work whatever the load, so its best is at most a tenth of the
    # machine's; a busy machine only lowers the unslowed figure, so the best of a few runs is compared.
    fast, slowed = [profile.tflops], []
    for _ in range(3):
        slowed_profile = profile_machine(spec, micro_batch=1, dtype="fp32", device="cpu", slowdown=10, seconds=0.1)
        assert slowed_profile.device_name == profile.device_name
        slowed.append(slowed_profile.tflops)
        fast.append(profile_machine(spec, micro_batch=1, dtype="fp32", device="cpu", seconds=0.1).tflops)
    assert 0 < max(slowed) < max(fast) / 2


def test_other_processes_on_the_cores_do_not_slow_the_compute_figure(one_thread):
    spec = preset("tiny")
    alone = block_tflops(spec, micro_batch=1, seconds=0.5, best=True)
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
    try:
        time.sleep(0.5)
        wall, cpu = time.perf_counter(), time.thread_time()
        shared = block_tflops(spec, micro_batch=1, seconds=0.5, best=True)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    # the load was real: two spinners to a core left this thread well under a core while it measured (about 2/5
    # of one; a median pass read by the clock is no control, a pass shorter than a time slice often runs whole),
    # and yet its figure, from the thread's CPU time, is about what it was alone
    assert wall > 1.5 * cpu, (wall, cpu)
    assert shared > 0.6 * alone


def test_one_slow_call_does_not_decide_the_compute_figure():
    durations = iter([0.01, 0.01, 0.01, 0.9, 0.01])  # warm-up, sizing, then a burst of other work slows the second timed call

    per_call_s = time_per_call(lambda: REAL_SLEEP(next(durations)), "cpu", seconds=0.0)
    assert 0.01 <= per_call_s < 0.3  # the mean would be 0.3 or more
    durations = iter([0.01, 0.01, 0.2, 0.01, 0.3])  # warm-up, sizing; the machine to itself only for the second call
    assert 0.01 <= time_per_call(lambda: REAL_SLEEP(next(durations)), "cpu", seconds=0.0, best=True) < 0.2


def test_short_calls_are_timed_many_to_a_synchronization(monkeypatch):
    """Calls far shorter than a timing queue up: one device synchronization ends each timing, not each call."""
    import hetpeer.peer.probe as probe

    syncs, calls = [], []
    monkeypatch.setattr(probe, "_sync", lambda device: syncs.append(device))
    monkeypatch.setattr(probe, "TIMING_S", 1.0)  # a call of an append is far shorter: every timing takes the most calls

    def call() -> None:
        if not calls:
            REAL_SLEEP(0.2)  # a first call pays for set-up (kernels loading): it must not size the timings
        calls.append(1)

    per_call_s = time_per_call(call, "cuda:0", seconds=0.0)
    assert len(syncs) == 2 + 3  # the warm-up, the call that sizes the timings, then three timings
    assert len(calls) == 2 + 3 * probe.MAX_CALLS_PER_TIMING and per_call_s < 1e-4


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(device_name=""), "device_name"),
        (dict(tflops=math.nan), "tflops"),
        (dict(tflops=0.0), "tflops"),
        (dict(memory_bytes=-1), "memory_bytes"),
    ],
)
def test_a_machine_profile_refuses_nonsense(fields, message):
    with pytest.raises(ValueError, match=message):
        MachineProfile(**{**dict(device_name="cpu", tflops=1.0, memory_bytes=0), **fields})


@pytest.mark.parametrize("files, free", [
    ({"memory.max": "1000000000\n", "memory.current": "300000000\n"}, 700_000_000),  # cgroup v2
    ({"memory.max": "max\n", "memory.current": "300000000\n"}, None),
    ({"memory/memory.limit_in_bytes": "2000\n", "memory/memory.usage_in_bytes": "500\n"}, 1500),  # cgroup v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n"}, None),
    ({"memory.max": "100\n", "memory.current": "250\n"}, 0),  # over its limit (reclaimable cache): nothing left
    ({"memory.max": "garbage\n", "memory.current": "1\n"}, None),
    ({}, None),  # no control group mounted
])
def test_a_containers_memory_limit_bounds_the_free_memory_a_peer_announces(tmp_path, files, free):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_free_bytes(tmp_path) == free


def test_peers_of_one_swarm_on_one_device_announce_one_key_and_their_share_of_it(one_thread):
    from hetpeer.peer.probe import compute_identity

    key, share = compute_identity("cpu", "demo")
    cores = len(os.sched_getaffinity(0))
    assert re.fullmatch(r"[0-9a-f]{16}", key) and share == pytest.approx(min(1.0, 1 / cores))
    assert compute_identity("cpu", "demo", slowdown=4.0) == (key, pytest.approx(share / 4))  # a slowed peer sleeps
    assert compute_identity("cpu", "another")[0] != key  # keys of different swarms do not link machines
    profile = profile_machine(preset("tiny"), micro_batch=1, dtype="fp32", device="cpu", seconds=0.05, swarm="demo")
    assert (profile.compute_key, profile.compute_share) == (key, pytest.approx(share))
    with pytest.raises(ValueError, match="compute_share"):
        MachineProfile(device_name="cpu", tflops=1.0, memory_bytes=0, compute_share=0.0)


def test_the_load_of_other_processes_counts():
    from hetpeer.peer.probe import DeviceLoad

    assert DeviceLoad("cuda").sample() is None  # a GPU's other work is not counted
    load = DeviceLoad("cpu", window=3)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(3):
            time.sleep(0.3)
            busy = load.sample()
    finally:
        spinner.kill()
        spinner.wait()
    # another process spinning a core: near one core's share of them, more on a busy machine, never all of them
    assert busy is not None and 0.4 / len(os.sched_getaffinity(0)) <= busy[0] <= 0.95
    assert busy[1] < 0.2 / len(os.sched_getaffinity(0))  # this process slept


def test_this_process_own_load_is_measured_apart():
    from hetpeer.peer.probe import DeviceLoad

    load = DeviceLoad("cpu", window=3)
    stop = time.monotonic() + 1.0
    while time.monotonic() < stop:  # this process spins a core: its own work, which the coordinator takes out
        pass
    other, own = load.sample()
    cores = len(os.sched_getaffinity(0))
    assert 0.4 / cores <= own <= 0.95 and other + own <= 0.95 + 1e-9
    assert other < own  # what the spinning did is not counted as other work


def test_time_skipped_is_left_out_of_the_load():
    from hetpeer.peer.probe import DeviceLoad

    skipped, plain = DeviceLoad("cpu", window=3), DeviceLoad("cpu", window=3)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        skipped.skip()  # the spinner's second is not counted
    finally:
        spinner.kill()
        spinner.wait()
    time.sleep(0.5)
    quiet, spun = skipped.sample(), plain.sample()
    # the same quiet half second ends both samples; only the one that did not skip holds the spinning core too
    assert quiet is not None and spun is not None and spun[0] - quiet[0] > 0.1 / len(os.sched_getaffinity(0))
