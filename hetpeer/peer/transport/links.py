"""The links a peer's transport moves frames over: a stream to another peer, opened by dialling or accepted.

`TcpLink` is the direct path: TCP to the peer's announced host and port, reading payloads straight into
their final buffer (`sock_recv_into`): on loopback it runs at most of a raw socket's speed. Given the
peer's swarm key (`LinkIdentity`), it opens every connection with a handshake (`protocol/handshake.py`)
that proves both ends' device ids, as P2P streams prove their peer ids; a connection that fails it is
closed and counted before a frame is read. `P2PLink` is hivemind's libp2p streams through p2pd: slower
(every byte copies through the daemon), but they work behind NAT through relays.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Awaitable, Sequence

import numpy

from hetpeer.peer.transport.sealed import Hello, answer, dial
from hetpeer.peer.transport.stream import Identify, LinkIdentity, Progress, Refuse, Serve, Stream
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.handshake import LENGTHS, HandshakeError

log = logging.getLogger("hetpeer.transport")
P2P_PROTOCOL = "/hetpeer/frames/1"
RELAY_MAGIC = b"HPR1"  # sent in place of a proof: a relay request (`relay.py`); a proof's first length is never this
SOCKET_BUFFER_BYTES = 4 << 20
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not proved who it is by then is closed
# A path that dies without a word (a home router that drops everything, a NAT mapping gone) is found by TCP itself:
# an idle connection sends keepalive probes after KEEPALIVE_IDLE_S, and one whose sent bytes or probes go
# unacknowledged for UNACKED_LIMIT_S is closed (TCP_USER_TIMEOUT, which then also bounds the keepalive probes). The
# transport redials a closed connection it keeps; each dial waits at most DIAL_TIMEOUT_S for the far end, so a
# path that comes back is tried again within seconds, not after the kernel's SYN backoff (its retries at 1, 3,
# 7, 15, 31 and 63 s).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S = 5, 2
UNACKED_LIMIT_S = 15
DIAL_TIMEOUT_S = 5.0


class Link(ABC):
    name: str
    errors: tuple[type[BaseException], ...]  # what `open` raises when the peer is not reachable this way

    @abstractmethod
    async def start(self, device: str, identify: Identify, serve: Serve, refuse: Refuse) -> None:
        """Listen; `identify` maps an authenticated P2P peer id to a device id (None: a stranger); a connection
        that does not prove who it is goes to `refuse`, never to `serve`."""

    @abstractmethod
    def address(self) -> PeerAddress:
        """How others reach this peer over this link (valid after start)."""

    @abstractmethod
    def reaches(self, address: PeerAddress) -> bool: ...

    @abstractmethod
    async def open(self, to: str, address: PeerAddress) -> Stream:
        """A stream to device `to` at `address`."""

    @abstractmethod
    async def shutdown(self) -> None: ...


class SocketStream(Stream):
    def __init__(self, sock: socket.socket, remote: str) -> None:
        self.sock, self.remote, self.authenticated = sock, remote, None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        keep_alive(sock)

    async def read_exactly(self, n: int, progress: Progress | None = None) -> memoryview:
        buffer = numpy.empty(n, numpy.uint8)  # not zero-filled, unlike bytearray: 64 MB costs no memset
        view, got = memoryview(buffer), 0
        while got < n:
            chunk = await self.read_some(view[got:])
            got += chunk
            if progress is not None:
                progress(view, got)
        return view

    async def read_some(self, into: memoryview) -> int:
        try:
            got = await asyncio.get_running_loop().sock_recv_into(self.sock, into)
        except ConnectionError:
            raise
        except (OSError, ValueError) as error:  # closed here, by another task (a replaced connection): fd gone or -1
            raise ConnectionError(f"the connection to {self.remote} was closed: {error}") from error
        if got == 0:
            raise ConnectionError(f"{self.remote} closed the connection")
        return got

    async def write(self, parts: Sequence[bytes]) -> None:
        loop = asyncio.get_running_loop()
        for part in parts:
            await loop.sock_sendall(self.sock, part)

    def unsent_bytes(self) -> int:
        return self._queued(termios.TIOCOUTQ)  # the kernel's send queue: bytes not yet acknowledged by the other end

    def unread_bytes(self) -> int:
        return self._queued(termios.FIONREAD)  # the kernel's receive queue

    def _queued(self, request: int) -> int:
        """Bytes in one of the kernel's queues of this socket; 0 once it is closed (another thread may close it
        while a probe or the inbox reads its queues: its fd is then -1)."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), request, b"\0" * 4))[0]
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def keep_alive(sock: socket.socket) -> None:
    """Keepalive probes on an idle connection and a bound on unacknowledged bytes, so a dead path closes it
    (`UNACKED_LIMIT_S`)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, UNACKED_LIMIT_S // KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_LIMIT_S * 1000)


def share_port(sock: socket.socket) -> None:
    """Let `sock` bind a port that other sockets of this peer bind too, each dialling elsewhere (Linux tells their
    connections apart by the far end): the reach check's and every hole punched from it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


