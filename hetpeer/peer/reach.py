"""What a peer learns of its own reachability when it joins: it asks the coordinator's reach service
(`protocol/reach.py`) to dial its ports back, and reads the address others see and its clock's offset.

A port others could dial means a direct link; none means the peer sits behind NAT or a firewall: it dials
the peers it works with, and they answer over its connections (`transport/network.py`). A peer that cannot
ask (no reach service named, or it does not answer) says its reachability is unknown and is dialled as before.
It asks from the port it would punch holes from (`transport/punch.py`): the source port the service saw tells
whether its NAT keeps ports.
"""

from __future__ import annotations

import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from hetpeer.peer.transport.links import share_port
from hetpeer.protocol.reach import MAX_LINE_BYTES, TURN_WAIT_S, ReachReply, ReachRequest
from hetpeer.protocol.wire import SchemaError

log = logging.getLogger("hetpeer.peer")
CLOCK_SAY_S = 5.0  # a clock further off than this is said to the volunteer
ASK_TRIES = 4  # a reach check that fails is tried again after 2, 4 and 8 s (and up to half more, at random)
ANSWER_WAIT_S = TURN_WAIT_S + 15.0  # the service may answer peers behind one address in turn


@dataclass(frozen=True, slots=True)
class Reach:
    """The reach check's answer: the address the coordinator saw, which ports it could dial, the clock."""

    observed: str
    open: tuple[bool, ...]  # per port asked, in order
    clock_offset_s: float  # add to this machine's clock to read the coordinator's
    round_trip_s: float
    local_port: int = 0  # the port the request left from
    seen_port: int = 0  # the source port the service saw it come from

    @property
    def keeps_port(self) -> bool:
        """Whether the path out (its NAT, if any) kept the request's source port: a port this peer binds is then the
        port others see, whatever it dials (Linux's MASQUERADE and most home routers keep it while it is free)."""
        return self.local_port == self.seen_port != 0


class ReachError(Exception):
    """The reach service could not be asked, or answered nonsense."""


def ask(service: tuple[str, int], ports: Sequence[int], timeout_s: float = 15.0,
        clock: Callable[[], float] = time.time, source: tuple[str, int] | None = None) -> Reach:
    """Ask the reach service at `service` (HOST, PORT) to dial `ports` back, from `source` (HOST, PORT; bound shared,
    as the punching sockets bind it) or any port; ReachError when it cannot. The connection is given `timeout_s`,
    the answer `ANSWER_WAIT_S`."""
    host, port = service
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            if source is not None:
                share_port(sock)
                # closed with a reset, not into TIME_WAIT: that would hold this (port, service) pair a minute, and
                # an ask again from the same port (a retry) could not connect ("Cannot assign requested address")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.bind(source)
            sock.settimeout(timeout_s)
            sock.connect((host, port))
            local_port = sock.getsockname()[1]
            sock.settimeout(ANSWER_WAIT_S)
            sent = clock()
            sock.sendall(ReachRequest(tuple(ports), sent).encode())
            line = sock.makefile("rb").readline(MAX_LINE_BYTES + 1)
            received = clock()
    except OSError as error:
        raise ReachError(f"cannot ask the reach service at {host}:{port}: {error.strerror or error}") from None
    if not line.endswith(b"\n"):
        raise ReachError(f"the reach service at {host}:{port} closed without a whole answer")
    try:
        reply = ReachReply.decode(line, len(ports))
    except SchemaError as error:
        raise ReachError(f"the reach service at {host}:{port} answered nonsense: {error}") from None
    # NTP's offset: the reply's time is when it left, `held_s` after the request arrived; what is left of the wait
    # is the round trip, taken as half each way
    arrived = reply.time - reply.held_s
    offset = ((arrived - sent) + (reply.time - received)) / 2
    return Reach(reply.observed, reply.open, offset, max(0.0, received - sent - reply.held_s), local_port, reply.port)


def ask_patiently(service: tuple[str, int], ports: Sequence[int], say: Callable[[str], None],
                  clock: Callable[[], float] = time.time, tries: int = ASK_TRIES, first_wait_s: float = 2.0,
                  sleep: Callable[[float], None] = time.sleep, source: tuple[str, int] | None = None) -> Reach:
    """`ask`, again when it fails (a service that closed on this peer, was restarting or did not answer in time),
    after 2, 4, 8 s (`first_wait_s` doubling, up to half more at random, so that peers behind one address
    refused together do not ask together again), saying each failure with `say`; the last one is raised."""
    for attempt in range(tries - 1):
        try:
            return ask(service, ports, clock=clock, source=source)
        except ReachError as error:
            wait = first_wait_s * 2**attempt * random.uniform(1.0, 1.5)
            say(f"reachable: asking again in {wait:.0f} s ({error})")
            sleep(wait)
    return ask(service, ports, clock=clock, source=source)


_LOWEST_PORT = 20000  # below it lie the ports that services on a machine commonly listen on
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a listener that binds it later (a peer started after its address book is
    written, a server started after the reach check). It is drawn below the kernel's ephemeral range: a port
    from that range can meanwhile become the source port of any outgoing connection on the machine, which then
    refuses the bind. No port is handed out twice in one process."""
    low = _ephemeral_low()
    with _handed_out_lock:
        if low - _LOWEST_PORT >= 1000:
            draw = random.SystemRandom()
            for _ in range(200):
                port = draw.randrange(_LOWEST_PORT, low)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        # no room below the ephemeral range (or none of it free): take what the kernel gives
        while True:
            with socket.socket(_family(host)) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def _ephemeral_low() -> int:
    """The lowest port the kernel gives to outgoing connections; Linux's and macOS's defaults start at 32768 or
    above, so that is assumed where the setting cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners bind it
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listening(host: str, port: int) -> socket.socket:
    """A bare listener on (host, port) (port 0: a `free_port`) for the reach check of a port whose server
    starts after it; close it before the server starts."""
    chosen = port or free_port(host)
    try:
        return socket.create_server((host, chosen))
    except OSError as error:
        raise ReachError(f"cannot listen on {host}:{chosen}: {error.strerror or error}"
                         + (" (another peer on this machine? give it another port)" if port else "")) from None


def advice(reach: Reach, ports: Sequence[int], names: Sequence[str]) -> str:
    """One line for the volunteer: how others reach this peer, and what would make it faster."""
    closed = [f"{port} ({name})" for port, name, ok in zip(ports, names, reach.open) if not ok]
    if not closed:
        return f"reachable: others can dial this peer at {reach.observed}; nothing to do"
    if len(closed) == len(ports):
        return (f"reachable: no, others cannot dial this peer at {reach.observed} (behind NAT or a firewall): it dials "
                f"the peers it works with and they answer over its connections; to be dialled directly (and be a "
                f"neighbour of other peers behind NAT), forward TCP port(s) {', '.join(closed)} to this machine")
    return (f"reachable: partly, others can dial {reach.observed} but not port(s) {', '.join(closed)}: forward them to "
            f"this machine")


def clock_words(offset_s: float) -> str | None:
    """A line when this machine's clock is far from the coordinator's (the peer corrects for it)."""
    if abs(offset_s) < CLOCK_SAY_S:
        return None
    way = "behind" if offset_s > 0 else "ahead of"
    return (f"clock: this machine's clock is {abs(offset_s):.0f} s {way} the coordinator's; hetpeer corrects its records "
            "and plans for it, but set the clock right (NTP) for everything else")
