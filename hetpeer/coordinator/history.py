"""What the coordinator remembers of a run for its organizer: progress over time, the plans it ran with
their predicted and measured step times, and events (joins, leaves, re-plans, bans). Pure and bounded.

Samples are taken once a round; when `max_samples` are held, every other one is dropped and the
interval between samples doubles, so the history always spans the whole run at an even resolution
(a page opened after days still shows the first hour). The newest sample always holds the latest round:
between kept samples it moves with the swarm. Events and plans are kept newest last, at most
`max_events` and `max_plans`. Every change bumps `version`: the dashboard serves a new document then.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from statistics import mean, median
from typing import Iterable, Mapping, Reversible

from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

EVENT_KINDS = ("join", "leave", "plan", "ban", "refused", "coordinator", "credit")
WINDOW_STEPS = 10  # a plan's measured step is taken over windows of at least this many steps
STALLED_WINDOW = 1.5  # a window slower than this times the median one held a stall (or the plan's start)
MAX_WINDOWS = 256  # windows a plan keeps, newest last
CHURN_WINDOW_S = 3600.0  # departures are counted over this last stretch of the swarm's time
# peer-seconds without a departure that the rate starts from: the first peer to leave a young swarm is one event, not
# yet a rate (1 of 4 peers gone in a minute would price a departure every 4 minutes a peer; with this, every hour)
CHURN_PRIOR_S = 3600.0
NAMED_AT_MOST = 5  # a round in which more peers join (or leave) than this is one event naming the first few


@dataclass(frozen=True, slots=True)
class Sample:
    time: float  # DHT time (UNIX seconds)
    step: int
    epoch: int
    loss: float | None
    val_loss: float | None
    tokens_per_s: float | None
    training: int  # peers training
    noise_scale: float | None = None  # the swarm's gradient noise scale, tokens (`view.noise_scale`)


@dataclass(frozen=True, slots=True)
class Pace:
    """A plan's measured step, defined one way for the dashboard, the API and `hetpeer swarm`'s report: the
    mean, over windows of at least `WINDOW_STEPS` steps run under the plan, of each window's seconds per step,
    leaving out the windows over `STALLED_WINDOW` times the median one: those held a stall or the plan's own
    start. A window's mean takes in the slow steps that come now and then (a gossip round late, a peer's
    heartbeat) as a swarm pays for them; the mean over windows keeps them where they fall into only some
    windows (the median of windows alike but for one such step in every other window would take the slower
    half). Before a whole window ran, the open one's mean so far. Fed (time, step) points in order, from any
    clock in seconds."""

    start: tuple[float, int] | None = None  # where the open window began
    last: tuple[float, int] | None = None  # the latest point
    windows: tuple[float, ...] = ()  # seconds per step of each closed window, at most MAX_WINDOWS, newest last

    def add(self, time: float, step: int) -> "Pace":
        if self.start is None:
            return Pace((time, step), (time, step))
        began, first = self.start
        if step - first < WINDOW_STEPS:
            return replace(self, last=(time, step))
        return Pace((time, step), (time, step), (*self.windows, (time - began) / (step - first))[-MAX_WINDOWS:])

    @property
    def step_s(self) -> float | None:
        """The measured step; None before a step ran."""
        if self.windows:
            typical = median(self.windows)
            return mean(w for w in self.windows if w <= STALLED_WINDOW * typical)
        if self.start is None or self.last[1] <= self.start[1]:
            return None
        return (self.last[0] - self.start[0]) / (self.last[1] - self.start[1])


@dataclass(frozen=True, slots=True)
class PlanEntry:
    epoch: int
    start_step: int
    published: float  # DHT time
    stages: int
    lanes: int
    standby: int
    predicted_step_s: float | None
    reason: str
    pace: Pace = Pace()  # of the samples past its start step

    @property
    def steps(self) -> int:
        """Steps the swarm ran under this plan, as far as the latest sample saw."""
        return self.pace.last[1] - self.start_step if self.pace.last else 0

    @property
    def measured_step_s(self) -> float | None:
        """Seconds per step under this plan (`Pace`)."""
        return self.pace.step_s


@dataclass(frozen=True, slots=True)
class Event:
    time: float
    kind: str  # one of EVENT_KINDS
    text: str


class History:
    def __init__(self, max_samples: int = 2048, max_events: int = 1000, max_plans: int = 256) -> None:
        if max_samples < 4 or max_events < 1 or max_plans < 1:
            raise ValueError("history needs room for 4 samples, 1 event and 1 plan at least")
        self.max_samples = max_samples
        self.samples: list[Sample] = []
        self.interval_s = 0.0  # grows as the history is thinned
        self._kept_at = -math.inf  # when the last sample was kept
        self._moving = False  # the newest sample is the latest round's, replaced by the next one
        self.events: deque[Event] = deque(maxlen=max_events)
        self.plans: deque[PlanEntry] = deque(maxlen=max_plans)
        self.version = 0
        self.plans_seen = 0  # every plan since the start, however many the history still holds
        self._present: dict[str, str] = {}  # device -> state, as of the last round
        self._rounds: deque[tuple[float, float, int]] = deque()  # (time, peer-seconds since the round before, departures)
        self._started = 0.0  # the first round's time

    # -- what the coordinator tells it --------------------------------------------------------------
    def event(self, time: float, kind: str, text: str) -> None:
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {', '.join(EVENT_KINDS)}, got {kind!r}")
        self.events.append(Event(time, kind, text))
        self.version += 1

    def plan(self, plan: Plan, published: float, reason: str) -> None:
        """A plan the coordinator published (or found running): its row in the history, an event."""
        if any(p.epoch == plan.epoch for p in self.plans):
            return
        predicted = _finite(plan.total_s)  # NaN: rebuilt from checkpoints
        self.plans_seen += 1
        self.plans.append(PlanEntry(plan.epoch, plan.start_step, published, len(plan.stages), plan.group_size,
                                    len(plan.standby), predicted, reason))
        self.event(published, "plan", f"plan epoch {plan.epoch} from step {plan.start_step}: {len(plan.stages)} "
                                      f"stage(s) x {plan.group_size} lane(s) ({reason})")

    def observe(self, now: float, peers: Mapping[str, PeerRecord], plan: Plan | None, plan_time: float | None,
                step: int, loss: float | None, val_loss: float | None, tokens_per_s: float,
                noise_scale: float | None = None) -> None:
        """One round: joins and leaves since the last, the running plan's measured pace, a sample when due."""
        self._membership(now, peers)
        if plan is not None:
            self.plan(plan, plan_time if plan_time is not None else now, "found running in the DHT")
            self._pace(plan, now, step)
        training = sum(1 for r in peers.values() if r.state == "training")
        # peers' figures are finite one by one; their sums need not be, and JSON has no infinity
        sample = Sample(now, step, plan.epoch if plan is not None else -1, _finite(loss), _finite(val_loss),
                        _finite(tokens_per_s), training, _finite(noise_scale))
        if self._moving:
            self.samples[-1] = sample
        else:
            self.samples.append(sample)
        due = now - self._kept_at >= self.interval_s
        self._moving = not due
        if due:
            self._kept_at = now
        if len(self.samples) > self.max_samples:
            self._thin()
        self.version += 1

    def current(self, epoch: int) -> PlanEntry | None:
        """Plan `epoch`'s entry, if the history holds it (as `Past.current`, without a snapshot)."""
        return _entry(self.plans, epoch)

    def snapshot(self) -> "Past":
        """The history as it is now, frozen: readers on other threads use this while the rounds go on."""
        return Past(tuple(self.samples), tuple(self.plans), tuple(self.events), self.version, self.plans_seen)

    # -- inside -------------------------------------------------------------------------------------
    def _thin(self) -> None:
        """Keep every other sample (the newest always) and sample half as often from now on."""
        self.samples = self.samples[::-1][::2][::-1]
        spans = [b.time - a.time for a, b in zip(self.samples, self.samples[1:])]
        self.interval_s = max(self.interval_s * 2, min(spans, default=0.0))

    def _pace(self, plan: Plan, now: float, step: int) -> None:
        for i, entry in enumerate(self.plans):
            if entry.epoch != plan.epoch or step <= entry.start_step:
                continue
            if entry.pace.last is None or step != entry.pace.last[1]:
                self.plans[i] = replace(entry, pace=entry.pace.add(now, step))

    def departure_rate(self) -> float:
        """Departures per peer and second over the last `CHURN_WINDOW_S` (a peer that says it leaves, or stops
        announcing), with `CHURN_PRIOR_S` more peer-seconds without one: what the planner prices a departure at."""
        exposure = sum(seconds for _, seconds, _ in self._rounds)
        return sum(gone for _, _, gone in self._rounds) / (exposure + CHURN_PRIOR_S)

    def _membership(self, now: float, peers: Mapping[str, PeerRecord]) -> None:
        joined = [d for d in peers if d not in self._present]
        left = [d for d, r in peers.items() if r.state == "leaving" and self._present.get(d, "") != "leaving"]
        gone = [d for d, state in self._present.items() if d not in peers and state != "leaving"]
        if self._rounds or self._present:
            since = now - (self._rounds[-1][0] if self._rounds else self._started)
            self._rounds.append((now, max(since, 0.0) * len(self._present), len(left) + len(gone)))
        else:
            self._started = now
        while self._rounds and self._rounds[0][0] < now - CHURN_WINDOW_S:
            self._rounds.popleft()
        self._present = {d: r.state for d, r in peers.items()}
        for devices, kind, words in ((joined, "join", "joined"), (left, "leave", "left"),
                                     (gone, "leave", "stopped announcing")):
            if devices:
                self.event(now, kind, _name_some(devices, words))


