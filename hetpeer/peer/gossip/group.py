"""A peer's part in its group's averaging, step by step: gossip with decentralized Adam, ring all-reduce,
outer steps every H steps (`outer.py`), or nothing (a group of one). Its state (`state_tensors`: parameters
and optimizer tensors, under `lock`) is what `state.StateServer` serves to a peer that (re)joins; this
module moves no state itself.

Gossip, peer i of the group (members in lane order), step t:

- `begin(t)`: as soon as x_i(t) exists, a copy goes to the peers that mix it in under W(t), in chunks,
  so the exchange runs while step t's gradient is computed (`overlap`);
- `finish(t)`: with the gradient ready, wait for the neighbours' x_j(t) until `deadline_s`; a neighbour
  that is late or sent something unusable is left out and the weights renormalised; mix
  (optionally clipping each neighbour's difference: robust mixing); take the Adam step from the mix.

All-reduce: the gradient is averaged exactly (`exact.py`: with the recipe's `robust`, every member sends its
gradient to every other and takes the same CenteredClip of all of them; without, by a butterfly's plain weighted
mean), then every peer takes the same Adam step. It needs every member: a missing one raises `TransportTimeout`
(gossip is the mode that tolerates faults).

Outer steps: every peer takes local Adam steps; after step t with (t + 1) divisible by H (the plan's
`outer_every`, counted on the swarm's step so every member agrees), the parameter changes since the last
outer step are averaged the same way, in `OUTER_CODEC`, and every member takes the same outer step. Like
all-reduce it needs every member. With the plan's `outer_delay` D the exchange runs in a thread of its own
beside the next D steps and lands after step t + D (`outer.Exchange`), its frames labelled with that step.
Before the plan's `outer_after` step such a group all-reduces every step instead (a warm start).

Membership comes from the plan (`set_plan`, at a step boundary). Every `params` and `allreduce` frame
received is checked by `accept` before the transport hands it over: sender in the group, epoch, step,
chunk index, shape, dtype. A frame of another plan epoch or of a step done or far ahead is `Late`
(dropped, not held against its sender).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from hetpeer.peer.gossip.adam import AdamConfig, AdamState, adam_update
from hetpeer.peer.gossip import exact
from hetpeer.peer.gossip.noise import NoiseMeter
from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.outer import Exchange, OuterConfig, OuterState, delta, outer_step
from hetpeer.peer.gossip.topology import TOPOLOGIES, mixing_matrix, neighbours
from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Late, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.protocol.frame import CODECS, FrameHeader
from hetpeer.protocol.plan import OUTER_CODEC, Plan
from hetpeer.protocol.recipe import Recipe

log = logging.getLogger("hetpeer.gossip")
DISTANCE_MEMORY = 0.9  # weight of the past in the running typical distance of robust mixing
SCALE_GROWTH = 0.5  # an observation counts for at most 1.5x the typical distance: +5% a round at most
SUSPECT_WAIT_S = 0.05
OUTLIER_ROUNDS = 3  # rounds in a row a neighbour is far past the clipping bound, while another passes, before it is left out
OUTLIER_FACTOR = 2.0  # "far": this many times the bound; an honest neighbour drifting a little past it is only clipped
# Peers of a group run at their own pace: one waits only for its neighbours of the round, so a sender
# may be a few steps ahead of a receiver that waited on someone else. Frames that far ahead are kept.
AHEAD_STEPS = 4
# What a stage's state tensors are, by the number a state request names them with (`state.py`): a peer holds
# the window only under AccumAdam, the anchor and outer momentum only in an outer-step group.
STATE_TENSORS = ("params", "m", "v", "window", "anchor", "outer_momentum")
NEEDED = frozenset(("params", "m", "v"))  # what a peer cannot start without; the rest it can start afresh


@dataclass(frozen=True, slots=True)
class SyncConfig:
    topology: str = "one-peer-exp"
    deadline_s: float = 10.0  # once the gradient is ready, how long to wait for neighbours' parameters
    codec: str = "raw"  # how parameters travel: one of frame.CODECS
    # robust averaging: gossip clips a neighbour's difference at clip x the typical neighbour distance; all-reduce
    # and outer steps take the CenteredClip of every member's contribution (`exact.py`); None: plain means
    clip: float | None = None
    chunk_bytes: int = 16 << 20  # parameters travel in frames of at most this size
    overlap: bool = True  # send x(t) as soon as it exists; False sends it after the gradient (to measure)
    # all-reduce cannot leave a member out, so it waits for one as long as for any frame (a failure timeout),
    # not a deadline: a member that enters the plan a little later must not break it
    allreduce_timeout_s: float = 60.0
    outer: OuterConfig = OuterConfig()  # the outer optimizer of a group the plan gives outer steps

    @staticmethod
    def of(recipe: Recipe, overlap: bool = True, allreduce_timeout_s: float = 60.0) -> "SyncConfig":
        """The group's averaging as the organizer's recipe asks for it; `overlap` and the all-reduce's patience are
        the peer's own (they change when, not what, it mixes)."""
        return SyncConfig(topology=recipe.topology, deadline_s=recipe.mix_deadline_s, codec=recipe.sync_codec,
                          clip=recipe.robust or None, overlap=overlap, allreduce_timeout_s=allreduce_timeout_s,
                          outer=OuterConfig(lr=recipe.outer_lr, momentum=recipe.outer_momentum))

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        if not self.deadline_s > 0 or not self.allreduce_timeout_s > 0 or self.chunk_bytes < 4:
            raise ValueError(f"deadline_s and allreduce_timeout_s must be positive and chunk_bytes at least 4: {self}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive, got {self.clip}")


