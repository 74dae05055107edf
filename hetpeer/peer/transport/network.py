"""The networked transport: one asyncio loop thread per peer moves frames over the links it has.

Links are tried in order for each destination, so `[TcpLink(), P2PLink()]` means: use the direct TCP
path when the peer is reachable at its direct address, fall back to hivemind P2P (which works behind
NAT through relays) when it is not. Frames to one destination leave in the order they were sent, from
a queue of their own, so compute never waits for the network; `flush` waits for the queues.

The direct path reads payloads straight into their final buffer (`sock_recv_into`): on loopback it
runs at most of a raw socket's speed, where P2P streams copy through the daemon.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import math
import socket
import struct
import termios
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

import numpy

from hetpeer.peer.transport.base import DEFAULT_MAX_FRAME_BYTES, Transport
from hetpeer.peer.transport.codec import PayloadCheck
from hetpeer.peer.transport.inbox import Arrival, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.frame import PREFIX, FrameError, FrameHeader, decode_header, header_length

log = logging.getLogger("hetpeer.transport")
P2P_PROTOCOL = "/hetpeer/frames/1"
SOCKET_BUFFER_BYTES = 4 << 20
MAX_EMULATED_LATENCY_S = 10.0
DRAIN_LIMIT_BYTES = 1 << 20  # a refused frame's payload up to this size is read past; beyond, the stream is closed
EMULATED_CHUNK_S = 0.01  # an emulated rate paces a frame in pieces of about this long, as a link delivers it


class Stream(ABC):
    remote: str  # for logs
    authenticated: str | None  # the device at the other end, when the link proves it

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


class Link(ABC):
    name: str
    errors: tuple[type[BaseException], ...]  # what `open` raises when the peer is not reachable this way

    @abstractmethod
    async def start(self, device: str, identify: Identify, serve: Serve) -> None:
        """Listen; `identify` maps an authenticated P2P peer id to a device id (None: a stranger)."""

    @abstractmethod
    def address(self) -> PeerAddress:
        """How others reach this peer over this link (valid after start)."""

    @abstractmethod
    def reaches(self, address: PeerAddress) -> bool: ...

    @abstractmethod
    async def open(self, address: PeerAddress) -> Stream: ...

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
        self.sock.close()


class TcpLink(Link):
    """The direct path: plain TCP to the peer's announced host and port."""

    name = "tcp"
    errors = (OSError, asyncio.TimeoutError)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self.host, self.port, self.advertise_host = host, port, advertise_host
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def start(self, device: str, identify: Identify, serve: Serve) -> None:
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(serve), name=f"{device}-tcp-accept")

    async def _accept(self, serve: Serve) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(self._listener)
            _spawn(serve(_SocketStream(sock, f"tcp {peer[0]}:{peer[1]}")), "tcp-serve")

    def address(self) -> PeerAddress:
        return PeerAddress(direct=(self.advertise_host or self.host, self.port))

    def reaches(self, address: PeerAddress) -> bool:
        return address.direct is not None

    async def open(self, address: PeerAddress) -> Stream:
        host, port = address.direct
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return _SocketStream(sock, f"tcp {host}:{port}")

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

    async def start(self, device: str, identify: Identify, serve: Serve) -> None:
        from hivemind.p2p import P2P

        self.p2p = await P2P.create(host_maddrs=self.host_maddrs, identity_path=self.identity_path)
        self._maddrs = tuple(str(m) for m in await self.p2p.get_visible_maddrs())

        async def handle(info, reader, writer) -> None:
            peer_id = info.peer_id.to_base58()
            sender = identify(peer_id)
            stream = _P2PStream(reader, writer, f"p2p {peer_id}", sender)
            if sender is None:
                log.warning("%s refused a P2P stream from %s: not in the address book", device, peer_id)
                stream.close()
                return
            await serve(stream)

        await self.p2p.add_binary_stream_handler(P2P_PROTOCOL, handle)

    def address(self) -> PeerAddress:
        return PeerAddress(p2p=self._maddrs)

    def reaches(self, address: PeerAddress) -> bool:
        return bool(address.p2p)

    async def open(self, address: PeerAddress) -> Stream:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        peer_id = PeerID.from_base58(address.p2p_peer_id)
        # the daemon only dials peers it has addresses for; hivemind itself connects the same way
        await self.p2p._client.connect(peer_id, [Multiaddr(m.rsplit("/p2p/", 1)[0]) for m in address.p2p])
        _, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, P2P_PROTOCOL)
        return _P2PStream(reader, writer, f"p2p {address.p2p_peer_id}", None)

    async def shutdown(self) -> None:
        if self.p2p is None:
            return
        sockets = [self.p2p.daemon_listen_maddr, self.p2p._client_listen_maddr]
        await self.p2p.shutdown()
        for maddr in sockets:  # p2pd leaves its unix sockets behind
            Path(str(maddr).removeprefix("/unix")).unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Emulation:
    """Slow, far links emulated on a fast network, for tests, demos and testbeds. Each frame this peer sends
    leaves `latency_s` (one way) after it was sent, by the destination's direct host (`HOST:PORT` first,
    then `HOST`, then `*`), and frames to one destination are paced to `rate_bytes_per_s` (in pieces of
    about `EMULATED_CHUNK_S`, so a receiver sees a frame arrive as over a link of that rate). Frames in flight
    overlap, as on a real link: a delay, not a stall. Neither touches the DHT's own traffic, nor TCP's
    behaviour on a long link (its window grows as fast as on the real, short one)."""

    rate_bytes_per_s: float | None = None
    latency_s: Mapping[str, float] = dataclass_field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rate_bytes_per_s is not None and not (math.isfinite(self.rate_bytes_per_s) and self.rate_bytes_per_s > 0):
            raise ValueError(f"emulated rate must be a positive number of bytes/s, got {self.rate_bytes_per_s}")
        for host, seconds in self.latency_s.items():
            if not (math.isfinite(seconds) and 0 <= seconds <= MAX_EMULATED_LATENCY_S):
                raise ValueError(f"emulated latency to {host} must be 0 to {MAX_EMULATED_LATENCY_S:g} s, got {seconds}")

    def latency_to(self, address: PeerAddress | None) -> float:
        if not self.latency_s:
            return 0.0
        if address is not None and address.direct is not None:
            host, port = address.direct
            for key in (f"{host}:{port}", host):
                if key in self.latency_s:
                    return self.latency_s[key]
        return self.latency_s.get("*", 0.0)


