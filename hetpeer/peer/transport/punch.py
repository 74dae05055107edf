"""Hole punching: a direct TCP connection between two peers that nobody can dial, through both their NATs.

Most home routers keep a connection's source port while it is free (a port-preserving, endpoint-independent
mapping: "cone" in this project's words), and the reach check tells a peer whether its own does
(`peer/reach.py`). Such a peer punches from one port of its own and announces it (`PeerRecord.punch`), with the
peers it wants to reach now (`calling`); the address the reach service saw is already in its record. Two such
peers that want each other (either one calling the other is enough) then dial each other's public address at
that port at the same time, each from its own punch port:

- each attempt first sends an *opening* SYN whose TTL (`OPEN_TTL`) takes it past this side's router (and a
  carrier's NAT behind it), which opens a mapping, and lets it die a few hops further, short of the far router;
- a moment later (`OPEN_LEAD_S`) it dials again from the same port with a full TTL. That SYN finds the far
  router's mapping open, if the far side's opening SYN left before, and TCP's simultaneous open (RFC 9293, section
  3.5) joins the two sockets into one connection (on whichever socket of each side the other's SYN met).

Without the opening SYN, two sides that dial at about the same time race: the first SYN to reach a router before
that router's own SYN left is dropped by a router that drops what it does not expect (the kernel sends it again
a second later and it gets in), but a router that answers for itself (a Linux router with no firewall rule on
its public side, OpenWrt's default REJECT) sends a reset, which closes the other side's fresh mapping too, and two
sides that retry on the same schedule repeat the same race every round. With the opening SYN each side's mapping
is open before any SYN of the other side's can reach its router, so the order no longer matters, and an attempt
that still collides (the two sides more than the lead apart) opens again before it dials: lead times drawn
at random keep two sides from colliding the same way twice. Within `PUNCH_WINDOW_S` of each other is enough.

Neither side accepted the connection, so the roles of the link handshake go by the device ids: the smaller one
answers (it sends the challenge, as a listener does), the other dials. The connection is then sealed like every
other and carries both channels, both ways. A pair that cannot punch (a NAT that changes ports, two peers behind
one address, a NAT further than `OPEN_TTL` - 1 hops behind a router that resets) stays with its relay, or has
no path, as before: the planner learns it from the peers' `unreachable` reports.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
import time

from hetpeer.peer.transport.links import HANDSHAKE_TIMEOUT_S, SocketStream, share_port
from hetpeer.peer.transport.sealed import Hello, answer, dial
from hetpeer.peer.transport.stream import LinkIdentity, Stream
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.handshake import LENGTHS, HandshakeError

PUNCH_WINDOW_S = 4.0  # one punch attempts this long: the other side punches within it
# The opening SYN's hop limit: a home router is hop 1 and a carrier's NAT (if any) hop 2; the far router lies
# further (two homes are rarely within 4 hops of each other; the lab puts one provider hop before each router).
OPEN_TTL = 3
OPEN_LEAD_S = 0.2  # from the opening SYN to the dial, on average: drawn from 0.5 to 1.5 times this, each attempt
ATTEMPT_S = 1.5  # a dial waits this long (the kernel sends its SYN again at 1 s) before the next attempt opens again


class Puncher:
    """Connections punched from this peer's punch port (`port`) to peers that announce one. The transport punches
    where it keeps a connection (`network.py`): both sides keep one to the other, so both dial at once."""

    errors = (OSError, asyncio.TimeoutError, HandshakeError)

    def __init__(self, identity: LinkIdentity, host: str, port: int, public_host: str | None = None) -> None:
        self.identity, self.host, self.port, self.public_host = identity, host, port, public_host

    def reaches(self, address: PeerAddress) -> bool:
        # two peers behind one address would dial their own router: that needs hairpinning, which few routers do
        return (address.punch is not None and address.direct is not None and not address.dialable
                and address.direct[0] != self.public_host)

    async def open(self, to: str, address: PeerAddress) -> Stream:
        host = address.direct[0]
        sock = await punch((self.host, self.port), (host, address.punch), PUNCH_WINDOW_S)
        stream = SocketStream(sock, f"punched {host}:{address.punch}")
        try:
            if self.identity.device < to:  # the answering side, as a listener would be
                hello = Hello()
                await stream.write([hello.challenge()])
                head = bytes(await asyncio.wait_for(stream.read_exactly(LENGTHS.size), HANDSHAKE_TIMEOUT_S))
                sealed = await asyncio.wait_for(answer(stream, self.identity, hello, head), HANDSHAKE_TIMEOUT_S)
                if sealed.authenticated != to:
                    raise HandshakeError(f"the peer punched through at {host}:{address.punch} proved to be "
                                         f"{sealed.authenticated!r}, not {to!r}")
            else:
                sealed = await asyncio.wait_for(dial(stream, self.identity, to), HANDSHAKE_TIMEOUT_S)
        except ConnectionError as error:
            stream.close()
            raise ConnectionError(f"{to} closed the punched connection during the link handshake ({error})") from None
        except BaseException:
            stream.close()
            raise
        sealed.route = "punched"
        return sealed


async def punch(local: tuple[str, int], far: tuple[str, int], window_s: float) -> socket.socket:
    """A TCP connection from `local` to `far`, the far side punching back at the same time: attempts (each an
    opening SYN, then a dial, from the same port, bound shared) until one connects or `window_s` is over;
    TimeoutError then, naming the last failure."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + window_s
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        opener = _bound(local, far)
        dialer = None
        try:
            _open(opener, far)
            dialer = _bound(local, far)
            await asyncio.sleep(min(left, OPEN_LEAD_S * random.uniform(0.5, 1.5)))
            if _connected(opener):  # the far side's dial met the opening socket: simultaneous open on it
                dialer.close()
                return _without_errors(opener)
            opener.close()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait_for(loop.sock_connect(dialer, far), min(ATTEMPT_S, left))
            return _without_errors(dialer)
        except asyncio.TimeoutError:
            last = "no answer"
        except OSError as error:  # a reset: a router that answered for itself, or the far side not punching
            last = os.strerror(error.errno) if error.errno else str(error)  # asyncio's words name no cause
        except BaseException:
            opener.close()
            if dialer is not None:
                dialer.close()
            raise
        opener.close()
        if dialer is None:  # refused before its lead (the ports still held by a connection): not at once again
            await asyncio.sleep(min(max(0.0, deadline - time.monotonic()), OPEN_LEAD_S))
        else:
            dialer.close()
    raise asyncio.TimeoutError(f"no hole punched to {far[0]}:{far[1]} from port {local[1]} within {window_s:g} s ({last})")


