"""Who may be planned: join tokens, allow-lists, and bans on a group's report (pure parts and the coordinator's rounds)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from hetpeer.coordinator import gate
from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.service import Coordinator
from hetpeer.protocol.admission import AdmissionError, Allowlist, mint_token, read_token, token_refusal
from hetpeer.protocol.plan import Plan, StagePlan

from test_coordinator_rounds import FIRST_PLAN_ROUNDS, Control, rounds

KEY = RSAPrivateKey()
PUBLIC = KEY.get_public_key().to_bytes()
A, B, C, D = (f"{n}-{i:012x}" for i, n in enumerate(("alice", "bob", "carol", "dave"), 1))


# -- tokens ---------------------------------------------------------------------------------------------
def test_a_token_admits_its_holder_until_it_expires():
    token = mint_token(KEY, "t", time.time() + 60)
    assert read_token(token, PUBLIC).swarm == "t"
    assert token_refusal(token, A, "t", PUBLIC, time.time()) is None
    assert "expired at" in token_refusal(token, A, "t", PUBLIC, time.time() + 120)


def test_a_named_token_admits_only_that_name():
    token = mint_token(KEY, "t", time.time() + 60, name="alice")
    assert token_refusal(token, A, "t", PUBLIC, time.time()) is None
    assert token_refusal(token, B, "t", PUBLIC, time.time()) == "its token is for a peer named 'alice'"


@pytest.mark.parametrize("make, reason", [
    (lambda: None, "carries no join token"),
    (lambda: mint_token(KEY, "other", time.time() + 60), "for swarm 'other'"),
    (lambda: mint_token(RSAPrivateKey(), "t", time.time() + 60), "not signed by this swarm's coordinator"),
    (lambda: "hpt1.abc", "not a hetpeer join token"),
    (lambda: "x" * 2000, "at most 1024"),
    (lambda: "hpt1.e30.!!!", "signature is not URL-safe base64"),
])
def test_a_token_that_does_not_admit_says_why(make, reason):
    assert reason in token_refusal(make(), A, "t", PUBLIC, time.time())


def test_a_token_whose_claims_were_changed_does_not_verify():
    prefix, claims, signature = mint_token(KEY, "t", time.time() + 60, name="alice").split(".")
    forged = f"{prefix}.{claims[:-2]}AA.{signature}"
    with pytest.raises(AdmissionError, match="not signed"):
        read_token(forged, PUBLIC)


def test_minting_refuses_a_bad_name():
    with pytest.raises(ValueError, match="peer name"):
        mint_token(KEY, "t", time.time() + 60, name="Not Valid")


# -- allow-lists -------------------------------------------------------------------------------------
def test_an_allowlist_names_device_ids_or_key_fingerprints():
    allowed = Allowlist.parse(f"# organizers' machines\n{A}\n\n{C.rpartition('-')[2]}  # carol, under any name\n", "list")
    assert allowed.admits(A) and allowed.admits(C) and allowed.admits("other-" + C.rpartition("-")[2])
    assert not allowed.admits(B)


def test_an_allowlist_line_that_is_neither_names_its_line(tmp_path):
    (tmp_path / "list").write_text(f"{A}\nalice\n")
    with pytest.raises(AdmissionError, match="list line 2: 'alice' is neither"):
        Allowlist.read(tmp_path / "list")
    with pytest.raises(AdmissionError, match="cannot read allow-list"):
        Allowlist.read(tmp_path / "missing")


# -- bans ----------------------------------------------------------------------------------------------
def plan_of(*groups: tuple[str, ...]) -> Plan:
    stages = tuple(StagePlan(i, i, i + 1, devices, "gossip") for i, devices in enumerate(groups))
    return Plan(cost_model="time", model="tiny", layers=len(groups), batch=8, micro_batch=1, micro_batches=8 // len(groups[0]),
                dtype="fp32", stages=stages, standby=(), epoch=1, start_step=0)


def records(control: Control, suspects: dict[str, tuple[str, ...]]):
    for device in (A, B, C, D):
        control.announce(device, suspects=suspects.get(device, ()))
    return control.records


def test_a_peer_reported_by_a_majority_of_its_group_is_banned_and_longer_each_time():
    control = Control()
    plan = plan_of((A, B, C, D))
    found = records(control, {A: (D,), B: (D,), D: (A,)})  # two of D's three group mates report it
    bans, news = gate.judge(plan, found, {}, 100.0, 300.0)
    assert set(bans) == {D} and bans[D].until == 400.0 and "reported by 2 of the 3" in news[0]
    again, _ = gate.judge(plan, found, bans, 200.0, 300.0)  # still banned: not judged again
    assert again == bans
    later, news = gate.judge(plan, found, bans, 500.0, 300.0)  # reported again once free: twice as long
    assert later[D].count == 2 and later[D].until == 1100.0


def test_a_minority_report_a_pair_or_bans_off_ban_no_one():
    control = Control()
    assert gate.judge(plan_of((A, B, C, D)), records(control, {D: (A,)}), {}, 0.0, 300.0)[0] == {}  # 1 of 3
    assert gate.judge(plan_of((A, B), (C, D)), records(control, {A: (B,), C: (D,)}), {}, 0.0, 300.0)[0] == {}
    assert gate.judge(plan_of((A, B, C, D)), records(control, {A: (D,), B: (D,)}), {}, 0.0, 0.0)[0] == {}


def test_in_a_pair_an_accusation_is_a_dispute_that_parts_the_pair_and_a_second_partners_bans():
    control = Control()
    first = plan_of((A, B), (C, D))  # stage 0: A and B; stage 1: C and D (lanes A-C, B-D)
    found = records(control, {A: (B,)})
    disputed, news = gate.disputes(first, found, {}, 10.0)
    assert disputed == {(B, A): 10.0} and f"{A} reports {B}, its only partner at stage 0" in news[0]
    assert gate.apart(disputed) == {tuple(sorted((A, B)))}
    tried = set()
    assert f"parting {min(A, B)} and {max(A, B)}" in gate.parted(first, disputed, tried)
    assert gate.parted(first, disputed, tried) is None  # asked once: a swarm too small to part them keeps its plan
    assert gate.judge(first, found, {}, 10.0, 300.0, disputed)[0] == {}  # one accuser: no verdict
    assert gate.disputes(first, found, disputed, 20.0) == (disputed, [])  # said once
    # the next plan gives B another partner, C, who also reports it: two partners in turn ban it
    second = plan_of((B, C), (D, A))  # lanes B-D and C-A: A and B are no neighbours
    assert gate.parted(second, disputed, set()) is None
    disputed, _ = gate.disputes(second, records(control, {C: (B,)}), disputed, 30.0)
    bans, news = gate.judge(second, records(control, {C: (B,)}), {}, 30.0, 300.0, disputed)
    assert set(bans) == {B} and f"reported by 2 partners in turn ({A}, {C})" in news[0]
    # a dispute is forgotten after DISPUTE_S: a partner accused long ago and once more is not banned
    stale, _ = gate.disputes(second, records(control, {}), {(B, A): 0.0}, gate.DISPUTE_S + 1.0)
    assert stale == {}


def test_plannable_says_why_each_peer_is_left_out():
    control = Control()
    found = records(control, {})
    bans = {B: gate.Ban(500.0, 1, "reported"), C: gate.Ban(50.0, 1, "reported")}  # C's ban ran out
    admission = gate.Admission("allowlist", allowlist=Allowlist.parse(f"{A}\n{B}\n{C}\n", "list"))
    kept, refused = gate.plannable(found, admission, bans, 100.0)
    assert set(kept) == {A, C}
    assert refused == {B: "banned for another 400 s: reported", D: "not admitted: not on the allow-list"}


# -- the coordinator's rounds --------------------------------------------------------------------------
class StartableControl(Control):
    def __init__(self) -> None:
        super().__init__()
        self.public_key = PUBLIC

    def start(self) -> None:
        pass

    def visible_maddrs(self) -> list[str]:
        return []


def coordinator_with(tmp_path: Path, **config) -> Coordinator:
    config = {"min_peers": 2, "stages": 1, **config}
    made = Coordinator(CoordinatorConfig(swarm="t", home=tmp_path, heartbeat_s=1.0, time_budget_s=0.2,
                                         replan_interval_s=3600, api_listen=None, **config), lambda line: None)
    made.control = StartableControl()
    made.control.clock = time.time()  # tokens expire in Unix time, as the DHT's clock runs
    made.lines = []
    made.report = made.lines.append
    made.start()
    made.executor.shutdown()
    made.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    return made


def planned(coordinator: Coordinator) -> set[str]:
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    plan = coordinator.control.plans[-1].plan
    return set(plan.devices) | set(plan.standby)


def test_open_admission_plans_every_peer(tmp_path):
    coordinator = coordinator_with(tmp_path)
    for device in (A, B, C):
        coordinator.control.announce(device)
    assert planned(coordinator) == {A, B, C}
    assert "admission: open to every peer; bans of 300 s on a group's report" in coordinator.lines


def test_allowlist_admission_plans_only_the_peers_listed_and_rereads_the_file(tmp_path):
    listed = tmp_path / "allowed"
    listed.write_text(f"{A}\n{B.rpartition('-')[2]}\n")
    coordinator = coordinator_with(tmp_path, admission="allowlist", allowlist=listed)
    for device in (A, B, C):
        coordinator.control.announce(device)
    assert planned(coordinator) == {A, B}
    assert f"left {C} out of plans: not admitted: not on the allow-list" in coordinator.lines
    listed.write_text(f"{A}\n{B}\n{C}\n")
    os.utime(listed, (time.time() + 5, time.time() + 5))  # a changed file, whatever the file system's clock grain
    rounds(coordinator, 4)
    assert set(coordinator.refused) == set()  # planned at the next re-plan, as any newcomer
    assert any(line.startswith(f"read allow-list {listed} again") for line in coordinator.lines)


def test_a_bad_allowlist_stops_the_coordinator_before_it_starts(tmp_path):
    listed = tmp_path / "allowed"
    listed.write_text("not-an-id\n")
    with pytest.raises(AdmissionError, match="line 1"):
        coordinator_with(tmp_path, admission="allowlist", allowlist=listed)


def test_token_admission_plans_only_peers_with_a_valid_token(tmp_path):
    coordinator = coordinator_with(tmp_path, admission="token")
    expires = time.time() + 3600
    coordinator.control.announce(A, token=mint_token(KEY, "t", expires))
    coordinator.control.announce(B, token=mint_token(KEY, "t", expires, name="bob"))
    coordinator.control.announce(C, token=mint_token(KEY, "t", expires, name="alice"))  # carol holds alice's token
    coordinator.control.announce(D)
    assert planned(coordinator) == {A, B}
    assert f"left {C} out of plans: not admitted: its token is for a peer named 'alice'" in coordinator.lines
    assert f"left {D} out of plans: not admitted: its record carries no join token" in coordinator.lines


def test_a_banned_member_is_planned_around_until_its_ban_ends(tmp_path):
    coordinator = coordinator_with(tmp_path, ban_period_s=30.0, group_size=4)
    control = coordinator.control
    for device in (A, B, C, D, "erin-000000000005"):
        control.announce(device)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    *honest, suspect = control.plans[-1].plan.devices
    for device in honest:
        control.announce(device, suspects=(suspect,))
    rounds(coordinator, 3)
    assert suspect not in control.plans[-1].plan.devices, "the standby peer took its place"
    assert any(line.startswith(f"banned {suspect} for 30 s (ban 1)") for line in coordinator.lines)
    banned_in = control.plans[-2].plan.epoch  # the plan it was banned under: its credit there is taken back
    assert f"voided {suspect}'s credit for plan epoch {banned_in}, where it was banned" in coordinator.lines
    for device in honest:
        control.announce(device, suspects=())  # it is gone: nothing more to report
    rounds(coordinator, 40)
    assert suspect not in coordinator.refused and f"left {suspect} out of plans" not in "".join(coordinator.lines[-40:])


def test_a_pair_in_dispute_is_parted_by_the_next_plan_and_the_liar_banned_by_its_next_partner(tmp_path):
    coordinator = coordinator_with(tmp_path, ban_period_s=30.0, group_size=2, stages=2, min_peers=4)
    control = coordinator.control
    for device in (A, B, C, D):
        control.announce(device)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    first = control.plans[-1].plan
    liar, accuser = first.stages[0].devices
    control.announce(accuser, suspects=(liar,))
    control.announce = reporting(control.announce, {accuser: (liar,)})
    rounds(coordinator, 3)
    second = control.plans[-1].plan
    assert second.epoch > first.epoch and any(f"{accuser} reports {liar}" in line for line in coordinator.lines)
    assert tuple(sorted((liar, accuser))) not in set(second.links), "the next plan parts them"
    assert liar in second.devices and not coordinator.bans
    partner = next(d for d in second.stages[second.position(liar)[0]].devices if d != liar)
    control.announce = reporting(control.announce, {accuser: (), partner: (liar,)})
    rounds(coordinator, 3)
    assert liar in coordinator.bans and f"reported by 2 partners in turn ({accuser}, {partner})" in coordinator.bans[liar].reason
    assert liar not in control.plans[-1].plan.devices


def reporting(announce, suspects: dict[str, tuple[str, ...]]):
    """`announce`, with these peers reporting these suspects in every record from now on."""
    def announced(device, **fields):
        if device in suspects:
            fields["suspects"] = suspects[device]
        return announce(device, **fields)
    return announced
