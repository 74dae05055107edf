"""Hole punching: a direct TCP connection between two peers that nobody can dial, through both their NATs.

Most home routers keep a connection's source port while it is free (a port-preserving, endpoint-independent
mapping: "cone" in this project's words), and the reach check tells a peer whether its own does
(`peer/reach.py`). Such a peer punches from one port of its own and announces it (`PeerRecord.punch`), with the
peers it wants to reach now (`calling`); the address the reach service saw is already in its record. Two such
peers that want each other (either one calling the other is enough) then dial each other's public address at
that port at the same time, each from its own punch port:

- each side's SYN opens a mapping in its own router, which from then on lets the other side's packets in;
- a SYN that reaches the other router before that one's own SYN left is dropped (home routers drop what they do
  not expect) and sent again by the kernel a second later; one that arrives after finds the mapping open and
  the far socket still connecting, and TCP's simultaneous open (RFC 9293, section 3.5) joins the two sockets
  into one connection. Neither side needs to time its dial finely: within `PUNCH_WINDOW_S` of each other is
  enough.

Neither side accepted the connection, so the roles of the link handshake go by the device ids: the smaller one
answers (it sends the challenge, as a listener does), the other dials. The connection is then sealed like every
other and carries both channels, both ways. A pair that cannot punch (a NAT that changes ports, a router that
answers the first SYN with a reset of its own, two peers behind one address) stays with its relay, or has no
path, as before: the planner learns it from the peers' `unreachable` reports.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

from hetpeer.peer.transport.links import HANDSHAKE_TIMEOUT_S, SocketStream, share_port
from hetpeer.peer.transport.sealed import Hello, answer, dial
from hetpeer.peer.transport.stream import LinkIdentity, Stream
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.handshake import LENGTHS, HandshakeError

PUNCH_WINDOW_S = 4.0  # one punch dials this long (its SYN sent at 0, 1 and 3 s): the other side dials within it
REFUSED_PAUSE_S = 0.2  # after a reset (a router that answers for itself), the next SYN leaves this much later


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
    """A TCP connection from `local` to `far`, the far side dialling back at the same time: dials (from the same
    port, bound shared) until one connects or `window_s` is over; TimeoutError then, naming the last failure."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + window_s
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        sock = socket.socket(socket.AF_INET6 if ":" in far[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            share_port(sock)
            sock.bind(local)
            await asyncio.wait_for(loop.sock_connect(sock, far), left)
            return sock
        except asyncio.TimeoutError:
            sock.close()
            break
        except OSError as error:  # a reset: the far router answered for itself, or the far side is not dialling yet
            sock.close()
            last = os.strerror(error.errno) if error.errno else str(error)  # asyncio's words name no cause
            await asyncio.sleep(min(REFUSED_PAUSE_S, max(0.0, deadline - time.monotonic())))
        except BaseException:
            sock.close()
            raise
    raise asyncio.TimeoutError(f"no hole punched to {far[0]}:{far[1]} from port {local[1]} within {window_s:g} s ({last})")