@dataclass(frozen=True, slots=True)
class SyncReport:
    mode: str
    mixed: int  # neighbours whose parameters (or gradient shares) were used
    left_out: tuple[str, ...]  # neighbours that were late or unusable this step
    clipped: int
    wait_s: float
    contributors: tuple[str, ...] = ()  # the neighbours whose parameters (or gradient shares) this step used


class GroupSync:
    KINDS = ("params", "allreduce")

    def __init__(
        self, plan: Plan, device_id: str, transport: Transport, flat: FlatParams, adam: AdamConfig, config: SyncConfig
    ) -> None:
        self.device_id, self.transport, self.flat, self.adam, self.config = device_id, transport, flat, adam, config
        self.state = AdamState(flat.size, flat.data.device, windowed=adam.windowed)
        self.lock = threading.Lock()  # parameters and moments change only under it; state serving reads under it
        self.chunk_elems = max(1, config.chunk_bytes // 4)
        self.step = plan.start_step
        self.sent: int | None = None  # the step whose parameters have been sent
        self.ahead: int | None = None  # the furthest step a group member has been seen at
        self.typical_distance: float | None = None
        self.left_out = collections.Counter()
        self.clip_streaks: collections.Counter[str] = collections.Counter()  # rounds in a row a neighbour was far past the bound
        self.unclipped: dict[str, int] = {}  # the last round each neighbour came within OUTLIER_FACTOR x the bound
        self.rounds = 0  # exchanges with the group so far: gossip mixes and (robust) all-reduces
        self.clipped = 0  # contributions clipped or left out since the last report
        self.suspects: set[str] = set()
        self.outer: OuterState | None = None  # anchor and outer momentum, in an outer-step group
        self.exchange: Exchange | None = None  # an outer step's exchange still running beside compute
        self.noise = NoiseMeter(flat.data.device)  # the gradient noise scale, where the group all-reduces gradients
        self.set_plan(plan)

    def set_plan(self, plan: Plan) -> None:
        """Take the group of `plan` (members in lane order, sync mode); call at a step boundary."""
        stage, _ = plan.position(self.device_id)
        self.plan = plan
        self.members = plan.stages[stage].devices
        self.index = self.members.index(self.device_id)
        self.mode = "none" if len(self.members) == 1 else plan.stages[stage].sync
        self.outer_every = plan.stages[stage].outer_every if self.mode == "outer" else 0
        self.outer_delay = plan.stages[stage].outer_delay if self.mode == "outer" else 0
        if self.mode == "outer" and self.outer is None:
            self.outer = OuterState(self.flat.data)
        if self.config.clip is not None:
            self.averager = exact.Everyone(self.transport, self.members, self.index, self.flat.size, self.chunk_elems,
                                           plan.epoch, self.config.clip)
            # outer steps' changes are judged apart from the warm start's gradients, and sooner (`exact.CHANGE_ROUNDS`)
            self.changes = exact.Everyone(self.transport, self.members, self.index, self.flat.size, self.chunk_elems,
                                          plan.epoch, self.config.clip, apart_after=exact.CHANGE_ROUNDS)
        else:
            sizes = [len(part) for part in torch.empty(self.flat.size, device="meta").tensor_split(len(self.members))]
            self.averager = self.changes = exact.Butterfly(self.transport, self.members, self.index, sizes, plan.epoch)
        # an all-reduce averages the lanes' gradients by their shares of the step's batch: the gradient of the whole
        # batch, however unlike the shares (each lane's gradient is its own batch's mean)
        self.shares = [plan.lane_sequences(k) for k in range(len(self.members))]
        if self.mode == "none" and len(self.members) > 1:
            log.warning("%s: plan says sync none for a group of %d; its lanes will drift apart", self.device_id, len(self.members))

    # -- what this peer accepts -------------------------------------------------------------------
    def accept(self, header: FrameHeader) -> str | None:
        if header.sender not in self.members or header.sender == self.device_id:
            return f"{header.sender} is not another member of {self.device_id}'s group"
        if header.epoch != self.plan.epoch:  # a peer switching plans a moment before or after this one
            return Late(f"plan epoch {header.epoch}, this peer runs epoch {self.plan.epoch}")
        if header.step < self.step:
            self.suspects.discard(header.sender)  # late, but alive: it gets a whole deadline again
            return Late(f"step {header.step} is done (this peer is at {self.step})")
        # members of an outer-step group train apart between outer steps: one may reach the next a whole H ahead,
        # and an overlapped exchange is labelled with the step it lands after, up to H later again
        if header.step > self.step + max(AHEAD_STEPS, 2 * self.outer_every):
            self.ahead = max(self.ahead or 0, header.step)
            return Late(f"step {header.step} is far ahead of this peer ({self.step})")
        expected = self._params_chunk_shape(header.micro) if header.kind == "params" else \
            self.averager.shape(header.sender, header.micro)
        if expected is None:
            return f"{header.kind} {'chunk' if header.kind == 'params' else self.averager.unit} {header.micro} does not exist"
        if header.shape != expected or header.dtype != "fp32":
            return f"{header.kind} chunk {header.micro} is {header.dtype}{list(header.shape)}, expected fp32{list(expected)}"
        self.suspects.discard(header.sender)  # it is sending: alive
        return None

    # -- a step -----------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """x(step) exists: start sending it to the neighbours of round `step` (gossip with overlap)."""
        self.step = step
        if self.mode == "gossip" and self.config.overlap and self.sent != step:
            self._send_params(step)

    def finish(self, step: int) -> SyncReport:
        """The gradient of `step` is in `flat.grad`: sync as the mode says and take the optimizer step."""
        started = time.perf_counter()
        received: dict[int, torch.Tensor] = {}
        left_out: list[str] = []
        if self.mode == "allreduce" or self.warming(step):
            self.noise.lane(self.flat.grad)
            self._allreduce(self.flat.grad, step, self.shares)
            self.noise.mean(self.flat.grad, len(self.members))
        elif self.mode == "gossip":
            if self.sent != step:
                self._send_params(step)
            w = mixing_matrix(self.config.topology, len(self.members), step)
            incoming, _ = neighbours(w, self.index)
            received, left_out = self._receive_params(step, incoming, time.monotonic() + self.config.deadline_s)
        wait_s = time.perf_counter() - started
        with self.lock:
            if self.mode == "gossip":
                self.clipped += self._mix(w[self.index], received)
            adam_update(self.flat.data, self.flat.grad, self.state, self.adam, self.flat.decay_ranges, self.flat.clip_apart,
                        peers=len(self.members) if self.mode == "gossip" else 1)
            if self.warming(step):  # the members move together: the anchor is where they are
                self.outer.anchor.copy_(self.flat.data)
        if self.exchange is not None and self.exchange.at == step:
            started = time.perf_counter()
            self._outer_land()
            wait_s += time.perf_counter() - started
        if self.outer_step_due(step):
            started = time.perf_counter()
            self._outer_sync(step)
            wait_s += time.perf_counter() - started
        for device in left_out:
            self.left_out[device] += 1
        if left_out:
            log.info("%s left %s out of step %d", self.device_id, ", ".join(left_out), step)
        exchanged = self.mode == "allreduce" or self.warming(step) or self.outer_step_due(step)
        contributors = tuple(m for m in self.members if m != self.device_id) if exchanged \
            else tuple(self.members[j] for j in sorted(received))
        clipped, self.clipped = self.clipped, 0
        return SyncReport(self.mode, len(contributors), tuple(left_out), clipped, wait_s, contributors)

    # -- gossip -----------------------------------------------------------------------------------
    def _send_params(self, step: int) -> None:
        _, outgoing = neighbours(mixing_matrix(self.config.topology, len(self.members), step), self.index)
        with self.lock:
            copy = self.flat.data.detach().clone()
        for j in outgoing:
            try:
                for c, chunk in enumerate(copy.split(self.chunk_elems)):
                    self.transport.send(
                        self.members[j], "params", chunk, step=step, micro=c, epoch=self.plan.epoch,
                        codec=self.config.codec, copy=False,
                    )
            except PeerUnreachable as error:  # it will be left out of its own mixing; we go on
                log.info("%s: parameters for %s not sent: %s", self.device_id, self.members[j], error)
        self.sent = step

    def _receive_params(self, step: int, incoming: list[int], deadline: float) -> tuple[dict[int, torch.Tensor], list[str]]:
        received, left_out = {}, []
        chunks = -(-self.flat.size // self.chunk_elems)
        device = self.flat.data.device
        for j in incoming:
            sender = self.members[j]
            # a neighbour silent since it missed a whole deadline gets a moment, not another deadline
            until = min(deadline, time.monotonic() + SUSPECT_WAIT_S) if sender in self.suspects else deadline
            try:
                parts = [
                    self.transport.recv("params", sender, step, c, max(0.0, until - time.monotonic()))
                    for c in range(chunks)
                ]
            except TransportTimeout:
                left_out.append(sender)
                if time.monotonic() >= deadline:
                    self.suspects.add(sender)
                continue
            received[j] = torch.cat(parts).to(device)
        return received, left_out

    @property
    def outlier_rounds(self) -> int:
        """Rounds in a row a member must be far before it is an outlier: a gossip neighbour's parameters, or outer
        steps' changes, are rarely far; one step's gradient of an honest lane now and then (`exact.py`)."""
        if self.mode == "gossip":
            return OUTLIER_ROUNDS
        return exact.CHANGE_ROUNDS if self.mode == "outer" and not self.warming(self.step) else exact.OUTLIER_ROUNDS

    def outliers(self, rounds: int = 8) -> dict[str, int]:
        """The members robust averaging leaves out or clips hard (and how many rounds in a row they were far): far
        past the bound in the last `outlier_rounds` or more rounds they took part in, while another member came
        nearer in the last `rounds` exchanges: far for what they send, not because this peer's scale is off."""
        return {
            device: streak for device, streak in list(self.clip_streaks.items())
            if streak >= self.outlier_rounds
            and any(other != device and at >= self.rounds - rounds for other, at in list(self.unclipped.items()))
        }

    def _judged(self, far: set[str], near: set[str]) -> None:
        """One more exchange in which the members `far` were far past the bound and those `near` were not."""
        self.rounds += 1
        for member in far:
            self.clip_streaks[member] += 1
        for member in near:
            self.clip_streaks.pop(member, None)
            self.unclipped[member] = self.rounds

    def _mix(self, weights: np.ndarray, received: dict[int, torch.Tensor]) -> int:
        """x_i <- x_i + sum_j w_ij / (w_ii + sum w_ij) * clip(x_j - x_i), over the neighbours received; with
        clipping, an outlier (`OUTLIER_FACTOR` times past the bound `OUTLIER_ROUNDS` rounds in a row while another
        neighbour came nearer) is left out until it comes nearer. How many neighbours were clipped or left out."""
        if not received:
            return 0
        x = self.flat.data
        limit = None
        if self.config.clip is not None:
            if not self.typical_distance:
                # the scale starts from this peer's own step (Adam moves each coordinate by about lr), never from what a
                # neighbour sends: a poisoner heard first would otherwise set it, and every difference would pass under it
                self.typical_distance = self.adam.lr * math.sqrt(x.numel())
            limit = self.config.clip * self.typical_distance
        # each neighbour's difference in its own received buffer: mixing takes no memory beyond what arrived
        differences = {j: x_j.sub_(x) for j, x_j in received.items()}
        norms = {j: float(d.norm()) for j, d in differences.items()}
        outliers = self.outliers()
        scales, left_out = {}, set()
        for j in differences:
            if limit is None or norms[j] <= OUTLIER_FACTOR * limit:
                scales[j] = 1.0 if limit is None or norms[j] <= limit else limit / norms[j]
            elif self.members[j] in outliers:
                left_out.add(j)  # what it sends is not mixed, nor does it feed the scale, until it comes near again
            else:
                scales[j] = limit / norms[j]
        far = {self.members[j] for j in differences if limit is not None and norms[j] > OUTLIER_FACTOR * limit}
        self._judged(far, {self.members[j] for j in differences} - far)
        total = weights[self.index] + sum(weights[j] for j in scales)
        for j, scale in scales.items():  # every difference was taken from x before it moves
            x.add_(differences[j], alpha=float(weights[j] / total) * scale)
        kept = [norms[j] for j in scales]
        if kept:
            # what feeds the running scale is capped too, so a steady poisoner can raise it only slowly
            cap = min(limit, (1 + SCALE_GROWTH) * self.typical_distance) if limit is not None else None
            typical = float(np.median([min(n, cap) if cap is not None else n for n in kept]))
            self.typical_distance = typical if not self.typical_distance else (  # without clipping, the first spread seeds it
                DISTANCE_MEMORY * self.typical_distance + (1 - DISTANCE_MEMORY) * typical
            )
        return len(left_out) + sum(scale < 1.0 for scale in scales.values())

    # -- outer steps ------------------------------------------------------------------------------
    def warming(self, step: int) -> bool:
        """Whether an outer-step group still all-reduces every step at `step` (before the plan's `outer_after`)."""
        return self.mode == "outer" and step < self.plan.outer_after

    def outer_step_due(self, step: int) -> bool:
        """Whether step `step` ends with an outer step."""
        return self.mode == "outer" and step >= self.plan.outer_after and (step + 1) % self.outer_every == 0

    def _outer_sync(self, step: int) -> None:
        with self.lock:
            change = delta(self.flat.data, self.outer)
        if not torch.isfinite(change).all():
            # an fp16 frame cannot carry it, and a peer whose own training diverged must not take the group with it
            raise FloatingPointError(f"{self.device_id}: its parameter change before the outer step of step {step} is not finite")
        if not self.outer_delay:
            self._allreduce(change, step, None, OUTER_CODEC, self.changes)
            with self.lock:
                outer_step(self.flat.data, change, self.outer, self.config.outer)
            return
        # labelled with the step it lands after: frames of steps done are dropped, and this one is not done yet
        at = step + self.outer_delay
        self.exchange = Exchange(lambda: self._allreduce(change, at, None, OUTER_CODEC, self.changes), change.clone(), change,
                                 at).start()

    def _outer_land(self) -> None:
        exchange, self.exchange = self.exchange, None
        exchange.wait()
        with self.lock:
            outer_step(self.flat.data, exchange.mean, self.outer, self.config.outer, own=exchange.own)

    def take(self, old: "GroupSync") -> None:
        """Continue from `old`, this peer's sync of the same layers under the plan before: parameters and
        optimizer tensors, and the outer state where both run outer steps. A group that enters outer steps
        anchors where it is; one that leaves them goes back to the anchor, which every member shares (the
        local steps since the last outer step are dropped: the members would otherwise differ from then on)."""
        if old.exchange is not None:  # its members all wait for it here, so it completes unless one of them left
            try:
                old._outer_land()
            except TransportError as error:
                log.info("%s: the outer step in flight when the plan changed was dropped: %s", self.device_id, error)
        with old.lock, self.lock:
            for name, tensor in old.named_state().items():
                if name in ("anchor", "outer_momentum"):
                    continue
                mine = self.named_state().get(name)
                if mine is not None:
                    mine.copy_(tensor)
            self.state.step = old.state.step
            if old.outer is not None and self.outer is not None:
                self.outer.anchor.copy_(old.outer.anchor)
                self.outer.momentum.copy_(old.outer.momentum)
            elif old.outer is not None:
                self.flat.data.copy_(old.outer.anchor)
            elif self.outer is not None:
                self.outer.restart(self.flat.data)

    def arrived(self, names: set[str]) -> None:
        """State tensors `names` were just filled from elsewhere (donors, a checkpoint): in an outer-step group,
        enter at the group's anchor, or anchor here when what came had no outer state. Call under `lock`."""
        if self.outer is None:
            return
        if {"anchor", "outer_momentum"} <= names:
            self.flat.data.copy_(self.outer.anchor)
        else:
            self.outer.restart(self.flat.data)

    # -- all-reduce -------------------------------------------------------------------------------
    def _allreduce(self, vector: torch.Tensor, step: int, weights: list[int] | None, codec: str = "raw",
                   averager: exact.Everyone | exact.Butterfly | None = None) -> None:
        """Average `vector` (in place) over the group, weighing member k by `weights[k]` (None: alike), robustly
        where the recipe says (`exact.py`); count who was far past the bound for the group's reports."""
        outcome = (averager or self.averager).average(vector, step, weights or [1] * len(self.members),
                                                      self.config.allreduce_timeout_s, codec)
        self.clipped += outcome.clipped
        self._judged(set(outcome.far), set(outcome.near))

    def _params_chunk_shape(self, micro: int) -> tuple[int, ...] | None:
        start = micro * self.chunk_elems
        return (min(self.chunk_elems, self.flat.size - start),) if start < self.flat.size else None

    # -- state for (re)joining peers ---------------------------------------------------------------
    def named_state(self) -> dict[str, torch.Tensor]:
        """This peer's state tensors by their `STATE_TENSORS` names, in that order."""
        held = dict(zip(("params", "m", "v", "window"), (self.flat.data, *self.state.tensors())))
        if self.outer is not None:
            held |= {"anchor": self.outer.anchor, "outer_momentum": self.outer.momentum}
        return held

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.named_state().values())
