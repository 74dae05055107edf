"""The coordinator's reach service (`protocol/reach.py`): dials a peer's ports back at the address its
request came from, and says what it saw.

It dials only the requester's own address, at most `MAX_PORTS` ports (all at once), one request per address
at a time and a bounded number at once, each with a short timeout (a home router drops what it does not
expect, so a closed port costs the whole timeout): it cannot be made to reach a third party, nor to
hold many sockets open. Requests from one address wait their turn (peers behind one household's router, a
campus or a carrier's NAT share it), up to `MAX_PER_ADDRESS` at once; beyond that, or past `TURN_WAIT_S`,
the connection is closed and the peer asks again. Requests that do not parse are answered by closing the
connection. The answer names the source port the request came from: a peer whose NAT keeps ports sees its own.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

from hetpeer.protocol.reach import MAX_LINE_BYTES, TURN_WAIT_S, ReachReply, ReachRequest
from hetpeer.protocol.wire import SchemaError

log = logging.getLogger("hetpeer.coordinator")
DIAL_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 5.0
MAX_AT_ONCE = 32
MAX_PER_ADDRESS = 16  # requests from one address held at once, answered in turn (each at most TURN_WAIT_S)


class ReachServer:
    def __init__(self, host: str, port: int, clock: Callable[[], float] = time.time,
                 dial_timeout_s: float = DIAL_TIMEOUT_S) -> None:
        self.host, self.port, self.clock, self.dial_timeout_s = host, port, clock, dial_timeout_s
        self.answered = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._turns: dict[str, tuple[threading.Lock, int]] = {}  # per address: whose turn, and requests holding it
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_AT_ONCE)

    def start(self) -> "ReachServer":
        service = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                service._handle(self.connection, self.client_address[0], self.client_address[1])

        self._server = _Server((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="reach", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handle(self, connection: socket.socket, address: str, source_port: int) -> None:
        observed = _plain(address)
        if not self._slots.acquire(blocking=False):
            return  # closing is the answer: the peer asks again later
        turn = self._join(observed)
        try:
            if turn is None:
                log.info("reach request from %s closed: %d from that address already wait", observed, MAX_PER_ADDRESS)
                return
            connection.settimeout(READ_TIMEOUT_S)
            request = ReachRequest.decode(connection.makefile("rb").readline(MAX_LINE_BYTES + 1))
            received = time.monotonic()
            if not turn.acquire(timeout=TURN_WAIT_S):
                log.info("reach request from %s closed: its turn did not come within %g s", observed, TURN_WAIT_S)
                return
            try:
                reply = self.rpc_reach(request, observed, source_port)
            finally:
                turn.release()
            reply = replace(reply, held_s=time.monotonic() - received)
            connection.sendall(reply.encode())
        except SchemaError as error:
            log.info("reach request from %s refused: %s", observed, error)
        except OSError as error:
            log.info("reach request from %s broke off: %s", observed, error)
        finally:
            if turn is not None:
                self._leave(observed)
            self._slots.release()

    def _join(self, observed: str) -> threading.Lock | None:
        """The lock whose holder dials `observed` now, counting this request in; None when too many wait."""
        with self._lock:
            lock, holding = self._turns.get(observed, (None, 0))
            if holding >= MAX_PER_ADDRESS:
                return None
            lock = lock or threading.Lock()
            self._turns[observed] = (lock, holding + 1)
            return lock

    def _leave(self, observed: str) -> None:
        with self._lock:
            lock, holding = self._turns[observed]
            if holding == 1:
                del self._turns[observed]
            else:
                self._turns[observed] = (lock, holding - 1)

    def rpc_reach(self, request: ReachRequest, observed: str, source_port: int) -> ReachReply:
        """Dial each port asked at `observed`, the address the request came from (from `source_port`), all at once."""
        with ThreadPoolExecutor(len(request.ports), thread_name_prefix="reach-dial") as dialling:
            opened = tuple(dialling.map(lambda port: self._dials(observed, port), request.ports))
        self.answered += 1
        return ReachReply(observed, source_port, opened, self.clock())

    def _dials(self, host: str, port: int) -> bool:
        try:
            with socket.create_connection((host, port), timeout=self.dial_timeout_s):
                return True
        except OSError:
            return False


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def _plain(address: str) -> str:
    """An IPv4 address that reached an IPv6 socket as ::ffff:a.b.c.d, as the plain address."""
    parsed = ipaddress.ip_address(address)
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)
