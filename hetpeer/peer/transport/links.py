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
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import numpy

from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.handshake import (
    CHALLENGE_BYTES, LENGTHS, NONCE_BYTES, HandshakeError, Proof, challenge, check, nonce, nonce_of, prove,
)

log = logging.getLogger("hetpeer.transport")
P2P_PROTOCOL = "/hetpeer/frames/1"
SOCKET_BUFFER_BYTES = 4 << 20
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not proved who it is by then is closed


class Stream(ABC):
    remote: str  # for logs
    authenticated: str | None  # the device at the other end, when the link proves it
    closed = False
    _lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a whole frame is written: two channels may share a stream."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @abstractmethod
    async def read_exactly(self, n: int, progress: Progress | None = None) -> memoryview | bytearray:
        """Exactly n bytes in a writable buffer, or ConnectionError when the stream ends first;
        `progress(buffer, end)` hears of the bytes as they arrive."""

    @abstractmethod
    async def write(self, parts: Sequence[bytes]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def unsent_bytes(self) -> int:
        """Bytes written but not yet across (as far as this end can tell)."""
        return 0

    def unread_bytes(self) -> int:
        """Bytes arrived but not yet read (as far as this end can tell)."""
        return 0


Serve = Callable[[Stream], Awaitable[None]]
Progress = Callable[[memoryview, int], None]
Identify = Callable[[str], "str | None"]
Refuse = Callable[[str, str], None]  # (remote, reason): a connection closed before it carried a frame


@dataclass(frozen=True, slots=True)
class LinkIdentity:
    """What a peer proves itself with on direct links: its device id and the swarm key it is bound to
    (a hivemind RSAPrivateKey, the one that signs its records)."""

    device: str
    private_key: object


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


class _SocketStream(Stream):
    def __init__(self, sock: socket.socket, remote: str) -> None:
        self.sock, self.remote, self.authenticated = sock, remote, None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)

    async def read_exactly(self, n: int, progress: Progress | None = None) -> memoryview:
        loop = asyncio.get_running_loop()
        buffer = numpy.empty(n, numpy.uint8)  # not zero-filled, unlike bytearray: 64 MB costs no memset
        view, got = memoryview(buffer), 0
        while got < n:
            chunk = await loop.sock_recv_into(self.sock, view[got:])
            if chunk == 0:
                raise ConnectionError(f"{self.remote} closed the connection")
            got += chunk
            if progress is not None:
                progress(view, got)
        return view

    async def write(self, parts: Sequence[bytes]) -> None:
        loop = asyncio.get_running_loop()
        for part in parts:
            await loop.sock_sendall(self.sock, part)

    def unsent_bytes(self) -> int:
        try:  # the kernel's send queue: bytes not yet acknowledged by the other end
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            return 0

    def unread_bytes(self) -> int:
        try:  # the kernel's receive queue
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return 0

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class TcpLink(Link):
    """The direct path: TCP to the peer's announced host and port. With an `identity`, every connection
    starts with the handshake of `protocol/handshake.py`, and only a connection whose other end proved its
    device id carries frames (`Stream.authenticated`). Without one (`hetpeer launch`: processes an
    organizer starts on machines it trusts), the sender a frame names is taken at its word."""

    name = "tcp"
    errors = (OSError, asyncio.TimeoutError, HandshakeError)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 identity: LinkIdentity | None = None) -> None:
        self.host, self.port, self.advertise_host, self.identity = host, port, advertise_host, identity
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
            stream = _SocketStream(sock, f"tcp {peer[0]}:{peer[1]}")
            spawn(serve(stream) if self.identity is None else self._answer(stream, serve, refuse), "tcp-serve")

    async def _answer(self, stream: _SocketStream, serve: Serve, refuse: Refuse) -> None:
        """The listener's side of the handshake, then `serve` the stream as the device it proved."""
        identity = self.identity

        async def exchange() -> str:
            mine = nonce()
            await stream.write([challenge(mine)])
            proof = await _read_proof(stream)
            theirs = bytes(await stream.read_exactly(NONCE_BYTES))
            device = check(proof, "dialer", mine, identity.device)
            await stream.write([prove(identity.private_key, "listener", theirs, identity.device, device).encode()])
            return device

        try:
            device = await asyncio.wait_for(exchange(), HANDSHAKE_TIMEOUT_S)
        except (HandshakeError, ConnectionError, OSError, asyncio.TimeoutError) as error:
            refuse(stream.remote, f"link handshake failed: {str(error) or f'no proof within {HANDSHAKE_TIMEOUT_S:g} s'}")
            stream.close()
            return
        stream.authenticated = device
        await serve(stream)

    async def _dial(self, stream: _SocketStream, to: str) -> None:
        """The dialer's side: prove this peer to `to`, and make `to` prove itself (HandshakeError if not)."""
        identity = self.identity

        async def exchange() -> str:
            theirs = nonce_of(bytes(await stream.read_exactly(CHALLENGE_BYTES)))
            mine = nonce()
            await stream.write([prove(identity.private_key, "dialer", theirs, identity.device, to).encode(), mine])
            return check(await _read_proof(stream), "listener", mine, identity.device, expected=to)

        stream.authenticated = await asyncio.wait_for(exchange(), HANDSHAKE_TIMEOUT_S)

    def address(self) -> PeerAddress:
        return PeerAddress(direct=(self.advertise_host or self.host, self.port))

    def reaches(self, address: PeerAddress) -> bool:
        return address.direct is not None

    async def open(self, to: str, address: PeerAddress) -> Stream:
        host, port = address.direct
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            stream = _SocketStream(sock, f"tcp {host}:{port}")
            if self.identity is not None:
                await self._dial(stream, to)
        except ConnectionError as error:  # closed during the handshake: the listener refused this peer's proof
            sock.close()
            raise ConnectionError(f"{to} closed the connection during the link handshake: the peer listening there "
                                  f"refused this peer's proof, or is not {to} ({error})") from None
        except BaseException:
            sock.close()
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


async def _read_proof(stream: Stream) -> Proof:
    lengths = bytes(await stream.read_exactly(LENGTHS.size))
    return Proof.decode(lengths, bytes(await stream.read_exactly(Proof.body_bytes(lengths))))


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