class NetworkTransport(Transport):
    def __init__(
        self,
        device: str,
        book: AddressBook,
        links: Sequence[Link],
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_s: float = 10.0,
        emulation: Emulation = Emulation(),
    ) -> None:
        if not links:
            raise ValueError("a transport needs at least one link")
        super().__init__(device, max_frame_bytes=max_frame_bytes)
        self.book, self.links, self.connect_timeout_s = book, tuple(links), connect_timeout_s
        self.emulation = emulation
        self.routes: dict[str, str] = {}  # destination -> name of the link that reached it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # one queue, pump and connection per (destination, channel): link probes travel apart from training
        # frames, so a ping does not wait behind megabytes of parameters queued for the same peer
        self._queues: dict[tuple[str, str], asyncio.Queue] = {}
        self._pumps: dict[tuple[str, str], asyncio.Task] = {}
        self._free_at: dict[str, float] = {}  # with an emulated rate: when the link to a destination is free again
        self._failures: dict[str, str] = {}
        self._streams: dict[tuple[str, str], Stream] = {}  # each pump's connection, to see what it has not sent
        self._written: collections.Counter[str] = collections.Counter()  # of `sent`, the payload bytes written
        self._incoming: dict[str, set[Stream]] = collections.defaultdict(set)  # streams carrying a peer's frames

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.device}-transport", daemon=True)
        self._thread.start()
        try:
            self._call(self._start_links(), timeout_s=60)
        except BaseException:
            self.shutdown()
            raise

    async def _start_links(self) -> None:
        for link in self.links:
            await link.start(self.device, lambda peer_id: self.book.device_of_p2p_id(peer_id), self._serve)

    def address(self) -> PeerAddress:
        """This peer's entry for the address book: every link's address together."""
        parts = [link.address() for link in self.links]
        direct = next((p.direct for p in parts if p.direct is not None), None)
        return PeerAddress(direct=direct, p2p=tuple(m for p in parts for m in p.p2p))

    def shutdown(self) -> None:
        if self._loop is None:
            return
        if self._loop.is_running():
            try:
                self._call(self._stop(), timeout_s=30)
            except (TimeoutError, TransportError) as error:
                log.warning("%s: transport did not stop cleanly: %s", self.device, error)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()
        self._loop = None

    async def _stop(self) -> None:
        for link in self.links:
            await link.shutdown()
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _call(self, coroutine: Awaitable, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    # -- sending ------------------------------------------------------------------------------
    def _send(self, to: str, header: FrameHeader, payload: memoryview) -> None:
        if to in self._failures:
            raise PeerUnreachable(self._failures.pop(to))
        channel = "probe" if header.kind == "probe" else "frames"
        self._loop.call_soon_threadsafe(self._enqueue, (to, channel), (header.encode(), payload, time.monotonic()))

    def _enqueue(self, key: tuple[str, str], parts: tuple[bytes, memoryview, float]) -> None:
        if key not in self._queues:
            self._queues[key] = asyncio.Queue()
            self._pumps[key] = _spawn(self._pump(*key, self._queues[key]), f"{self.device}->{key[0]} ({key[1]})")
        self._queues[key].put_nowait(parts)

    async def _pump(self, to: str, channel: str, queue: asyncio.Queue) -> None:
        key, stream = (to, channel), None
        while True:
            *parts, sent_at = await queue.get()
            try:
                reused = stream is not None
                if stream is None:
                    stream = self._streams[key] = await self._connect(to)
                emulation = self.emulation
                if emulation.latency_s:  # its time in flight, counted from when it was sent: frames overlap
                    await asyncio.sleep(sent_at + emulation.latency_to(self.book.peers.get(to)) - time.monotonic())
                try:
                    await self._write(to, stream, parts)
                except (ConnectionError, OSError):
                    if not reused:
                        raise
                    # a connection that carried earlier frames broke (its peer restarted, say): one fresh one
                    # before the frame counts as lost; a receiver drops a frame cut short on the old one
                    stream.close()
                    stream = None
                    stream = self._streams[key] = await self._connect(to)
                    await self._write(to, stream, parts)
                if channel == "frames":
                    self._written[to] += memoryview(parts[1]).nbytes
            except (PeerUnreachable, ConnectionError, OSError) as error:
                dropped = 1 + queue.qsize()
                self._failures[to] = f"{self.device}: sending to {to} failed, {dropped} frame(s) dropped: {error}"
                log.warning("%s", self._failures[to])
                if stream is not None:
                    stream.close()
                    stream = None
                self._streams.pop(key, None)
                while not queue.empty():
                    queue.get_nowait()
                    queue.task_done()
            finally:
                queue.task_done()

    async def _write(self, to: str, stream: Stream, parts: Sequence[bytes | memoryview]) -> None:
        rate = self.emulation.rate_bytes_per_s
        if rate is None:
            await stream.write(parts)
            return
        # one emulated link per destination, whatever the channel: each piece waits for its turn on it and
        # leaves when it would have crossed, so a receiver sees the frame arrive at the emulated rate
        piece = max(1 << 12, int(rate * EMULATED_CHUNK_S))
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, max(len(view), 1), piece):
                chunk = view[start:start + piece]
                free_at = max(time.monotonic(), self._free_at.get(to, 0.0)) + len(chunk) / rate
                self._free_at[to] = free_at
                await asyncio.sleep(free_at - time.monotonic())
                await stream.write([chunk])

    def arrived_bytes(self, sender: str) -> int:
        # what the kernel holds unread counts as arrived: a reader busy with a frame lags its stream
        return self.inbox.received[sender] + sum(stream.unread_bytes() for stream in list(self._incoming[sender]))

    def unsent_bytes(self, to: str) -> int:
        stream = self._streams.get((to, "frames"))  # read from another thread: a moment's view is all it needs
        return self.sent[to] - self._written[to] + (stream.unsent_bytes() if stream is not None else 0)

    async def _connect(self, to: str) -> Stream:
        try:
            address = self.book.get(to)
        except KeyError as error:
            raise PeerUnreachable(str(error.args[0])) from None
        deadline = time.monotonic() + self.connect_timeout_s
        tried: dict[str, str] = {}
        while True:
            for link in self.links:
                if not link.reaches(address):
                    continue
                try:
                    stream = await asyncio.wait_for(link.open(address), max(0.1, deadline - time.monotonic()))
                except link.errors as error:
                    tried[link.name] = str(error) or type(error).__name__
                    continue
                if self.routes.get(to) != link.name:
                    log.info("%s reaches %s over %s", self.device, to, link.name)
                self.routes[to] = link.name
                return stream
            if not tried:
                raise PeerUnreachable(f"no link of {self.device} can use the addresses of {to}")
            if time.monotonic() >= deadline:
                reasons = "; ".join(f"{name}: {reason}" for name, reason in tried.items())
                raise PeerUnreachable(f"cannot reach {to} within {self.connect_timeout_s:g} s ({reasons})")
            await asyncio.sleep(0.1)  # the peer may still be starting

    def flush(self, timeout_s: float, to: Iterable[str] | None = None) -> None:
        destinations = {d for d, _ in self._queues} if to is None else set(to)
        try:
            self._call(self._drain(destinations), timeout_s)
        except TimeoutError:
            raise TransportTimeout(
                f"{self.device}: frames to {', '.join(sorted(destinations))} not sent within {timeout_s:g} s"
            ) from None
        for destination in sorted(destinations & set(self._failures)):
            raise PeerUnreachable(self._failures.pop(destination))

    async def _drain(self, destinations: set[str]) -> None:
        for (to, _), queue in list(self._queues.items()):
            if to in destinations:
                await queue.join()

    # -- receiving ----------------------------------------------------------------------------
    async def _serve(self, stream: Stream) -> None:
        """Read frames off one stream until it ends; garbage or an oversize frame closes it."""
        inbox, incoming = self.inbox, set()
        try:
            while True:
                try:
                    prefix = await stream.read_exactly(PREFIX.size)
                except ConnectionError:
                    return  # closed between frames: the normal end
                header = decode_header(bytes(await stream.read_exactly(header_length(bytes(prefix)))))
                reason = inbox.screen(header, stream.authenticated)
                oversize = header.payload_bytes > inbox.max_frame_bytes
                if oversize or (reason is not None and header.payload_bytes > DRAIN_LIMIT_BYTES):
                    # never read past the limit, nor a large payload we will drop: close, the sender reconnects
                    inbox.refuse(header, reason or "over the frame limit", "; connection closed")
                    return
                if reason is not None:
                    await stream.read_exactly(header.payload_bytes)
                    inbox.refuse(header, reason)
                    continue
                check = PayloadCheck(header)
                if header.kind != "probe":
                    self._incoming[header.sender].add(stream)
                    incoming.add(header.sender)
                arriving = _Arriving(self, header, check.update)
                payload = await stream.read_exactly(header.payload_bytes, arriving)
                if header.kind == "probe" and arriving.first_s is not None:
                    inbox.arrivals[header.sender] = Arrival(
                        arriving.first_s, time.perf_counter(), arriving.first_bytes, arriving.others_before
                    )
                # the sender is up (again): a failure to reach it before is history, not news for the next send
                self._failures.pop(header.sender, None)
                inbox.offer(header, payload, check)
        except FrameError as error:
            inbox.reject(stream.authenticated or stream.remote, f"garbage on the stream: {error}; connection closed")
        except ConnectionError as error:
            log.info("%s: stream from %s ended inside a frame: %s", self.device, stream.remote, error)
        finally:
            for sender in incoming:
                self._incoming[sender].discard(stream)
            stream.close()


_tasks: set[asyncio.Task] = set()


def _spawn(coroutine: Awaitable, name: str) -> asyncio.Task:
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


class _Arriving:
    """The progress of one payload off a stream, passed on to `then`: bytes of frames other than probes
    count into `inbox.received` as they arrive; for a probe, when the first read came, what it found, and
    what had arrived of the sender's other frames by then."""

    def __init__(self, transport: "NetworkTransport", header: FrameHeader, then: Progress) -> None:
        self.transport, self.sender, self.then = transport, header.sender, then
        self.probe = header.kind == "probe"
        self.counted = 0
        self.first_s: float | None = None
        self.first_bytes = self.others_before = 0

    def __call__(self, buffer: memoryview, end: int) -> None:
        if self.probe:
            if self.first_s is None:
                self.first_s, self.first_bytes = time.perf_counter(), end
                self.others_before = self.transport.arrived_bytes(self.sender)
        else:
            self.transport.inbox.received[self.sender] += end - self.counted
            self.counted = end
        self.then(buffer, end)
