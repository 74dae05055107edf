"""The coordinator's reach service (`protocol/reach.py`): dials a peer's ports back at the address its
request came from, and says what it saw.

It dials only the requester's own address, at most `MAX_PORTS` ports, one request per address at a time
and a bounded number at once, each with a short timeout: it cannot be made to reach a third party, nor to
hold many sockets open. Requests that do not parse are answered by closing the connection.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
import threading
import time
from typing import Callable

from hetpeer.protocol.reach import MAX_LINE_BYTES, ReachReply, ReachRequest
from hetpeer.protocol.wire import SchemaError

log = logging.getLogger("hetpeer.coordinator")
DIAL_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 5.0
MAX_AT_ONCE = 32


class ReachServer:
    def __init__(self, host: str, port: int, clock: Callable[[], float] = time.time,
                 dial_timeout_s: float = DIAL_TIMEOUT_S) -> None:
        self.host, self.port, self.clock, self.dial_timeout_s = host, port, clock, dial_timeout_s
        self.answered = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_AT_ONCE)

    def start(self) -> "ReachServer":
        service = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                service._handle(self.connection, self.client_address[0])

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

    def _handle(self, connection: socket.socket, address: str) -> None:
        observed = _plain(address)
        if not self._slots.acquire(blocking=False):
            return  # closing is the answer: the peer asks again later
        try:
            with self._lock:
                if observed in self._busy:
                    return
                self._busy.add(observed)
            try:
                connection.settimeout(READ_TIMEOUT_S)
                line = connection.makefile("rb").readline(MAX_LINE_BYTES + 1)
                request = ReachRequest.decode(line)
                connection.sendall(self.rpc_reach(request, observed).encode())
            finally:
                with self._lock:
                    self._busy.discard(observed)
        except SchemaError as error:
            log.info("reach request from %s refused: %s", observed, error)
        except OSError as error:
            log.info("reach request from %s broke off: %s", observed, error)
        finally:
            self._slots.release()

    def rpc_reach(self, request: ReachRequest, observed: str) -> ReachReply:
        """Dial each port asked at `observed`, the address the request came from."""
        opened = tuple(self._dials(observed, port) for port in request.ports)
        self.answered += 1
        return ReachReply(observed, opened, self.clock())

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
