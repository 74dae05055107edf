"""The stage worker: one peer's share of a lane, run step by step under a plan.

A step is `compute` (the 1F1B schedule over the lane's micro-batches: receive, forward, send; then
backward in reverse, accumulating gradients) followed by `apply` (the group's averaging and the Adam
step, `hetpeer.peer.gossip`). The stage's parameters travel to the group while `compute` runs. Stage 0 reads its lane's data and sends the
labels along the lane with the activations; the last stage computes the loss, scaled so the
accumulated gradient is that of the mean loss over the lane's batch.

The worker tells its transport what it accepts (`accept`): from the previous peer of its lane,
activations and labels; from the next, gradients; each of the shape, dtype, epoch and step the plan
implies. Every receive has the configured deadline, so a dead neighbour raises `TransportTimeout`.

A model with a tied output head (GPT-2, some Llamas) keeps the head as a copy of the token embedding on
the stage that holds the last layer; after the backward pass the two ends of each lane exchange the two
gradients (`tied` frames) and both add them, so the copies take the same steps (on one stage the two
are added in place).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from hetpeer.peer.checkpoint import StageCheckpoint, load_stage, save_stage
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.adam import AdamConfig
from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.group import GroupSync, SyncConfig, SyncReport
from hetpeer.peer.gossip.state import Download, StateDownloadError, StateServer, fetch_state
from hetpeer.peer.probe import Slowdown
from hetpeer.peer.model import build_stage
from hetpeer.peer.model.folder import ModelFolder
from hetpeer.peer.pipeline.checks import ATTESTED, Check, Checks, Declined, Disputed
from hetpeer.peer.pipeline.schedule import FORWARD, one_f_one_b
from hetpeer.peer.pipeline.tally import Tally
from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Late, TransportTimeout
from hetpeer.peer.transport.codec import TORCH_DTYPES, as_received
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.modelspec import PRESETS, ModelSpec, preset

COMPUTE_DTYPES = ("fp32", "bf16")
# A peer this many steps behind its group (stopped, cut off) downloads the group's state rather than mix in
# parameters that old: robust mixing would take them for poison, and plain mixing would drag the group back.
STALE_STEPS = 16
CHECK_KINDS = ("check", "check_input", "check_labels", "check_grad", "sketch", "attest", "attested")
log = logging.getLogger("hetpeer.peer")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How this peer's machine takes part: where it computes, how long it waits, what it emulates. How it trains
    (optimizer, schedule, averaging, seed) is the plan's recipe, the same for every member of a group."""

    device: str = "cpu"  # torch device of this peer
    timeout_s: float = 60.0  # deadline for every frame of the lane this peer waits for (an all-reduce's too)
    slowdown: float = 1.0  # emulate a slower accelerator: compute takes this many times as long
    model: ModelSpec | None = None  # a model read from a folder (plans name presets, or such a model's name)
    weights: str | None = None  # the model folder to read this peer's stage from (its safetensors), if any
    recompute: bool = False  # recompute every block's activations in backward, whatever the plan says
    overlap: bool = True  # gossip sends x(t) as soon as it exists; False: after the gradient (to measure what overlap hides)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if not self.slowdown >= 1:
            raise ValueError(f"slowdown must be at least 1 (1: full speed), got {self.slowdown}")


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    loss: float | None  # the lane's mean loss; known on the last stage only
    sequences: int
    tokens: int
    compute_s: float  # forward and backward
    wait_s: float  # blocked on lane neighbours
    sync: SyncReport | None = None  # the group's averaging, once the step is applied
    val_loss: float | None = None  # the lane's loss on its held-out batch, at the plan's validation steps (last stage)
    windows: tuple[int, int] | None = None  # [first, end) of the positions in the swarm's data order it read (first stage)
    checks: tuple[int, int] = (0, 0)  # outputs of other lanes it recomputed and judged at this step, and how many failed


