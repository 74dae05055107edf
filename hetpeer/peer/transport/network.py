"""The networked transport: one asyncio loop thread per peer moves frames over the links it has (`links.py`).

Links are tried in order for each destination, so `[TcpLink(), P2PLink()]` means: use the direct TCP
path when the peer is reachable at its direct address, fall back to hivemind P2P when it is not. Frames
to one destination leave in the order they were sent, from a queue of their own, so compute never waits
for the network; `flush` waits for the queues.

A connection carries frames both ways, whichever side dialled it: a peer behind NAT (which nobody can
dial) dials the peers it works with (`keep_connected`), and frames to it travel back over those
connections. Frames to a peer whose address is not `dialable` take a connection of its own, else its
relay's, waiting up to the connect timeout for one. Two peers behind NATs that keep ports, each keeping a
connection to the other, punch one (`punch.py`): it is shared by both channels, both ways, and replaces a
relayed connection between them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field as dataclass_field
from typing import Awaitable, Iterable, Mapping, Sequence

from hetpeer.peer.transport.base import DEFAULT_MAX_FRAME_BYTES, Transport
from hetpeer.peer.transport.codec import PayloadCheck
from hetpeer.peer.transport.inbox import Arrival, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.peer.transport.links import Link, spawn
from hetpeer.peer.transport.punch import Puncher
from hetpeer.peer.transport.stream import Progress, Stream
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.handshake import HandshakeError
from hetpeer.protocol.frame import PREFIX, FrameError, FrameHeader, decode_header, header_length

log = logging.getLogger("hetpeer.transport")
MAX_EMULATED_LATENCY_S = 10.0
DRAIN_LIMIT_BYTES = 1 << 20  # a refused frame's payload up to this size is read past; beyond, the stream is closed
PATHS = {"tcp": "direct", "back": "direct", "p2p": "direct", "punched": "punched", "relay": "relayed"}  # route -> path
KEEP_SAY_S = 30.0  # a kept connection that keeps failing for one reason is said again this often
EMULATED_CHUNK_S = 0.01  # an emulated rate paces a frame in pieces of about this long, as a link delivers it


def failure(error: BaseException) -> str:
    """How a dial, punch or send failed, in `protocol.reach.FAILURES`' words."""
    if isinstance(error, PeerUnreachable):
        return error.how
    if isinstance(error, HandshakeError):
        return "handshake"
    if isinstance(error, ConnectionRefusedError):
        return "refused"
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    return "lost"


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
        puncher: Puncher | None = None,
    ) -> None:
        if not links:
            raise ValueError("a transport needs at least one link")
        super().__init__(device, max_frame_bytes=max_frame_bytes)
        self.book, self.links, self.connect_timeout_s = book, tuple(links), connect_timeout_s
        self.emulation, self.puncher = emulation, puncher  # no puncher: this peer does not punch holes
        self.routes: dict[str, str] = {}  # destination -> the route of the stream that last reached it (`Stream.route`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # one queue, pump and connection per (destination, channel): link probes travel apart from training
        # frames, so a ping does not wait behind megabytes of parameters queued for the same peer
        self._queues: dict[tuple[str, str], asyncio.Queue] = {}
        self._pumps: dict[tuple[str, str], asyncio.Task] = {}
        self._free_at: dict[str, float] = {}  # with an emulated rate: when the link to a destination is free again
        self._failures: dict[str, tuple[str, str]] = {}
        self._streams: dict[tuple[str, str], Stream] = {}  # each pump's connection, to see what it has not sent
        self._written: collections.Counter[str] = collections.Counter()  # of `sent`, the payload bytes written
        self._incoming: dict[str, set[Stream]] = collections.defaultdict(set)  # streams carrying a peer's frames
        self._accepted: dict[str, list[Stream]] = collections.defaultdict(list)  # live streams a peer opened, oldest first
        self._opening: dict[tuple[str, str], asyncio.Lock] = {}
        self.keep: frozenset[str] = frozenset()  # peers this one keeps a connection open to (it must be the one to dial)
        self.keep_every_s = 1.0
        self._keeping: dict[str, asyncio.Task] = {}  # per kept peer, the dial or punch under way
        self._keep_said: dict[str, tuple[str, float]] = {}  # per kept peer, the last failure said, and when
        # destination -> when frames to it last failed to leave, or a connection kept to it failed (monotonic), and how
        self.unreached: dict[str, tuple[float, str]] = {}

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
        self._loop.call_soon_threadsafe(lambda: spawn(self._keep_loop(), f"{self.device}-keep"))

    async def _start_links(self) -> None:
        for link in self.links:
            await link.start(self.device, lambda peer_id: self.book.device_of_p2p_id(peer_id),
                             lambda stream: self._serve(stream, accepted=True), self.inbox.refuse_connection)

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
            raise PeerUnreachable(*self._failures.pop(to))
        channel = "probe" if header.kind == "probe" else "frames"
        self._loop.call_soon_threadsafe(self._enqueue, (to, channel), (header.encode(), payload, time.monotonic()))

    def _enqueue(self, key: tuple[str, str], parts: tuple[bytes, memoryview, float]) -> None:
        if key not in self._queues:
            self._queues[key] = asyncio.Queue()
            self._pumps[key] = spawn(self._pump(*key, self._queues[key]), f"{self.device}->{key[0]} ({key[1]})")
        self._queues[key].put_nowait(parts)

    async def _pump(self, to: str, channel: str, queue: asyncio.Queue) -> None:
        key = (to, channel)
        while True:
            *parts, sent_at = await queue.get()
            stream = self._streams.get(key)
            try:
                reused = stream is not None and not stream.closed
                if not reused:
                    stream = await self._stream_to(to, channel)
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
                    stream = await self._stream_to(to, channel)
                    await self._write(to, stream, parts)
                if channel == "frames":
                    self._written[to] += memoryview(parts[1]).nbytes
                self.unreached.pop(to, None)
            except (PeerUnreachable, ConnectionError, OSError) as error:
                how = failure(error)
                self.unreached[to] = (time.monotonic(), how)
                dropped = 1 + queue.qsize()
                self._failures[to] = (f"{self.device}: sending to {to} failed, {dropped} frame(s) dropped: {error}", how)
                log.warning("%s", self._failures[to][0])
                if stream is not None:
                    stream.close()
                self._streams.pop(key, None)
                while not queue.empty():
                    queue.get_nowait()
                    queue.task_done()
            finally:
                queue.task_done()

    async def _stream_to(self, to: str, channel: str) -> Stream:
        """A live stream to `to` for `channel`: the one kept for it, else a new one (dialled, or one `to` opened)."""
        key = (to, channel)
        async with self._opening.setdefault(key, asyncio.Lock()):  # the pump and the keeper never both dial
            stream = self._streams.get(key)
            if stream is None or stream.closed:
                stream = self._streams[key] = await self._connect(to, channel)
            return stream

    async def _write(self, to: str, stream: Stream, parts: Sequence[bytes | memoryview]) -> None:
        rate = self.emulation.rate_bytes_per_s
        async with stream.lock:  # a stream may serve two channels (one a peer behind NAT opened): whole frames each
            if rate is None:
                await stream.write(parts)
            else:
                await self._write_paced(to, stream, parts, rate)

    async def _write_paced(self, to: str, stream: Stream, parts: Sequence[bytes | memoryview], rate: float) -> None:
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

    async def _connect(self, to: str, channel: str) -> Stream:
        """A stream to `to`: dialled, else over a connection `to` opened. A peer that cannot be dialled: a connection
        of its own first, else its relay's (`relay.py`, the only link that reaches it), while any lasts."""
        try:
            address = self.book.get(to)
        except KeyError as error:
            raise PeerUnreachable(str(error.args[0]), "no-path") from None
        deadline = time.monotonic() + self.connect_timeout_s
        tried: dict[str, str] = {}
        hows: set[str] = set()
        while True:
            if not address.dialable and (accepted := self._accepted_stream(to, channel)) is not None:
                return self._route(to, accepted)
            for link in self.links:
                if not link.reaches(address):
                    continue
                try:
                    stream = await asyncio.wait_for(link.open(to, address), max(0.1, deadline - time.monotonic()))
                except link.errors as error:
                    tried[link.name] = str(error) or type(error).__name__
                    hows.add(failure(error))
                    continue
                stream.route = link.name
                spawn(self._serve(stream), f"{self.device}<-{to} ({link.name})")  # frames come back over it too
                return self._route(to, stream)
            if not address.dialable and not tried:
                tried["dial"] = f"{to} cannot be dialled (it announced so) and has no connection to this peer"
            if (accepted := self._accepted_stream(to, channel)) is not None:  # `to` dialled (or punched) meanwhile
                return self._route(to, accepted)
            if not tried:
                raise PeerUnreachable(f"no link of {self.device} can use the addresses of {to}", "no-path")
            if time.monotonic() >= deadline:
                reasons = "; ".join(f"{name}: {reason}" for name, reason in tried.items())
                how = next((h for h in ("refused", "handshake", "timeout") if h in hows), "no-path")
                raise PeerUnreachable(f"cannot reach {to} within {self.connect_timeout_s:g} s ({reasons})", how)
            await asyncio.sleep(0.1)  # the peer may still be starting, or about to dial this one

    def _route(self, to: str, stream: Stream) -> Stream:
        route = stream.route
        if self.routes.get(to) != route:
            words = {"back": "over the connection it opened", "punched": "over a connection punched through both NATs"}
            log.info("%s reaches %s %s", self.device, to, words.get(route, f"over {route}"))
        self.routes[to] = route
        return stream

    def paths(self) -> dict[str, str]:
        """Per peer this one reached lately, how: "direct", "punched" or "relayed"."""
        return {d: PATHS.get(route, "direct") for d, route in list(self.routes.items())}

    def _accepted_stream(self, to: str, channel: str) -> Stream | None:
        """A live stream `to` opened to this peer, or punched with it: for probes its newest, for frames its oldest (a
        peer behind NAT opens one for frames when it takes a plan, and one for probes when it probes)."""
        streams = [stream for stream in self._accepted.get(to, ()) if not stream.closed]
        if not streams:
            return None
        return streams[-1] if channel == "probe" else streams[0]

    def unreachable(self, within_s: float) -> dict[str, str]:
        """The peers frames to which failed to leave, or a connection kept to which failed, in the last `within_s`
        seconds, and that have not been reached since (frames left or arrived, a kept connection opened), each with
        how it failed (`protocol.reach.FAILURES`), in device order."""
        now = time.monotonic()
        return {d: how for d, (at, how) in sorted(self.unreached.items()) if now - at <= within_s}

    def forget_failures(self, peers: Iterable[str]) -> None:
        """Peers no longer counted as unreachable (they came back)."""
        for peer in peers:
            self.unreached.pop(peer, None)

    def reaches(self, peer: str) -> bool:
        """Whether a link can open a connection to `peer` (a dial, its relay), this peer can punch a hole to it, or a
        live connection joins them (either side opened it)."""
        address = self.book.peers.get(peer)
        if address is None:
            return False
        return any(link.reaches(address) for link in self.links) or self.punchable(peer) or self.connected(peer)

    def connected(self, peer: str) -> bool:
        """Whether a live connection joins this peer and `peer` (either side dialled it)."""
        return any(not s.closed for s in self._accepted.get(peer, ())) or any(
            not s.closed for (to, _), s in list(self._streams.items()) if to == peer)

    def keep_connected(self, peers: Iterable[str]) -> None:
        """Keep a connection open to each of `peers` (each with a path: dialable, through its relay, or punched),
        redialled within `keep_every_s` when it drops: how a peer that cannot be dialled stays reachable to them.
        To a peer this one can punch a hole to, the connection is punched (the other side keeps one too, so both
        dial at once), and a relayed one does not count."""
        self.keep = frozenset(peers) - {self.device}

    def punchable(self, peer: str) -> bool:
        """Whether this peer punches holes and `peer`, as the address book has it, can be punched to."""
        address = self.book.peers.get(peer)
        return self.puncher is not None and address is not None and self.puncher.reaches(address)

    def _kept(self, peer: str) -> bool:
        if not self.punchable(peer):
            return self.connected(peer)
        streams = [*self._accepted.get(peer, ()), *(s for (to, _), s in list(self._streams.items()) if to == peer)]
        return any(not s.closed and s.route != "relay" for s in streams)

    async def _keep_loop(self) -> None:
        while True:
            for peer in sorted(self.keep):
                busy = self._keeping.get(peer)
                if (busy is not None and not busy.done()) or peer not in self.book.peers:
                    continue
                if self._kept(peer):  # connected (the other side dialled, say): no longer unreachable
                    self.unreached.pop(peer, None)
                    continue
                self._keeping[peer] = spawn(self._keep_one(peer), f"{self.device}-keep-{peer}")
            for peer in set(self._keeping) - self.keep:
                if self._keeping[peer].done():
                    del self._keeping[peer]
            await asyncio.sleep(self.keep_every_s)

    async def _keep_one(self, peer: str) -> None:
        """Dial `peer`, or punch a hole to it, for the connection kept to it; a failure is said (once a reason, and
        again after `KEEP_SAY_S`) and tried again by the keep loop."""
        try:
            if self.punchable(peer):
                await self._punch(peer)
            else:
                await self._stream_to(peer, "frames")
        except (PeerUnreachable, *Puncher.errors) as error:  # dials and punches fail alike: OSError, timeouts, handshakes
            reason, now = str(error) or type(error).__name__, time.monotonic()
            how = failure(error)
            self.unreached[peer] = (now, "punch" if self.punchable(peer) and how in ("timeout", "refused", "lost") else how)
            said = self._keep_said.get(peer)
            if said is None or said[0] != reason or now - said[1] > KEEP_SAY_S:
                self._keep_said[peer] = (reason, now)
                log.info("%s: cannot keep a connection to %s: %s", self.device, peer, reason)
            return
        self._keep_said.pop(peer, None)
        self.unreached.pop(peer, None)

    async def _punch(self, peer: str) -> None:
        """A connection punched to `peer`, shared by both channels both ways; the relayed ones it replaces are closed
        once no frame is being written on them (the far side's pumps then take the punched one too)."""
        stream = await self.puncher.open(peer, self.book.get(peer))
        spawn(self._serve(stream, accepted=True), f"{self.device}<-{peer} (punched)")
        self._route(peer, stream)
        for channel in ("frames", "probe"):
            old = self._streams.get((peer, channel))
            if old is not None and old is not stream and old.route == "relay":
                self._streams[(peer, channel)] = stream
                spawn(self._retire(old), f"{self.device}-retire-{peer}")

    @staticmethod
    async def _retire(stream: Stream) -> None:
        async with stream.lock:
            stream.close()

    def flush(self, timeout_s: float, to: Iterable[str] | None = None) -> None:
        wanted = None if to is None else set(to)
        # the loop thread decides which queues to wait for: frames sent just before were queued there first
        destinations = self._call(self._destinations(wanted), timeout_s)
        try:
            self._call(self._drain(destinations), timeout_s)
        except TimeoutError:
            raise TransportTimeout(
                f"{self.device}: frames to {', '.join(sorted(destinations))} not sent within {timeout_s:g} s"
            ) from None
        for destination in sorted(destinations & set(self._failures)):
            raise PeerUnreachable(*self._failures.pop(destination))

    async def _destinations(self, wanted: set[str] | None) -> set[str]:
        return {d for d, _ in self._queues} | set(self._failures) if wanted is None else wanted

    async def _drain(self, destinations: set[str]) -> None:
        for (to, _), queue in list(self._queues.items()):
            if to in destinations:
                await queue.join()

    # -- receiving ----------------------------------------------------------------------------
    async def _serve(self, stream: Stream, accepted: bool = False) -> None:
        """Read frames off one stream until it ends; garbage or an oversize frame closes it. A stream accepted
        from a peer that proved who it is (or punched with it) may carry frames back to it (`_accepted_stream`)."""
        inbox, incoming = self.inbox, set()
        opener = stream.authenticated if accepted else None
        if opener is not None:
            self._accepted[opener].append(stream)
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
                    inbox.refuse(header, reason or "over the frame limit", "; connection closed", stream.authenticated)
                    return
                if reason is not None:
                    await stream.read_exactly(header.payload_bytes)
                    inbox.refuse(header, reason, blame=stream.authenticated)
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
                self.unreached.pop(header.sender, None)
                inbox.offer(header, payload, check)
        except FrameError as error:
            inbox.reject(stream.authenticated or stream.remote, f"garbage on the stream: {error}; connection closed")
        except ConnectionError as error:
            log.info("%s: stream from %s ended inside a frame: %s", self.device, stream.remote, error)
        finally:
            for sender in incoming:
                self._incoming[sender].discard(stream)
            if opener is not None:
                self._accepted[opener].remove(stream)
            stream.close()


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
