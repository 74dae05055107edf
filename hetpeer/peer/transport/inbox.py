"""The receiving side of a peer: frames are checked, then wait in a mailbox until the worker asks.

Every frame passes three gates before anything uses it: the frame limit (checked on the header,
before a byte of payload is read), the receiver's policy (what the plan says this peer should get:
sender, kind, shape, dtype, step), and the payload itself (checksum, finiteness). A frame that fails
is dropped with a logged reason and its claimed sender is counted as misbehaving; the worker never
sees it. `recv` blocks for one expected frame with a deadline, so a silent peer raises
`TransportTimeout` instead of hanging.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hetpeer.peer.transport.codec import PayloadCheck, decode
from hetpeer.protocol.frame import FrameError, FrameHeader

log = logging.getLogger("hetpeer.transport")

Policy = Callable[[FrameHeader], "str | None"]
Key = tuple[str, str, int, int]  # kind, sender, step, micro-batch


class TransportError(RuntimeError):
    """Moving tensors between peers failed."""


class TransportTimeout(TransportError, TimeoutError):
    """An expected frame did not arrive before its deadline."""


class PeerUnreachable(TransportError):
    """No link reached the peer, or the connection to it broke and could not be rebuilt; `how`, one of
    `protocol.reach.FAILURES`."""

    def __init__(self, message: str, how: str = "lost") -> None:
        super().__init__(message)
        self.how = how


class Interrupted(TransportError):
    """A wait given up on purpose: the peer has a new plan to follow."""


class Late(str):
    """A refusal that is no one's fault: a frame for a step this peer has left behind, a plan it does not run
    (yet), or a request a little past a rate limit. Not counted against the sender."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """How a probe frame's payload came in off a stream: the clock (`time.perf_counter`) at the first
    read after its header and at its end, the payload bytes that first read found already there, and
    the bytes of other frames from its sender received before that first read."""

    first_s: float
    end_s: float
    first_bytes: int
    others_before: int


def accept_all(header: FrameHeader) -> str | None:
    return None


class Inbox:
    def __init__(self, device: str, *, max_frame_bytes: int, policy: Policy = accept_all) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.device = device
        self.max_frame_bytes = max_frame_bytes
        self.policy = policy
        self.misbehaving: collections.Counter[str] = collections.Counter()
        self.rejections: collections.deque[tuple[str, str]] = collections.deque(maxlen=256)
        self.late = 0  # frames dropped because they came after their step was done
        self.unauthenticated = 0  # connections closed before a frame because they did not prove their sender
        self.received: collections.Counter[str] = collections.Counter()  # payload bytes arrived per sender, probes aside
        self.arrivals: dict[str, Arrival] = {}  # per sender, its last probe frame off a stream, for the probe handler
        self.handlers: dict[str, Callable[[FrameHeader, torch.Tensor], None]] = {}  # kinds served, not stored
        self._frames: dict[Key, torch.Tensor] = {}
        self._headers: dict[Key, FrameHeader] = {}  # of the frames waiting, to screen them again under a new plan
        self._arrived = threading.Condition()
        self._interrupt: str | None = None

    def screen(self, header: FrameHeader, authenticated: str | None = None) -> str | None:
        """Why a frame must be refused before its payload is read, or None to read it."""
        if header.payload_bytes > self.max_frame_bytes:
            return f"payload of {header.payload_bytes} bytes is over the {self.max_frame_bytes}-byte frame limit"
        if authenticated is not None and header.sender != authenticated:
            return f"sender claims to be {header.sender!r} on a stream from {authenticated!r}"
        try:
            return self.policy(header)
        except Exception as error:  # a policy bug must not kill the receiving loop
            log.exception("frame policy failed")
            return f"policy failed: {error!r}"

    def offer(self, header: FrameHeader, payload: memoryview | bytearray, check: PayloadCheck | None = None) -> bool:
        """Decode and deliver a screened frame (its payload checked as it arrived when `check` is given);
        False (logged, counted) when the payload is bad."""
        try:
            tensor = decode(header, payload, check)
        except FrameError as error:
            self.reject(header.sender, f"{header.kind} step {header.step} micro {header.micro}: {error}")
            return False
        handler = self.handlers.get(header.kind)
        if handler is not None:
            handler(header, tensor)
            return True
        key = (header.kind, header.sender, header.step, header.micro)
        with self._arrived:
            waiting = self._headers.get(key)
            # a plan that restarts from a step the one before it reached sends that step again: the newer
            # epoch's frame takes the place of the older one's, which its receiver will discard on switching
            if waiting is None or waiting.epoch < header.epoch:
                self._frames[key] = tensor
                self._headers[key] = header
                self._arrived.notify_all()
                return True
        what = f"{header.kind} for step {header.step} micro {header.micro}"
        if waiting.epoch > header.epoch:
            self.reject(header.sender, Late(f"{what} of plan epoch {header.epoch}: one of epoch {waiting.epoch} is here"))
        else:
            self.reject(header.sender, f"duplicate {what}")
        return False

    def refuse(self, header: FrameHeader, reason: str, consequence: str = "", blame: str | None = None) -> None:
        """`reject` a screened frame, naming it, against `blame` (the device its link proved; else the sender
        it claims): a frame sent in another's name counts against the one who sent it. A `Late` reason stays late."""
        text = f"{header.kind} step {header.step} micro {header.micro}: {reason}{consequence}"
        self.reject(blame or header.sender, Late(text) if isinstance(reason, Late) else text)

    def refuse_connection(self, remote: str, reason: str) -> None:
        """A connection closed before it carried a frame: it did not prove which peer it comes from. Counted
        apart from `misbehaving`: the device it claimed may be an honest one that someone impersonates."""
        self.unauthenticated += 1
        self.rejections.append((remote, reason))
        if self.unauthenticated <= 10 or self.unauthenticated % 100 == 0:  # a stranger can open connections fast
            log.warning("%s refused connection %d from %s: %s", self.device, self.unauthenticated, remote, reason)

    def reject(self, sender: str, reason: str) -> None:
        if isinstance(reason, Late):
            self.late += 1
            log.debug("%s dropped a late frame from %s: %s", self.device, sender, reason)
            return
        self.misbehaving[sender] += 1
        self.rejections.append((sender, reason))
        log.warning("%s rejected a frame from %s: %s", self.device, sender, reason)

    def recv(self, kind: str, sender: str, step: int, micro: int, timeout_s: float) -> torch.Tensor:
        return self.take(kind, sender, step, micro, timeout_s)[1]

    def take(self, kind: str, sender: str, step: int, micro: int, timeout_s: float) -> tuple[FrameHeader, torch.Tensor]:
        """`recv`, with the frame's header (its checksum says which bytes came)."""
        key = (kind, sender, step, micro)
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while key not in self._frames:
                if self._interrupt is not None:
                    raise Interrupted(f"{self.device}: stopped waiting for {kind} from {sender}: {self._interrupt}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout(
                        f"{self.device}: no {kind} for step {step} micro-batch {micro} "
                        f"from {sender} within {timeout_s:g} s"
                    )
                self._arrived.wait(left)
            return self._headers.pop(key), self._frames.pop(key)

    def interrupt(self, reason: str) -> None:
        """Make every wait, now and until `resume`, raise `Interrupted` (frames already here stay)."""
        with self._arrived:
            self._interrupt = reason
            self._arrived.notify_all()

    def resume(self) -> None:
        with self._arrived:
            self._interrupt = None

    def discard_before(self, step: int, epoch: int | None = None, running: int | None = None,
                       keep: Callable[[Key], bool] | None = None) -> int:
        """Drop frames of steps before `step` (left by a lane that timed out) and, given `epoch`, frames sent
        under an earlier plan epoch (left by a plan this peer no longer runs); how many were dropped. Given the
        `running` plan epoch, frames of newer plans are kept whatever step they name: a plan that starts below
        the step this peer has reached under the running one is read from its own start, after the switch. Frames
        that `keep` says are still wanted (a check gathering its frames across steps) stay whatever their step."""
        with self._arrived:
            stale = [
                key for key in self._frames
                if (key[2] < step and (running is None or self._headers[key].epoch <= running)
                    and not (keep is not None and keep(key)))
                or (epoch is not None and self._headers[key].epoch < epoch)
            ]
            for key in stale:
                del self._frames[key]
                del self._headers[key]
        return len(stale)

    def rescreen(self) -> int:
        """Run the frames waiting here through the policy again (a peer that takes frames of a plan it
        has not read yet checks them once it has); drop, and count against their senders, those it
        refuses. How many were dropped."""
        with self._arrived:
            waiting = list(self._headers.items())
        dropped = 0
        for key, header in waiting:
            reason = self.screen(header)
            if reason is not None:
                with self._arrived:
                    self._frames.pop(key, None)
                    self._headers.pop(key, None)
                self.refuse(header, reason)
                dropped += 1
        return dropped
