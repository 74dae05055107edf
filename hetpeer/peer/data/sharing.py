"""Shards from other peers: a first-stage peer serves the verified shards it holds, and asks its stage's group
for a shard before the organizer's URL.

The lanes of a swarm read the same block of shards at the same time (`order.py`), so a first-stage peer that
joins finds what it needs next at its group's other members, over links the plan already uses, and the
organizer's server carries a shard once per swarm rather than once per lane.

Protocol: a `shard_request` frame is int64 [dataset, shard, offset, length]: bytes [offset, offset + length)
of shard `shard` (the manifest's training shards, then its validation shards) of the dataset whose
manifest's sha256 begins with `dataset`'s 8 bytes (big-endian, sign bit cleared), `length` at most
`CHUNK_BYTES`; the request id travels as the step and the chunk number as the micro-batch. The answer is a
`shard` frame of exactly that many uint8, or of none when the peer does not hold the shard. The asker asks a
peer for the first chunk alone and for the rest once that one came, takes only the chunks it asked of that
peer (one that comes after its request was given up is dropped as late, not counted against the sender), checks the whole shard's sha256 against the manifest, and on a
mismatch rejects the peer (counted as misbehaving: `Inbox.reject`) and asks the next one. A server limits
the requests and bytes it serves to each sender (`ratelimit.TokenBuckets`).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import threading
import time
from typing import Callable, Sequence

import torch

from hetpeer.peer.data.fetch import ShardStore
from hetpeer.peer.ratelimit import Rate, TokenBuckets, refusal, screen_request
from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Late, PeerUnreachable, TransportTimeout
from hetpeer.protocol.dataset import Shard
from hetpeer.protocol.frame import FrameHeader

log = logging.getLogger("hetpeer.peer")
CHUNK_BYTES = 4 << 20
REQUESTS = Rate(per_s=64.0, burst=256.0)  # chunk requests a sender may make
SERVED = Rate(per_s=64e6, burst=256 << 20)  # bytes served to a sender: a block of shards at once, then 64 MB/s
FINISHED_KEPT = 256  # requests remembered after they ended, so that their stragglers are dropped as late
_request_ids = itertools.count(int(time.time()) % 2**31)


def dataset_tag(name: str) -> int:
    """The int64 that names a dataset (its manifest's sha256) in requests."""
    return int(name[:16], 16) & (2**63 - 1)


class ShardServer:
    """One per transport: serves the shards `offer`ed stores hold, and keeps the chunks this peer asked for."""

    def __init__(self, transport: Transport, device_id: str, known: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport, self.device_id, self.known = transport, device_id, known
        self.store: ShardStore | None = None
        self.expected: dict[tuple[int, int], tuple[str, int]] = {}  # (request, chunk) -> peer, bytes
        self.finished: collections.deque[int] = collections.deque(maxlen=FINISHED_KEPT)  # requests given up or done
        self.lock = threading.Lock()
        self.requests, self.served = TokenBuckets(REQUESTS, clock), TokenBuckets(SERVED, clock)
        transport.inbox.handlers["shard_request"] = self.serve

    def offer(self, store: ShardStore | None) -> None:
        """Serve the shards of `store` (the dataset this peer reads); None: none."""
        with self.lock:
            self.store = store

    def accept(self, header: FrameHeader) -> str | None:
        """The policy for `shard_request` and `shard` frames."""
        if header.kind == "shard_request":
            return screen_request(header, self.known, self.requests, "shard request", "four int64")
        with self.lock:
            expected = self.expected.get((header.step, header.micro))
            finished = header.step in self.finished
        if expected is None and finished:  # a chunk that came after its request was given up on: no one's fault
            return Late(f"shard chunk {header.micro} of request {header.step} came after it was given up")
        if expected is None or expected[0] != header.sender:
            return f"shard chunk {header.micro} of request {header.step} was not asked of {header.sender}"
        if header.dtype != "uint8" or header.shape not in ((expected[1],), (0,)):
            return f"shard chunk {header.micro} is {header.dtype}{list(header.shape)}, expected uint8[{expected[1]}]"
        return None

    def serve(self, header: FrameHeader, request: torch.Tensor) -> None:
        """Answer a request from a held shard (on the transport's thread: one read of at most CHUNK_BYTES)."""
        tag, index, offset, length = (int(v) for v in request)
        with self.lock:
            store = self.store
        shards = (*store.manifest.train, *store.manifest.validation) if store is not None else ()
        path = store.held(shards[index]) if store is not None and tag == dataset_tag(store.name) and 0 <= index < len(shards) else None
        if path is not None and not (0 < length <= CHUNK_BYTES and 0 <= offset and offset + length <= store.manifest.shard_bytes(shards[index])):
            self.transport.inbox.reject(header.sender, f"shard request for bytes [{offset}, {offset + length}) of shard {index}, "
                                                       f"outside it or over {CHUNK_BYTES} bytes")
            return
        answer = torch.zeros(0, dtype=torch.uint8)
        if path is not None:
            refused = refusal(self.served.take(header.sender, length), f"shard bytes over {SERVED.burst / 2**20:.0f} MiB at "
                                                                       f"once or {SERVED.per_s / 1e6:.0f} MB/s to {header.sender}")
            if refused is not None:
                self.transport.inbox.reject(header.sender, refused)
                return
            try:
                with open(path, "rb") as handle:
                    answer = torch.frombuffer(bytearray(os.pread(handle.fileno(), length, offset)), dtype=torch.uint8)
            except OSError as error:  # evicted from the cache meanwhile: this peer holds it no longer
                log.info("%s: shard %s not served: %s", self.device_id, shards[index].file, error)
                answer = torch.zeros(0, dtype=torch.uint8)
        try:
            self.transport.send(header.sender, "shard", answer, step=header.step, micro=header.micro, epoch=header.epoch)
        except PeerUnreachable as error:
            log.info("%s: shard chunk for %s not sent: %s", self.device_id, header.sender, error)

    def fetch(self, name: str, index: int, shard: Shard, size: int, peers: Sequence[str], timeout_s: float) -> bytes | None:
        """Shard `index` of dataset `name` (`size` bytes) from the first of `peers` that has it and sends it whole
        and true; None when none does. Each peer is asked for the first chunk alone, and for the rest only once
        it sent that one: a peer without the shard costs one round trip and sends nothing unasked."""
        tag = dataset_tag(name)
        chunks = [(offset, min(CHUNK_BYTES, size - offset)) for offset in range(0, size, CHUNK_BYTES)]
        for peer in (p for p in dict.fromkeys(peers) if p != self.device_id):
            request = next(_request_ids)
            try:
                with self.lock:
                    for c, (_, length) in enumerate(chunks):
                        self.expected[(request, c)] = (peer, length)
                parts = []
                for c, (offset, length) in enumerate(chunks):
                    if c <= 1:  # chunk 0 alone; once it came, every other
                        for asked in range(c, len(chunks) if c == 1 else 1):
                            at, many = chunks[asked]
                            self.transport.send(peer, "shard_request", torch.tensor([tag, index, at, many]), step=request,
                                                micro=asked)
                    part = self.transport.recv("shard", peer, request, c, timeout_s)
                    if part.numel() == 0:
                        break  # it does not hold the shard
                    parts.append(part.numpy().tobytes())
                else:
                    data = b"".join(parts)
                    if hashlib.sha256(data).hexdigest() == shard.sha256:
                        return data
                    self.transport.inbox.reject(peer, f"sent shard {shard.file}, which does not match the manifest's sha256")
            except (TransportTimeout, PeerUnreachable) as error:
                log.info("%s: shard %s not had from %s: %s", self.device_id, shard.file, peer, error)
            finally:
                with self.lock:
                    for c in range(len(chunks)):
                        self.expected.pop((request, c), None)
                    self.finished.append(request)
        return None

def from_peers(server: ShardServer, store: ShardStore, peers: Callable[[], Sequence[str]], timeout_s: float
               ) -> Callable[[Shard], bytes | None]:
    """A `ShardStore.peers` source: each shard asked of `peers()` (read when asked: the plan's group then)."""
    index = {s.file: i for i, s in enumerate((*store.manifest.train, *store.manifest.validation))}
    return lambda shard: server.fetch(store.name, index[shard.file], shard, store.manifest.shard_bytes(shard), peers(), timeout_s)
