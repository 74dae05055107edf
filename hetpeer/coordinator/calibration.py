"""What a step takes beyond the time model, learned from the plan the swarm runs.

The time model predicts a step from what the peers announce: what their training achieved, what their probes
got of each link. Some of a step is in no announcement: each hop's trip through the transport's threads and
queues, a peer's heartbeat and probes taking the core its stage computes on, an operating system scheduling
more threads than it has cores. That shows as the running plan's measured step (`history.Pace`) beyond the
model's prediction for that same plan on the peers' latest figures. The coordinator keeps the difference
and adds it to every step the time model predicts (`Problem.step_overhead_s`) in every plan it weighs,
publishes or mends: a prediction said to the organizer is then what this swarm's steps have been taking,
and a plan's gain is weighed against the real cost of moving its weights. Plans rank the same with it or
without: every plan's step gets the same seconds.

A difference, not a ratio: what the model leaves out is mostly per-step and per-hop work that does not grow
with a plan's compute. Over five demo runs each, predictions with the difference landed 0.80 to 1.18 of the
measured step (mean 0.98), predictions scaled by the ratio 0.78 to 1.13 (mean 0.95; docs/planner.md).

It is taken afresh each time the running plan's pace closes a window, once `WINDOWS` have, while every
member of the plan is still announcing; a plan that has not run that long (a new one, a repair) is weighed
with the overhead learned before it. It is held to `BOUNDS` of the prediction it was learned against: a
model more than 2x off is one to mend, not to patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetpeer.coordinator import policy
from hetpeer.coordinator.history import Pace
from hetpeer.coordinator.planner import PlannerConfig
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord
from hetpeer.protocol.workload import Workload

WINDOWS = 3  # closed windows of the running plan's pace before its measured step counts
BOUNDS = (-0.5, 1.0)  # the overhead, in predictions of the plan it is learned from: measured over predicted 0.5 to 2
NEWS = 0.01  # seconds a step: a change the coordinator says in its log (the figures it predicts from swing)


@dataclass(frozen=True, slots=True)
class Calibration:
    overhead_s: float = 0.0  # measured minus predicted; 0 before any plan ran long enough
    epoch: int | None = None  # the plan it was learned from
    windows: int = 0  # that plan's closed windows then
    measured_s: float | None = None
    predicted_s: float | None = None  # the model's step for that plan on the figures of then, without an overhead

    def describe(self) -> str:
        """The coordinator's log line for a learned one."""
        return (f"plan epoch {self.epoch} measures {self.measured_s:.3f} s a step against {self.predicted_s:.3f} s predicted "
                f"on the peers' latest figures: every prediction adds {self.overhead_s * 1e3:+.0f} ms a step")


def measured(pace: Pace | None) -> bool:
    """Whether a plan's `pace` has closed the `WINDOWS` windows its step is learned from: before, what its peers
    announce is of the steps around its start (a peer leaving, a stage downloaded), not of the plan."""
    return pace is not None and len(pace.windows) >= WINDOWS


def due(calibration: Calibration, plan: Plan | None, pace: Pace | None) -> bool:
    """Whether the running `plan`'s `pace` has closed a window to learn from since `calibration` was taken."""
    if plan is None or not measured(pace):
        return False
    return (calibration.epoch, calibration.windows) != (plan.epoch, len(pace.windows))


def learn(plan: Plan, pace: Pace, records: Mapping[str, PeerRecord], workload: Workload, planner: PlannerConfig) -> Calibration | None:
    """`plan`'s measured step less its prediction on the `records` of now (every member's; the rest count as the
    planner would see them), or None where a member is not announcing."""
    if any(d not in records for d in plan.devices):
        return None
    problem, _ = policy.build_problem(records, workload, plan)
    predicted = policy.running_report(problem, planner, plan).cost["total_s"]
    measured = pace.step_s
    if not (measured and predicted > 0):
        return None
    overhead = min(max(measured - predicted, BOUNDS[0] * predicted), BOUNDS[1] * predicted)
    return Calibration(overhead, plan.epoch, len(pace.windows), measured, predicted)


def news(old: Calibration, new: Calibration) -> bool:
    """Whether `new` is worth a line in the log: the first one, or a change of more than `NEWS`."""
    return old.epoch is None or abs(new.overhead_s - old.overhead_s) > NEWS
