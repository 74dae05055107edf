"""What the coordinator decides, as pure functions of what it read: no DHT, no clock, no threads.

- `build_problem`: the planner's `Problem` from the peers' announcements. Compute is what a peer's
  training achieved, or its probe corrected by the swarm's achieved-over-probed (`effective_tflops`);
  peers that announce one compute device share it (`Sharing`), and what a peer achieved while sharing
  is counted as what it would achieve alone (its slowdown under the running plan taken out), since the
  time model applies the sharing of each plan it weighs. Links are what peers measured
  (a pair measured both ways takes the slower bandwidth and the mean latency of the two); a pair nobody
  measured is guessed no better than the worse end's typical link (the median of its measured links,
  else of all measured links, else `DEFAULT_LINK`) and marked, so the plan can name the links it uses
  that were estimated (`estimated_links`). Two peers that both announce nobody can dial them have no path,
  unless both punch holes (`PeerRecord.punches_with`: a punched pair is a direct link, as measured or
  estimated, not its relay's two hops): their pair is `ABSENT_LINK`, slow enough that the search shuns it,
  and `without_path` names the pairs a plan would still make neighbours; so is a pair whose two peers each
  report they could not reach the other (a lane that stalled on it, a hole that would not punch: the next
  plan does not pair them again, but for their relay).
- `broken`: why the running plan cannot go on (a member stopped announcing, or announces that its lane
  stalled under this plan), or None.
- `decide`: whether to run the planner now, and why.
- `worth_it`: whether a new plan should replace the running one: always when the running one is broken;
  otherwise only when its predicted step time (moving weights included, amortised over the planner's
  horizon) beats the running plan's on the same measurements by `gain`: hysteresis, so that measurement
  noise does not make the swarm flap between plans. A running plan made by a repair gives way to any
  better one.
- `start_step`: the step a new plan takes effect at: far enough ahead that every peer has read it.
- `furthest_step`: how far the swarm got under the running plan; a coordinator with a last step stops
  planning there, so peers that leave once they reach it do not look like a broken plan.
- `orphaned_layers`: the layers no live peer holds: a plan starts them from fresh weights.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import numpy as np

from hetpeer.coordinator.planner import PlannerConfig, Problem, Report, Shape, make_model
from hetpeer.coordinator.planner.relays import ABSENT_LINK, Relays, route
from hetpeer.coordinator.planner.sharing import Sharing
from hetpeer.coordinator.view import noise_scale
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.reach import FAILURES
from hetpeer.protocol.stepcosts import FIELDS as STEP_COSTS
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.workload import Workload

DEFAULT_LINK = (1e-3, 100e6)  # (latency s, bytes/s) assumed when no link at all has been measured
MAX_ESTIMATED_LINKS = 2048  # a plan names at most this many of its estimated links (about 100 kB)
MAX_LEAD_STEPS = 1000
LEAD_HEARTBEATS = 5  # a plan that keeps membership takes effect this far ahead: peers read plans once a heartbeat
# the first plan waits up to this much past the settling for the links to be measured and the devices timed again
MEASURE_WAIT_HEARTBEATS = 10
SETTLED_TIMINGS = 2  # the first plan waits for peers' second timings: a burst of peers starting slows the first


# heartbeats a departure stalls a group that waits for every member: its record expires (TTL_HEARTBEATS + 1, the
# coordinator's read), then a round to repair and one for the peers to take the repaired plan
STALL_HEARTBEATS = TTL_HEARTBEATS + 3


@dataclass(frozen=True, slots=True)
class Decision:
    solve: bool
    reason: str
    broken: bool = False


def build_problem(
    records: Mapping[str, PeerRecord], workload: Workload, current: Plan | None, step_overhead_s: float = 0.0,
    departure_stall: float = 0.0, apart: Collection[tuple[str, str]] = (),
) -> tuple[Problem, np.ndarray]:
    """(problem over the announcing peers in id order, (n, n) mask of the pairs whose link figures are estimates).
    `step_overhead_s`: what every step takes beyond the time model's terms (`calibration.py`); `departure_stall`: the
    departures a peer and second the coordinator saw x how long one stalls a plan (`Problem.departure_stall`);
    `apart`: pairs (sorted) in dispute (`gate.disputes`), given no path, so that no plan makes them neighbours.
    O(n^2) in numpy for the matrices, O(measurements) in Python: 10,000 peers take about a second."""
    ids = tuple(sorted(records))
    n = len(ids)
    index = {d: i for i, d in enumerate(ids)}
    rows, cols, latencies, bandwidths = [], [], [], []
    for d, record in records.items():
        for peer, link in record.links.items():
            if peer in index and peer != d:
                rows.append(index[d])
                cols.append(index[peer])
                latencies.append(link.latency_s)
                bandwidths.append(link.bandwidth_bytes_per_s)
    # The planner's links are symmetric and a pipeline or a group uses each both ways, so the slower direction
    # is the link's bandwidth (a peer with a capped uplink measures it; the other side measures its own, faster,
    # direction). Latency: the mean of the two ends' estimates.
    a = np.array(rows + cols, dtype=np.int64)
    b = np.array(cols + rows, dtype=np.int64)
    flat = np.unique(a * n + b)  # the measured pairs, both ways
    pair = np.searchsorted(flat, a * n + b)
    latency_sum = np.zeros(len(flat))
    count = np.zeros(len(flat))
    np.add.at(latency_sum, pair, np.array(latencies + latencies, dtype=float))
    np.add.at(count, pair, 1.0)
    slowest = np.full(len(flat), np.inf)
    np.minimum.at(slowest, pair, np.array(bandwidths + bandwidths, dtype=float))
    measured_latency = latency_sum / np.maximum(count, 1.0)
    # A pair nobody measured: no better than the worse end's typical link (the median of its measured links,
    # else of every measured link, else DEFAULT_LINK). One peer's slow uplink must not become everyone's guess.
    overall = (float(np.median(measured_latency)), float(np.median(slowest))) if len(flat) else DEFAULT_LINK
    typical_latency, typical_bandwidth = np.full(n, overall[0]), np.full(n, overall[1])
    owner = flat // n
    starts = np.searchsorted(owner, np.arange(n + 1))
    for i in np.flatnonzero(np.diff(starts)):
        typical_latency[i] = np.median(measured_latency[starts[i] : starts[i + 1]])
        typical_bandwidth[i] = np.median(slowest[starts[i] : starts[i + 1]])
    latency = np.maximum.outer(typical_latency, typical_latency)
    bandwidth = np.minimum.outer(typical_bandwidth, typical_bandwidth)
    latency.flat[flat], bandwidth.flat[flat] = measured_latency, slowest
    estimated = np.ones((n, n), dtype=bool)
    estimated.flat[flat] = False
    relays = _relayed(records, ids, latency, bandwidth, estimated, typical_bandwidth, apart)
    np.fill_diagonal(estimated, False)
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    sharing = Sharing.from_keys([records[d].compute_key for d in ids], [records[d].compute_share for d in ids],
                                [records[d].compute_background for d in ids], [records[d].compute_own for d in ids])
    problem = Problem(
        device_ids=ids,
        latency_s=latency,
        bandwidth_bytes_per_s=bandwidth,
        workload=workload,
        tflops=effective_tflops([records[d] for d in ids], _running_slowdowns(ids, sharing, current)),
        memory_bytes=np.array([float(records[d].memory_bytes) for d in ids]),
        current=current,
        step_overhead_s=step_overhead_s,
        sharing=sharing,
        step_costs=np.array([records[d].step_costs.to_wire() for d in ids], dtype=float).reshape(len(ids), len(STEP_COSTS)),
        noise_scale_tokens=noise_scale(records[d] for d in ids if records[d].state == "training"),
        departure_stall=departure_stall,
        relays=relays,
    )
    return problem, estimated


def _relayed(records: Mapping[str, PeerRecord], ids: Sequence[str], latency: np.ndarray, bandwidth: np.ndarray,
             estimated: np.ndarray, typical_bandwidth: np.ndarray, apart: Collection[tuple[str, str]] = ()) -> Relays | None:
    """Pairs of peers that nobody can dial, in place: punched where both punch holes (left as measured or
    estimated: a direct link), else through the relay of either (`relays.route`: its two hops, the better relay
    where both have one; a relay's capacity its typical link, `typical_bandwidth`), else `ABSENT_LINK` (no path,
    a fact). The relayed pairs' `Relays`, or None. O(peers behind NAT squared)."""
    index = {d: i for i, d in enumerate(ids)}
    behind = np.array([records[d].behind_nat for d in ids], dtype=bool)
    hidden = np.array([records[d].reachable == "none" for d in ids], dtype=bool)
    punched = _punched(records, ids)
    absent = np.outer(hidden, hidden) & ~punched  # neither can dial the other, punch, nor has a relay: no path
    # pairs whose ends each failed to reach the other: no path either (punched or not); and pairs kept apart
    for a, b in _reported(records) | {pair for pair in apart if pair[0] in index and pair[1] in index}:
        i, j = index[a], index[b]
        absent[i, j] = absent[j, i] = True
        punched[i, j] = punched[j, i] = False
    latency[absent], bandwidth[absent], estimated[absent] = ABSENT_LINK[0], ABSENT_LINK[1], False
    relay = np.array([index.get(records[d].relay, -1) for d in ids], dtype=np.int64)
    relays = route(latency, bandwidth, behind, relay, punched, typical_bandwidth, tuple(ids))
    if relays is not None:
        estimated[relays.via >= 0] = False
    return relays


