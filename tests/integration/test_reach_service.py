"""The coordinator's reach service over real sockets on 127.0.0.1: it dials the asker's ports back, says which
opened, where the request came from and its clock; it dials nobody else, and drops what does not parse."""

from __future__ import annotations

import socket
import time

import pytest

from hetpeer.coordinator.reach import ReachServer
from hetpeer.peer.reach import ReachError, ask, listening


@pytest.fixture
def service():
    server = ReachServer("127.0.0.1", 0, clock=lambda: time.time() + 90.0, dial_timeout_s=1.0).start()
    yield server
    server.shutdown()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def test_it_says_which_ports_it_could_dial_and_how_far_the_clock_is(service):
    shut = closed_port()
    with listening("127.0.0.1", 0) as open_one:
        reach = ask(("127.0.0.1", service.port), (open_one.getsockname()[1], shut))
    assert reach.observed == "127.0.0.1" and reach.open == (True, False)
    assert abs(reach.clock_offset_s - 90.0) < 1.0 + reach.round_trip_s
    assert service.answered == 1


def test_a_request_that_does_not_parse_gets_no_answer_and_the_service_goes_on(service):
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as sock:
        sock.sendall(b'{"version": 1, "ports": [1], "time": 0.0, "to": "192.0.2.1"}\n')
        assert sock.recv(100) == b""  # closed: a request names ports of the asker only, never another host
    with listening("127.0.0.1", 0) as open_one:
        assert ask(("127.0.0.1", service.port), (open_one.getsockname()[1],)).open == (True,)


def test_a_service_that_is_not_there_is_a_clear_error():
    with pytest.raises(ReachError, match=r"cannot ask the reach service at 127\.0\.0\.1:\d+"):
        ask(("127.0.0.1", closed_port()), (7000,), timeout_s=2.0)


def test_a_port_taken_is_a_clear_error():
    with listening("127.0.0.1", 0) as taken:
        with pytest.raises(ReachError, match="another peer on this machine"):
            listening("127.0.0.1", taken.getsockname()[1])
