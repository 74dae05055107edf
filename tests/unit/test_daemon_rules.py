"""A swarm peer's pure rules: when a new plan replaces the running one (`switch_now`), which plans' frames
it keeps before it runs them (`held_epochs`), whom a peer entering a plan waits for (`not_arrived`), and
which peers to download a stage's state from (`donors_for`), whether a peer sharing its device trains
(`device_trains`: then it neither times the device nor reads its load), when a peer times its device again,
when one without the reach check's clock offset takes one from the records it reads, and which relay a peer
behind NAT registers at (`pick_relay`)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hetpeer.peer.daemon import probing
from hetpeer.peer.daemon.announcing import Status, achieved_tflops
from hetpeer.peer.daemon.following import FUTURE_EPOCHS, fetching, held_epochs, not_arrived, switch_now
from hetpeer.peer.daemon.handover import donors_for, still_fetched
from hetpeer.peer.daemon.reaching import Reaching, pick_relay
from hetpeer.peer.daemon.probing import REPROFILE_S, REPROFILE_WAITING_HEARTBEATS, Probing, device_trains
from hetpeer.peer.probe import MachineProfile
from hetpeer.peer.transport.punch import Puncher
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import PeerRecord
from hetpeer.protocol.stepcosts import FIELDS, StepCosts
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def make_plan(stages: list[list[str]], *, standby: tuple[str, ...] = (), epoch: int = 1, start_step: int = 0) -> Plan:
    """Stages of equal layer counts over 4 layers (1, 2 or 4 stages), batch 8, micro-batch 1."""
    per = 4 // len(stages)
    lane_batch = -(-8 // len(stages[0]))
    return Plan(
        cost_model="time", model="tiny", layers=4, batch=8, micro_batch=1, micro_batches=lane_batch, dtype="fp32",
        stages=tuple(StagePlan(s, s * per, (s + 1) * per, tuple(d), "gossip") for s, d in enumerate(stages)),
        standby=standby, cost={"total_s": 1.0}, epoch=epoch, start_step=start_step,
    )  # fmt: skip


RUNNING = make_plan([["a", "b"], ["c", "d"]], epoch=1)


# -- switch_now -------------------------------------------------------------------------------------------


def test_a_peer_without_a_plan_switches_at_once():
    assert switch_now(None, make_plan([["a", "b"], ["c", "d"]], epoch=2, start_step=50), 0)


def test_a_peer_at_or_past_the_start_step_switches_at_once():
    new = make_plan([["b", "a"], ["d", "c"]], epoch=2, start_step=50)
    assert switch_now(RUNNING, new, 50)
    assert switch_now(RUNNING, new, 70)


def test_intact_membership_runs_the_old_plan_up_to_the_start_step():
    reshuffled = make_plan([["c", "a"], ["d", "b"]], epoch=2, start_step=50)
    assert not switch_now(RUNNING, reshuffled, 49)
    grown = make_plan([["a", "b", "e"], ["c", "d", "f"]], epoch=2, start_step=50)  # newcomers break nothing
    assert not switch_now(RUNNING, grown, 10)


def test_a_member_missing_from_the_new_plan_switches_at_once():
    without_d = make_plan([["a"], ["c"]], standby=("b",), epoch=2, start_step=50)
    assert switch_now(RUNNING, without_d, 10)
    replaced = make_plan([["a", "b"], ["c", "e"]], epoch=2, start_step=50)
    assert switch_now(RUNNING, replaced, 10)


def test_a_member_moved_to_standby_is_still_intact():
    benched = make_plan([["a", "b"], ["c", "e"]], standby=("d",), epoch=2, start_step=50)
    assert not switch_now(RUNNING, benched, 10)


# -- held_epochs ------------------------------------------------------------------------------------------


def test_a_working_peer_keeps_frames_of_the_plans_after_its_own():
    running = make_plan([["a", "b"], ["c", "d"]], epoch=4)
    pending = make_plan([["a", "b"], ["c", "d"]], epoch=5)
    assert held_epochs(running, running, None, "a") == (5, 4 + FUTURE_EPOCHS)
    assert held_epochs(running, running, pending, "a") == (5, 5 + FUTURE_EPOCHS)


def test_a_peer_building_the_worker_of_a_plan_keeps_that_plans_frames():
    """A standby peer that a new plan brings in builds its worker and downloads its state while its lane
    neighbours already send it the plan's first activations: those must wait for it, not be dropped."""
    entered = make_plan([["a", "b"], ["c", "d"]], epoch=5)
    assert held_epochs(None, entered, None, "c") == (5, 5 + FUTURE_EPOCHS)