async def connect(host: str, port: int) -> SocketStream:
    """A TCP connection to (host, port), as a stream; TimeoutError when the far end has not answered within
    `DIAL_TIMEOUT_S`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), DIAL_TIMEOUT_S)
    except asyncio.TimeoutError:
        sock.close()
        raise asyncio.TimeoutError(f"tcp {host}:{port} did not answer within {DIAL_TIMEOUT_S:g} s") from None
    except BaseException:
        sock.close()
        raise
    return SocketStream(sock, f"tcp {host}:{port}")


class TcpLink(Link):
    """The direct path: TCP to the peer's announced host and port. With an `identity`, every connection
    starts with the handshake of `protocol/handshake.py`, and only a connection whose other end proved its
    device id carries frames (`Stream.authenticated`); every peer `hetpeer` runs has one. Without one (the
    transport benchmark's baseline, tests of the inbox on a bare socket) the sender a frame names is taken at
    its word."""

    name = "tcp"
    errors = (OSError, asyncio.TimeoutError, HandshakeError)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 identity: LinkIdentity | None = None) -> None:
        self.host, self.port, self.advertise_host, self.identity = host, port, advertise_host, identity
        self.relay = None  # a `relay.Relay` when this peer relays for peers nobody can dial
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def start(self, device: str, identify: Identify, serve: Serve, refuse: Refuse) -> None:
        if self.identity is not None and self.identity.device != device:
            raise ValueError(f"link identity {self.identity.device!r} is not the transport's device {device!r}")
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(serve, refuse), name=f"{device}-tcp-accept")

    async def _accept(self, serve: Serve, refuse: Refuse) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(self._listener)
            stream = SocketStream(sock, f"tcp {peer[0]}:{peer[1]}")
            spawn(serve(stream) if self.identity is None else self._answer(stream, serve, refuse), "tcp-serve")

    async def _answer(self, stream: SocketStream, serve: Serve, refuse: Refuse) -> None:
        """The listener's side of the handshake, then `serve` the stream, sealed, as the device it proved. A relay
        request in place of a proof goes to the relay (`relay.py`), where this peer serves as one."""
        hello = Hello()
        try:
            await stream.write([hello.challenge()])
            head = bytes(await asyncio.wait_for(stream.read_exactly(LENGTHS.size), HANDSHAKE_TIMEOUT_S))
            if head.startswith(RELAY_MAGIC) and self.relay is not None:
                await self.relay.handle(stream, head, hello, self.identity)
                return
            sealed = await asyncio.wait_for(answer(stream, self.identity, hello, head), HANDSHAKE_TIMEOUT_S)
        except (HandshakeError, ConnectionError, OSError, asyncio.TimeoutError) as error:
            refuse(stream.remote, f"link handshake failed: {str(error) or f'no proof within {HANDSHAKE_TIMEOUT_S:g} s'}")
            stream.close()
            return
        await serve(sealed)

    def address(self) -> PeerAddress:
        return PeerAddress(direct=(self.advertise_host or self.host, self.port))

    def reaches(self, address: PeerAddress) -> bool:
        return address.direct is not None and address.dialable

    async def open(self, to: str, address: PeerAddress) -> Stream:
        host, port = address.direct
        stream = await connect(host, port)
        try:
            if self.identity is not None:
                return await asyncio.wait_for(dial(stream, self.identity, to), HANDSHAKE_TIMEOUT_S)
        except ConnectionError as error:  # closed during the handshake: the listener refused this peer's proof
            stream.close()
            raise ConnectionError(f"{to} closed the connection during the link handshake: the peer listening there "
                                  f"refused this peer's proof, or is not {to} ({error})") from None
        except BaseException:
            stream.close()
            raise
        return stream

    async def shutdown(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()


class _P2PStream(Stream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, remote: str, device: str | None):
        self.reader, self.writer, self.remote, self.authenticated = reader, writer, remote, device

    async def read_exactly(self, n: int, progress: Progress | None = None) -> bytearray:
        try:
            data = bytearray(await self.reader.readexactly(n))  # writable, as the tensor built on it must be
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"{self.remote} closed the stream") from None
        if progress is not None and n:
            progress(memoryview(data), n)
        return data

    async def write(self, parts: Sequence[bytes]) -> None:
        for part in parts:
            self.writer.write(part)
        await self.writer.drain()

    def unsent_bytes(self) -> int:
        return self.writer.transport.get_write_buffer_size()  # what the daemon holds is out of sight

    def close(self) -> None:
        self.closed = True
        self.writer.close()


class P2PLink(Link):
    """hivemind P2P streams: libp2p with NAT traversal and relays; the remote peer id is authenticated."""

    name = "p2p"

    def __init__(self, identity_path: str | None = None, host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)):
        from hivemind.p2p import P2PDaemonError
        from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

        self.errors = (OSError, asyncio.TimeoutError, P2PDaemonError, ControlFailure)
        self.identity_path, self.host_maddrs = identity_path, tuple(host_maddrs)
        self.p2p = None
        self._maddrs: tuple[str, ...] = ()

    async def start(self, device: str, identify: Identify, serve: Serve, refuse: Refuse) -> None:
        from hivemind.p2p import P2P

        self.p2p = await P2P.create(host_maddrs=self.host_maddrs, identity_path=self.identity_path)
        self._maddrs = tuple(str(m) for m in await self.p2p.get_visible_maddrs())

        async def handle(info, reader, writer) -> None:
            peer_id = info.peer_id.to_base58()
            sender = identify(peer_id)
            stream = _P2PStream(reader, writer, f"p2p {peer_id}", sender)
            if sender is None:
                refuse(stream.remote, "not in the address book")
                stream.close()
                return
            await serve(stream)

        await self.p2p.add_binary_stream_handler(P2P_PROTOCOL, handle)

    def address(self) -> PeerAddress:
        return PeerAddress(p2p=self._maddrs)

    def reaches(self, address: PeerAddress) -> bool:
        return bool(address.p2p)

    async def open(self, to: str, address: PeerAddress) -> Stream:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        peer_id = PeerID.from_base58(address.p2p_peer_id)
        # the daemon only dials peers it has addresses for; hivemind itself connects the same way
        await self.p2p._client.connect(peer_id, [Multiaddr(m.rsplit("/p2p/", 1)[0]) for m in address.p2p])
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, P2P_PROTOCOL)
        return _P2PStream(reader, writer, f"p2p {address.p2p_peer_id}", to)

    async def shutdown(self) -> None:
        if self.p2p is None:
            return
        sockets = [self.p2p.daemon_listen_maddr, self.p2p._client_listen_maddr]
        await self.p2p.shutdown()
        for maddr in sockets:  # p2pd leaves its unix sockets behind
            Path(str(maddr).removeprefix("/unix")).unlink(missing_ok=True)


_tasks: set[asyncio.Task] = set()


def spawn(coroutine: Awaitable, name: str) -> asyncio.Task:
    """A background task that is kept referenced and whose unexpected end is logged."""
    task = asyncio.ensure_future(coroutine)
    task.set_name(name)
    _tasks.add(task)

    def done(task: asyncio.Task) -> None:
        _tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", name, exc_info=task.exception())

    task.add_done_callback(done)
    return task
