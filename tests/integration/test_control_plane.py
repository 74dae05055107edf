"""The control plane on real hivemind DHTs on 127.0.0.1: what one peer announces another reads; an identity
survives a restart; forged, malformed and unsigned records never reach a reader; each plan comes with the
key that signed it, so a peer keeps only its coordinator's."""

from __future__ import annotations

import os
import stat
import time
from typing import Callable, TypeVar

import pytest

from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.control import DHT_NICE, ControlError, ControlPlane, key_digest, load_or_create_key
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.identity import device_id
from hetpeer.protocol.records import LinkMeasurement, PeerRecord, peers_key, plan_key

SWARM = "cp_test"
TTL_S = 60.0
MAX_AGE_S = 60.0
READ_S = 10.0  # a hang guard for reads that must eventually see a store, not a timing

T = TypeVar("T")


def eventually(read: Callable[[], T], ok: Callable[[T], bool]) -> T:
    """`read()` until `ok` holds (a store reaches the nodes a reader asks a moment later), else the last read."""
    deadline = time.monotonic() + READ_S
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


@pytest.fixture(scope="module")
def planes(tmp_path_factory):
    """Three control planes of one swarm: a bootstraps b and c. Each has its own key file."""
    folder = tmp_path_factory.mktemp("keys")
    started: list[ControlPlane] = []
    try:
        a = ControlPlane(SWARM, folder / "a.key").start()
        started.append(a)
        for name in ("b", "c"):
            started.append(ControlPlane(SWARM, folder / f"{name}.key", initial_peers=a.visible_maddrs()).start())
        yield dict(zip("abc", started))
    finally:
        for plane in reversed(started):
            plane.shutdown()


def announcement(plane: ControlPlane, name: str, **changes) -> PeerRecord:
    fields = dict(
        device_id=device_id(name, plane.public_key),
        model="tiny",
        dtype="fp32",
        device_name="cpu: test",
        tflops=0.5,
        memory_bytes=1 << 30,
        address=PeerAddress(direct=("127.0.0.1", 7000), p2p=tuple(plane.visible_maddrs()[:1])),
        state="waiting",
        time=plane.now(),
        links={"x-000000000000": LinkMeasurement(0.001, 1e8)},
    )
    fields.update(changes)
    return PeerRecord(**fields)


def bee(plane: ControlPlane, **changes) -> PeerRecord:
    """b's own announcement."""
    return announcement(plane, "bee", **{**dict(state="training", layers=(0, 2), step=5, loss=3.25, epoch=1), **changes})


def one_stage_plan(devices: tuple[str, ...], epoch: int) -> Plan:
    return Plan("time", "tiny", 4, len(devices), 1, 1, "fp32", (StagePlan(0, 0, 4, devices, "gossip"),), epoch=epoch)


# -- keys -------------------------------------------------------------------------------------------


def test_a_key_file_is_created_private_and_read_back(tmp_path):
    path = tmp_path / "sub" / "peer.key"
    key = load_or_create_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_or_create_key(path)
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    assert again.sign(b"x") and len(key_digest(key.get_public_key().to_bytes())) == 64


def test_a_key_file_that_is_not_a_key_is_a_clear_control_error(tmp_path):
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key at all")
    with pytest.raises(ControlError, match=f"{garbage} is not an RSA private key"):
        ControlPlane(SWARM, garbage).start()
    with pytest.raises(ControlError, match=f"cannot read key file {tmp_path}"):
        load_or_create_key(tmp_path)  # a folder
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = tmp_path / "ec.key"
    other.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
    with pytest.raises(ControlError, match="is not an RSA private key"):
        load_or_create_key(other)


def test_a_swarm_name_is_checked():
    for name in ("", "a b", "a.peers", "x/y"):
        with pytest.raises(ValueError, match="swarm name"):
            ControlPlane(name, "unused.key")


# -- peer records -----------------------------------------------------------------------------------