def test_a_standby_peer_keeps_only_frames_of_later_plans():
    benched = make_plan([["a", "b"], ["c", "d"]], standby=("e",), epoch=5)
    assert held_epochs(None, benched, None, "e") == (6, 5 + FUTURE_EPOCHS)
    assert held_epochs(None, None, None, "e") == (1, FUTURE_EPOCHS)  # no plan read yet


# -- donors_for -------------------------------------------------------------------------------------------


def record(device: str, layers: tuple[int, int] | None, step: int, state: str = "training") -> PeerRecord:
    return PeerRecord(
        device_id=device, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=1 << 30,
        address=PeerAddress(direct=("127.0.0.1", 7000)), state=state, time=0.0, epoch=1, layers=layers, step=step,
    )  # fmt: skip


def book(*records: PeerRecord) -> dict[str, PeerRecord]:
    return {r.device_id: r for r in records}


def test_only_overlapping_layers_donate():
    records = book(
        record("left", (0, 2), 5), record("inside", (3, 4), 5), record("right", (4, 6), 5),
        record("across", (1, 5), 5), record("far", (6, 8), 5),
    )  # fmt: skip
    assert set(donors_for(records, (2, 4), "me")) == {"inside", "across"}  # [0,2) and [4,6) only touch [2,4)


def test_exact_holders_come_first_then_the_furthest_step():
    records = book(
        record("partial_new", (0, 3), 90), record("exact_old", (0, 2), 10), record("partial_old", (1, 2), 20),
        record("exact_new", (0, 2), 40),
    )  # fmt: skip
    assert donors_for(records, (0, 2), "me") == ["exact_new", "exact_old", "partial_new", "partial_old"]


def test_never_itself_and_never_a_peer_that_holds_nothing():
    records = book(record("me", (0, 2), 99), record("fresh", None, 99), record("other", (0, 2), 1))
    assert donors_for(records, (0, 2), "me") == ["other"]
    assert donors_for(book(record("me", (0, 2), 99), record("fresh", None, 3)), (0, 2), "me") == []


def test_a_leaving_or_downloading_peer_never_donates():
    records = book(
        record("gone", (0, 2), 99, state="leaving"), record("joining", (0, 2), 99, state="fetching"),
        record("other", (0, 2), 1),
    )  # fmt: skip
    assert donors_for(records, (0, 2), "me") == ["other"]


# -- not_arrived --------------------------------------------------------------------------------------------


def announcing(device: str, epoch: int) -> PeerRecord:
    return replace(record(device, None, 0), epoch=epoch)


def test_an_entering_peer_waits_for_its_lane_and_group_to_announce_the_plan():
    plan = make_plan([["a", "b"], ["c", "d"]], standby=("e",), epoch=3)  # lanes a-c and b-d; groups a,b and c,d
    assert not_arrived(plan, {}, "a") == ["b", "c"]  # never d: neither in its lane nor in its group
    records = book(announcing("b", 3), announcing("c", 2), announcing("d", 2), announcing("e", 1))
    assert not_arrived(plan, records, "a") == ["c"]  # c still finishes the plan before
    records["c"] = announcing("c", 4)  # or is already under a later one
    assert not_arrived(plan, records, "a") == []


# -- still_fetched ------------------------------------------------------------------------------------------