@dataclass(frozen=True, slots=True)
class Past:
    samples: tuple[Sample, ...] = ()
    plans: tuple[PlanEntry, ...] = ()
    events: tuple[Event, ...] = ()
    version: int = 0
    plans_seen: int = 0

    def current(self, epoch: int) -> PlanEntry | None:
        return _entry(self.plans, epoch)

    def to_wire(self) -> dict:
        return {
            "sample_fields": list(SAMPLE_FIELDS),
            "samples": [[getattr(s, name) for name in SAMPLE_FIELDS] for s in self.samples],
            "plans": [plan_wire(p) for p in self.plans],
            "events": [{"time": e.time, "kind": e.kind, "text": e.text} for e in self.events],
        }


SAMPLE_FIELDS = ("time", "step", "epoch", "loss", "val_loss", "tokens_per_s", "training", "noise_scale")


def plan_wire(p: PlanEntry) -> dict:
    return {
        "epoch": p.epoch, "start_step": p.start_step, "published": p.published, "stages": p.stages, "lanes": p.lanes,
        "standby": p.standby, "predicted_step_s": p.predicted_step_s, "measured_step_s": p.measured_step_s,
        "steps": p.steps, "reason": p.reason,
    }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _name_some(devices: Iterable[str], words: str) -> str:
    devices = sorted(devices)
    if len(devices) == 1:
        return f"{devices[0]} {words}"
    if len(devices) <= NAMED_AT_MOST:
        return f"{', '.join(devices)} {words}"
    return f"{len(devices)} peers {words}: {', '.join(devices[:NAMED_AT_MOST])} and {len(devices) - NAMED_AT_MOST} more"


def _entry(plans: Reversible[PlanEntry], epoch: int) -> PlanEntry | None:
    """The entry of plan `epoch` among `plans` (newest last), or None."""
    return next((p for p in reversed(plans) if p.epoch == epoch), None)
