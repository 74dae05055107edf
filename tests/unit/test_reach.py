"""The reach check's wire format (`protocol/reach.py`), what a peer says of its answer (`peer/reach.py`), and the
free ports it and the local launcher choose, which must still be free when they are bound."""

from __future__ import annotations

import json
import socket

import pytest

from hetpeer.peer import reach
from hetpeer.peer.reach import Reach, advice, clock_words, free_port
from hetpeer.protocol.reach import MAX_LINE_BYTES, ReachReply, ReachRequest
from hetpeer.protocol.wire import SchemaError


def test_request_and_reply_round_trip():
    assert ReachRequest.decode(ReachRequest((7000, 7001), 12.5).encode()) == ReachRequest((7000, 7001), 12.5)
    reply = ReachReply("203.0.113.7", 40123, (True, False), 99.0, held_s=3.01)
    assert ReachReply.decode(reply.encode(), 2) == reply


@pytest.mark.parametrize("line, where", [
    (b"not json\n", "reach_request"),
    (json.dumps({"version": 1, "ports": [1], "time": 0.0}).encode(), "reach_request.version"),
    (json.dumps({"version": 2, "ports": [], "time": 0.0}).encode(), "reach_request.ports"),
    (json.dumps({"version": 2, "ports": [1, 2, 3, 4, 5], "time": 0.0}).encode(), "reach_request.ports"),
    (json.dumps({"version": 2, "ports": [70000], "time": 0.0}).encode(), "reach_request.ports"),
    (json.dumps({"version": 2, "ports": [0], "time": 0.0}).encode(), "reach_request.ports[0]"),
    (json.dumps({"version": 2, "ports": [True], "time": 0.0}).encode(), "reach_request.ports[0]"),
    (json.dumps({"version": 2, "ports": [1], "time": "now"}).encode(), "reach_request.time"),
    (json.dumps({"version": 2, "ports": [1], "time": 0.0, "to": "10.0.0.1"}).encode(), "reach_request.to"),
    (b"{" + b" " * MAX_LINE_BYTES + b"}", "reach_request"),
])
def test_a_bad_request_is_refused_naming_what_is_wrong(line, where):
    with pytest.raises(SchemaError) as error:
        ReachRequest.decode(line)
    assert error.value.path == where


@pytest.mark.parametrize("raw, ports, where", [
    ({"version": 2, "observed": "not-an-ip", "port": 9, "open": [True], "time": 1.0}, 1, "reach_reply.observed"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": [True], "time": 1.0}, 2, "reach_reply.open"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": ["yes"], "time": 1.0}, 1, "reach_reply.open"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": [True]}, 1, "reach_reply.time"),
    ({"version": 2, "observed": "10.0.0.1", "open": [True], "time": 1.0}, 1, "reach_reply.port"),
    ({"version": 2, "observed": "10.0.0.1", "port": 0, "open": [True], "time": 1.0}, 1, "reach_reply.port"),
    ({"version": 2, "observed": "10.0.0.1", "port": 65536, "open": [True], "time": 1.0}, 1, "reach_reply.port"),
    ({"version": 1, "observed": "10.0.0.1", "open": [True], "time": 1.0}, 1, "reach_reply.version"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": [True], "time": 1.0}, 1, "reach_reply.held_s"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": [True], "time": 1.0, "held_s": -1.0}, 1, "reach_reply.held_s"),
    ({"version": 2, "observed": "10.0.0.1", "port": 9, "open": [True], "time": 1.0, "held_s": 1e9}, 1, "reach_reply.held_s"),
])
def test_a_bad_reply_is_refused_naming_what_is_wrong(raw, ports, where):
    with pytest.raises(SchemaError) as error:
        ReachReply.decode(json.dumps(raw).encode(), ports)
    assert error.value.path == where


def test_the_volunteer_is_told_what_would_help():
    ports, names = (7000, 7001), ("tensors", "DHT")
    assert advice(Reach("198.51.100.4", (True, True), 0.0, 0.01), ports, names).endswith("nothing to do")
    closed = advice(Reach("198.51.100.4", (False, False), 0.0, 0.01), ports, names)
    assert "cannot dial this peer at 198.51.100.4" in closed and "forward TCP port(s) 7000 (tensors), 7001 (DHT)" in closed
    partly = advice(Reach("198.51.100.4", (True, False), 0.0, 0.01), ports, names)
    assert "partly" in partly and "7001 (DHT)" in partly and "7000" not in partly


def test_a_nat_keeps_the_port_only_when_the_service_saw_the_one_the_request_left_from():
    assert Reach("198.51.100.4", (False,), 0.0, 0.01, local_port=40123, seen_port=40123).keeps_port
    assert not Reach("198.51.100.4", (False,), 0.0, 0.01, local_port=40123, seen_port=1034).keeps_port
    assert not Reach("198.51.100.4", (False,), 0.0, 0.01).keeps_port  # not told: no claim


def test_a_clock_far_off_is_said_and_a_close_one_is_not():
    assert clock_words(1.5) is None
    assert "90 s behind" in clock_words(90.0)
    assert "120 s ahead of" in clock_words(-120.0)


def test_free_ports_lie_below_the_range_outgoing_connections_take_theirs_from_and_are_never_handed_out_twice():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(reach._LOWEST_PORT <= port < reach._ephemeral_low() for port in ports)
    for port in ports[:5]:  # still free: a listener binds each
        socket.create_server(("127.0.0.1", port)).close()
    with reach.listening("127.0.0.1", 0) as checked:  # the reach check's listeners on "any port" take one too
        assert reach._LOWEST_PORT <= checked.getsockname()[1] < reach._ephemeral_low()


def test_a_port_something_listens_on_or_already_handed_out_is_passed_over(monkeypatch):
    handed = free_port()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = busy.getsockname()[1]
        with socket.create_server(("127.0.0.1", 0)) as spare:
            free = spare.getsockname()[1]
        draws = iter([taken, handed, free])

        class Draw:
            def randrange(self, low, high):
                return next(draws)

        monkeypatch.setattr(reach, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(reach.random, "SystemRandom", Draw)
        assert free_port() == free


def test_with_no_room_below_the_ephemeral_range_the_kernel_picks_and_still_never_twice(monkeypatch):
    monkeypatch.setattr(reach, "_ephemeral_low", lambda: reach._LOWEST_PORT + 10)
    port = free_port()
    assert port >= reach._LOWEST_PORT + 10
    socket.create_server(("127.0.0.1", port)).close()
    picks = iter([port, port + 1])  # the kernel gives the same port again, then another

    class Socket(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(reach.socket, "socket", Socket)
    assert free_port() == port + 1