def test_a_stage_held_before_is_kept_until_every_new_holder_of_its_layers_trains_under_the_plan():
    plan = make_plan([["a", "b"], ["c", "d"]], epoch=3)  # layers [0, 2) on a and b, [2, 4) on c and d
    records = book(replace(record("b", (0, 2), 0, state="fetching"), epoch=3), replace(record("c", (2, 4), 0), epoch=3))
    assert still_fetched(plan, records, "a", (0, 2))  # b still downloads layers 0-1, perhaps from a
    records["b"] = replace(records["b"], state="training")
    assert not still_fetched(plan, records, "a", (0, 2))  # a itself and b train: no one needs a's old copy
    assert still_fetched(plan, records, "a", (1, 3))  # overlaps c's and d's stage: d has not announced epoch 3
    records["d"] = replace(record("d", (2, 4), 0), epoch=2)
    assert still_fetched(plan, records, "a", (1, 3))  # d still runs the plan before
    records["d"] = replace(records["d"], epoch=4)
    assert not still_fetched(plan, records, "a", (1, 3))


# -- fetching --------------------------------------------------------------------------------------------


def test_a_neighbour_is_waited_for_only_while_it_announces_fetching_under_the_running_plan():
    plan = make_plan([["a", "b"], ["c", "d"]], epoch=3)
    downloading = replace(record("c", (2, 4), 0, state="fetching"), epoch=3)
    assert fetching(plan, book(downloading), "c")
    assert not fetching(plan, book(replace(downloading, epoch=2)), "c")  # fetching for a plan this one replaced
    assert not fetching(plan, book(replace(downloading, state="training")), "c")  # it has its state: frames are late
    assert not fetching(plan, book(replace(downloading, state="waiting")), "c")
    assert not fetching(plan, {}, "c")  # stopped announcing: gone


def test_what_a_step_achieves_counts_its_layers_flops_over_its_compute_less_the_rest_its_probe_timed():
    spec = preset("tiny")
    w = Workload(spec, batch=4)
    stages = (StagePlan(0, 0, 3, ("a",), "none", recompute=2), StagePlan(1, 3, 4, ("b",), "none"))
    plan = Plan(cost_model="time", model="tiny", layers=4, batch=4, micro_batch=1, micro_batches=4, dtype="fp32", stages=stages)
    layer = w.layer_fwd_flops_per_seq
    # a peer that announces no step costs: its whole compute, the head counted by its FLOPs
    assert achieved_tflops(plan, "a", spec, 2.0, StepCosts()) == pytest.approx((3 * 3 + 2) * 4 * layer / 2.0 / 1e12)  # 2 recomputed
    assert achieved_tflops(plan, "b", spec, 2.0, StepCosts()) == pytest.approx(3 * 4 * (layer + w.head_fwd_flops_per_seq) / 2e12)
    # one that timed the rest: the embedding (first stage) or the head (last), and the Python of each micro-batch
    costs = StepCosts(embed_s_per_seq=0.1, head_s_per_seq=0.2, micro_s=0.05)
    assert achieved_tflops(plan, "a", spec, 2.0, costs) == pytest.approx((3 * 3 + 2) * 4 * layer / (2.0 - 4 * 0.1 - 4 * 0.05) / 1e12)
    assert achieved_tflops(plan, "b", spec, 2.0, costs) == pytest.approx(3 * 4 * layer / (2.0 - 4 * 0.2 - 4 * 0.05) / 1e12)
    # one that timed recomputing a layer at 0.85 of its forward and backward: the two recomputed count that much more
    timed = StepCosts(recompute_share=0.85)
    assert achieved_tflops(plan, "a", spec, 2.0, timed) == pytest.approx(3 * (3 + 2 * 0.85) * 4 * layer / 2.0 / 1e12)
    # a probe that timed the rest longer than the step took leaves the blocks a tenth of it, not a negative time
    assert achieved_tflops(plan, "b", spec, 0.5, costs) == pytest.approx(3 * 4 * layer / 0.05 / 1e12)


# -- device_trains --------------------------------------------------------------------------------------------


def test_only_another_training_peer_on_the_same_device_counts():
    def record(device: str, key: str | None, state: str) -> PeerRecord:
        return PeerRecord(device, "tiny", "fp32", "cpu", 1.0, 0, PeerAddress(("127.0.0.1", 1)), state, 0.0, compute_key=key)

    others = {"b": record("b", "k", "standby"), "c": record("c", "other", "training")}
    assert not device_trains("k", others, "a")  # on its device nobody trains; elsewhere does not count
    assert not device_trains("k", {**others, "a": record("a", "k", "training")}, "a")  # itself does not count
    assert device_trains("k", {**others, "d": record("d", "k", "training")}, "a")
    assert not device_trains(None, {"d": record("d", None, "training")}, "a")  # an unknown device is shared with nobody


