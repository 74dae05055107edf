"""The planner's input: devices as arrays, links as matrices, the workload, and the shapes to search.

A grid is the planner's genome: an int array of shape (stages, group_size) of device indices, row s
the group holding stage s in lane order, column l the lane. Devices of the problem not in the grid
are on standby.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hetpeer.coordinator.planner.relays import Relays
from hetpeer.coordinator.planner.sharing import Sharing
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.stepcosts import CODEC_FIELDS, FIELDS as STEP_COSTS
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload


class PlanningError(ValueError):
    """The problem has no valid plan (no shape fits, nothing fits in memory, missing measurements)."""


@dataclass(frozen=True, slots=True)
class Shape:
    stages: int
    group_size: int

    @property
    def devices(self) -> int:
        return self.stages * self.group_size

    def __str__(self) -> str:
        return f"{self.stages} stage{'s' * (self.stages != 1)} x {self.group_size} lane{'s' * (self.group_size != 1)}"


@dataclass(frozen=True, slots=True)
class Report:
    """A cost model's account of one grid: layers per stage, each group's sync mode, seconds by part.

    `objective` is what the search minimises: `cost["total_s"]`, for the time model times the steps factor and
    what departures cost the grid, plus the amortised cost of moving weights from the current plan and any
    memory overflow penalty.
    """

    layers: tuple[int, ...]
    sync: tuple[str, ...]
    cost: dict[str, float]
    objective: float
    fits_memory: bool = True
    recompute: tuple[int, ...] = ()  # per stage, layers that recompute their activations (none when empty)
    # per hop (stage s to s + 1), per lane: the codecs of activations and of their gradients back (() all raw)
    codecs: tuple[tuple[tuple[str, str], ...], ...] = ()
    outer_every: tuple[int, ...] = ()  # per stage, H of a group with outer steps (0 otherwise; () none has them)
    outer_delay: tuple[int, ...] = ()  # per stage, the steps its exchange overlaps (D)
    steps_factor: float = 1.0  # all-reduce's steps to the loss over this plan's (`quality.py`)
    lane_batches: tuple[int, ...] = ()  # sequences per lane, summing to the batch (`lanes.py`; () the even split)
    # per relay the plan routes pairs through: (its device id, the pairs, the bytes it carries a step; `relays.py`)
    relay_load: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Problem:
    """Everything the planner knows. Matrices are (n, n), indexed like `device_ids`; the diagonal is unused.

    `dp_bytes` and `pp_bytes` override the dtfm cost model's c_DP (one stage's gradients) and c_PP
    (one lane's activations per step), which otherwise follow from the workload.
    """

    device_ids: tuple[str, ...]
    latency_s: np.ndarray
    bandwidth_bytes_per_s: np.ndarray
    workload: Workload
    tflops: np.ndarray | None = None
    memory_bytes: np.ndarray | None = None
    dp_bytes: float | None = None
    pp_bytes: float | None = None
    current: Plan | None = None
    # fixed seconds every step takes beyond compute and transfers: from efficiency terms (`efficiency.py`), or what the
    # swarm's running plan measured beyond its prediction (`coordinator/calibration.py`, which may be below 0)
    step_overhead_s: float = 0.0
    sharing: Sharing | None = None  # devices that compute on one device (`sharing.py`); None: each has its own
    # (n, len(stepcosts.FIELDS)): what a stage's step costs each device beyond its blocks, as `StepCosts` has them
    # (embedding and head s/sequence, optimizer s/parameter, Python s/micro-batch, recomputation's share of a
    # layer, each codec's encoding and decoding s/value); None: not measured
    step_costs: np.ndarray | None = None
    # the gradient noise scale the swarm's all-reduce groups measure (B_simple in tokens; `quality.py` places groups on
    # the steps factor table by it); None: not measured
    noise_scale_tokens: float | None = None
    # departures per device and second (as the coordinator observed them) x the seconds one stalls a group that waits for
    # every member (all-reduce, outer steps) until the plan is repaired: what a departure costs each sync mode; 0: none
    departure_stall: float = 0.0
    # the pairs that talk through a relay and the relays' capacities (`relays.py`); None: every pair has a path of its own
    relays: Relays | None = None
    # matrices derived once and shared by every shape's cost model: n^2 floats each, gigabytes at 10,000 devices
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def seconds_per_byte(self) -> np.ndarray:
        """1 / bandwidth, (n, n)."""
        if "per_byte" not in self._derived:
            self._derived["per_byte"] = 1 / self.bandwidth_bytes_per_s
        return self._derived["per_byte"]

    def transfer_s(self, size_bytes: float) -> np.ndarray:
        """(n, n) seconds to send `size_bytes` between each pair (latency + bytes / bandwidth; 0 to itself).
        Kept for the sizes last asked (shapes mostly share their micro-batch, so their hop size)."""
        key = ("transfer", float(size_bytes))
        if key not in self._derived:
            if len(self._derived) > 4:  # a few sizes at most: one per micro-batch size and the layer's weights
                for old in [k for k in self._derived if k != "per_byte"][:1]:
                    del self._derived[old]
            seconds = self.latency_s + size_bytes * self.seconds_per_byte
            np.fill_diagonal(seconds, 0.0)
            self._derived[key] = seconds
        return self._derived[key]

    @property
    def n(self) -> int:
        return len(self.device_ids)

    @property
    def layers(self) -> int:
        return self.workload.model.layers

    @staticmethod
    def from_topology(
        topology: Topology,
        workload: Workload,
        *,
        dp_bytes: float | None = None,
        pp_bytes: float | None = None,
        current: Plan | None = None,
    ) -> "Problem":
        devices = topology.devices
        latency_ms, bandwidth_gbps = topology.link_matrices()
        latency = latency_ms / 1e3
        bandwidth = bandwidth_gbps * 1e9 / 8
        np.fill_diagonal(latency, 0.0)  # a device does not talk to itself
        np.fill_diagonal(bandwidth, np.inf)
        tflops = memory = None
        if all(d.tflops is not None for d in devices):
            tflops = np.array([d.tflops for d in devices], dtype=float)
        if any(d.memory_gb is not None for d in devices):  # a device that does not say is not limited
            memory = np.array([np.inf if d.memory_gb is None else d.memory_gb * 1e9 for d in devices])
        for name, value in (("dp_bytes", dp_bytes), ("pp_bytes", pp_bytes)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PlanningError(f"{name} must be a positive number of bytes, got {value}")
        step_costs = None
        if any(d.codec_s for d in devices):  # the codec rates devices measured; nothing else of their step costs
            step_costs = np.zeros((len(devices), len(STEP_COSTS)))
            for i, device in enumerate(devices):
                for codec, rate in device.codec_s:
                    step_costs[i, STEP_COSTS.index(CODEC_FIELDS[codec])] = rate
        return Problem(
            device_ids=tuple(d.id for d in devices),
            latency_s=latency,
            bandwidth_bytes_per_s=bandwidth,
            workload=workload,
            tflops=tflops,
            memory_bytes=memory,
            dp_bytes=dp_bytes,
            pp_bytes=pp_bytes,
            current=current,
            step_costs=step_costs,
        )

    def subset(self, devices: np.ndarray) -> "Problem":
        """The same problem over `devices` (indices, ascending) only."""
        pick = np.ix_(devices, devices)
        return Problem(
            device_ids=tuple(self.device_ids[d] for d in devices),
            latency_s=self.latency_s[pick],
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s[pick],
            workload=self.workload,
            tflops=None if self.tflops is None else self.tflops[devices],
            memory_bytes=None if self.memory_bytes is None else self.memory_bytes[devices],
            dp_bytes=self.dp_bytes,
            pp_bytes=self.pp_bytes,
            current=self.current,
            step_overhead_s=self.step_overhead_s,
            sharing=None if self.sharing is None else self.sharing.subset(devices),
            step_costs=None if self.step_costs is None else self.step_costs[devices],
            noise_scale_tokens=self.noise_scale_tokens,
            departure_stall=self.departure_stall,
            relays=None if self.relays is None else self.relays.subset(devices),
        )

    def lanes_batch(self, group_size: int) -> int:
        """Sequences per lane per step: the batch split over the lanes, rounded up."""
        return -(-self.workload.batch // group_size)

    def lane_micro_batch(self, group_size: int) -> int:
        """Sequences per micro-batch: the workload's, unless a lane's share of the batch is smaller."""
        return min(self.workload.micro_batch, self.lanes_batch(group_size))

    def micro_batches(self, group_size: int) -> int:
        return -(-self.lanes_batch(group_size) // self.lane_micro_batch(group_size))

    def shapes(self, stages: int | None, group_size: int | None, allow_standby: bool) -> list[Shape]:
        """Every shape the search may use, or PlanningError naming why there is none."""
        n, layers = self.n, self.layers
        if stages is not None and not 1 <= stages <= layers:
            raise PlanningError(f"stages must be between 1 and the model's {layers} layers, got {stages}")
        if group_size is not None and group_size < 1:
            raise PlanningError(f"group size must be at least 1, got {group_size}")
        shapes = []
        for s in [stages] if stages is not None else range(1, min(layers, n) + 1):
            # no more lanes than sequences in the batch: a lane beyond them would have nothing to train on
            fit = min(n // s, self.workload.batch) if allow_standby else n // s
            sizes = [group_size] if group_size is not None else _group_sizes(fit, allow_standby)
            for m in sizes:
                if s * m == n or (allow_standby and s * m < n):
                    shapes.append(Shape(s, m))
        if not shapes:
            wanted = f"{stages or 'any'} stages x {group_size or 'any'} lanes"
            rule = "at most" if allow_standby else "exactly"
            raise PlanningError(
                f"no shape fits {n} devices: {wanted} must use {rule} {n} devices with at most {layers} stages"
            )
        return shapes


def _group_sizes(largest: int, allow_standby: bool) -> list[int]:
    """Group sizes worth trying when at most `largest` fit: all of them while few, else the largest
    few and a geometric thinning below (leaving more than half the swarm idle rarely pays)."""
    if not allow_standby or largest <= 16:
        return list(range(1, largest + 1))
    near = range(max(1, largest - 7), largest + 1)
    thinned = {max(1, round(largest * f)) for f in (0.5, 0.6, 0.7, 0.8, 0.9)}
    return sorted(set(near) | thinned)
