"""Per-sender token buckets: how much one peer may make this one do (serve state, answer probes).

A `Rate` lets a sender take up to `burst` at once and `per_s` a second after that. `TokenBuckets` keeps
one bucket per sender. A sender that asks past its limit is refused and charged all the same (down to
a floor), so one that keeps asking stays refused, while one that backs off is served again after a
while. How far past its limit a sender has gone, in bursts, tells an honest overshoot (a peer that
asked a little too much once: refused as `Late`, no one's fault, not counted) from a flood (more than
`EXCESSIVE_BURSTS` past: refused and counted as misbehaving, see `Inbox.reject`).

Every call is O(1); a sender's bucket is forgotten once it has refilled, so the table holds only the
senders that asked recently. The clock is handed in, so tests step it by hand.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hetpeer.peer.transport.inbox import Late
from hetpeer.protocol.frame import FrameHeader

EXCESSIVE_BURSTS = 1.0  # past this (a sender that asked over twice what its rate allows), a refusal counts against it
DEBT_BURSTS = 2.0  # a sender's debt stops here: one that stops asking is served again within (1 + this) bursts' refill
PRUNE_AT = 1024  # senders held before full buckets are swept out


@dataclass(frozen=True, slots=True)
class Rate:
    """Up to `burst` at once, then `per_s` a second (in whatever unit the caller charges: requests, bytes)."""

    per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (0 < self.per_s < math.inf and 0 < self.burst < math.inf):
            raise ValueError(f"a rate needs a positive, finite per_s and burst, got {self.per_s}, {self.burst}")


class TokenBuckets:
    """One token bucket per sender, all at `rate`; thread-safe (frames are screened on transport threads).

    `rate` may be replaced (a peer that takes on a larger stage may serve more): buckets then refill
    towards the new burst, and a bucket above it is cut to it at its next use."""

    def __init__(self, rate: Rate, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # sender -> (tokens, clock when they were counted)
        self._lock = threading.Lock()

    def take(self, sender: str, cost: float = 1.0) -> float:
        """Charge `sender` `cost`: 0.0 when it was within its limit (serve it), else how far past the
        limit it now is, in bursts (> 0: refuse it)."""
        if not 0 <= cost < math.inf:
            raise ValueError(f"a cost must be finite and not negative, got {cost}")
        with self._lock:
            now, rate = self.clock(), self.rate
            tokens = self._tokens(sender, now, rate)
            if tokens >= cost:
                self._buckets[sender] = (tokens - cost, now)
                over = 0.0
            else:
                tokens = max(tokens - cost, -DEBT_BURSTS * rate.burst)
                self._buckets[sender] = (tokens, now)
                over = -tokens / rate.burst
            if len(self._buckets) > PRUNE_AT:
                self._prune(now, rate)
            return over

    def available(self, sender: str) -> float:
        """What `sender` may take now without being refused (negative: its debt)."""
        with self._lock:
            return self._tokens(sender, self.clock(), self.rate)

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, sender: str, now: float, rate: Rate) -> float:
        tokens, at = self._buckets.get(sender, (rate.burst, now))
        return min(rate.burst, tokens + max(0.0, now - at) * rate.per_s)

    def _prune(self, now: float, rate: Rate) -> None:
        """Forget the senders whose buckets have refilled: a full bucket is the same as none."""
        for sender in [s for s in self._buckets if self._tokens(s, now, rate) >= rate.burst]:
            del self._buckets[sender]


def refusal(over: float, reason: str) -> str | None:
    """What a frame policy returns for a sender `over` its limit (`TokenBuckets.take`): None within it;
    `reason` as a `Late` refusal (logged, not counted) for an overshoot of up to `EXCESSIVE_BURSTS`;
    `reason` itself (counted against the sender) past that."""
    if over <= 0:
        return None
    return reason if over > EXCESSIVE_BURSTS else Late(reason)


def screen_request(header: FrameHeader, known: Callable[[str], bool], buckets: TokenBuckets, what: str, shape: str
                   ) -> str | None:
    """The frame policy for a request of int64 values (`what`, e.g. "state request", of `shape` in words, e.g.
    "three int64"): from a known peer, of that shape, within its sender's request rate."""
    if not known(header.sender):
        return f"{header.sender} is not a known peer of the swarm"
    count = {"three": 3, "four": 4}[shape.split()[0]]
    if header.shape != (count,) or header.dtype != "int64":
        return f"a {what} is {shape}"
    rate = buckets.rate
    return refusal(buckets.take(header.sender), f"over {rate.burst:.0f} {what}s at once or {rate.per_s:.3g} a second "
                                                f"from {header.sender}")


def in_bytes(count: float) -> str:
    """A number of bytes for people: '320 B', '1.5 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.3g} B"