# -- timing the device again ----------------------------------------------------------------------------------


HEARTBEAT_S = 2.0


class Reprofiled(Probing):
    """A peer's probing part, alone: its device times `fresh` GFLOPS whenever it is timed again."""

    def __init__(self, state: str, tflops: float, fresh: float, profiled_at: float, home: Path) -> None:
        self.status, self.lock, self.records, self.device_id = Status(state=state), threading.Lock(), {}, "a"
        self.config = SimpleNamespace(home=home, model=preset("tiny"), dtype="fp32", micro_batch=2, heartbeat_s=HEARTBEAT_S,
                                      worker=SimpleNamespace(slowdown=4.0, device="cpu"))
        self.machine = MachineProfile("cpu", tflops, 1 << 30, compute_key="k")
        self.fresh, self._profiled_at, self.timed, self.said = fresh, profiled_at, 0, []

    def _profile(self) -> MachineProfile:
        self.timed += 1
        return replace(self.machine, tflops=self.fresh)

    def report(self, line: str) -> None:
        self.said.append(line)


WAITING_S = REPROFILE_WAITING_HEARTBEATS * HEARTBEAT_S


@pytest.mark.parametrize("state, since, timed", [
    ("waiting", WAITING_S - 1, 0), ("waiting", WAITING_S + 1, 1),  # before any plan: soon again
    ("standby", WAITING_S + 1, 0), ("standby", REPROFILE_S + 1, 1),  # on standby: now and then
    ("training", REPROFILE_S + 1, 0),  # never while it trains
])  # fmt: skip
def test_a_peer_times_its_device_again_sooner_before_the_first_plan(monkeypatch, tmp_path, state, since, timed):
    monkeypatch.setattr(probing.time, "monotonic", lambda: 1000.0)
    peer = Reprofiled(state, 1e-3, 2e-3, 1000.0 - since, tmp_path)
    peer._profile_again()
    assert peer.timed == timed
    assert peer.machine.tflops == (2e-3 if timed else 1e-3)
    assert peer.machine.timings == 1 + timed  # the record counts it: the swarm's first plan waits for a second


def test_timing_again_keeps_the_faster_figure_and_leaves_a_busy_device_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(probing.time, "monotonic", lambda: 1000.0)
    slower = Reprofiled("waiting", 2e-3, 1e-3, 0.0, tmp_path)
    slower._profile_again()
    assert (slower.timed, slower.machine.tflops, slower.said) == (1, 2e-3, [])  # timed, and the busier start kept
    assert slower.machine.timings == 2  # counted all the same
    faster = Reprofiled("waiting", 1e-3, 3e-3, 0.0, tmp_path)
    faster._profile_again()
    assert faster.machine.tflops == 3e-3 and faster.said == ["machine: 3.00 GFLOPS achieved now (was 1.00 when busier)"]
    busy = Reprofiled("waiting", 1e-3, 3e-3, 0.0, tmp_path)  # another peer on its device trains: timing it would slow that peer
    busy.records = {"b": PeerRecord("b", "tiny", "fp32", "cpu", 1.0, 0, PeerAddress(("127.0.0.1", 1)), "training", 0.0,
                                    compute_key="k")}
    busy._profile_again()
    assert (busy.timed, busy.machine.tflops, busy.machine.timings) == (0, 1e-3, 1)


def test_a_returning_peer_announces_the_faster_figure_its_home_remembers(monkeypatch, tmp_path):
    # it left after timing 3 GFLOPS; back while its device's other peers train, it times 1
    monkeypatch.setattr(probing.time, "monotonic", lambda: 1000.0)
    before = Reprofiled("waiting", 1e-3, 3e-3, 0.0, tmp_path)
    before._profile_again()  # faster than its start: remembered
    back = Reprofiled("waiting", 1e-3, 1e-3, 0.0, tmp_path)
    machine = back._fastest_known(replace(back.machine, step_costs=StepCosts(micro_s=0.01)))
    assert machine.tflops == 3e-3 and machine.step_costs == StepCosts()  # the remembered timing, with its own costs
    assert "busier than when it timed 3.00" in back.said[0]
    back.machine = machine
    back._profile_again()
    assert back.machine.tflops == 3e-3  # a slower timing again changes nothing


