"""Devices that cannot matter, taken out before the search (under the `time` model, with standby allowed).

A swarm of strangers holds devices no plan should use: a Raspberry Pi among V100s, a laptop GPU with less
memory than one layer's training state. Searching over them costs time and memory (the search is O(n^2) in
links) and finds nothing. Two rules, each a proof that no plan the time model would choose uses the device:

- too small: its usable memory (less the reserve) is below one layer's training state and what it keeps
  for one sequence's backward pass, which every stage holds at least (a recomputing stage rebuilds a
  layer's activations at a time; more layers, sequences and a group's exchange only add to it), so every
  plan with it overflows;
- too slow: in any plan with m lanes, a device processes at least one micro-batch (of min(micro-batch,
  ceil(batch / m)) sequences: lanes share a step's micro-batches by their speed, each lane one at least)
  through at least one layer, forward and backward, and the lane's step takes at least that long (the time
  model's lane is round trip + (M - 1) x bottleneck, at least M micro-batches of its compute). With the most
  lanes any plan can have, that bound still exceeds the predicted step of a plan without the device (`reference_s`,
  from a few block layouts of the fastest remaining devices): no plan with it is as fast.

Pruning is O(n) plus a handful of cost evaluations; it is skipped where the planner must use every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hetpeer.coordinator.planner.grid import layouts
from hetpeer.coordinator.planner.problem import Problem, Report, Shape
from hetpeer.protocol.workload import STATE_BYTES_PER_PARAM

REFERENCE_STAGES = 4  # stage counts tried for the reference plan: the model's depth and a few divisors of it
REFERENCE_SHARES = (1.0, 0.5, 0.25)  # of the fastest devices the reference plans use


@dataclass(frozen=True, slots=True)
class Pruned:
    kept: np.ndarray  # indices into the problem's devices, ascending
    too_small: np.ndarray
    too_slow: np.ndarray
    layer_gb: float  # one layer's training state and one sequence's activations: what the smallest stage holds at least
    reference_s: float  # the predicted step of the plan the slow devices were measured against (inf: none)

    def reasons(self, device_ids: tuple[str, ...]) -> dict[str, list[str]]:
        """The pruned devices by reason, in words an organizer reads in the plan."""
        return {
            f"too small: less usable memory than one layer's training state and activations ({self.layer_gb:.2f} GB)":
                [device_ids[d] for d in self.too_small],
            f"too slow: one layer of its share of the batch takes longer than a whole step without it "
            f"({self.reference_s:.3g} s)": [device_ids[d] for d in self.too_slow],
        }  # fmt: skip


def prune(
    problem: Problem, memory_reserve: float, report: Callable[[Problem, Shape, np.ndarray], Report]
) -> Pruned:
    """Devices that cannot be in a plan the search should return, and why. `report(problem, shape, grid)`
    is the cost model's account of a grid (used for the reference plan)."""
    n, w = problem.n, problem.workload
    everyone = np.arange(n)
    layer_bytes = STATE_BYTES_PER_PARAM * w.model.layer_params + w.layer_activation_bytes(1)
    if problem.memory_bytes is None:
        too_small = np.zeros(n, dtype=bool)
    else:
        too_small = problem.memory_bytes * (1 - memory_reserve) < layer_bytes
    remaining = everyone[~too_small]
    reference_s = _reference_s(problem, remaining, report) if problem.tflops is not None else np.inf
    too_slow = np.zeros(n, dtype=bool)
    if np.isfinite(reference_s):
        most_lanes = max(1, min(w.batch, len(remaining)))
        sequences = min(w.micro_batch, -(-w.batch // most_lanes))  # one micro-batch, at the most lanes
        # every step pays the problem's fixed overhead too (a coordinator's learned one may be negative)
        least_s = sequences * 3 * w.layer_fwd_flops_per_seq / (problem.tflops * 1e12) + problem.step_overhead_s
        too_slow = ~too_small & (least_s > reference_s)
    return Pruned(
        kept=everyone[~too_small & ~too_slow], too_small=everyone[too_small], too_slow=everyone[too_slow],
        layer_gb=layer_bytes / 1e9, reference_s=float(reference_s),
    )


def _reference_s(problem: Problem, devices: np.ndarray, report: Callable[[Problem, Shape, np.ndarray], Report]) -> float:
    """The best predicted step among block layouts of the fastest `devices` (all, half, a quarter of them), over a
    few stage counts (each with as many lanes as fit, at most one per sequence of the batch), counting only plans
    that fit in memory."""
    layers, batch = problem.layers, problem.workload.batch
    fastest = devices[np.argsort(-problem.tflops[devices], kind="stable")]
    best = np.inf
    shapes = {Shape(stages, min(batch, int(len(fastest) * share) // stages))
              for stages in {max(1, layers // k) for k in range(1, REFERENCE_STAGES + 1)} for share in REFERENCE_SHARES}
    for shape in sorted(shapes, key=lambda shape: (shape.stages, shape.group_size)):
        if shape.group_size < 1:
            continue
        for grid in layouts(shape, fastest[: shape.devices]):
            found = report(problem, shape, grid)
            if found.fits_memory:
                best = min(best, found.cost["total_s"])
    return best