class StageWorker:
    def __init__(
        self,
        plan: Plan,
        device_id: str,
        transport: Transport,
        corpus: Corpus | None,
        config: WorkerConfig,
        server: StateServer | None = None,
    ):
        if plan.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"plan dtype {plan.dtype} is not supported by the runtime (it runs {', '.join(COMPUTE_DTYPES)}; "
                "fp16 would need loss scaling): plan with --dtype bf16 or fp32"
            )
        self.plan, self.device_id, self.transport, self.config = plan, device_id, transport, config
        self.stage, self.lane = plan.position(device_id)
        stage_plan = plan.stages[self.stage]
        self.spec = model_for(plan, config.model)
        lane = plan.lanes[self.lane]
        self.previous = lane[self.stage - 1] if self.stage > 0 else None
        self.next = lane[self.stage + 1] if self.stage + 1 < len(lane) else None
        # how this peer's tensors travel, as the plan says for its lane's hops: activations to the next stage,
        # gradients back to the previous one
        self.codecs = {
            "activation": stage_plan.codecs(self.lane)[0],
            "gradient": plan.stages[self.stage - 1].codecs(self.lane)[1] if self.stage > 0 else "raw",
        }
        if self.previous is None and corpus is None:
            raise ValueError(f"{device_id} holds stage 0 and needs a corpus to read")
        self.corpus = corpus
        self.seed = plan.recipe.seed  # model initialisation and data order
        self.model = build_stage(self.spec, stage_plan.layer_start, stage_plan.layer_end, self.seed)
        self.loaded_bytes = 0
        if config.weights is not None:
            folder = ModelFolder.open(config.weights, self.spec)
            if folder.has_weights:
                self.loaded_bytes = folder.load_into(self.model)
        self.model.to(config.device)
        # the plan's count of this stage's layers that recompute their activations, or all of them
        self.recompute = self.model.recompute = stage_plan.layers if config.recompute else stage_plan.recompute
        self.flat = FlatParams(self.model)
        tied, _ = self._tied_peer()
        if tied is not None:  # its copy at the lane's other end gets the same gradient: it must take the same step
            self.flat.clip_apart = (self.flat.range_of(tied),)
        self.sync = GroupSync(plan, device_id, transport, self.flat, AdamConfig.of(plan.recipe),
                              SyncConfig.of(plan.recipe, config.overlap, allreduce_timeout_s=config.timeout_s))
        self.layers = (stage_plan.layer_start, stage_plan.layer_end)
        self.param_range = self.spec.param_range(*self.layers)
        # a static plan serves its own peers; a swarm peer passes the server it keeps across plans
        self.server = server or StateServer(transport, device_id, known=lambda d: d in plan.devices)
        self.server.hold(self.sync, *self.param_range)
        # whether a lane neighbour that let a frame's deadline pass is still worth waiting for (a swarm peer:
        # it announces fetching this plan's state, and its first frames come once it has it)
        self.patience: Callable[[str], bool] = lambda sender: False
        self.slowdown = Slowdown(config.slowdown)
        self.sizes = plan.micro_batch_sizes(self.lane)
        self.schedule = one_f_one_b(self.stage, len(plan.stages), len(self.sizes))
        self.step = plan.start_step
        self.tally = Tally()  # what it did and took of others' work, for the credit ledger (a swarm peer passes its own)
        self._dtype = TORCH_DTYPES[plan.dtype]
        # this stage's checks of its group's other lanes, and this peer's part in its lane neighbours' (`checks.py`)
        self.checks = Checks(plan, device_id, transport, (self.spec.seq_len, self.spec.hidden), config.timeout_s,
                             lambda: self.step)
        transport.set_policy(self.accept)

    # -- what this peer takes from the network --------------------------------------------------
    def accept(self, header: FrameHeader) -> str | None:
        """Why a frame is not what the plan says this peer should get, or None if it is."""
        if header.kind in GroupSync.KINDS:
            return self.sync.accept(header)
        if header.kind in ("state_request", "state"):
            return self.server.accept(header)
        if header.kind == "tied":
            return self._accept_tied(header)
        if header.kind in CHECK_KINDS:
            return self.checks.accept(header)
        if header.sender == self.previous:
            allowed = ("activation", "labels")
        elif header.sender == self.next:
            allowed = ("gradient",)
        else:
            return f"{header.sender} is not a neighbour of {self.device_id} in lane {self.lane}"
        if header.kind not in allowed:
            return f"{header.kind} is not expected from {header.sender}"
        if header.epoch != self.plan.epoch:  # a neighbour switching plans a moment before or after this one
            return Late(f"plan epoch {header.epoch}, this peer runs epoch {self.plan.epoch}")
        if not self.step <= header.step <= self.step + 1:
            return f"step {header.step} is not {self.step} or the next"
        if header.micro < len(self.sizes):
            rows = (self.sizes[header.micro], self.spec.seq_len)
        else:  # a validation micro-batch: forward only, at the plan's validation steps
            extra = header.micro - len(self.sizes)
            if header.kind == "gradient" or not self.plan.evaluates(header.step) or extra >= len(self.plan.eval_sizes):
                return f"micro-batch {header.micro} of {len(self.sizes)}"
            rows = (self.plan.eval_sizes[extra], self.spec.seq_len)
        shape, dtype = (rows, "int64") if header.kind == "labels" else ((*rows, self.spec.hidden), self.plan.dtype)
        if header.shape != shape or header.dtype != dtype:
            return f"{header.kind} is {header.dtype}{list(header.shape)}, expected {dtype}{list(shape)}"
        return None

    # -- one step ---------------------------------------------------------------------------------
    def compute(self) -> StepResult:
        """Forward and backward over the lane's micro-batches; gradients are left in `.grad`."""
        self.sync.begin(self.step)  # x(step) starts travelling to the group while the gradient is computed
        self.checks.begin(self.step)
        self.checks.note(self.step, self.flat.data)
        self.flat.zero_grad()
        step, timeout = self.step, self.config.timeout_s
        started = time.perf_counter()
        val_loss, wait_s = self._validate(step) if self.plan.evaluates(step) else (None, 0.0)
        data = self._lane_data(step)
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.config.device)
        for op, micro in self.schedule:
            if op == FORWARD:
                tick = time.perf_counter()
                if data is not None:
                    x, labels = data[micro]
                    inputs = None
                else:
                    # the residual stream stays fp32 on every stage, as on the first: only the wire is 16-bit
                    x = self._recv("activation", self.previous, step, micro).float().requires_grad_()
                    labels = self._recv("labels", self.previous, step, micro)
                    self.tally.received(self.previous, self.plan.epoch, "activations", step, self.sizes[micro])
                    self.checks.received("activation", step, micro, x)
                    inputs = x
                wait_s += time.perf_counter() - tick
                with self._autocast(), self.slowdown.of(("forward", self.sizes[micro])):
                    y = self.model(x)
                    if self.next is None:
                        y = self.model.loss(y, labels) * (self.sizes[micro] / self.plan.lane_sequences(self.lane))
                        loss_sum += y.detach()
                if self.next is not None:
                    sent = y.detach().to(self._dtype)
                    self._send("activation", self.next, sent, micro)
                    self._send("labels", self.next, labels, micro)
                    self.checks.sent("activation", step, micro, sent, self.codecs["activation"], labels)
                held[micro] = (inputs, y)
            else:
                inputs, y = held.pop(micro)
                if self.next is None:
                    with self.slowdown.of(("backward", self.sizes[micro])):
                        y.backward()
                else:
                    tick = time.perf_counter()
                    grad = self._recv("gradient", self.next, step, micro)
                    self.tally.received(self.next, self.plan.epoch, "gradients", step, self.sizes[micro])
                    self.checks.received("gradient", step, micro, grad)
                    wait_s += time.perf_counter() - tick
                    with self.slowdown.of(("backward", self.sizes[micro])):
                        y.backward(grad.to(y.dtype))
                if inputs is not None:
                    sent = inputs.grad.to(self._dtype)
                    self._send("gradient", self.previous, sent, micro)
                    self.checks.sent("gradient", step, micro, sent, self.codecs["gradient"])
        tick = time.perf_counter()
        self.transport.flush(timeout, to=[p for p in (self.previous, self.next) if p is not None])
        self._tie_gradients(step)
        wait_s += time.perf_counter() - tick
        judged, failed = self.checks.judged, self.checks.failed
        for check in self.checks.due(step):
            wait_s += self._check(check, step, time.perf_counter() - started)
        sequences = self.plan.lane_sequences(self.lane)
        self.tally.trained(self.plan.epoch, step, len(self.sizes), sequences)
        return StepResult(
            step=step,
            loss=float(loss_sum) if self.next is None else None,
            sequences=sequences,
            tokens=sequences * self.spec.seq_len,
            compute_s=time.perf_counter() - started - wait_s,
            wait_s=wait_s,
            val_loss=val_loss,
            windows=(self._position(step), self._position(step) + sequences) if self.previous is None else None,
            checks=(self.checks.judged - judged, self.checks.failed - failed),
        )

    def noise_scale(self) -> float | None:
        """The gradient noise scale (tokens) this peer's all-reduce group measured lately (`gossip/noise.py`); None in a
        group that does not all-reduce gradients, or before its first step."""
        return self.sync.noise.estimate(self.plan.lane_sequences(self.lane) * self.spec.seq_len,
                                        self.plan.rows_per_step * self.spec.seq_len)

    def apply(self, last: bool = False) -> SyncReport:
        """Average with the group and take the optimizer step that closes the current step; unless this is
        the `last` step, the new parameters start travelling for the next one."""
        report = self.sync.finish(self.step)
        if len(self.plan.stages) == 1:  # no lane neighbours to confirm the work: the group members it mixed in do
            for member in report.contributors:
                lane = self.plan.position(member)[1]
                self.tally.received(member, self.plan.epoch, "params", self.step, self.plan.lane_sequences(lane),
                                    micro=len(self.plan.micro_batch_sizes(lane)))
        self.step += 1
        if self.sync.ahead is not None and self.sync.ahead > self.step and len(self.plan.stages) == 1:
            # the group is further on (this peer was slow, or just joined): skip to where it is, with its state
            # when this peer's is stale
            behind, self.step = self.sync.ahead - self.step, self.sync.ahead
            how = "skipping"
            if behind >= STALE_STEPS:
                try:
                    download = self.fetch_state(keep_own=False)
                    how = f"downloaded its state ({download.bytes / 2**20:.1f} MiB from {', '.join(download.donors)})"
                except StateDownloadError as error:
                    how = f"skipping with its own state ({error})"
            log.info("%s: group is %d step(s) ahead, at step %d: %s", self.device_id, behind, self.step, how)
        self.sync.ahead = None
        self.transport.inbox.discard_before(self.step, running=self.plan.epoch, keep=self.checks.keeps)
        self.checks.forget_before(self.step)
        if not last:
            self.sync.begin(self.step)
        return report

    def train_step(self, last: bool = False) -> StepResult:
        result = self.compute()
        return replace(result, sync=self.apply(last))

    def fetch_state(
        self, donors: Sequence[str] | None = None, timeout_s: float | None = None, enter_at: int | None = None,
        keep_own: bool = True,
    ) -> Download:
        """Download this stage's parameters and optimizer state from `donors` (default: the rest of the
        group), and enter at `enter_at` (default: the step they are at); what a stage this peer held before
        has of them is kept unless not `keep_own`. A peer that enters a new plan stays at the plan's start
        step throughout, so its neighbours' first frames are never "ahead"."""
        donors = [d for d in (self.sync.members if donors is None else donors) if d != self.device_id]
        download = fetch_state(self.server, self.sync, *self.param_range, donors, timeout_s or self.config.timeout_s,
                               keep_own)
        self.step = self.sync.step = download.step if enter_at is None else enter_at
        self.sync.sent = None
        return download

    def _check(self, check: Check, step: int, step_s: float) -> float:
        """Recompute a micro-batch another lane's holder of this stage worked on, and judge its outputs against what its
        lane neighbours received (`checks.py`), at `step`, once the helpers' frames are here; seconds spent waiting on
        them. A helper that declines or does not answer in time drops the check, blaming no one. An all-reduce group waits up to
        twice this step's time so far (its lanes meet at the all-reduce anyway); others look again at later steps."""
        started = time.perf_counter()
        wait_s = max(1.0, 2 * step_s) if self.sync.mode == "allreduce" and check.step == step else 0.0
        size = self.plan.micro_batch_sizes(check.lane)[check.micro]
        try:
            pieces = self.checks.gather(check, wait_s)
            if pieces is None:
                return time.perf_counter() - started
            if check.previous is None:
                x, labels = self._lane_data(check.step, check.lane)[check.micro]
            else:
                (head, x), (tail, labels) = pieces[("check_input", check.previous)], pieces[("check_labels", check.previous)]
                x, labels = x.to(self.config.device).float().requires_grad_(), labels.to(self.config.device)
            grad = pieces.get(("check_grad", check.next))
            sums = [pieces[key][0].checksum if key in pieces else -1 for key in (
                ("check_input", check.previous), ("check_labels", check.previous), ("check_grad", check.next))]
            seen = {what: pieces[("sketch", sender)][1]
                    for what, sender in (("activations", check.next), ("gradients", check.previous)) if sender is not None}
            # its output is out: now it may learn of the check, and say what it got and which weights it holds
            if not self.checks.attest(check, tuple(sums), step, time.monotonic() + self.config.timeout_s):
                raise Declined("its weights at that step are not this peer's now: nothing to judge it by")
        except (Declined, Disputed, TransportTimeout) as error:
            self.checks.dropped += 1
            self.checks.done(check)
            log.info("%s: dropped its check of %s at step %d: %s", self.device_id, check.checked, check.step, error)
            return time.perf_counter() - started
        waited = time.perf_counter() - started
        with self._autocast(), self.slowdown.of(("forward", size)):
            y = self.model(x)
            if check.next is None:
                y = self.model.loss(y, labels) * (size / self.plan.lane_sequences(check.lane))
        if "activations" in seen:
            codec = self.plan.stages[self.stage].codecs(check.lane)[0]
            self.checks.judge(check, "activations", seen["activations"], as_received(y.detach().to(self._dtype), codec))
        if "gradients" in seen:
            with self.slowdown.of(("backward", size)):
                (recomputed,) = torch.autograd.grad(y, x, None if grad is None else grad[1].to(y.device, y.dtype))
            codec = self.plan.stages[self.stage - 1].codecs(check.lane)[1]
            self.checks.judge(check, "gradients", seen["gradients"], as_received(recomputed.to(self._dtype), codec))
        self.checks.done(check)
        return waited

    def _validate(self, step: int) -> tuple[float | None, float]:
        """Forward the lane's held-out batch through the pipeline, no gradients (micro-batch numbers after the
        training ones); (its mean loss on the last stage, else None; seconds waiting on neighbours)."""
        sizes, first, wait_s = self.plan.eval_sizes, len(self.sizes), 0.0
        data = None
        if self.previous is None:
            batch = self.corpus.validation_batch(self.plan.eval_batch, self.spec.seq_len, seed=self.seed)
            data = [(torch.from_numpy(p.tokens).to(self.config.device), torch.from_numpy(p.labels).to(self.config.device))
                    for p in batch.split(sizes)]
        total = torch.zeros((), device=self.config.device)
        with torch.no_grad():
            for e, size in enumerate(sizes):
                micro = first + e
                if data is not None:
                    x, labels = data[e]
                else:
                    tick = time.perf_counter()
                    x = self._recv("activation", self.previous, step, micro).float()
                    labels = self._recv("labels", self.previous, step, micro)
                    wait_s += time.perf_counter() - tick
                with self._autocast(), self.slowdown.of(("forward", size)):
                    y = self.model(x)
                if self.next is not None:
                    self._send("activation", self.next, y.to(self._dtype), micro)
                    self._send("labels", self.next, labels, micro)
                else:
                    total += self.model.loss(y, labels) * (size / self.plan.eval_batch)
        return (float(total) if self.next is None else None), wait_s

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self, folder: Path) -> Path:
        """Write this stage (weights, optimizer tensors, the step to train next) to folder/DEVICE.safetensors, atomically."""
        with self.sync.lock:
            optimizer = {name: t for name, t in self.sync.named_state().items() if name != "params"}
            return save_stage(folder / f"{self.device_id}.safetensors", self.model, optimizer, spec=self.spec,
                              layers=self.layers, step=self.step, epoch=self.plan.epoch, adam_step=self.sync.state.step,
                              data_position=self.plan.data_position_at(self.step), recipe=self.plan.recipe)

    def restore(self, path: Path) -> StageCheckpoint:
        """Take this stage's weights, moments and step from a checkpoint of exactly this stage of this model. A
        checkpoint made under another recipe is taken too (the organizer changed it): `recipe_changes` says how."""
        checkpoint = StageCheckpoint.read(path)
        with self.sync.lock:
            optimizer = {name: t for name, t in self.sync.named_state().items() if name != "params"}
            self.sync.arrived(load_stage(checkpoint, self.model, optimizer, self.spec, self.layers))
            self.sync.state.step = checkpoint.adam_step
        self.step = self.sync.step = checkpoint.step
        self.sync.sent = None
        return checkpoint

    def recipe_changes(self, checkpoint: StageCheckpoint) -> str:
        """How this plan's recipe differs from the one `checkpoint` trained by, in words ("" when it does not, or
        the checkpoint does not say)."""
        if checkpoint.recipe is None or checkpoint.recipe == self.plan.recipe:
            return ""
        return "; ".join(checkpoint.recipe.changes(self.plan.recipe))

    # -- a tied head ------------------------------------------------------------------------------
    def _tied_peer(self) -> tuple[torch.nn.Parameter | None, str | None]:
        """(this stage's copy of a tied matrix, the lane end holding the other copy); (None, None) when this
        stage holds neither or both."""
        if not self.spec.tied:
            return None, None
        embedding, head = self.model.tied_parameters()
        lane = self.plan.lanes[self.lane]
        if embedding is not None and head is None:
            return embedding, lane[-1]
        if head is not None and embedding is None:
            return head, lane[0]
        return None, None

    def _accept_tied(self, header: FrameHeader) -> str | None:
        mine, other = self._tied_peer()
        if mine is None or header.sender != other:
            return f"tied gradients are not expected from {header.sender}"
        if header.epoch != self.plan.epoch:
            return Late(f"plan epoch {header.epoch}, this peer runs epoch {self.plan.epoch}")
        if not self.step <= header.step <= self.step + 1 or header.micro != 0:
            return f"tied gradient of step {header.step} (micro {header.micro}) is not for step {self.step} or the next"
        if header.shape != tuple(mine.shape) or header.dtype != "fp32":
            return f"tied gradient is {header.dtype}{list(header.shape)}, expected fp32{list(mine.shape)}"
        return None

    def _tie_gradients(self, step: int) -> None:
        """Add the two gradients of a tied embedding and head: in place on a stage that holds both, else
        exchanged with the other end of the lane."""
        if not self.spec.tied:
            return
        embedding, head = self.model.tied_parameters()
        if embedding is not None and head is not None:
            embedding.grad.add_(head.grad)
            head.grad.copy_(embedding.grad)
            return
        mine, other = self._tied_peer()
        if mine is None:
            return
        self.transport.send(other, "tied", mine.grad, step=step, micro=0, epoch=self.plan.epoch)
        mine.grad.add_(self._recv("tied", other, step, 0).to(mine.grad.dtype))

    # -- helpers ----------------------------------------------------------------------------------
    def _lane_data(self, step: int, lane: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """A lane's micro-batches of `step` (this peer's lane by default), on a first stage; None on the others."""
        if self.previous is not None:
            return None
        lane = self.lane if lane is None else lane
        batch = self.corpus.batch(self._position(step, lane), self.plan.lane_sequences(lane), self.spec.seq_len, seed=self.seed)
        device = self.config.device
        return [
            (torch.from_numpy(part.tokens).to(device), torch.from_numpy(part.labels).to(device))
            for part in batch.split(self.plan.micro_batch_sizes(lane))
        ]

    def _position(self, step: int, lane: int | None = None) -> int:
        """The first of a lane's windows at `step`: its slice of the step's in the swarm's order."""
        return self.plan.data_position_at(step) + self.plan.lane_offset(self.lane if lane is None else lane)

    def _recv(self, kind: str, sender: str, step: int, micro: int) -> torch.Tensor:
        while True:
            try:
                header, tensor = self.transport.take(kind, sender, step, micro, self.config.timeout_s)
                if kind in ATTESTED and micro < len(self.sizes):  # what came, for the checkers of this stage
                    self.checks.got(kind, step, micro, header.checksum)
                return tensor.to(self.config.device)
            except TransportTimeout:
                if not self.patience(sender):
                    raise
                log.info("%s: %s is still fetching its state; waiting on for its %s of step %d", self.device_id, sender, kind, step)

    def _send(self, kind: str, to: str, tensor: torch.Tensor, micro: int) -> None:
        self.transport.send(
            to, kind, tensor, step=self.step, micro=micro, epoch=self.plan.epoch, codec=self.codecs.get(kind, "raw"),
            copy=False,
        )

    def _autocast(self):
        if self.plan.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.config.device).type, dtype=self._dtype)


def model_for(plan: Plan, given: ModelSpec | None) -> ModelSpec:
    """The model `plan` trains: a preset it names, or `given` (read from a model folder) when the plan names
    that model. A plan of a model this peer was not given is refused, saying which."""
    if given is not None and given.name == plan.model and given.layers == plan.layers:
        return given
    if plan.model in PRESETS:  # at the plan's depth
        return preset(plan.model, plan.layers)
    have = f"model {given.name}" if given is not None else "no model folder"
    raise ValueError(f"plan trains model {plan.model}, and this peer has {have}: give --model with the folder of "
                     "that model (the same config.json, sequence length and layers)")
