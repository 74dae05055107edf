"""Staying in the swarm's DHT on 127.0.0.1: a node remembers where the others announce their DHT nodes, a
restart starts from what it remembered, and a node left knowing no one is restarted through them."""

from __future__ import annotations

import json
import time

from hetpeer.peer.launch import free_port
from hetpeer.protocol.control import ISOLATED_ROUNDS, REMEMBER, ControlPlane, load_remembered

SWARM = "heal_test"
GUARD_S = 20.0  # a hang guard for what must eventually happen, not a timing


def plane(home, name: str, port: int = 0, initial=()) -> ControlPlane:
    return ControlPlane(SWARM, home / f"{name}.key", initial, [f"/ip4/127.0.0.1/tcp/{port}"],
                        identity_path=home / f"{name}.dht", remember_path=home / f"{name}.known.json")


def neighbours(control: ControlPlane) -> int:
    return control._dht_neighbours()


def test_remembered_addresses_survive_a_restart_and_bootstrap_it(tmp_path):
    with plane(tmp_path, "a") as a, plane(tmp_path, "b", initial=a.visible_maddrs()) as b:
        c = plane(tmp_path, "c", initial=a.visible_maddrs())
        with c:
            c.remember([b.dialable_maddrs(), a.dialable_maddrs(), c.dialable_maddrs()])  # its own is never kept
            assert [node[0] for node in c.remembered] == [b.visible_maddrs()[0], a.visible_maddrs()[0]]
        assert load_remembered(tmp_path / "c.known.json") == c.remembered
        again = plane(tmp_path, "c")  # no initial peers given: only what it remembered
        with again:
            deadline = time.monotonic() + GUARD_S
            while neighbours(again) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert neighbours(again) == 2


def test_the_memory_is_bounded_and_a_bad_file_is_ignored(tmp_path):
    path = tmp_path / "known.json"
    path.write_text("{broken")
    assert load_remembered(path) == []
    path.write_text(json.dumps({"version": 1, "nodes": [["/ip4/1.2.3.4/tcp/1"]]}))  # no peer id
    assert load_remembered(path) == []
    with plane(tmp_path, "a") as a:
        a.remember([(f"/ip4/10.0.0.{i}/tcp/1/p2p/Qm{i}",) for i in range(3 * REMEMBER)])
        assert len(a.remembered) == REMEMBER and a.remembered[0] == ("/ip4/10.0.0.0/tcp/1/p2p/Qm0",)
        a.remember([("/ip4/10.0.0.40/tcp/1/p2p/Qm40",)])  # the most recent first; an old one falls off the end
        assert a.remembered[0] == ("/ip4/10.0.0.40/tcp/1/p2p/Qm40",) and len(a.remembered) == REMEMBER


def test_a_node_that_knows_no_one_is_restarted_through_the_nodes_it_remembers(tmp_path):
    port = free_port()
    a = plane(tmp_path, "a", port=port).start()
    try:
        with plane(tmp_path, "b", initial=a.visible_maddrs()) as b:
            assert neighbours(b) == 1
            b.remember([a.dialable_maddrs()])
            a.shutdown()  # the other side goes away: after its failed requests b's node forgets it
            deadline = time.monotonic() + GUARD_S
            while neighbours(b) and time.monotonic() < deadline:
                b.dht.get("anything", latest=True)
            assert neighbours(b) == 0
            a = plane(tmp_path, "a", port=port).start()  # back at the same address, with the same identity
            assert neighbours(a) == 0  # nobody tells either of them: without healing they stay apart
            notes = [b.heal() for _ in range(ISOLATED_ROUNDS)]
            assert notes[:-1] == [None] * (ISOLATED_ROUNDS - 1)  # a round or two alone is not yet a partition
            assert notes[-1] is not None and "restarted" in notes[-1] and "now knows 1 node(s)" in notes[-1], notes[-1]
            assert neighbours(b) == 1 and b.heal() is None
    finally:
        a.shutdown()
