"""Moving a stage's state (parameters, optimizer tensors, step) to a peer that (re)joins or changes stage.

Coordinates are the whole model's: its parameters in order (embeddings, blocks, final norm, head) form
one flat vector, and every stage's parameters are a slice [start, end) of it (`ModelSpec.param_range`).
A peer's optimizer tensors are slices of equally long vectors. So a peer that moves to layers nobody
holds exactly can assemble them from several peers, each serving the part it holds.

Protocol: a request is an int64 frame [k, start, length]. k >= 0 asks for elements [start, start +
length) of state tensor k, named by `group.STATE_TENSORS` (0 parameters, 1 and 2 the Adam moments, 3
AccumAdam's window, 4 and 5 an outer-step group's anchor and outer momentum); k = -1 asks for a
description of what the donor holds there: [Adam step, start, end, step, held], held a bit mask of the
tensors it holds (bit k for tensor k). Parameters and moments are needed from someone; a tensor that no
donor holds otherwise starts afresh here (an empty window; an anchor at the parameters). Answers are
`state` frames carrying the request id as the step and the asker's chunk number as the micro-batch,
and the asker accepts only the chunks it asked of that donor, of the length it asked.

`fetch_state` takes what this peer itself still holds of the range (the stage it held before a plan
change) from memory, asks every candidate donor for a description of the rest, cuts the range into
chunks at donor boundaries, asks chunk c of the c mod D-th donor holding it (D donors serve at once). A donor that
lets a chunk pass the deadline is given up on: every chunk it still owes goes to the next holder at
once, so a donor that dies midway costs one deadline, not one per chunk. Donors answer from their live state under a
short lock, so serving never waits for averaging. Nothing lands in the asker's state until every chunk
has arrived and passed the frame checks (shape, dtype, finite values).

A donor limits what one sender may ask of it (`StateLimits`): requests, counted as they arrive (before
their payload is read), and bytes served, per second and at once. A joiner asks each donor for at most
one copy of what the donor holds (its share of the range, every chunk at once, plus one description)
once per plan change, so the limits scale with the donor's holdings: two whole copies at once, one more
every ten seconds, and never less than a floor that covers any small model outright. A legitimate
joiner never meets them; a peer that asks for the same state over and over is refused, and counted as
misbehaving once it is more than a burst past its limit (`ratelimit.refusal`).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hetpeer.peer.gossip.group import NEEDED, STATE_TENSORS, GroupSync
from hetpeer.peer.ratelimit import Rate, TokenBuckets, in_bytes, refusal, screen_request
from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import PeerUnreachable, TransportError, TransportTimeout
from hetpeer.protocol.frame import FrameHeader

log = logging.getLogger("hetpeer.gossip")
_request_ids = itertools.count(int(time.time()) % 2**31)
DESCRIBE = -1
MAX_CHUNK_ELEMS = 1 << 24  # 64 MiB of fp32: a donor serves no larger slice in one frame
HOLDINGS = 2  # the current stage and, while a plan change settles, the one before
OTHERS_WAIT_S = 0.5  # after the first description, how much longer the other donors get


def held_mask(sync: GroupSync) -> int:
    """The bit mask of `STATE_TENSORS` that `sync` holds."""
    return sum(1 << STATE_TENSORS.index(name) for name in sync.named_state())


def held_names(mask: int) -> frozenset[str]:
    return frozenset(name for k, name in enumerate(STATE_TENSORS) if mask >> k & 1)


class StateDownloadError(TransportError):
    """No donor delivered some part of the state."""


@dataclass(frozen=True, slots=True)
class Download:
    step: int  # the step the donors were at, where the joiner enters
    chunks: int
    donors: tuple[str, ...]  # the donors that served chunks
    bytes: int  # downloaded
    seconds: float
    kept: int = 0  # bytes taken from a stage this peer held before


@dataclass(frozen=True, slots=True)
class Holding:
    sync: GroupSync
    start: int  # whole-model coordinates of the stage's parameters
    end: int

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sync.state_tensors())

    @property
    def chunks(self) -> int:
        """Chunk requests a joiner asking for all of it sends: each tensor in chunks, plus a cut or two
        where other donors' ranges end."""
        per_tensor = math.ceil((self.end - self.start) / min(self.sync.chunk_elems, MAX_CHUNK_ELEMS)) + 2
        return len(self.sync.state_tensors()) * per_tensor