@pytest.mark.parametrize("change", [
    {"slowdown": 8.0}, {"device_name": "cuda:0"}, {"compute_key": "other"}, {"model": "small"}, {"time": -2 * probing.REMEMBER_S},
])  # fmt: skip
def test_a_remembered_timing_stands_only_for_the_same_device_and_settings_and_not_for_long(tmp_path, change):
    peer = Reprofiled("waiting", 1e-3, 1e-3, 0.0, tmp_path)
    path = tmp_path / probing.MACHINE_FILE
    probing.remember(path, peer._timing_context(), replace(peer.machine, tflops=3e-3))
    assert probing.recalled(path, peer._timing_context(), peer.machine)[0] == 3e-3
    record = json.loads(path.read_text())
    record.update({k: (record["time"] + v if k == "time" else v) for k, v in change.items()})
    path.write_text(json.dumps(record))
    assert probing.recalled(path, peer._timing_context(), peer.machine) is None


def test_a_home_it_cannot_write_to_is_said_and_the_timing_still_announced(tmp_path):
    peer = Reprofiled("waiting", 1e-3, 1e-3, 0.0, tmp_path / "missing")  # no such folder: nothing can be kept there
    assert peer._fastest_known(peer.machine).tflops == 1e-3
    assert peer.said and peer.said[0].startswith("machine: its timing is not kept for a later start:")


@pytest.mark.parametrize("text, words", [
    ("{not json", "not JSON"), ("[1, 2]", "not a JSON object"),
    ('{"tflops": -1}', "tflops must be a positive number"), ('{"step_costs": [1]}', "step_costs must be a list"),
    ('{"step_costs": [-1' + ', 0' * (len(FIELDS) - 1) + ']}', "embed_s_per_seq must be"),
    ('{"step_costs": [0, 0, 0, 0, 0]}', "step_costs must be a list"),  # a file an older hetpeer wrote: timed again
])  # fmt: skip
def test_a_damaged_machine_file_is_named_and_the_fresh_timing_announced(tmp_path, text, words):
    peer = Reprofiled("waiting", 1e-3, 1e-3, 0.0, tmp_path)
    good = {**peer._timing_context(), "device_name": "cpu", "compute_key": "k", "tflops": 3e-3, "step_costs": [0.0] * len(FIELDS),
            "time": probing.time.time()}
    damaged = text if not text.startswith('{"') else json.dumps({**good, **json.loads(text)})
    (tmp_path / probing.MACHINE_FILE).write_text(damaged)
    machine = peer._fastest_known(peer.machine)
    assert machine.tflops == 1e-3 and words in peer.said[0] and probing.MACHINE_FILE in peer.said[0]
    assert probing.recalled(tmp_path / probing.MACHINE_FILE, peer._timing_context(), peer.machine)[0] == 1e-3  # replaced


class Loads:
    """A device's load as `probe.DeviceLoad` reads it: (other work, this process), or skipped."""

    def __init__(self, reading: tuple[float, float]) -> None:
        self.reading, self.skipped = reading, 0

    def sample(self) -> tuple[float, float]:
        return self.reading

    def skip(self) -> None:
        self.skipped += 1


def test_a_waiting_peer_announces_the_other_work_and_its_own_and_nothing_while_its_device_trains(tmp_path):
    peer = Reprofiled("waiting", 1e-3, 1e-3, 0.0, tmp_path)
    peer.running, peer.device_load = None, Loads((0.3, 0.05))
    peer._measure_load()
    assert (peer.machine.compute_background, peer.machine.compute_own) == (0.3, 0.05)
    peer.device_load = Loads((0.9, 0.01))  # a peer on its device trains: its compute would read as other work
    peer.records = {"b": PeerRecord("b", "tiny", "fp32", "cpu", 1.0, 0, PeerAddress(("127.0.0.1", 1)), "training", 0.0,
                                    compute_key="k")}
    peer._measure_load()
    assert peer.device_load.skipped == 1 and (peer.machine.compute_background, peer.machine.compute_own) == (0.3, 0.05)


