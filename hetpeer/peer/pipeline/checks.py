"""Stage checks: a member of a stage's group recomputes, now and then, a micro-batch another lane's holder of the
stage worked on, and compares what it gets with what that lane's neighbours received.

Roles, for a check of stage s in lane L at (step, micro):
- the *checker* C holds stage s in another lane. It picks the step (`LEAD` steps ahead), the lane and the micro-batch
  at random, at about the recipe's `check` share of the group's micro-batches, and a private seed for the sketches.
  The checked peer is not told.
- the *input* comes from the data (stage 0: C reads lane L's windows itself) or from lane L's previous stage U, which
  copies to C the activations and labels it sends the checked peer (`check_input`, `check_labels`), in the same codec.
- the *witnesses* are the checked peer's lane neighbours: the next stage W sketches the activations it received
  (`sketch`) and, for a middle stage, copies to C the gradient it sent back (`check_grad`); U sketches the gradient it
  received. A sketch is 64 numbers (a count sketch under C's seed), whatever the tensor's size.
C runs the stage forward on the input (and backward, from W's gradient or the loss), puts its output through the hop's
codec as the witnesses received it, and compares sketches. Once the checked peer's output is out, C asks it which input
frames it got (their checksums: an input provider that copied C another input than it sent is found out, and the check
dropped) and for a fingerprint of its weights at that step. Where the fingerprints are equal (an all-reduce group, or
right after an outer step), an honest output is matched to rounding (`EXACT`); where they differ (gossip, between
outer steps, members that entered a plan at different steps), the check is dropped: honest drift there is as large as
a lie. An output further off is *caught*: C
reports the checked peer (`caught`), and the coordinator bans it on a majority of its group, or on two partners in
turn where its group is a pair (`coordinator/gate.py`).

What a check cannot tell. A witness or an input provider that lies to C frames the checked peer; each is a lane
neighbour in another group, itself checked only for what it hands its lane. A stale output or a small perturbation
within the tolerance passes, and a checked peer that claims weights other than its partner's is judged by the looser
one. A helper asked too late (its lane already at the step) declines, and the check is
dropped, not counted against anyone.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Late, TransportError, TransportTimeout
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.plan import Plan

LEAD = 2  # steps ahead a check is asked for: its helpers have the request before their lane reaches the step
SKETCH = 256  # numbers in a sketch
# how far a recomputed output may be from what the witness received, where checker and checked hold weights of one
# fingerprint: rounding and the hop's codec (relative, in sketch norm). Where their weights differ (gossip, between
# outer steps, members that entered a plan at different steps), nothing is judged: honest outputs were seen there up to
# 1.8x their size apart, at a cosine of -0.46 with the recomputed ones, and 0.13x the size (docs/trust.md).
EXACT = 0.05
POLL_S = 0.2  # how often a checker waiting on a helper looks for its decline
AHEAD = 64  # a helper takes a request for a step at most this far ahead of its own
KEEP_STEPS = 256  # a checked peer keeps its input checksums and weights' fingerprints this many steps for its checkers
KINDS = ("check_input", "check_labels", "check_grad", "sketch", "attested")  # frames a checker gathers
WINDOW_S = 30.0  # a caught peer stays reported this long after the check that caught it
log = logging.getLogger("hetpeer.peer")


def sketch(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A count sketch of `tensor` (SKETCH fp32 numbers): each element added, with a sign, into one bucket, both drawn
    from `seed`. Its norm estimates the tensor's, and the sketch of a difference is the difference of sketches."""
    flat = tensor.detach().reshape(-1).float().cpu()
    generator = torch.Generator().manual_seed(seed)
    buckets = torch.randint(SKETCH, (flat.numel(),), generator=generator)
    signs = torch.randint(2, (flat.numel(),), generator=generator, dtype=torch.int8).float().mul_(2).sub_(1)
    return torch.zeros(SKETCH).index_add_(0, buckets, flat * signs)


def distance(seen: torch.Tensor, recomputed: torch.Tensor) -> float:
    """How far the witness's sketch is from the checker's, relative to the checker's."""
    return float((seen - recomputed).norm() / recomputed.norm().clamp_min(1e-12))




def signed(checksum: int) -> int:
    """A frame's 64-bit checksum as an int64 travels."""
    return checksum - 2**64 if checksum >= 2**63 else checksum


@dataclass(frozen=True, slots=True)
class Check:
    """One check this peer runs as checker."""

    step: int
    lane: int
    micro: int
    seed: int
    checked: str
    previous: str | None  # the input provider and witness of gradients (None at stage 0)
    next: str | None  # the witness of activations (None at the last stage)