@dataclass(frozen=True, slots=True)
class StateLimits:
    """What one sender may ask of a donor: `copies` whole copies of what the donor holds at once (its
    requests and its bytes), one more every `refill_s` seconds, and never less than `min_requests`
    requests and `min_bytes` bytes at once (refilled at the same pace)."""

    copies: float = 2.0
    refill_s: float = 10.0
    min_requests: int = 1024
    min_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not (self.copies >= 1 and 0 < self.refill_s < math.inf and self.min_requests >= 1 and self.min_bytes >= 1):
            raise ValueError(f"state limits need copies >= 1, a positive refill_s and positive floors, got {self}")

    def rates(self, holdings: Sequence[Holding]) -> tuple[Rate, Rate]:
        """(requests, bytes) a sender may ask of a donor holding `holdings`."""
        requests = max(self.min_requests, self.copies * (sum(h.chunks for h in holdings) + 1))  # + 1: its description
        served = max(self.min_bytes, self.copies * sum(h.state_bytes for h in holdings))
        refill_s = self.copies * self.refill_s  # from empty to full
        return Rate(requests / refill_s, requests), Rate(served / refill_s, served)


class StateServer:
    """One per transport: serves state requests from this peer's holdings, within `limits` per sender,
    and keeps the chunks this peer has asked for, so that the frames it accepts are exactly those."""

    def __init__(
        self, transport: Transport, device_id: str, known: Callable[[str], bool], limits: StateLimits = StateLimits(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport, self.device_id, self.known, self.limits = transport, device_id, known, limits
        self.holdings: list[Holding] = []  # newest first
        self.expected: dict[tuple[int, int], tuple[str, tuple[int, ...], str]] = {}  # (request, chunk) -> donor, shape, dtype
        self.lock = threading.Lock()
        requests, served = limits.rates([])
        self.requests, self.served = TokenBuckets(requests, clock), TokenBuckets(served, clock)  # per sender
        transport.inbox.handlers["state_request"] = self.serve

    def hold(self, sync: GroupSync, start: int, end: int) -> None:
        if end - start != sync.flat.size:
            raise ValueError(f"range [{start}, {end}) is not the {sync.flat.size} parameters of {self.device_id}'s stage")
        with self.lock:
            self.holdings = [Holding(sync, start, end)] + [h for h in self.holdings if h.sync is not sync][: HOLDINGS - 1]
            self.requests.rate, self.served.rate = self.limits.rates(self.holdings)

    def own(self, sync: GroupSync, start: int, end: int) -> Holding | None:
        """The newest stage this peer holds besides `sync` that overlaps [start, end)."""
        with self.lock:
            return next((h for h in self.holdings if h.sync is not sync and h.start < end and start < h.end), None)

    def release(self, sync: GroupSync) -> None:
        """Stop serving `sync`'s state (a stage this peer no longer holds)."""
        with self.lock:
            self.holdings = [h for h in self.holdings if h.sync is not sync]
            self.requests.rate, self.served.rate = self.limits.rates(self.holdings)

    def accept(self, header: FrameHeader) -> str | None:
        """The policy for `state_request` and `state` frames."""
        if header.kind == "state_request":
            return screen_request(header, self.known, self.requests, "state request", "three int64")
        with self.lock:
            expected = self.expected.get((header.step, header.micro))
        if expected is None or expected[0] != header.sender:
            return f"state chunk {header.micro} of request {header.step} was not asked of {header.sender}"
        if (header.shape, header.dtype) != expected[1:]:
            return f"state chunk {header.micro} is {header.dtype}{list(header.shape)}, expected {expected[2]}{list(expected[1])}"
        return None

    def serve(self, header: FrameHeader, request: torch.Tensor) -> None:
        """Answer a request (on the transport's thread; never waits long)."""
        k, start, length = (int(v) for v in request)
        with self.lock:
            holdings = list(self.holdings)
        if k == DESCRIBE:
            holding = next((h for h in holdings if h.start < start + length and start < h.end), None)
            if holding is None:
                answer = torch.tensor([0, 0, 0, 0, 0])
            else:
                sync = holding.sync
                answer = torch.tensor([sync.state.step, holding.start, holding.end, sync.step, held_mask(sync)])
        else:
            holding = next((h for h in holdings if h.start <= start and start + length <= h.end), None)
            tensor = holding.sync.named_state().get(STATE_TENSORS[k]) if holding is not None and 0 <= k < len(STATE_TENSORS) else None
            if tensor is None or not 0 < length <= MAX_CHUNK_ELEMS:
                self.transport.inbox.reject(
                    header.sender, f"state request for tensor {k} [{start}, {start + length}), which this peer does not hold"
                )
                return
            rate = self.served.rate
            refused = refusal(
                self.served.take(header.sender, length * tensor.element_size()),
                f"state request for tensor {k} [{start}, {start + length}) over {in_bytes(rate.burst)} at once or "
                f"{in_bytes(rate.per_s)}/s served to {header.sender}",
            )
            if refused is not None:
                self.transport.inbox.reject(header.sender, refused)
                return
            with holding.sync.lock:
                offset = start - holding.start
                answer = tensor[offset : offset + length].detach().to("cpu", copy=True)
        try:
            self.transport.send(header.sender, "state", answer, step=header.step, micro=header.micro, epoch=header.epoch)
        except PeerUnreachable as error:
            log.info("%s: state for %s not sent: %s", self.device_id, header.sender, error)

    def expect(self, request: int, chunk: int, donor: str, shape: tuple[int, ...], dtype: str) -> None:
        with self.lock:
            self.expected[(request, chunk)] = (donor, shape, dtype)

    def forget(self, request: int) -> None:
        with self.lock:
            for key in [key for key in self.expected if key[0] == request]:
                del self.expected[key]


def fetch_state(
    server: StateServer, sync: GroupSync, start: int, end: int, donors: Sequence[str], timeout_s: float,
    keep_own: bool = True,
) -> Download:
    """Fill `sync` (this peer's stage, whole-model range [start, end)) from the stage this peer held
    before, where it overlaps (unless not `keep_own`: that copy is stale), and from `donors` for the rest."""
    me = server.device_id
    donors = tuple(d for d in dict.fromkeys(donors) if d != me)
    own = server.own(sync, start, end) if keep_own else None
    if not donors and own is None:
        raise StateDownloadError(f"{me} has no peer to download its state from")
    started = time.perf_counter()
    request = next(_request_ids)
    transport, epoch, tensors = server.transport, sync.plan.epoch, sync.named_state()
    try:
        held: dict[str, tuple[int, int, int, int, int]] = {}
        if own is not None:
            held[me] = (own.sync.state.step, own.start, own.end, own.sync.step, held_mask(own.sync))
        if donors and (own is None or not (own.start <= start and end <= own.end)):
            try:
                held |= _describe(server, request, donors, start, end, timeout_s)
            except StateDownloadError:
                if own is None:
                    raise  # else: the pieces no one holds are named below
        chunks = _chunks(me, held, start, end, tuple(tensors), sync.chunk_elems)
        asked = [0] * len(chunks)  # chunk c goes to holder (c + asked[c]) mod D: D donors serve at once
        failed: set[str] = set()  # donors that let a chunk time out: none of their chunks is waited for again

        def holder(c: int) -> str:
            holders = chunks[c][3]
            return holders[(c + asked[c]) % len(holders)]

        def ask(c: int) -> None:
            k, lo, length, holders = chunks[c]
            donor = holder(c)
            server.expect(request, c, donor, (length,), "fp32")
            try:
                transport.send(donor, "state_request", torch.tensor([STATE_TENSORS.index(k), lo, length]), step=request,
                               micro=c, epoch=epoch)
            except PeerUnreachable as error:
                log.info("%s: state request to %s failed: %s", server.device_id, donor, error)

        for c in range(len(chunks)):
            if chunks[c][3] != (me,):
                ask(c)
        parts: list[torch.Tensor | None] = []
        served: set[str] = set()
        for c, (k, lo, length, holders) in enumerate(chunks):
            if holders == (me,):
                parts.append(None)  # taken from its own copy when everything else is here: nothing staged
            while len(parts) == c:
                donor = holder(c)
                try:
                    parts.append(transport.recv("state", donor, request, c, timeout_s))
                    served.add(donor)
                except TransportTimeout:
                    log.info("%s: %s did not send state chunk %d; asking other donors", server.device_id, donor, c)
                    failed.add(donor)
                    for later in range(c, len(chunks)):
                        if holder(later) not in failed:
                            continue
                        while asked[later] < len(chunks[later][3]) and holder(later) in failed:
                            asked[later] += 1
                        if asked[later] >= len(chunks[later][3]):
                            raise StateDownloadError(f"{server.device_id}: {_missing(chunks[later])} within {timeout_s:g} s") from None
                        ask(later)
    finally:
        server.forget(request)
    size = end - start
    with sync.lock:
        offset = dict.fromkeys(tensors, 0)
        for (k, lo, length, _), part in zip(chunks, parts):
            if part is None:
                with own.sync.lock:
                    part = own.sync.named_state()[k][lo - own.start : lo - own.start + length]
                    tensors[k][lo - start : lo - start + length].copy_(part.to(tensors[k].device))
            else:
                tensors[k][lo - start : lo - start + length].copy_(part.to(tensors[k].device))
            offset[k] += length
        arrived = {name for name, o in offset.items() if o == size}
        assert arrived >= NEEDED and all(o in (0, size) for o in offset.values()), "the chunks cover each tensor once or not at all"
        for name in set(tensors) - arrived:
            if name != "anchor" and name != "outer_momentum":  # those `arrived` restarts
                tensors[name].zero_()
        sync.arrived(arrived)
        sync.state.step = max(adam_step for adam_step, *_ in held.values())
    step = max(s for _, _, _, s, _ in held.values())
    kept = sum(length for _, _, length, holders in chunks if holders == (me,)) * 4
    return Download(step, len(chunks), tuple(d for d in donors if d in served), size * len(arrived) * 4 - kept,
                    time.perf_counter() - started, kept)


def _missing(chunk: tuple[str, int, int, tuple[str, ...]]) -> str:
    k, lo, length, holders = chunk
    return f"no donor ({', '.join(holders)}) sent state tensor {k} [{lo}, {lo + length})"


def _describe(
    server: StateServer, request: int, donors: tuple[str, ...], start: int, end: int, timeout_s: float
) -> dict[str, tuple[int, int, int, int, int]]:
    """Donor -> (Adam step, start, end, step, held mask) for the donors that hold part of [start, end)."""
    transport = server.transport
    base = 2**31  # descriptions travel as chunk numbers past any real chunk's, one per donor
    for i, donor in enumerate(donors):
        server.expect(request, base + i, donor, (5,), "int64")
        try:
            transport.send(donor, "state_request", torch.tensor([DESCRIBE, start, end - start]), step=request, micro=base + i)
        except PeerUnreachable as error:
            log.info("%s: %s cannot be asked for state: %s", server.device_id, donor, error)
    held: dict[str, tuple[int, int, int, int, int]] = {}
    until = time.monotonic() + timeout_s  # one deadline for all: dead donors do not add up
    for i, donor in enumerate(donors):
        try:
            answer = transport.recv("state", donor, request, base + i, max(0.0, until - time.monotonic()))
        except TransportTimeout:
            continue
        adam_step, lo, hi, step, mask = (int(v) for v in answer)
        if not held:
            until = time.monotonic() + OTHERS_WAIT_S
        if hi > lo and adam_step >= 0 and step >= 0 and NEEDED <= held_names(mask):
            held[donor] = (adam_step, lo, hi, step, mask)
        elif hi > lo:
            log.info("%s: %s holds state tensors %s, not the %s a joiner needs; not asked", server.device_id, donor,
                     ", ".join(sorted(held_names(mask))) or "none", ", ".join(sorted(NEEDED)))
    if not held:
        raise StateDownloadError(
            f"{server.device_id}: no donor ({', '.join(donors)}) described its state of parameters [{start}, {end}) "
            f"within {timeout_s:g} s"
        )
    return held


def _chunks(
    device: str, held: dict[str, tuple[int, int, int, int, int]], start: int, end: int, names: tuple[str, ...],
    chunk_elems: int,
) -> list[tuple[str, int, int, tuple[str, ...]]]:
    """(tensor name, start, length, holders) pieces of at most `chunk_elems`, cut where holders change; a
    piece `device` itself holds (a stage it held before) has it as its only holder. A tensor outside `NEEDED`
    that some piece has no holder of is left out whole (it starts afresh)."""
    cuts = sorted({start, end} | {b for _, lo, hi, _, _ in held.values() for b in (lo, hi) if start < b < end})
    step = min(chunk_elems, MAX_CHUNK_ELEMS)
    chunks = []
    for name in names:
        pieces = []
        for lo, hi in zip(cuts, cuts[1:]):
            holders = tuple(d for d, (_, a, b, _, mask) in held.items() if a <= lo and hi <= b and name in held_names(mask))
            if device in holders:
                holders = (device,)
            if not holders and name in NEEDED:
                raise StateDownloadError(f"{device}: no donor holds parameters [{lo}, {hi}) (donors hold "
                                         + ", ".join(f"{d} [{a}, {b})" for d, (_, a, b, _, _) in held.items()) + ")")
            if not holders:
                break
            pieces += [(name, at, min(hi, at + step) - at, holders) for at in range(lo, hi, step)]
        else:
            chunks += pieces
    return chunks