def test_an_announcement_is_read_by_the_other_peers(planes):
    a, b, c = planes["a"], planes["b"], planes["c"]
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3  # one key per plane, not the process's
    sent = bee(b)
    assert b.announce(sent, TTL_S)
    for reader in (a, c):
        records, _ = eventually(lambda: reader.read_peers(MAX_AGE_S), lambda r: sent.device_id in r[0])
        assert records[sent.device_id] == sent
    # a reader that holds records to a tighter freshness drops it, saying why
    records, dropped = c.read_peers(max_age_s=1e-9)
    assert sent.device_id not in records
    assert any(d.signer == b.fingerprint and d.reason.startswith("peer.time") for d in dropped)


def test_a_reader_keeps_how_far_the_others_records_lead_its_clock_refused_for_their_age_or_not(planes):
    a, b, c = planes["a"], planes["b"], planes["c"]
    sent, sea = bee(b), announcement(c, "sea")
    assert b.announce(sent, TTL_S) and c.announce(sea, TTL_S)
    eventually(lambda: a.read_peers(MAX_AGE_S), lambda r: {sent.device_id, sea.device_id} <= set(r[0]))
    assert len(a.record_leads_s) == 2 and all(-MAX_AGE_S < lead <= 0 for lead in a.record_leads_s)  # not its own
    try:
        a.skew_s = -90.0  # its clock 90 s behind: the records read 90 s ahead, refused, and counted
        records, dropped = a.read_peers(MAX_AGE_S)
        assert not records and any("in the future" in d.reason for d in dropped)
        assert len(a.record_leads_s) == 2 and all(90.0 - MAX_AGE_S < lead <= 90.0 for lead in a.record_leads_s)
        assert c.announce(announcement(c, "sea", tflops=-1.0), TTL_S)  # fails another check: never counted
        eventually(lambda: a.read_peers(MAX_AGE_S), lambda r: any("tflops" in d.reason for d in r[1]))
        assert len(a.record_leads_s) == 1
    finally:
        a.skew_s = 0.0
        c.announce(announcement(c, "sea"), TTL_S)


def test_the_dht_node_and_its_daemon_yield_the_cpu_to_training(planes):
    pending, seen = [planes["a"].dht.pid], {}
    while pending:  # the DHT process and its descendants (p2pd), every thread of each
        pid = pending.pop()
        for task in os.listdir(f"/proc/{pid}/task"):
            seen[(pid, int(task))] = os.getpriority(os.PRIO_PROCESS, int(task))
            pending += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    assert len({pid for pid, _ in seen}) >= 2  # the node and its daemon
    assert set(seen.values()) == {DHT_NICE}
    assert os.getpriority(os.PRIO_PROCESS, 0) < DHT_NICE  # the process that trains keeps its own


def test_a_restart_with_the_same_key_file_keeps_the_identity(planes, tmp_path):
    path = tmp_path / "d.key"
    first = ControlPlane(SWARM, path, initial_peers=planes["a"].visible_maddrs())
    with first:
        identity = first.fingerprint, device_id("dee", first.public_key)
    second = ControlPlane(SWARM, path, initial_peers=planes["a"].visible_maddrs())
    with second:
        assert (second.fingerprint, device_id("dee", second.public_key)) == identity
        assert second.announce(announcement(second, "dee"), TTL_S)
        records, _ = eventually(lambda: planes["a"].read_peers(MAX_AGE_S), lambda r: identity[1] in r[0])
        assert identity[1] in records


def test_a_record_claiming_another_peers_device_id_is_dropped(planes):
    a, b, c = planes["a"], planes["b"], planes["c"]
    forged = announcement(c, "bee")
    forged = PeerRecord(**{**{f: getattr(forged, f) for f in PeerRecord.__slots__}, "device_id": device_id("bee", b.public_key)})
    assert c.announce(forged, TTL_S)  # the DHT cannot tell: the record is well formed and signed by c
    records, dropped = eventually(lambda: a.read_peers(MAX_AGE_S), lambda r: any(d.signer == c.fingerprint for d in r[1]))
    reasons = [d.reason for d in dropped if d.signer == c.fingerprint]
    assert reasons and reasons[0].startswith("peer.device_id") and c.fingerprint in reasons[0]
    if forged.device_id in records:  # b's own announcement, from another test, is still b's
        assert records[forged.device_id] == bee(b, time=records[forged.device_id].time)
    assert c.announce(announcement(c, "sea"), TTL_S)  # c's slot holds its own record again