def needed(check: Check) -> list[tuple[str, str]]:
    """The helpers' frames a check takes, as (kind, sender)."""
    frames = []
    if check.previous is not None:
        frames += [("check_input", check.previous), ("check_labels", check.previous)]
        if check.next is not None:  # a middle stage's backward starts from its next's gradient
            frames.append(("check_grad", check.next))
    return frames + [("sketch", helper) for helper in (check.next, check.previous) if helper is not None]


@dataclass(frozen=True, slots=True)
class Verdict:
    checked: str
    step: int
    micro: int
    what: str  # "activations" or "gradients"
    error: float  # relative to what the checker recomputed

    @property
    def caught(self) -> bool:
        return not self.error <= EXACT

    @property
    def words(self) -> str:
        return (f"its {self.what} of step {self.step} micro-batch {self.micro} were {self.error:.0%} off what this peer "
                f"recomputed with the same weights (allowed {EXACT:.0%})")


class Declined(Exception):
    """A helper was asked after its lane reached the step."""


DECLINE = -1  # a `check` frame's value from a helper asked too late (a request's is the seed, >= 0)
ATTESTED = ("activation", "labels", "gradient")  # the lane frames a checked peer gives the checksums of
ANSWER = len(ATTESTED) + 2  # and the fingerprint of its weights: their sum and sum of squares, as float64 bits


class Disputed(Exception):
    """A checked peer and its lane neighbour disagree on what input it got."""