def _bound(local: tuple[str, int], far: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in far[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        share_port(sock)
        sock.bind(local)
    except BaseException:
        sock.close()
        raise
    return sock


def _open(sock: socket.socket, far: tuple[str, int]) -> None:
    """Send the opening SYN (`OPEN_TTL` hops); whatever `sock` sends after it (its SYN again, the SYN-ACK of a
    simultaneous open) goes with the system's hop limit."""
    level, option = (socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS) if sock.family == socket.AF_INET6 else (socket.IPPROTO_IP, socket.IP_TTL)
    usual = sock.getsockopt(level, option)
    sock.setsockopt(level, option, OPEN_TTL)
    error = sock.connect_ex(far)
    sock.setsockopt(level, option, usual)
    if error not in (0, errno.EINPROGRESS):
        raise OSError(error, os.strerror(error))


def _without_errors(sock: socket.socket) -> socket.socket:
    """`sock`, its error queue emptied: the opening SYN's "time exceeded" lands there (on whichever socket holds
    the pair's ports when it comes back), and a socket with a queued error polls as ready for ever, which would
    spin the event loop that reads it (measured: 900,000 wake-ups a second, and a swarm stepping at a third of
    its speed)."""
    for _ in range(64):
        try:
            sock.recvmsg(1, 1024, socket.MSG_ERRQUEUE)
        except OSError:  # BlockingIOError: nothing (more) queued
            break
    return sock


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