def _running_slowdowns(ids: Sequence[str], sharing: Sharing | None, current: Plan | None) -> np.ndarray | None:
    """The slowdown (n,) each peer's training ran under from sharing its device with the running plan's other
    peers, or None where no peers share a device or there is no plan. A peer announces what its last steps
    achieved, so its figure is taken as of the running plan."""
    if sharing is None or current is None:
        return None
    members = np.isin(np.array(ids), np.array(current.devices))[None, :]
    return sharing.device_slowdowns(members)[0]


def _punched(records: Mapping[str, PeerRecord], ids: Sequence[str]) -> np.ndarray:
    """(n, n): the pairs that can punch a hole to each other (`PeerRecord.punches_with`)."""
    punching = np.array([bool(records[d].punch and records[d].behind_nat and records[d].address.direct) for d in ids])
    hosts = np.array([records[d].address.direct[0] if punching[i] else "" for i, d in enumerate(ids)], dtype=object)
    return np.outer(punching, punching) & (hosts[:, None] != hosts[None, :])  # one public address: no hairpinning


def without_path(plan: Plan, records: Mapping[str, PeerRecord], apart: Collection[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The pairs the plan's traffic crosses (`Plan.links`) that have no path: both peers announce that nobody can
    dial them and cannot punch a hole to each other, or each reports it could not reach the other; or that are
    kept `apart` (sorted pairs in dispute)."""
    hidden = {d for d, r in records.items() if r.reachable == "none"}
    reported = _reported(records) | set(apart)
    return sorted(pair for pair in plan.links if pair in reported or (
        pair[0] in hidden and pair[1] in hidden and not records[pair[0]].punches_with(records[pair[1]])))


def failure_words(records: Mapping[str, PeerRecord], a: str, b: str) -> str:
    """How `a` and `b` failed to reach each other, as their records say (`FAILURES`' words, each side's), or ""."""
    hows = [FAILURES.get(how, how) for record, other in ((records.get(a), b), (records.get(b), a))
            if record is not None and (how := record.failed().get(other)) is not None]
    return " / ".join(dict.fromkeys(hows))


def _reported(records: Mapping[str, PeerRecord]) -> set[tuple[str, str]]:
    """The pairs (sorted) whose two peers each report they could not reach the other. One side's word is not
    enough: the neighbours of a peer that died and came back report it for a while, and it does not report them."""
    return {tuple(sorted((d, u))) for d, r in records.items() for u in r.unreachable
            if u in records and d in records[u].unreachable}


def least_served(pairs: Sequence[tuple[str, str]]) -> str:
    """Of the peers in `pairs`, the one in most of them (ties: the first by id): the one to leave out first."""
    counts = Counter(device for pair in pairs for device in pair)
    return min(counts, key=lambda d: (-counts[d], d))


def estimated_links(plan: Plan, device_ids: Sequence[str], estimated: np.ndarray) -> tuple[tuple[str, str], ...]:
    """The links the plan's traffic crosses (`Plan.links`) whose figures were estimates, given the (n, n) mask
    of `build_problem` over `device_ids`: what the plan should be solved again for once measured. At most
    `MAX_ESTIMATED_LINKS` of them (the first in order): a plan record must stay under 1 MiB, and a few thousand
    unmeasured pairs already say that the plan is to be solved again once they are measured."""
    index = {d: i for i, d in enumerate(device_ids)}
    return tuple(sorted(pair for pair in plan.links if estimated[index[pair[0]], index[pair[1]]]))[:MAX_ESTIMATED_LINKS]


def effective_tflops(records: Sequence[PeerRecord], slowdown: np.ndarray | None = None) -> np.ndarray:
    """What each peer's compute will deliver in training when it has its device to itself: what its training
    steps achieved, where it has trained, times the `slowdown` (n,) it trained under from sharing its device
    (if given); else its probe's figure times the swarm's efficiency, the median of achieved over probed among
    peers that trained (a block timed alone runs faster than a training step: the framework's own
    overheads, the transport's threads beside it), else its probe's figure."""
    probed = np.array([r.tflops for r in records], dtype=float)
    achieved = np.array([r.achieved_tflops if r.achieved_tflops is not None else np.nan for r in records])
    if slowdown is not None:
        achieved = achieved * slowdown
    known = ~np.isnan(achieved)
    efficiency = float(np.median(achieved[known] / probed[known])) if known.any() else 1.0
    return np.where(known, achieved, probed * efficiency)


def broken(current: Plan, records: Mapping[str, PeerRecord]) -> str | None:
    gone = [d for d in current.devices if d not in records or records[d].state == "leaving"]
    if gone:
        return f"{', '.join(gone)} stopped announcing"
    stalled = [d for d in current.devices if records[d].state == "waiting" and records[d].epoch == current.epoch]
    if stalled:
        return f"the lanes of {', '.join(stalled)} stalled under epoch {current.epoch}"
    return None


def decide(
    current: Plan | None,
    records: Mapping[str, PeerRecord],
    first_seen: Mapping[str, float],
    now: float,
    last_solve: float,
    *,
    min_peers: int,
    settle_s: float,
    replan_interval_s: float,
    considered: Collection[str] = (),
    estimates_rechecked: bool = False,
    measure_wait_s: float = 0.0,
    plan_measured: bool = True,
    parted: str | None = None,
) -> Decision:
    """Whether to solve now. `first_seen` holds when each announcing peer was first read; peers that
    appeared less than `settle_s` ago are waited for (a swarm starting up arrives in a burst).
    `considered`: newcomers already solved for under the running plan and left out of it (the plan was
    not worth changing for them); they wait for the periodic re-solve instead of one solve a round.
    A plan made on estimated links (a starting swarm has measured few) is solved again once peers have
    measured them all, unless `estimates_rechecked` says that was done for it already. The first plan
    waits up to `measure_wait_s` past the settling for the peers to measure the links between them and to
    time their devices a second time: a plan made on guesses is soon replaced, and moving stages between the
    two costs downloads over the very links it guessed; peers that start together time their devices in
    each other's way (vs_hivemind's eight first read 1.3 to 1.5 times slow), and a plan on those figures
    may not be worth replacing by the time they are right. `plan_measured`: whether the running plan has run
    long enough for the peers' figures to be its own (`calibration.measured`); until then a periodic re-solve
    waits, up to one more interval: figures from the steps around a peer leaving or a repair read the
    transition, not the plan. `parted`: why the running plan pairs peers in dispute (`gate.parted`): it is broken."""
    settled = [d for d in records if now - first_seen.get(d, now) >= settle_s]
    if current is None:
        if len(records) < min_peers:
            return Decision(False, f"waiting for peers: {len(records)} of at least {min_peers}")
        if len(settled) < len(records):
            return Decision(False, f"{len(records) - len(settled)} peer(s) arrived less than {settle_s:g} s ago")
        missing = unmeasured_pairs(records)
        untimed = sum(r.timings < SETTLED_TIMINGS for r in records.values())
        waited = now - max(first_seen.get(d, now) for d in records) - settle_s
        if (missing or untimed) and waited < measure_wait_s:
            what = [f"{missing} link(s) between the peers not measured"] if missing else []
            what += [f"{untimed} peer(s) not timed twice"] if untimed else []
            return Decision(False, f"{' and '.join(what)} yet (waiting up to {measure_wait_s - waited:.0f} s more)")
        return Decision(True, f"first plan for {len(records)} peers")
    why = broken(current, records) or parted
    if why is not None:
        return Decision(True, why, broken=True)
    known = set(current.devices) | set(current.standby) | set(considered)
    newcomers = [d for d in settled if d not in known]
    if newcomers:
        return Decision(True, f"{', '.join(sorted(newcomers))} joined")
    if current.estimated_links and not estimates_rechecked and all(measured(records, a, b) for a, b in current.estimated_links):
        return Decision(True, f"the {len(current.estimated_links)} link(s) it estimated are measured now")
    if now - last_solve >= replan_interval_s:
        if not plan_measured and now - last_solve < 2 * replan_interval_s:
            return Decision(False, "running plan holds: its steps are not measured yet")
        return Decision(True, "periodic re-solve")
    return Decision(False, "running plan holds")


def unmeasured_pairs(records: Mapping[str, PeerRecord]) -> int:
    """How many pairs of the announcing peers neither end announces a measurement of."""
    pairs = {frozenset((a, b)) for a, record in records.items() for b in record.links if b != a and b in records}
    return len(records) * (len(records) - 1) // 2 - len(pairs)


def measured(records: Mapping[str, PeerRecord], a: str, b: str) -> bool:
    """Whether either end announces a measurement of the link between `a` and `b`."""
    return (a in records and b in records[a].links) or (b in records and a in records[b].links)


def grid_of(plan: Plan, device_ids: tuple[str, ...]) -> np.ndarray:
    """The plan's devices as the planner's (stages, lanes) grid of indices into `device_ids`."""
    index = {d: i for i, d in enumerate(device_ids)}
    return np.array([[index[d] for d in stage.devices] for stage in plan.stages])


def running_report(problem: Problem, config: PlannerConfig, plan: Plan) -> Report:
    """The running plan as the planner judges it on the problem's (fresh) measurements, with its own layer split
    as the planner would choose it for that grid and every hop in the codecs the plan gives it (not those the
    configuration would choose now: links measured since may favour others): `cost["total_s"]` its step,
    `objective` what a new plan has to beat (the step x its steps factor x what departures cost it, as the search
    scores every grid)."""
    shape = Shape(len(plan.stages), plan.group_size)
    grid = grid_of(plan, problem.device_ids)
    return make_model(problem, config, shape, plan_codecs(plan, grid)).report(grid)


def plan_codecs(plan: Plan, grid: np.ndarray) -> dict[tuple[int, int], tuple[str, str]]:
    """Each hop of `plan` on its `grid` of device indices, (sender, receiver) -> (forward, backward): the codecs
    the plan names for it, raw where it names none."""
    return {(int(grid[s, lane]), int(grid[s + 1, lane])): stage.codecs(lane)
            for s, stage in enumerate(plan.stages[:-1]) for lane in range(grid.shape[1])}


def worth_it(
    decision: Decision, new_objective_s: float, current_s: float | None, gain: float, same: bool, repaired: bool = False
) -> tuple[bool, str]:
    """Whether to publish the new plan; the reason either way. A running plan that a repair made was never
    searched for, so the first better plan replaces it however small the gain (a repair that dropped a lane
    would otherwise keep the swarm a lane short when its peer comes back). A plan made on links it guessed keeps
    the gain once they are measured: without it, vs_hivemind's swarm traded its first plan, 2 s in, for one
    predicted 1.6% faster over the 100-step horizon (moves included) and stalled about 40 s moving every stage
    (docs/vs_hivemind.md)."""
    if repaired:
        gain = 0.0
    if decision.broken:
        return True, "the running plan is broken"
    if current_s is None:
        return True, "no plan yet"
    if same:
        return False, "the planner chose the running plan again"
    if new_objective_s < current_s * (1 - gain):
        return True, f"predicted {new_objective_s:.3f} s/step (moving weights included) against {current_s:.3f} s"
    return False, f"predicted {new_objective_s:.3f} s/step is not {gain:.0%} better than the running {current_s:.3f} s"


def furthest_step(current: Plan, records: Mapping[str, PeerRecord]) -> int:
    """The furthest step any peer announced under `current` (leaving peers included), and at least the
    plan's own start."""
    return max([current.start_step] + [r.step for r in records.values() if r.epoch == current.epoch])


def start_step(
    current: Plan | None, records: Mapping[str, PeerRecord], broken_now: bool, heartbeat_s: float, seq_len: int,
    reached: int = 0,
) -> int:
    """The step a new plan starts at. A broken plan: just past the furthest peer, for every peer switches
    at once. Otherwise: far enough ahead that every peer reads the plan (`LEAD_HEARTBEATS`) before
    its lanes reach that step, at the pace the peers announce. `records` include leaving peers, whose
    last step counts too, and `reached` is the furthest step seen before (peers that left long ago): the
    swarm's step never goes back, even when every peer that reached it is gone."""
    if current is None:
        return reached + 1 if reached else 0
    furthest = max(furthest_step(current, records), reached)
    if broken_now:
        return furthest + 1
    # each member's step time from its lane's tokens a step over its own rate (lanes may take unlike shares)
    lane_of = {d: lane for stage in current.stages for lane, d in enumerate(stage.devices)}
    steps_s = [current.lane_sequences(lane_of[d]) * seq_len / r.tokens_per_s
               for d, r in records.items() if d in lane_of and r.tokens_per_s > 0]
    step_s = float(np.median(steps_s)) if steps_s and seq_len else current.total_s
    if not math.isfinite(step_s) or step_s <= 0:
        return furthest + 2
    return furthest + min(MAX_LEAD_STEPS, 2 + math.ceil(LEAD_HEARTBEATS * heartbeat_s / step_s))


@dataclass(frozen=True, slots=True)
class Resumption:
    """A swarm's shape rebuilt from the stage checkpoints its peers announce: stages (start, end, devices in
    lane order), the step to resume at, the swarm's data position at that step, and the peers left out."""

    stages: tuple[tuple[int, int, tuple[str, ...]], ...]
    step: int
    standby: tuple[str, ...]
    data_position: int = 0


def resume_from_checkpoints(records: Mapping[str, PeerRecord], layers: int) -> Resumption | str:
    """When no live peer holds any layers but some announce checkpoints: stages that tile [0, layers) from the
    checkpoints' ranges, chosen to make the thinnest stage's holders the most (then the fewest stages), as
    many lanes as that stage has holders (those at the highest step first), resuming at the highest step
    they hold. A layer no tiling covers is the answer in words, naming it. O(ranges x layers) plus a sort."""
    held = {d: r.checkpoint for d, r in records.items() if r.checkpoint is not None and r.state != "leaving"}
    by_range: dict[tuple[int, int], list[str]] = {}
    for device, (start, end, step, _) in sorted(held.items(), key=lambda item: (-item[1][2], item[0])):
        if end <= layers:
            by_range.setdefault((start, end), []).append(device)
    # best[at]: (holders of the thinnest stage, -stages) of the best tiling of [at, layers), and its first range
    best: dict[int, tuple[tuple[float, int], tuple[int, int] | None]] = {layers: ((math.inf, 0), None)}
    for at in sorted({start for start, _ in by_range}, reverse=True):
        tilings = [((min(len(by_range[r]), best[r[1]][0][0]), best[r[1]][0][1] - 1), r)
                   for r in by_range if r[0] == at and r[1] in best]
        if tilings:
            best[at] = max(tilings)
    if 0 not in best:
        reached, frontier = {0}, [0]  # where chains of ranges from layer 0 get to: the gap starts at the furthest
        while frontier:
            at = frontier.pop()
            for start, end in by_range:
                if start == at and end not in reached:
                    reached.add(end)
                    frontier.append(end)
        at = max(reached)
        ahead = min((start for start, _ in by_range if start > at), default=layers)
        have = ", ".join(f"{d} layers {c[0]}-{c[1] - 1} (step {c[2]})" for d, c in sorted(held.items())) or "none"
        return f"no live peer holds a checkpoint of layers {at}-{ahead - 1}: start the peers that do, " \
               f"or their --save folders elsewhere to train afresh (checkpoints announced: {have})"
    stages, at = [], 0
    while at < layers:
        stages.append(best[at][1])
        at = stages[-1][1]
    lanes = min(len(by_range[r]) for r in stages)
    chosen = tuple((start, end, tuple(by_range[(start, end)][:lanes])) for start, end in stages)
    used = {d for _, _, devices in chosen for d in devices}
    step, position = max(held[d][2:] for d in used)
    return Resumption(chosen, step, tuple(sorted(d for d in records if d not in used)), position)


def orphaned_layers(records: Mapping[str, PeerRecord], layers: int) -> list[tuple[int, int]]:
    """The ranges [start, end) of the model's `layers` that no peer announces holding (leaving peers do
    not count: they take their copy with them). A plan starts these from fresh weights."""
    held = [False] * layers
    for record in records.values():
        if record.state != "leaving" and record.layers is not None:
            for layer in range(record.layers[0], min(record.layers[1], layers)):
                held[layer] = True
    ranges: list[tuple[int, int]] = []
    for layer, kept in enumerate(held):
        if kept:
            continue
        if ranges and ranges[-1][1] == layer:
            ranges[-1] = (ranges[-1][0], layer + 1)
        else:
            ranges.append((layer, layer + 1))
    return ranges
