"""The swarm as the coordinator sees it (`SwarmView`) and as its API reports it (`Progress`, `PeerStatus`).

Plain values and the pure `progress` figures, shared by the API's two ends (`api.py`, `api_client.py`),
the dashboard (`board.py`) and `hetpeer status` (`console.py`). No gRPC here.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

from hetpeer.protocol.plan import Plan
from hetpeer.protocol.reach import FAILURES
from hetpeer.protocol.records import PeerRecord

ROUTES = ("direct", "punched", "relayed", "failed", "not yet")  # how a planned pair talks, in `route`'s words


@dataclass(frozen=True)
class SwarmView:
    """The coordinator's current view of the swarm, as of DHT time `now`."""

    swarm: str
    coordinator_key: str  # SHA-256 of the coordinator's public key, hex
    plan: Plan | None
    plan_time: float | None
    peers: Mapping[str, PeerRecord]  # device id -> its latest parsed announcement
    dropped: int  # records refused in the last read
    now: float
    step_overhead_s: float = 0.0  # what the running plan's steps took beyond the time model's prediction (`calibration.py`)


@dataclass(frozen=True)
class Progress:
    swarm: str
    coordinator_key: str
    epoch: int  # the current plan's; -1 without a plan
    step: int  # highest step among peers training (or leaving, having trained) under the current plan
    loss: float | None  # mean over the last stage's counted peers (see `progress`); None when none announces one
    tokens_per_s: float  # sum over the lanes' last stages
    peers_by_state: Mapping[str, int]
    dropped: int
    val_loss: float | None = None  # mean of the validation losses the same peers announce, when the plan asks for them
    step_overhead_s: float = 0.0  # the coordinator's learned one (`calibration.py`)
    noise_scale: float | None = None  # the gradient noise scale the plan's all-reduce groups measure (`noise_scale`)


@dataclass(frozen=True)
class PeerStatus:
    record: PeerRecord
    age_s: float  # how old the announcement was when the coordinator read it


def progress(view: SwarmView) -> Progress:
    """The swarm's progress from one view. Pure; O(peers).

    Each lane's last stage computes the loss and counts the tokens its lane trained, so loss and
    throughput come from the current plan's last-stage peers that say they are training; a peer
    left on standby, or still fetching, may announce stale figures and is not counted. Peers leaving
    under the current plan count with their last figures: a peer that stops at its last step says so
    only in its leaving record, and a watcher waiting for that step must see it (a plan without them
    follows at once when they leave early).
    """
    epoch = view.plan.epoch if view.plan is not None else None
    counted = [r for r in view.peers.values() if r.state == "training" or (r.state == "leaving" and r.epoch == epoch)]
    last = set(view.plan.stages[-1].devices) if view.plan is not None else set()
    heads = [r for r in counted if r.device_id in last]
    losses = [r.loss for r in heads if r.loss is not None]
    val_losses = [r.val_loss for r in heads if r.val_loss is not None]
    return Progress(
        swarm=view.swarm,
        coordinator_key=view.coordinator_key,
        epoch=view.plan.epoch if view.plan is not None else -1,
        step=max((r.step for r in counted), default=0),
        loss=sum(losses) / len(losses) if losses else None,
        tokens_per_s=float(sum(r.tokens_per_s for r in heads)),
        peers_by_state=dict(sorted(Counter(r.state for r in view.peers.values()).items())),
        dropped=view.dropped,
        val_loss=sum(val_losses) / len(val_losses) if val_losses else None,
        step_overhead_s=view.step_overhead_s,
        noise_scale=noise_scale(counted),
    )


def noise_scale(records: Iterable[PeerRecord]) -> float | None:
    """The swarm's gradient noise scale in tokens: the median of what its peers' all-reduce groups measure (each its
    own stage's, `peer/gossip/noise.py`); None where none measures one."""
    found = [r.noise_scale for r in records if r.noise_scale is not None]
    return statistics.median(found) if found else None


def route(peers: Mapping[str, PeerRecord], a: str, b: str) -> tuple[str, str]:
    """How the pair (a, b) talks now, as its two records say, and why where it fails: ("failed", how) where either
    could not reach the other lately (`PeerRecord.failed`, in `FAILURES`' words), else "punched" or "relayed"
    where either reaches the other so, "direct" where either measured the other, else "not yet"."""
    ends = [(peers.get(a), b), (peers.get(b), a)]
    for record, other in ends:
        if record is not None and (how := record.failed().get(other)) is not None:
            return "failed", FAILURES.get(how, how)
    for path in ("punched", "relayed"):
        if any(record is not None and other in getattr(record, path) for record, other in ends):
            return path, ""
    if any(record is not None and other in record.links for record, other in ends):
        return "direct", ""
    return "not yet", ""


def route_lines(plan: Plan, peers: Mapping[str, PeerRecord]) -> list[str]:
    """The plan's pairs (`Plan.links`) by route, one line, then one line per failed pair with how; [] without pairs."""
    routes = {pair: route(peers, *pair) for pair in sorted(plan.links)}
    if not routes:
        return []
    counts = Counter(path for path, _ in routes.values())
    lines = [", ".join(f"{counts[path]} {path}" for path in ROUTES if counts[path])]
    lines += [f"{a} - {b} failed: {how}" for (a, b), (path, how) in routes.items() if path == "failed"]
    return lines