class Clocked(Reaching):
    """A peer's reaching part, alone, over a control plane that read records `leads` seconds ahead of its clock."""

    def __init__(self, leads: list[float], from_reach: bool = False) -> None:
        self.config, self.said, self.clock_from_reach = SimpleNamespace(heartbeat_s=HEARTBEAT_S), [], from_reach
        self.control = SimpleNamespace(record_leads_s=leads, clock_offset_s=0.0, set=[])
        self.control.set_clock_offset = lambda offset: (self.control.set.append(offset),
                                                        setattr(self.control, "clock_offset_s", offset))

    def report(self, line: str) -> None:
        self.said.append(line)


def test_a_peer_without_the_reach_checks_offset_takes_the_median_of_the_records_it_reads():
    behind = Clocked([89.0, 90.5, 91.0, -500.0, 3000.0])  # two liars, one each way, move the median not at all
    behind._correct_clock()
    assert behind.control.set == [90.5]
    assert behind.said[0].startswith("clock: this machine's clock is 90 s behind the coordinator's")
    assert "median of 5 other peer(s)' signed records" in behind.said[0]
    behind.control.record_leads_s = [-1.0, -0.5, 0.0]  # read again once corrected: within two heartbeats, left alone
    behind._correct_clock()
    assert behind.control.set == [90.5] and len(behind.said) == 1
    nearly = Clocked([-4.5, -4.6, -4.4])  # past two heartbeats, not far enough to tell the volunteer of
    nearly._correct_clock()
    assert nearly.control.set == [-4.5] and nearly.said[0].startswith("clock: corrected by -4.5 s (from the median")
    for left in (Clocked([90.0], from_reach=True), Clocked([]), Clocked([3.9, -3.9, 1.0])):
        left._correct_clock()  # the reach check's offset stands; no records; within two heartbeats
        assert left.control.set == [] and left.said == []


class Keeping(Reaching):
    """A punching peer's reaching part, alone: the records it read, its running plan, what it keeps connections to."""

    def __init__(self, records: dict[str, PeerRecord], running: Plan, device: str = "me") -> None:
        self.device_id, self.records, self.running, self.pending = device, records, running, None
        self.reachable, self.punch_port, self.lock, self.kept = "none", 40000, threading.Lock(), None
        # the address book as `SwarmPeer._control_round` makes it from the records, and a puncher at its own address
        book = {d: replace(r.address, dialable=not r.behind_nat, relay=r.relay, punch=r.punch or None) for d, r in records.items()}
        puncher = Puncher(LinkIdentity(device, None), "0.0.0.0", 40000, public_host=records[device].address.direct[0])
        self.transport = SimpleNamespace(keep_connected=lambda peers: setattr(self, "kept", set(peers)),
                                         punchable=lambda d: d in book and puncher.reaches(book[d]))
        self.relay_link, self.relay, self.links = SimpleNamespace(via=None), None, SimpleNamespace(current=dict)


def test_a_punching_peer_calls_its_neighbours_first_then_a_spread_of_others_and_keeps_whoever_calls_it():
    def home(device: str, host: str, punch: int = 40000, calling: tuple[str, ...] = ()) -> PeerRecord:
        return replace(record(device, None, 0), address=PeerAddress(direct=(host, 7000)), reachable="none", punch=punch,
                       calling=calling)

    records = {"me": home("me", "198.51.100.1"), "n1": home("n1", "198.51.100.2"), "n2": home("n2", "198.51.100.3", punch=0),
               "caller": home("caller", "198.51.100.4", calling=("me",)), "sibling": home("sibling", "198.51.100.1")}
    records.update({f"o{i:02}": home(f"o{i:02}", f"203.0.113.{i}") for i in range(30)})
    peer = Keeping(records, make_plan([["me", "x"], ["n1", "n2"]]))
    peer._keep_paths()
    assert peer.calling[0] == "n1" and len(peer.calling) == 16  # its lane neighbour first, then 15 others
    assert "n2" not in peer.calling and "sibling" not in peer.calling  # cannot punch; behind its own router
    assert peer.kept == set(peer.calling) | {"caller"}  # n2 has no path at all: nothing to keep
    first = peer.calling
    peer._keep_paths()
    assert peer.calling == first  # the same others heartbeat after heartbeat
    other = Keeping(records, make_plan([["n1"], ["me"]]), device="n1")  # me's lane neighbour, reading the same records
    other._keep_paths()
    assert set(other.calling[1:]) != set(first[1:])  # another peer calls another spread