def test_a_malformed_record_is_refused_by_the_dht(planes):
    a, b = planes["a"], planes["b"]
    good = bee(b).to_wire()
    assert b.store_raw(peers_key(SWARM), good, TTL_S, subkey=b.owner)  # the same path takes a good record
    bad_values = [dict(good, admin=True), dict(good, tflops=1), dict(good, step="5"), dict(good, p2p=None),
                  {k: v for k, v in good.items() if k != "links"}, "just a string", [good]]
    for bad in bad_values:
        assert not b.store_raw(peers_key(SWARM), bad, TTL_S + 1, subkey=b.owner), bad  # later: would replace good
    records, dropped = eventually(lambda: a.read_peers(MAX_AGE_S), lambda r: bee(b).device_id in r[0])
    assert records[bee(b).device_id].to_wire() == good
    assert all(d.signer != b.fingerprint for d in dropped)


def test_an_unsigned_record_or_one_under_another_peers_marker_is_refused(planes):
    a, b = planes["a"], planes["b"]
    value = announcement(b, "bee", device_name="unsigned test").to_wire()
    assert not b.store_raw(peers_key(SWARM), value, TTL_S, subkey=b"bee")
    assert not b.store_raw(peers_key(SWARM), value, TTL_S, subkey=a.owner)  # b cannot sign as a
    records, dropped = a.read_peers(MAX_AGE_S)
    assert all(r.device_name != "unsigned test" for r in records.values())
    assert all(d.signer != "unsigned" for d in dropped)


# -- plans ------------------------------------------------------------------------------------------


def test_each_plan_comes_with_its_signer_so_a_peer_keeps_its_coordinators(planes):
    a, b, c = planes["a"], planes["b"], planes["c"]
    coordinator, impostor = a, b
    assert coordinator.publish_plan(one_stage_plan(("p-1", "p-2"), epoch=3), TTL_S)
    assert impostor.publish_plan(one_stage_plan(("evil-1", "evil-2"), epoch=99), TTL_S)

    def both(result) -> bool:
        return {p.signer for p in result[0]} >= {a.public_key, b.public_key}

    plans, _ = eventually(c.read_plans, both)
    signed = {p.signer: p for p in plans}
    assert signed[a.public_key].plan == one_stage_plan(("p-1", "p-2"), epoch=3)
    assert signed[b.public_key].plan.epoch == 99
    assert [p.plan.epoch for p in plans] == sorted((p.plan.epoch for p in plans), reverse=True)
    trusted = key_digest(coordinator.public_key)
    kept = [p for p in plans if key_digest(p.signer) == trusted]
    assert [p.plan.stages[0].devices for p in kept] == [("p-1", "p-2")]
    assert 0 < signed[a.public_key].time <= a.now()


def test_a_plan_record_that_does_not_parse_is_dropped_with_a_reason(planes):
    a, c = planes["a"], planes["c"]
    # well typed, so the DHT stores it; only a reader can see that the text is not a plan
    assert c.store_raw(plan_key(SWARM), {"plan": "{not json", "time": c.now()}, TTL_S, subkey=c.owner)
    plans, dropped = eventually(a.read_plans, lambda r: any(d.signer == c.fingerprint for d in r[1]))
    reasons = [d.reason for d in dropped if d.signer == c.fingerprint]
    assert reasons and reasons[0].startswith("plan_record.plan: is not JSON")
    assert all(p.signer != c.public_key for p in plans)
    # badly typed plan records never get stored
    assert not c.store_raw(plan_key(SWARM), {"plan": "{}", "time": 5}, TTL_S, subkey=c.owner)
    assert not c.store_raw(plan_key(SWARM), {"plan": "{}", "time": 5.0, "epoch": 1}, TTL_S, subkey=c.owner)
