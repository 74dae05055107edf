"""What a swarm peer announces of itself on every heartbeat: its `PeerRecord` (what it measured, what it
holds, where it is, how its training goes) and the peers it reports as misbehaving (`suspects.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hetpeer import __version__
from hetpeer.protocol.identity import DEVICE_RE
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import MAX_LINKS, MAX_SUSPECTS, PeerRecord
from hetpeer.protocol.stepcosts import StepCosts
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.workload import Workload

UNREACHED_HEARTBEATS = 15  # a peer it failed to reach is reported this long after, unless frames cross again
BLOCKS_SHARE = 0.1  # of a step's compute, the least its blocks are taken to have had (a probe that timed the rest too long)


@dataclass(frozen=True, slots=True)
class Status:
    """What this peer announces about its training; replaced whole, so readers never see half an update."""

    state: str = "probing"
    epoch: int = -1
    layers: tuple[int, int] | None = None
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # its lane's latest validation loss (last stage)
    noise_scale: float | None = None  # the gradient noise scale its all-reduce group measures (tokens)
    tokens_per_s: float = 0.0
    achieved_tflops: float | None = None  # of its training steps: the stage's FLOPs over the median compute time


def achieved_tflops(plan: Plan, me: str, spec: ModelSpec, compute_s: float, costs: StepCosts) -> float:
    """What `me`'s blocks achieve in training under `plan`, in TFLOPS, as the planner's time model means a device's
    TFLOPS: its layers' FLOPs for the lane's batch (forward and backward: 3x forward; a recomputed layer its probe's
    share of that more, `StepCosts.recompute`) over `compute_s`, a step's compute, less what the rest of the stage's
    step costs by its probe (`costs`: the embedding on the first stage, the head and loss on the last, the Python
    around each micro-batch). Where the probe did not time the head (a peer that announces no step costs), the head
    counts by its FLOPs, as a block."""
    stage, lane = plan.position(me)
    first, last = stage == 0, stage == len(plan.stages) - 1
    workload = Workload(spec, batch=plan.batch, micro_batch=plan.micro_batch, dtype=plan.dtype)
    flops = workload.stage_flops(plan.stages[stage].layers, last=last and not costs.head_s_per_seq, sequences=plan.lane_sequences(lane),
                                 recompute=plan.stages[stage].recompute, recompute_share=costs.recompute)
    rest = plan.lane_sequences(lane) * (first * costs.embed_s_per_seq + last * costs.head_s_per_seq) \
        + len(plan.micro_batch_sizes(lane)) * costs.micro_s
    return flops / max(compute_s - rest, BLOCKS_SHARE * compute_s) / 1e12


class Announcing:
    """The part of `SwarmPeer` that writes its record (`_record`: on the control thread, and once more as
    it leaves) from its `status`, `machine`, `links`, `checkpoint` and `tally` (the work it did and took of others,
    for the credit ledger), and keeps the `suspects` it reports."""

    def _record(self) -> PeerRecord:
        status, machine = self.status, self.machine
        with self.lock:
            links = self.links.current()
        self._suspect()
        paths = {d: path for d, path in self.transport.paths().items() if d in self.records}
        failed = [(d, how) for d, how in self.transport.unreachable(UNREACHED_HEARTBEATS * self.config.heartbeat_s).items()
                  if d in self.records][:MAX_SUSPECTS]
        return PeerRecord(
            device_id=self.device_id,
            model=self.spec.name,
            dtype=self.config.dtype,
            device_name=machine.device_name,
            tflops=machine.tflops,
            memory_bytes=machine.memory_bytes,
            address=self.transport.address(),
            state=status.state,
            time=self.control.now(),
            epoch=status.epoch,
            layers=status.layers,
            step=status.step,
            loss=status.loss,
            val_loss=status.val_loss,
            noise_scale=status.noise_scale,
            checkpoint=(*checkpoint.layers, checkpoint.step, checkpoint.data_position) if (checkpoint := self.checkpoint) is not None else None,
            tokens_per_s=status.tokens_per_s,
            achieved_tflops=status.achieved_tflops,
            links=links,
            dht=self.control.dialable_maddrs(),
            token=self.config.token,
            suspects=self.suspects,
            compute_key=machine.compute_key,
            compute_share=machine.compute_share,
            compute_background=machine.compute_background,
            compute_own=machine.compute_own,
            timings=machine.timings,
            step_costs=machine.step_costs,
            reachable=self.announced_reachable,
            unreachable=tuple(d for d, _ in failed),
            unreachable_how=tuple(how for _, how in failed),
            punch=self.punch_port,
            calling=self.calling,
            punched=tuple(sorted(d for d, path in paths.items() if path == "punched"))[:MAX_LINKS],
            relayed=tuple(sorted(d for d, path in paths.items() if path == "relayed"))[:MAX_LINKS],
            team=self.config.team,
            received=self.tally.receipts(),
            trained=self.tally.claims(),
            software=f"hetpeer {__version__}",
        )

    def _suspect(self) -> None:
        """Update the peers this peer reports (`suspects.py`); say so when one is reported first."""
        worker = self.worker
        streaks = worker.sync.outliers() if worker is not None else {}
        caught = worker.checks.caught() if worker is not None else {}
        sent = "its parameters" if worker is not None and worker.sync.mode == "gossip" else \
            "its gradient, or its change at outer steps"
        misbehaving = {d: n for d, n in self.transport.inbox.misbehaving.items() if DEVICE_RE.match(d) and d != self.device_id}
        suspects = self.suspicion.update(misbehaving, {**streaks, **{d: 1 for d in caught}}, time.monotonic())
        for device in set(suspects) - set(self.suspects):
            clipped = streaks.get(device, 0)
            self.report(f"reports {device} as misbehaving: " + (
                f"a check caught it: {caught[device].words}" if device in caught
                else f"what it sent its group far off {clipped} rounds in a row ({sent})" if clipped
                else f"{self.transport.inbox.misbehaving[device]} frame(s) refused so far"))
        self.suspects = suspects
