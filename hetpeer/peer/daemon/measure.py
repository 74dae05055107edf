"""What a volunteer's peer measures of its links to a few peers, before and while it joins (its machine:
`probe.profile_machine`).

`LinkProber` measures latency and bandwidth to another peer with short active probes
over the peer's own transport, so what it measures is the path training frames take:

    ping    micro 0, one float32   -> echoed as micro 1            latency = median round trip - fastest / 2
    data    micro 2, n float32s    -> answered by micro 3 (n, own, beside, window)

Bandwidth is what crossed the link while a data frame arrived, as its receiver saw it: from the first
read of its payload after its header to its last byte (`window`), the frame's own bytes (`own`, less
what that first read found already there: they came earlier) and the bytes of the prober's other frames
(`beside`: a link that carries training frames gives a probe only its share), over `window`. Neither
the way back (an answer that queues behind the receiver's traffic) nor a slowed ping enters it, and a
link that delivers in bursts is timed from burst to burst. The answer is checked: its parts within the
frame's size and round trip, and no more beside than the prober had on its way or sent since. A frame
whose receiver could not time it (the P2P path delivers a frame whole; a frame that came in one burst)
counts by its round trip beyond the fastest ping.

A peer answers any one prober within `ProbeLimits` (probe frames and their bytes, per second and at
once): far above what a measurement a round needs, far below what would let one peer keep another's
link or receiving loop busy.

A probe id (the frame's `step` field) is unique in the process, so probes of several peers at once never
mix. Each measurement is bounded in bytes (`budget_bytes`) and in time (`budget_s`): a small pilot frame
first estimates the link, and the main data frames are sized to what the link carries in `FRAME_S` (and
in half the time left), so a slow link is measured instead of timing out, without crowding out
training. `pick_targets` chooses whom to probe (neighbours, then the links measured longest ago), so a
peer's probing costs O(k) frames whatever the swarm's size.

Latency is what a training frame's hop adds to a step: the network's one-way delay and the two thread
hand-offs of a frame, the sender's compute thread to its transport thread and the receiver's transport
thread to its compute thread. A ping's round trip crosses those two hand-offs once each (the prober's
thread out and back in) and the network twice, so a hop is about a typical round trip less one network
crossing: the median ping less half the fastest (which stands for the crossing, hand-offs at their
quickest included). Half the fastest ping alone missed the hand-offs' usual wait: in the 8-peer demo,
frames between stages took 2.3 ms median and 3.5 ms mean from send to arrival where it said 1 to 1.5 ms,
and first plans ran 1.35 to 1.58 times their prediction, 1.23 to 1.34 with this estimate (docs/swarm.md).
Bandwidth is the median of three frames (`estimate_link`), and a transfer too short to tell from timing
noise counts as `RESOLUTION_S`: a fast link reads as "at least this fast", never as a near-infinite rate.
`LinkHistory` then announces, per peer, the median of the last few rounds, so one bad round does not
move the plan.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy
import torch

from hetpeer.peer.ratelimit import Rate, TokenBuckets, in_bytes, refusal
from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Late, PeerUnreachable, TransportError
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.records import MAX_LINKS, LinkMeasurement

log = logging.getLogger("hetpeer.peer")

PING, PONG, DATA, DATA_ACK = range(4)  # the `micro` field of probe frames
PILOT_BYTES = 64 << 10  # the first data frame, at most; it sizes the main one
PILOT_SHARE = 8  # the pilot takes at most 1/8 of the byte budget
DATA_SAMPLES = 3  # data frames per measurement; the median counts
FRAME_S = 0.1  # a main data frame holds the link about this long: long enough to time, short enough not to crowd out training
RESOLUTION_S = 1e-4  # a data frame's time on the wire is taken to be at least this: shorter is lost in timing noise
HISTORY_ROUNDS = 3  # rounds of measurements a peer's announced figure is the median of
_probe_ids = itertools.count(1)  # shared by every prober in the process: replies never cross
_probe_ids_lock = threading.Lock()


class ProbeError(TransportError):
    """A link could not be measured within its budget: the peer did not answer, or is unreachable."""


@dataclass(frozen=True, slots=True)
class ProbeLimits:
    """What one peer may make this one answer. A measurement sends `pings` + 1 + `DATA_SAMPLES` probe
    frames (7 by default) carrying at most (1 + `DATA_SAMPLES`) x `max_probe_bytes` (the most this peer
    takes in a frame), and a peer measures each target once a round, every `probe_every` heartbeats (10 s
    by default). So the defaults allow nine measurements back to back and two a second, sustained: 16
    frames a second, 64 at once; and the bytes of one of the largest measurements a second, four at once."""

    frames: Rate = Rate(per_s=16.0, burst=64.0)
    measurements_per_s: float = 1.0
    burst_measurements: float = 4.0

    def __post_init__(self) -> None:
        if not (0 < self.measurements_per_s < math.inf and 0 < self.burst_measurements < math.inf):
            raise ValueError(f"probe limits need positive, finite measurements, got {self}")

    def bytes_rate(self, max_probe_bytes: int) -> Rate:
        largest = (1 + DATA_SAMPLES) * max_probe_bytes
        return Rate(self.measurements_per_s * largest, self.burst_measurements * largest)


class LinkProber:
    """Answers other peers' probes (within `limits` per sender) and measures links to them, over `transport`.

    Probe frames are served on the transport thread (an inbox handler): requests are answered at once,
    replies wake the `measure` waiting for them. `accept` is the frame policy for kind "probe"."""

    def __init__(
        self, transport: Transport, device_id: str, max_probe_bytes: int = 1 << 20, limits: ProbeLimits = ProbeLimits(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_probe_bytes < 4:
            raise ValueError(f"max_probe_bytes must allow one float32 (4 bytes), got {max_probe_bytes}")
        self.transport, self.device_id, self.max_probe_bytes = transport, device_id, max_probe_bytes
        self.frames = TokenBuckets(limits.frames, clock)  # probe requests per sender
        self.received = TokenBuckets(limits.bytes_rate(max_probe_bytes), clock)  # their payload bytes per sender
        self._replies: dict[tuple[str, int, int], torch.Tensor | None] = {}  # (peer, probe id, micro) awaited
        self._arrived = threading.Condition()

    def install(self) -> None:
        self.transport.inbox.handlers["probe"] = self._serve

    def uninstall(self) -> None:
        self.transport.inbox.handlers.pop("probe", None)

    def accept(self, header: FrameHeader) -> str | None:
        """Why a probe frame must be refused (before its payload is read), or None to take it."""
        if header.kind != "probe":
            return f"{header.kind} is not a probe frame"
        if header.micro not in (PING, PONG, DATA, DATA_ACK):
            return f"probe micro {header.micro} is not one of 0-3"
        if header.dtype != "fp32" or header.codec != "raw":
            return f"probe frames are raw fp32, got {header.dtype} as {header.codec}"
        if len(header.shape) != 1:
            return f"probe frames are 1-D, got shape {header.shape}"
        least, most = {DATA: (1, self.max_probe_bytes // 4), DATA_ACK: (4, 4)}.get(header.micro, (1, 1))
        if not least <= header.shape[0] <= most:
            return f"probe micro {header.micro} carries {least} to {most} float32s, got {header.shape[0]}"
        if header.micro in (PONG, DATA_ACK):
            with self._arrived:
                awaited = (header.sender, header.step, header.micro) in self._replies
            if not awaited:
                with _probe_ids_lock:
                    issued = header.step < _peek_probe_id()
                # a reply after its probe gave up is no one's fault; one to a probe never sent is
                return Late("reply after its probe gave up") if issued else "reply to a probe never sent"
            return None
        frames, received = self.frames.rate, self.received.rate
        refused = refusal(self.frames.take(header.sender),
                          f"over {frames.burst:.0f} probes at once or {frames.per_s:.3g} a second from {header.sender}")
        if refused is None:
            refused = refusal(self.received.take(header.sender, header.payload_bytes),
                              f"over {in_bytes(received.burst)} of probes at once or {in_bytes(received.per_s)}/s "
                              f"from {header.sender}")
        return refused

    def measure(self, peer: str, budget_bytes: int = 1 << 20, budget_s: float = 2.0, pings: int = 3) -> LinkMeasurement:
        """Latency and bandwidth from this peer to `peer`, spending at most `budget_bytes` of probe data
        and `budget_s` seconds; ProbeError (naming the peer) when it cannot.

        Cost: `pings` round trips, a pilot data frame of at most `PILOT_BYTES`, then up to `DATA_SAMPLES`
        data frames sharing the rest of the byte budget, each sized to hold the link about `FRAME_S` (at
        least twice the pilot)."""
        if peer == self.device_id:
            raise ValueError(f"{self.device_id} cannot probe itself")
        if budget_bytes < 4 or not budget_s > 0 or pings < 1:
            raise ValueError(f"need budget_bytes >= 4, budget_s > 0 and pings >= 1, got {budget_bytes}, {budget_s}, {pings}")
        deadline = time.perf_counter() + budget_s
        ping_s = [self._round_trip(peer, PING, torch.zeros(1), deadline, budget_s)[0] for _ in range(pings)]
        total_bytes = min(budget_bytes, DATA_SAMPLES * self.max_probe_bytes + PILOT_BYTES)
        pilot_bytes = min(PILOT_BYTES, total_bytes // PILOT_SHARE) // 4 * 4
        each_bytes = min((total_bytes - pilot_bytes) // DATA_SAMPLES, self.max_probe_bytes)
        if not pilot_bytes:  # a budget too small for a pilot: one frame of what there is
            size = max(4, min(total_bytes, self.max_probe_bytes) // 4 * 4)
            return estimate_link(ping_s, [self._data(peer, size, deadline, budget_s)], size)
        pilot = estimate_link(ping_s, [self._data(peer, pilot_bytes, deadline, budget_s)], pilot_bytes)
        # The pilot only sizes the main frames: its transfer is short beside timing noise. The main frames
        # hold the link about FRAME_S at the pilot's rate, but are at least twice the pilot, and what they
        # take must fit half the time left; being the largest, their estimate counts.
        rate = pilot.bandwidth_bytes_per_s
        fits = int(rate * (deadline - time.perf_counter()) / 2 / DATA_SAMPLES)
        each_bytes = min(each_bytes, fits, max(int(rate * FRAME_S), 2 * pilot_bytes)) // 4 * 4
        if each_bytes <= pilot_bytes:
            return pilot
        sent, unsent = self.transport.sent[peer], self.transport.unsent_bytes(peer)
        frames = [self._data(peer, each_bytes, deadline, budget_s) for _ in range(DATA_SAMPLES)]
        # the receiver's word for what else crossed: at most what was on its way at the start or sent since
        could_cross = self.transport.sent[peer] - sent + unsent
        claimed = sum(f.beside_bytes for f in frames)
        if claimed > could_cross:
            log.info("%s: %s claims %.0f bytes of other frames crossed beside probe frames, at most %d could",
                     self.device_id, peer, claimed, could_cross)
            frames = [replace(f, beside_bytes=f.beside_bytes * could_cross / claimed) for f in frames]
        return estimate_link(ping_s, frames, each_bytes)

    def measure_many(
        self, peers: Sequence[str], budget_bytes: int = 1 << 20, budget_s: float = 2.0, pings: int = 3
    ) -> dict[str, LinkMeasurement]:
        """`measure` each peer in turn (one at a time, so probes do not share this peer's uplink);
        peers that fail are logged and left out."""
        links = {}
        for peer in peers:
            try:
                links[peer] = self.measure(peer, budget_bytes, budget_s, pings)
            except ProbeError as error:
                log.warning("%s: %s", self.device_id, error)
        return links

    def _data(self, peer: str, size_bytes: int, deadline: float, budget_s: float) -> Transfer:
        """One data frame of `size_bytes`: its round trip, and its arrival as the receiver saw it, where
        that can be true (its own bytes within the frame, other bytes not negative, its time within the
        round trip); else its round trip alone."""
        round_trip_s, reply = self._round_trip(peer, DATA, torch.ones(size_bytes // 4), deadline, budget_s)
        floats, own, beside, window = (float(x) for x in reply)
        if floats == size_bytes // 4 and 0 <= own <= size_bytes and beside >= 0 and 0 <= window <= round_trip_s:
            return Transfer(round_trip_s, own, beside, window)
        return Transfer(round_trip_s)

    def _round_trip(
        self, peer: str, micro: int, tensor: torch.Tensor, deadline: float, budget_s: float
    ) -> tuple[float, torch.Tensor]:
        with _probe_ids_lock:
            probe_id = next(_probe_ids)
        slot = (peer, probe_id, micro + 1)
        with self._arrived:
            self._replies[slot] = None
        try:
            started = time.perf_counter()
            self.transport.send(peer, "probe", tensor, step=probe_id, micro=micro)
            with self._arrived:
                while self._replies[slot] is None:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise ProbeError(f"{self.device_id}: {peer} did not answer probe {probe_id} within {budget_s:g} s")
                    self._arrived.wait(left)
                return time.perf_counter() - started, self._replies[slot]
        except PeerUnreachable as error:
            raise ProbeError(f"{self.device_id}: cannot probe {peer}: {error}") from None
        finally:
            with self._arrived:
                self._replies.pop(slot, None)

    def _serve(self, header: FrameHeader, tensor: torch.Tensor) -> None:
        """On the transport thread: answer a request, or hand a reply to the probe waiting for it."""
        if header.micro in (PONG, DATA_ACK):
            slot = (header.sender, header.step, header.micro)
            with self._arrived:
                if slot in self._replies:  # else its probe gave up while the reply was on the way
                    self._replies[slot] = tensor
                    self._arrived.notify_all()
            return
        if header.micro == PING:
            reply = tensor
        else:  # what crossed while it arrived, when its transport could see it arrive
            arrival = self.transport.inbox.arrivals.pop(header.sender, None)
            own = beside = window = 0.0
            if arrival is not None:
                own = float(tensor.numel() * 4 - arrival.first_bytes)
                beside = float(self.transport.arrived_bytes(header.sender) - arrival.others_before)
                window = arrival.end_s - arrival.first_s
            reply = torch.tensor([float(tensor.numel()), own, beside, window])
        try:
            self.transport.send(header.sender, "probe", reply, step=header.step, micro=header.micro + 1)
        except PeerUnreachable as error:
            log.info("%s: cannot answer probe %d of %s: %s", self.device_id, header.step, header.sender, error)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One data frame: its round trip and, as its receiver saw it arrive, its own bytes after the first
    read, the bytes of the prober's other frames meanwhile, and the time from that first read to its end."""

    round_trip_s: float
    own_bytes: float = 0.0
    beside_bytes: float = 0.0
    window_s: float = 0.0

    def rate(self, data_bytes: int, fastest_ping_s: float) -> float:
        """What the link carries by this frame: what crossed while it arrived, where its receiver timed at
        least a quarter of it; else its size over its round trip beyond the fastest ping (at least
        `RESOLUTION_S`)."""
        if self.window_s >= RESOLUTION_S and self.own_bytes >= data_bytes / 4:
            return (self.own_bytes + self.beside_bytes) / self.window_s
        return data_bytes / max(self.round_trip_s - fastest_ping_s, RESOLUTION_S)


def estimate_link(ping_s: Sequence[float], data: Sequence[Transfer], data_bytes: int) -> LinkMeasurement:
    """A link from pings of one float and data frames of `data_bytes` each: latency is the median ping less
    half the fastest (a hop's network crossing and its hand-offs as they usually go: the module's docstring);
    the median frame's rate counts for bandwidth. Noise only adds time to a round trip, so the fastest ping
    is the one a frame's time on the wire is reckoned beyond."""
    if not ping_s or not data or data_bytes < 1:
        raise ValueError(f"need pings, data round trips and a positive size, got {list(ping_s)}, {list(data)}, {data_bytes}")
    fastest_ping = min(ping_s)
    latency_s = statistics.median(ping_s) - fastest_ping / 2
    return LinkMeasurement(latency_s, statistics.median(t.rate(data_bytes, fastest_ping) for t in data))


class LinkHistory:
    """The links a peer announces: per peer, the median of its last `rounds` measurements (latency and
    bandwidth each), so one round spoiled by a busy machine does not change what the coordinator plans
    with; until there are that many, the fastest (noise only slows, and two rounds cannot outvote a
    spoiled one: a first round made while the machine was still starting up would otherwise stand); at
    most `limit` peers, the most recently measured (a record carries at most `MAX_LINKS`).
    Not thread-safe: its owner holds a lock."""

    def __init__(self, rounds: int = HISTORY_ROUNDS, limit: int = MAX_LINKS) -> None:
        if rounds < 1 or limit < 0:
            raise ValueError(f"need rounds >= 1 and limit >= 0, got {rounds}, {limit}")
        self.rounds, self.limit = rounds, limit
        self._seen: dict[str, list[LinkMeasurement]] = {}  # oldest measured first

    def add(self, measured: Mapping[str, LinkMeasurement]) -> None:
        for peer, link in measured.items():
            self._seen[peer] = (self._seen.pop(peer, []) + [link])[-self.rounds:]
        for stale in list(self._seen)[: max(0, len(self._seen) - self.limit)]:
            del self._seen[stale]

    def keep_only(self, peers: Iterable[str]) -> None:
        """Forget the peers not in `peers` (they left the swarm)."""
        keep = set(peers)
        for gone in set(self._seen) - keep:
            del self._seen[gone]

    def oldest_first(self) -> list[str]:
        """The peers it holds measurements of, the least recently measured first."""
        return list(self._seen)

    def current(self) -> dict[str, LinkMeasurement]:
        found = {}
        for peer, seen in self._seen.items():
            latency, bandwidth = [m.latency_s for m in seen], [m.bandwidth_bytes_per_s for m in seen]
            if len(seen) < self.rounds:
                found[peer] = LinkMeasurement(min(latency), max(bandwidth))
            else:
                found[peer] = LinkMeasurement(statistics.median(latency), statistics.median(bandwidth))
        return found


def describe_links(links: Mapping[str, LinkMeasurement]) -> str:
    """One line for people: each peer with its one-way latency and bandwidth, in peer order."""
    return ", ".join(
        f"{peer} {link.latency_s * 1e3:.2f} ms {_rate(link.bandwidth_bytes_per_s)}" for peer, link in sorted(links.items())
    )


def _rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def pick_targets(
    me: str, known: Sequence[str], preferred: Sequence[str], k: int, rng: numpy.random.Generator, measured: Sequence[str] = ()
) -> list[str]:
    """Up to `k` peers to probe, never `me`: the `preferred` ones (lane and group neighbours) first, in order,
    filling at most half of `k` (rounded up) when there are others; the rest goes to the peers measured
    longest ago: first those never measured (a uniform sample), then `measured` in its order (least recent
    first). So every known peer is measured within a few rounds, and the coordinator plans from measured
    links rather than guesses, whichever plan runs. The same seed gives the same targets."""
    if k < 0:
        raise ValueError(f"k must not be negative, got {k}")
    others = set(known) - {me}
    near = list(dict.fromkeys(p for p in preferred if p != me))
    chosen = near[: k if others <= set(near) else -(-k // 2)]
    taken = set(chosen) | {me}
    never = sorted(others - taken - set(measured))  # sorted: the sample depends on the seed, not on the order given
    want = min(k - len(chosen), len(never))
    if want > 0:
        chosen += [never[i] for i in rng.choice(len(never), size=want, replace=False)]
    stale = [p for p in dict.fromkeys(measured) if p in others and p not in chosen]
    return chosen + stale[: k - len(chosen)]


def _peek_probe_id() -> int:
    """The next probe id, without taking it (the caller holds `_probe_ids_lock`)."""
    return int(repr(_probe_ids)[len("count("):-1])