def test_peers_behind_nat_spread_over_the_relays_in_proportion_to_their_links_and_keep_theirs():
    """400 peers, four relays (one twice as fast, one not yet measured: as the median): each relay takes its share,
    the same again on the next heartbeat; a relay that leaves moves only its own peers; one that comes takes some;
    a peer keeps a relay that still scores near the best."""
    public = {"r1": 50e6, "r2": 50e6, "r3": 100e6, "r4": None}
    peers = [f"home{k}" for k in range(400)]
    picked = {p: pick_relay(p, None, public) for p in peers}
    shares = Counter(picked.values())
    assert set(shares) == set(public)
    assert 45 <= shares["r1"] <= 115 and 45 <= shares["r2"] <= 115 and 45 <= shares["r4"] <= 115
    assert 110 <= shares["r3"] <= 210  # twice the weight: about 160 of 400
    assert all(pick_relay(p, picked[p], public) == picked[p] for p in peers)  # the same, heartbeat after heartbeat
    without = {d: b for d, b in public.items() if d != "r3"}
    moved = {p for p in peers if pick_relay(p, picked[p] if picked[p] in without else None, without) != picked[p]}
    assert moved == {p for p in peers if picked[p] == "r3"}
    joined = {**public, "r5": 50e6}
    assert 0 < sum(pick_relay(p, picked[p], joined) == "r5" for p in peers) < 100
    assert pick_relay("home0", None, {}) is None


def test_a_peer_behind_nat_probes_no_peer_it_reaches_only_through_a_relay():
    """The planner takes a relayed pair at its relay's two hops: a probe through the relay would only load it. A
    peer it punched a hole to and a public peer are probed; one behind a NAT that changes ports (no hole), reached
    through its relay, is not."""
    def home(device: str, host: str, punch: int = 40000, reachable: str = "none") -> PeerRecord:
        return replace(record(device, None, 0), address=PeerAddress(direct=(host, 7000)), reachable=reachable, punch=punch)

    records = {"me": home("me", "198.51.100.1"), "punches": home("punches", "198.51.100.2"),
               "public": home("public", "203.0.113.9", punch=0, reachable="direct"),
               "symmetric": home("symmetric", "198.51.100.3", punch=0, reachable="via:public")}
    peer = Keeping(records, make_plan([["me"], ["public"]]))
    peer.transport.connected = lambda d: d == "punches"  # the hole is punched
    assert [d for d in records if d != "me" and peer._worth_probing(d)] == ["punches", "public"]
    peer.reachable = "direct"  # a public peer probes them all: it is no pair through a relay
    assert [d for d in records if d != "me" and peer._worth_probing(d)] == ["punches", "public", "symmetric"]
    # nor is a plan neighbour reached only through a relay probed: the round's targets leave it out
    probed = Probed(records, make_plan([["me", "punches"], ["symmetric", "public"]]))
    probed.transport.connected = lambda d: d == "punches"
    probed._probe_links()
    assert probed.targets and "symmetric" not in probed.targets and set(probed.targets) <= {"punches", "public"}


class Probed(Keeping, Probing):
    """A peer behind NAT's probe round, alone: whom it probes."""

    def __init__(self, records: dict[str, PeerRecord], running: Plan) -> None:
        super().__init__(records, running)
        self.config = SimpleNamespace(probe_targets=4, probe_bytes=1 << 20, heartbeat_s=HEARTBEAT_S)
        self._rng, self.targets = np.random.default_rng(0), None
        self.links = SimpleNamespace(oldest_first=list, add=lambda measured: None, keep_only=lambda records: None)
        self.prober = SimpleNamespace(measure_many=lambda targets, **_: setattr(self, "targets", list(targets)) or {})
