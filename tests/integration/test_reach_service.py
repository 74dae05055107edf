"""The coordinator's reach service over real sockets on 127.0.0.1: it dials the asker's ports back, says which
opened, where the request came from and its clock; it dials nobody else, and drops what does not parse; peers
behind one address are answered in turn; a peer whose check failed asks again."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time

import pytest

from hetpeer.coordinator import reach as reach_service
from hetpeer.coordinator.reach import ReachServer
from hetpeer.peer.reach import Reach, ReachError, ask, ask_patiently, free_port, listening
from hetpeer.peer.transport.links import share_port
from hetpeer.protocol.reach import ReachReply, ReachRequest


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


def test_it_names_the_source_port_a_request_came_from_so_a_peer_tells_whether_its_port_was_kept(service):
    """Asked from a port of the peer's choosing (bound shared, as the punching sockets bind it after), the service
    sees that port: no NAT on 127.0.0.1 changes it. A closed port costs the dial timeout once, not once a port."""
    port = free_port()
    shut, shut2 = closed_port(), closed_port()
    with listening("127.0.0.1", 0) as open_one:
        reach = ask(("127.0.0.1", service.port), (open_one.getsockname()[1], shut, shut2), source=("127.0.0.1", port))
    assert (reach.local_port, reach.seen_port) == (port, port) and reach.keeps_port
    assert reach.open == (True, False, False)
    again = ask(("127.0.0.1", service.port), (shut,), source=("127.0.0.1", port))  # the same port again, at once
    assert again.seen_port == port and again.keeps_port
    with socket.socket() as punching:  # and a socket that punches from it, bound beside
        share_port(punching)
        punching.bind(("127.0.0.1", port))


def test_a_peer_that_closes_first_can_ask_again_from_the_same_port_at_once():
    """A service slow to close leaves the asker to close first; its port and the service's must not then be held
    in TIME_WAIT, or the peer's retry from its punch port could not connect for a minute."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer_and_wait(times: int) -> None:
            for _ in range(times):
                connection, (host, port) = server.accept()
                with connection:
                    connection.makefile("rb").readline()
                    connection.sendall(ReachReply(host, port, (False,), time.time()).encode())
                    connection.settimeout(10)
                    with contextlib.suppress(ConnectionResetError):  # until the asker has closed
                        connection.recv(1)
        answering = threading.Thread(target=answer_and_wait, args=(2,), daemon=True)
        answering.start()
        port = free_port()
        first = ask(server.getsockname(), (7,), source=("127.0.0.1", port))
        again = ask(server.getsockname(), (7,), source=("127.0.0.1", port))
        answering.join(10)
    assert first.seen_port == again.seen_port == port


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


class SlowDials(ReachServer):
    """A service whose dials take a while, as to a peer behind NAT, and that records how many run at once."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", 0, dial_timeout_s=1.0)
        self.at_once, self.most_at_once, self.count_lock = 0, 0, threading.Lock()

    def _dials(self, host: str, port: int) -> bool:
        with self.count_lock:
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
        time.sleep(0.3)
        with self.count_lock:
            self.at_once -= 1
        return super()._dials(host, port)


def test_the_clock_offset_leaves_out_the_time_the_service_held_the_request():
    """Dials to ports a home router drops take the whole dial timeout: seconds in which the request waits at the
    service, which the round trip's midpoint would count as half there and half back (1 s off here)."""
    class Held(ReachServer):
        def _dials(self, host: str, port: int) -> bool:
            time.sleep(2.0)
            return False

    service = Held("127.0.0.1", 0, clock=lambda: time.time() + 90.0).start()
    try:
        reach = ask(("127.0.0.1", service.port), (closed_port(),))
    finally:
        service.shutdown()
    assert reach.open == (False,)
    assert abs(reach.clock_offset_s - 90.0) < 0.25, reach
    assert reach.round_trip_s < 1.0, reach  # the two seconds held are not the network's


def ask_at_once(service: ReachServer, peers: int) -> list:
    """`peers` peers on this host asking at the same moment; each one's Reach or ReachError."""
    def one(_: int):
        with listening("127.0.0.1", 0) as port:
            try:
                return ask(("127.0.0.1", service.port), (port.getsockname()[1],))
            except ReachError as error:
                return error

    with concurrent.futures.ThreadPoolExecutor(peers) as pool:
        return list(pool.map(one, range(peers)))


def test_peers_behind_one_address_are_each_answered_in_turn():
    service = SlowDials().start()
    try:
        answers = ask_at_once(service, 8)
    finally:
        service.shutdown()
    assert all(isinstance(a, Reach) and a.open == (True,) for a in answers), answers
    assert service.answered == 8 and service.most_at_once == 1  # one address is never dialled twice at once


def test_more_from_one_address_than_it_holds_are_closed(monkeypatch):
    monkeypatch.setattr(reach_service, "MAX_PER_ADDRESS", 2)
    service = SlowDials().start()
    try:
        answers = ask_at_once(service, 4)
    finally:
        service.shutdown()
    refused = [a for a in answers if isinstance(a, ReachError)]
    assert refused and all("closed without a whole answer" in str(a) for a in refused), answers
    assert service.answered == len(answers) - len(refused) >= 2


def flaky_service(closes: int, answers: bool = True) -> tuple[socket.socket, threading.Thread]:
    """A reach service that closes the first `closes` connections, then answers one (if `answers`)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for _ in range(closes):
            server.accept()[0].close()
        if not answers:
            return
        connection = server.accept()[0]
        with connection:
            ReachRequest.decode(connection.makefile("rb").readline())
            connection.sendall(ReachReply("127.0.0.1", 1, (True,), time.time()).encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_a_peer_whose_check_failed_says_so_and_asks_again():
    server, thread = flaky_service(closes=2)
    said, slept = [], []
    with server:
        reach = ask_patiently(("127.0.0.1", server.getsockname()[1]), (7000,), said.append, sleep=slept.append)
    thread.join(10)
    assert reach.open == (True,) and len(said) == 2 and all(s.startswith("reachable: asking again in ") for s in said)
    assert 2.0 <= slept[0] <= 3.0 and 4.0 <= slept[1] <= 6.0  # backing off, each peer at its own moment
    server, thread = flaky_service(closes=3, answers=False)
    with server, pytest.raises(ReachError, match=r"the reach service at 127\.0\.0\.1:\d+"):  # closed, or reset
        ask_patiently(("127.0.0.1", server.getsockname()[1]), (7000,), said.append, tries=3, sleep=slept.append)
    thread.join(10)
    assert len(slept) == 4  # two more waits, then the third failure is the error