class Checks:
    """A peer's part in its stage's checks under one plan: as checker of its group's other lanes, and as helper (input
    provider, witness) of the checks of its lane neighbours. `step` says which step this peer is at."""

    def __init__(self, plan: Plan, device_id: str, transport: Transport, shape: tuple[int, int], timeout_s: float,
                 step: Callable[[], int], rng: random.Random | None = None):
        self.plan, self.device_id, self.transport, self.timeout_s = plan, device_id, transport, timeout_s
        self.seq_len, self.hidden = shape
        self.step = step
        self.stage, self.lane = plan.position(device_id)
        self.last = len(plan.stages) - 1
        self.others = [l for l in range(len(plan.lanes)) if l != self.lane]  # the lanes this peer may check
        self.most_micro = max(len(plan.micro_batch_sizes(l)) for l in range(len(plan.lanes)))
        self.rng = rng or random.Random()  # private: the checked peers must not guess the checks
        self.mine: dict[int, Check] = {}  # step -> the check this peer runs then
        self.asked: dict[tuple[int, int], list[tuple[str, int]]] = {}  # (step, micro) -> [(checker, seed)], as helper
        self.declined: set[tuple[str, int, int]] = set()  # (helper, step, micro) of this peer's checks
        self.pieces: dict[int, dict[tuple[str, str], tuple[FrameHeader, torch.Tensor]]] = {}  # check step -> frames so far
        self.since: dict[int, float] = {}  # check step -> when this peer first looked for its frames
        self.sums: dict[tuple[int, int], list[int]] = {}  # (step, micro) -> checksums of the lane frames got (`ATTESTED`)
        self.prints: dict[int, tuple[int, int]] = {}  # step -> the fingerprint of this peer's weights through it
        self.verdicts: collections.deque[Verdict] = collections.deque(maxlen=256)  # the latest
        self.judged = self.failed = self.dropped = 0
        self._lock = threading.Lock()
        self._caught_at: dict[str, tuple[float, Verdict]] = {}
        self._unsent: set[str] = set()  # peers a check's frame could not leave for (said once each)
        transport.inbox.handlers["check"] = self._on_check
        transport.inbox.handlers["attest"] = self._on_attest

    # -- the checker ---------------------------------------------------------------------------------------
    @property
    def rate(self) -> float:
        """How often this peer checks: never in one stage (nothing goes along a lane), alone, or in a gossip group (its
        members never hold one fingerprint)."""
        gossip = self.plan.stages[self.stage].sync == "gossip"
        return self.plan.recipe.check if self.others and self.last > 0 and not gossip else 0.0

    def begin(self, step: int) -> None:
        """At the start of `step`: maybe ask for a check of step + LEAD (each micro-batch of the group is checked at
        about the recipe's rate, by one of the members of the other lanes)."""
        if not self.rate:
            return
        lane = self.rng.choice(self.others)
        sizes = self.plan.micro_batch_sizes(lane)
        if self.rng.random() >= min(1.0, self.rate * len(sizes)):
            return
        target, holders = step + LEAD, self.plan.lanes[lane]
        check = Check(target, lane, self.rng.randrange(len(sizes)), self.rng.getrandbits(62), holders[self.stage],
                      holders[self.stage - 1] if self.stage > 0 else None,
                      holders[self.stage + 1] if self.stage < self.last else None)
        helpers = [h for h in (check.previous, check.next) if h is not None]
        # the helpers are no neighbours of this peer in the plan: where this peer has no way to one (two peers behind
        # one router, say), the check is not asked for (`dropped`), rather than a frame that cannot leave
        if not all(self.transport.reaches(h) for h in helpers):
            self.dropped += 1
            return
        with self._lock:
            self.mine[target] = check
        seed = torch.tensor([check.seed], dtype=torch.int64)
        for helper in helpers:
            self._send(helper, "check", seed, step=target, micro=check.micro)

    def due(self, step: int) -> list[Check]:
        """This peer's checks of `step` and of earlier steps whose helpers' frames were not all here yet."""
        with self._lock:
            return [self.mine[k] for k in sorted(self.mine) if k <= step]

    def gather(self, check: Check, wait_s: float) -> dict[tuple[str, str], tuple[FrameHeader, torch.Tensor]] | None:
        """The helpers' frames for `check`, by (kind, sender), waiting up to `wait_s` for them; None while some have not
        come (they may come by a later step: a lane of a drifting group runs steps apart from this one). `Declined` if a
        helper was asked too late, `TransportTimeout` once `timeout_s` passed since the first try."""
        deadline = self.since.setdefault(check.step, time.monotonic()) + self.timeout_s
        now_deadline = min(deadline, time.monotonic() + wait_s)
        pieces = self.pieces.setdefault(check.step, {})
        for key in needed(check):
            if key not in pieces:
                try:
                    pieces[key] = self.receive(*key, check, now_deadline)
                except TransportTimeout:
                    if time.monotonic() >= deadline:
                        raise TransportTimeout(f"no {key[0]} of step {check.step} from {key[1]} for a check within "
                                               f"{self.timeout_s:g} s") from None
                    return None
        return pieces

    def keeps(self, key: tuple[str, str, int, int]) -> bool:
        """Whether the inbox keeps a frame (kind, sender, step, micro) past its step: one for a check still gathering."""
        check = self.mine.get(key[2])
        return key[0] in KINDS and check is not None and key[3] == check.micro

    def done(self, check: Check) -> None:
        """Forget `check`, and whatever frames for it came but were not used."""
        with self._lock:
            self.mine.pop(check.step, None)
            self.pieces.pop(check.step, None)
            self.since.pop(check.step, None)
        for kind, sender in needed(check):
            try:
                self.transport.inbox.take(kind, sender, check.step, check.micro, 0.0)
            except TransportTimeout:
                pass

    def receive(self, kind: str, sender: str, check: Check, deadline: float) -> tuple[FrameHeader, torch.Tensor]:
        """A helper's frame for `check` (or the checked peer's answer), waiting until `deadline` (monotonic; one look
        when it has passed); `Declined` if the helper said it was asked too late, `TransportTimeout` if nothing came."""
        while True:
            left = deadline - time.monotonic()
            if (sender, check.step, check.micro) in self.declined:
                raise Declined(f"{sender} was asked after its lane reached step {check.step}")
            try:
                return self.transport.inbox.take(kind, sender, check.step, check.micro, max(0.0, min(POLL_S, left)))
            except TransportTimeout:
                if left <= 0:
                    raise TransportTimeout(f"no {kind} of step {check.step} from {sender} for a check within "
                                           f"{self.timeout_s:g} s") from None

    def attest(self, check: Check, sums: tuple[int, int, int], step: int, deadline: float) -> bool:
        """Ask the checked peer, now that its output is out, which input frames it got (their checksums: activations,
        labels, gradient; -1 where none) and its weights' fingerprint; `Disputed` unless the frames are the ones its
        lane neighbours copied to this peer (`sums`): either that neighbour or the checked peer lies about the input
        then, and the check says nothing about the checked peer's work. Whether its weights' fingerprint at the check's
        step is this peer's at `step`, the one it recomputes at (its outputs are then judged exactly)."""
        self.transport.send(check.checked, "attest", torch.tensor([0]), step=check.step, micro=check.micro,
                            epoch=self.plan.epoch)
        said = [int(v) for v in self.receive("attested", check.checked, check, deadline)[1]]
        sums = tuple(-1 if c == -1 else signed(c) for c in sums)
        frames = said[:len(ATTESTED)]
        if any(c != -1 for c in sums) and all(c == -1 for c in frames):
            raise Declined(f"{check.checked} no longer keeps what it got at step {check.step}")
        if any(mine != -1 and mine != theirs for mine, theirs in zip(sums, frames)):
            raise Disputed(f"{check.checked} says it got other input frames than its lane neighbours copied to this peer "
                           f"(checksums {list(frames)} against {list(sums)}): one of them lies, the check says nothing")
        return tuple(said[len(ATTESTED):]) == self.prints.get(step)

    def note(self, step: int, weights: torch.Tensor) -> None:
        """The fingerprint of this peer's weights at the start of `step` (its sum and sum of squares), for its checkers
        and its own checks; only while a check can ask for it."""
        if not self.plan.recipe.check or not self.others or not self.last:
            return
        flat = weights.detach()  # no copy: a stage's weights can be most of its device's memory
        pair = torch.stack((flat.sum(dtype=torch.float64), torch.dot(flat, flat).double())).cpu().view(torch.int64)
        with self._lock:
            self.prints[step] = (int(pair[0]), int(pair[1]))

    def got(self, kind: str, step: int, micro: int, checksum: int) -> None:
        """This peer received a lane frame (`ATTESTED` kinds): keep its checksum for the checkers of its group."""
        with self._lock:
            sums = self.sums.setdefault((step, micro), [-1, -1, -1])
            sums[ATTESTED.index(kind)] = signed(checksum)

    def judge(self, check: Check, what: str, seen: torch.Tensor, recomputed: torch.Tensor) -> Verdict:
        verdict = Verdict(check.checked, check.step, check.micro, what, distance(seen, sketch(recomputed, check.seed)))
        self.verdicts.append(verdict)
        self.judged += 1
        if verdict.caught:
            self.failed += 1
            self._caught_at[check.checked] = (time.monotonic(), verdict)
            log.warning("%s: check of %s failed: %s", self.device_id, check.checked, verdict.words)
        return verdict

    def caught(self, now: float | None = None) -> dict[str, Verdict]:
        """The peers a check caught in the last WINDOW_S, with the last verdict that did."""
        now = time.monotonic() if now is None else now
        for device, (at, _) in list(self._caught_at.items()):
            if at < now - WINDOW_S:
                del self._caught_at[device]
        return {device: verdict for device, (_, verdict) in self._caught_at.items()}

    # -- what this peer takes ------------------------------------------------------------------------------
    def accept(self, header: FrameHeader) -> str | None:
        """Why a check frame is not what the plan says this peer should get, or None if it is."""
        if header.epoch != self.plan.epoch:
            return Late(f"plan epoch {header.epoch}, this peer runs epoch {self.plan.epoch}")
        if header.kind == "check":
            return self._accept_request(header)
        if header.kind == "attest":
            return self._accept_attest(header)
        check = self.mine.get(header.step)
        if check is None or header.micro != check.micro:  # dropped, or judged already
            return Late(f"{header.kind} of step {header.step} micro-batch {header.micro} is for no check this peer runs")
        wanted = {"check_input": check.previous, "check_labels": check.previous,
                  "check_grad": check.next if self.stage < self.last else None, "attested": check.checked,
                  "sketch": header.sender if header.sender in (check.previous, check.next) else None}[header.kind]
        if wanted is None or header.sender != wanted:
            return f"{header.kind} is not expected from {header.sender} for the check of {check.checked}"
        rows = (self.plan.micro_batch_sizes(check.lane)[check.micro], self.seq_len)
        shape, dtype = {"check_labels": (rows, "int64"), "sketch": ((SKETCH,), "fp32"), "attested": ((ANSWER,), "int64")}.get(
            header.kind, ((*rows, self.hidden), self.plan.dtype))
        if header.shape != shape or header.dtype != dtype:
            return f"{header.kind} is {header.dtype}{list(header.shape)}, expected {dtype}{list(shape)}"
        return None

    def _accept_request(self, header: FrameHeader) -> str | None:
        """A request from a checker of a lane neighbour's stage, or a helper's decline of one of this peer's checks."""
        if header.sender not in self.plan.devices:
            return f"{header.sender} is not in plan epoch {self.plan.epoch}"
        stage, lane = self.plan.position(header.sender)
        if lane == self.lane or stage not in (self.stage - 1, self.stage + 1):
            return f"{header.sender} holds no stage next to this peer's in another lane: it checks nothing here"
        if header.shape != (1,) or header.dtype != "int64" or not 0 <= header.micro < self.most_micro:
            return f"check frame {header.dtype}{list(header.shape)} for micro-batch {header.micro}"
        if not self.step() <= header.step <= self.step() + AHEAD:  # a drifting group's lanes run steps apart
            return Late(f"check of step {header.step} at step {self.step()}")
        return None

    def _accept_attest(self, header: FrameHeader) -> str | None:
        """A checker of this peer asking which input it got."""
        if header.sender not in self.plan.devices or header.sender == self.device_id or \
                self.plan.position(header.sender)[0] != self.stage:
            return f"{header.sender} is not in this peer's group: it checks nothing of it"
        if header.dtype != "int64" or header.shape != (1,):
            return f"attest frame {header.dtype}{list(header.shape)}"
        if not self.step() - KEEP_STEPS <= header.step <= self.step() + 1:
            return Late(f"attest of step {header.step} at step {self.step()}")
        return None

    def _on_attest(self, header: FrameHeader, value: torch.Tensor) -> None:
        """Answer with the checksums of the input frames that came (-1 for those it does not have) and the weights'
        fingerprint (0s if it has none for that step)."""
        with self._lock:
            sums = list(self.sums.get((header.step, header.micro), (-1,) * len(ATTESTED)))
            sums += self.prints.get(header.step, (0, 0))
        self._send(header.sender, "attested", torch.tensor(sums, dtype=torch.int64), step=header.step, micro=header.micro)

    def _on_check(self, header: FrameHeader, value: torch.Tensor) -> None:
        """A request (its seed), taken unless this peer's lane is already at its step (then declined); or a decline."""
        seed = int(value.reshape(-1)[0])
        with self._lock:
            if seed == DECLINE:
                check = self.mine.get(header.step)
                if check is not None and header.sender in (check.previous, check.next):
                    self.declined.add((header.sender, header.step, header.micro))
                return
            if seed < 0 or header.micro >= len(self.plan.micro_batch_sizes(self.lane)):
                return
            if any(c == header.sender for (at, _), asked in self.asked.items() if at == header.step for c, _ in asked):
                return  # one check a step from each checker: more would make this peer its copier
            if header.step > self.step():
                self.asked.setdefault((header.step, header.micro), []).append((header.sender, seed))
                return
        self._send(header.sender, "check", torch.tensor([DECLINE]), step=header.step, micro=header.micro)

    # -- the helper ----------------------------------------------------------------------------------------
    def _checkers(self, step: int, micro: int, stage: int) -> list[tuple[str, int]]:
        """The checkers of stage `stage` of this lane that asked for (step, micro)."""
        with self._lock:
            asked = list(self.asked.get((step, micro), ()))
        return [(c, seed) for c, seed in asked if self.plan.position(c)[0] == stage]

    def sent(self, kind: str, step: int, micro: int, tensor: torch.Tensor, codec: str,
             labels: torch.Tensor | None = None) -> None:
        """This peer sent its lane neighbour `tensor` (activations forward, a gradient back): copy it to that
        neighbour's checkers that asked for it."""
        checked = self.stage + 1 if kind == "activation" else self.stage - 1
        for checker, _ in self._checkers(step, micro, checked):
            self._send(checker, "check_input" if kind == "activation" else "check_grad", tensor, step=step, micro=micro,
                       codec=codec)
            if labels is not None:
                self._send(checker, "check_labels", labels, step=step, micro=micro)

    def received(self, kind: str, step: int, micro: int, tensor: torch.Tensor) -> None:
        """This peer received `tensor` from its lane neighbour: sketch it for that neighbour's checkers."""
        checked = self.stage - 1 if kind == "activation" else self.stage + 1
        for checker, seed in self._checkers(step, micro, checked):
            self._send(checker, "sketch", sketch(tensor, seed), step=step, micro=micro)

    def _send(self, to: str, kind: str, tensor: torch.Tensor, *, step: int, micro: int, codec: str = "raw") -> None:
        """A check's frame to a peer the plan need not make this one's neighbour: where it cannot leave, it is lost
        (the check it belongs to is dropped on the other side), never this peer's step."""
        try:
            self.transport.send(to, kind, tensor, step=step, micro=micro, epoch=self.plan.epoch, codec=codec)
        except TransportError as error:
            if to not in self._unsent:
                self._unsent.add(to)
                log.info("checks: a frame to %s could not leave (%s); its checks are dropped", to, error)

    def forget_before(self, step: int) -> None:
        with self._lock:
            for key in [k for k in self.asked if k[0] < step]:
                del self.asked[key]
            for key in [k for k in self.sums if k[0] < step - KEEP_STEPS]:  # its checkers may ask steps later
                del self.sums[key]
            for key in [k for k in self.prints if k < step - KEEP_STEPS]:
                del self.prints[key]
