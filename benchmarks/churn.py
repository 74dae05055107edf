"""Churn benchmark: a simulated swarm of volunteers that come and go, driving the coordinator's real policy
(`policy.decide`, `broken`, `worth_it`, `running_report`), planner (`solve`) and `repair` on a simulated
clock, to compare re-plan policies by the tokens per second the swarm trains.

    python3 benchmarks/churn.py [--peers 1000] [--hours 1] [--budget 0.5] [--seed 0] [--public 1] [--cone 0] [--quick] [--json]

Sessions. How long a volunteer stays is drawn from a Weibull distribution, the family Javadi, Kondo, Vincent
and Anderson fitted (with log-normal and gamma, per cluster of hosts) to the availability intervals of about
230,000 SETI@home hosts: "Mining for statistical models of availability in large-scale distributed systems:
an empirical study of SETI@home", IEEE MASCOTS 2009 (journal version: "Discovering statistical models of
availability in large distributed systems: an empirical study of SETI@home", IEEE TPDS, 2011, whose abstract
gives the figures quoted here: about 21% of hosts have availability that is a truly random process, modelled
by a few distributions from different families). Their fitted per-cluster parameters were not at hand
when this was written, so the shape and the mean here are ASSUMPTIONS, not their figures: `--session-shape`
(default 0.5: a decreasing hazard, many short sessions and a long tail) and `--session-mean-h` (default 6 h,
1 h with `--quick`). Arrivals are
Poisson at peers / mean session, so the swarm holds about `--peers` (Little's law); the peers there at the
start have residual sessions of the stationary renewal process (length-biased sessions, a uniform point in each).

Devices and work. The GPU classes and geo links of `planner.synthetic.random_topology` (one topology with
every peer that ever comes, `max(4, n // 16)` regions, as benchmarks/planner.py's scale part); GPT-3 XL,
batch 512 sequences of 2048 tokens, fp16, the `time` cost model; each peer's compute is its class's figure.

The coordinator, every heartbeat (2 s), as `service._round` drives it: it sees a peer from its first
announcement until its record expires, (TTL_HEARTBEATS + 1) heartbeats after its last one: peers leave
abruptly, unannounced. Newcomers settle for two heartbeats. A solve is `planner.solve` with the policy's
budget over the peers it sees (the problem built directly from the topology's matrices, as `build_problem`
would from complete measurements), with the running plan as the current one; the coordinator waits for it:
no round runs for `budget` simulated seconds. The planner's clock is this process's CPU time, so that a
budget means the same search on a loaded machine. A repair (`coordinator/repair.py`) takes the time it took.

The swarm. A published plan takes effect after peers read it: one heartbeat for a broken plan, LEAD_HEARTBEATS
otherwise. A switch then costs the time model's move estimate (`move_s`: the slowest device fetching the
layers it does not hold at its best incoming bandwidth from a current holder), during which the swarm does
not step. A running plan trains batch tokens / its predicted step time, less the share of its lanes with
a member gone: those lanes stall until a plan without that member takes effect.

Volunteers at home. With `--public` below 1, each peer that comes is public with that chance, behind a cone NAT
with `--cone` (it punches holes to other cone peers) and else behind a symmetric NAT (it reaches other NATed
peers only through a relay); NATed peers register at a public peer as peers do (`planner/relays.behind_nat`), so
a relay that leaves moves its peers to others, and the planner counts what the pairs through one relay share.
The default is every peer public.

Policies: re-plan interval, gain threshold, what a break does (`solve`: a full re-solve; `repair`) and what
a newcomer does (`solve`: a solve as soon as it settled; `wait`: it waits on standby for the periodic
re-solve, by passing it as `considered` to `decide`). Every policy sees the same arrivals and departures (same
seed) and starts from the same first plan (solved once); each is reported against the coordinator's defaults
before this benchmark chose new ones (60 s, gain 0.1, solve on break and on join) run with the same budget in
the same run; the defaults it chose (`hetpeer coordinator`'s: 300 s, gain 0.1, repair, solve) are run too.

The planner at 1,000 peers runs to its budget on every solve, and the old policy solves a few hundred times
an hour of churn: to stay under about 10 minutes on 2 cores the default run simulates 1 hour with a 0.5 s
budget for every policy (the coordinator's budget is 2 s: `--budget 2` runs that; the old policy alone took
12 minutes so), and solves are cached by their question (the peers seen
and the running plan), so policies that ask the same pay once. `--quick` is a small run for tests. `--json`
prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hetpeer.coordinator import policy as coordinator_policy
from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, Solution, solve, synthetic
from hetpeer.coordinator.planner.relays import CONE, PUBLIC, SYMMETRIC, behind_nat
from hetpeer.coordinator.repair import repair
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

HEARTBEAT_S = 2.0
SETTLE_S = 2 * HEARTBEAT_S  # the coordinator's default settling
EXPIRE_S = (TTL_HEARTBEATS + 1) * HEARTBEAT_S  # a record read this long after its peer's last announcement is gone
MODEL, BATCH, DTYPE = "gpt3-xl", 512, "fp16"
TIE = 0.005  # tokens/s this close to the top count as equal when naming the best policy


@dataclass(frozen=True, slots=True)
class Policy:
    replan_interval_s: float
    gain: float
    on_break: str  # "solve" | "repair"
    on_join: str  # "solve" | "wait"

    @property
    def name(self) -> str:
        return f"{self.on_break}/{self.on_join} {self.replan_interval_s:g}s gain {self.gain:g}"


BEFORE = Policy(60.0, 0.1, "solve", "solve")  # the coordinator's defaults before this benchmark chose new ones
CHOSEN = Policy(300.0, 0.1, "repair", "solve")  # the defaults it chose (`CoordinatorConfig`, docs/churn.md)
DEFAULT_POLICIES = (
    BEFORE,
    CHOSEN,
    Policy(60.0, 0.1, "solve", "wait"),
    Policy(300.0, 0.1, "solve", "wait"),
    Policy(60.0, 0.1, "repair", "wait"),
    Policy(300.0, 0.1, "repair", "wait"),
    Policy(900.0, 0.1, "repair", "wait"),
    Policy(3600.0, 0.1, "repair", "wait"),
    Policy(300.0, 0.02, "repair", "wait"),
    Policy(300.0, 0.05, "repair", "wait"),
    Policy(300.0, 0.2, "repair", "wait"),
)
QUICK_POLICIES = (BEFORE, Policy(300.0, 0.1, "repair", "wait"))


@dataclass(frozen=True, slots=True, eq=False)
class Swarm:
    """Every peer that ever comes, in arrival order (ids sort in that order): when it comes and goes, its
    device, and the links between all of them."""

    ids: tuple[str, ...]
    arrive_s: np.ndarray
    leave_s: np.ndarray
    latency_s: np.ndarray
    bandwidth_bytes_per_s: np.ndarray
    tflops: np.ndarray
    memory_bytes: np.ndarray
    records: dict[str, PeerRecord]
    kinds: np.ndarray  # (n,) `relays.PUBLIC`, `CONE` or `SYMMETRIC`


def sessions(count: int, shape: float, mean_s: float, rng: np.random.Generator) -> np.ndarray:
    """`count` Weibull session lengths with the given shape and mean. O(count)."""
    scale = mean_s / math.gamma(1 + 1 / shape)
    return scale * rng.weibull(shape, size=count)


def residual_sessions(count: int, shape: float, mean_s: float, rng: np.random.Generator) -> np.ndarray:
    """What is left of the sessions of `count` peers found there at a random time: a session is found with a
    chance in proportion to its length (length bias), at a uniform point of it. O(count)."""
    pool = sessions(20 * count, shape, mean_s, rng)
    found = rng.choice(pool, size=count, p=pool / pool.sum())
    return found * rng.random(count)


def make_swarm(peers: int, hours: float, shape: float, mean_h: float, seed: int, public: float = 1.0,
               cone: float = 0.0) -> Swarm:
    """The peers there at time 0 and the Poisson arrivals over `hours`, with devices and links, a share `public` of
    them public and `cone` behind cone NATs (the rest behind symmetric ones). O(n^2)."""
    rng = np.random.default_rng(seed)
    mean_s, horizon_s = mean_h * 3600.0, hours * 3600.0
    gaps = rng.exponential(mean_s / peers, size=int(4 * peers * horizon_s / mean_s) + 16)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < horizon_s]
    arrive = np.concatenate([np.full(peers, -SETTLE_S), arrivals])
    leave = np.concatenate([residual_sessions(peers, shape, mean_s, rng), arrivals + sessions(len(arrivals), shape, mean_s, rng)])
    n = len(arrive)
    raw = synthetic.random_topology(n, max(4, n // 16), rng)
    topology = Topology.from_wire(raw)
    whole = Problem.from_topology(topology, workload())
    ids = tuple(f"p{k:05d}" for k in range(n))
    records = {
        d: PeerRecord(device_id=d, model=MODEL, dtype=DTYPE, device_name=f"gpu {whole.tflops[k]:g} TFLOPS",
                      tflops=float(whole.tflops[k]), memory_bytes=int(whole.memory_bytes[k]), address=PeerAddress(),
                      state="training", time=0.0)
        for k, d in enumerate(ids)
    }  # fmt: skip
    kinds = np.full(n, PUBLIC) if public >= 1 else rng.choice([PUBLIC, CONE, SYMMETRIC], size=n, p=[public, cone, 1 - public - cone])
    return Swarm(ids, arrive, leave, whole.latency_s, whole.bandwidth_bytes_per_s, whole.tflops, whole.memory_bytes, records,
                 kinds)


def workload() -> Workload:
    return Workload(preset(MODEL), batch=BATCH, micro_batch=1, dtype=DTYPE)


def problem_over(swarm: Swarm, seen: np.ndarray, current: Plan | None) -> Problem:
    """The planner's problem over the peers the coordinator sees (indices in id order), as `build_problem`
    makes it from complete measurements: NATed peers' pairs through the relays they pick among the public peers seen."""
    cut = np.ix_(seen, seen)
    problem = Problem(
        device_ids=tuple(swarm.ids[i] for i in seen), latency_s=swarm.latency_s[cut],
        bandwidth_bytes_per_s=swarm.bandwidth_bytes_per_s[cut], workload=workload(), tflops=swarm.tflops[seen],
        memory_bytes=swarm.memory_bytes[seen], current=current,
    )  # fmt: skip
    kinds = swarm.kinds[seen]
    return problem if (kinds == PUBLIC).all() else behind_nat(problem, kinds)


@dataclass
class Result:
    policy: Policy
    tokens: float = 0.0
    seconds: float = 0.0
    switches: int = 0
    moved: int = 0
    solves: int = 0
    repairs: int = 0
    repair_failures: int = 0
    breaks: int = 0
    published: int = 0
    kept: int = 0
    planner_cpu_s: float = 0.0
    stalled_lane_s: float = 0.0
    paused_s: float = 0.0
    lane_s: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)  # (simulated time, why it solved or repaired)
    first: Plan | None = None  # the first plan the peers ran

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return {
            "policy": self.policy.name, "replan_interval_s": self.policy.replan_interval_s, "gain": self.policy.gain,
            "on_break": self.policy.on_break, "on_join": self.policy.on_join, "tokens_per_s": self.tokens_per_s,
            "switches": self.switches, "moved_devices": self.moved, "solves": self.solves, "repairs": self.repairs,
            "repair_failures": self.repair_failures, "breaks": self.breaks, "kept": self.kept,
            "planner_cpu_s": self.planner_cpu_s, "stalled_lane_share": self.stalled_lane_s / self.lane_s if self.lane_s else 0.0,
            "paused_s": self.paused_s, "reasons": dict(self.reasons),
            "first_plan_step_s": self.first.total_s if self.first is not None else None,
        }  # fmt: skip


@dataclass
class Running:
    """What the peers run: the plan, its lanes as device indices, its rate with every lane up, and until when
    the swarm fetches weights for it."""

    plan: Plan
    lanes: np.ndarray  # (lanes, stages) device indices
    full_rate: float
    paused_until: float


class Solver:
    """`solve` with a cache keyed by what decides its answer, so that policies that reach the same question
    (the first plan, above all) get the same plan and pay for it once."""

    def __init__(self, budget_s: float, seed: int) -> None:
        self.config = PlannerConfig(time_budget_s=budget_s)
        self.seed = seed
        self.cache: dict[tuple, tuple[Solution, float]] = {}

    def __call__(self, problem: Problem, current: Plan | None) -> tuple[Solution, float]:
        key = (problem.device_ids, None if current is None else (current.stages, current.standby))
        if key not in self.cache:
            started = time.process_time()
            rng = np.random.default_rng([self.seed, len(self.cache)])
            solution = solve(problem, self.config, rng, clock=time.process_time)
            self.cache[key] = (solution, time.process_time() - started)
        return self.cache[key]


def simulate(swarm: Swarm, chosen: Policy, solver: Solver, hours: float) -> Result:
    """One policy over the swarm's arrivals and departures, a heartbeat at a time. O(rounds x peers) plus
    the solves and repairs."""
    result = Result(chosen)
    index = {d: i for i, d in enumerate(swarm.ids)}
    tokens_per_step = BATCH * preset(MODEL).seq_len
    config = solver.config
    current: Plan | None = None  # the coordinator's plan: the newest published
    running: Running | None = None
    queued: tuple[float, Plan, float] | None = None  # (takes effect at, plan, move seconds)
    first_seen: dict[str, float] = {}
    considered: set[str] = set()
    repaired: set[int] = set()  # epochs of the plans repairs made
    last_solve, busy_until, end_s = -math.inf, 0.0, hours * 3600.0
    t = 0.0
    while t < end_s:
        if queued is not None and queued[0] <= t:
            running = switch(swarm, running, queued[1], queued[0] + queued[2], tokens_per_step, index, result)
            queued = None
        account(swarm, running, t, min(t + HEARTBEAT_S, end_s), result)
        if t >= busy_until:
            step = coordinate(swarm, chosen, solver, config, t, current, first_seen, considered, repaired, last_solve,
                              result)
            if step is not None:
                current, plan, ready_s, move_s, last_solve, broken = step
                busy_until = ready_s
                if plan is not None:
                    lead = HEARTBEAT_S if broken else coordinator_policy.LEAD_HEARTBEATS * HEARTBEAT_S
                    queued = (ready_s + lead, plan, move_s)
        t += HEARTBEAT_S
    return result


def coordinate(
    swarm: Swarm, chosen: Policy, solver: Solver, config: PlannerConfig, now: float, current: Plan | None,
    first_seen: dict[str, float], considered: set[str], repaired: set[int], last_solve: float, result: Result,
) -> tuple[Plan | None, Plan | None, float, float, float, bool] | None:
    """One coordinator round: read, decide, solve or repair. None when it did not solve; else (its plan now,
    the plan to publish or None, when it is ready, its move seconds, the time of this solve, broken)."""
    seen = np.flatnonzero((swarm.arrive_s <= now) & (swarm.leave_s + EXPIRE_S > now))
    live = {swarm.ids[i]: swarm.records[swarm.ids[i]] for i in seen}
    for d in live:
        first_seen.setdefault(d, max(0.0, now) if swarm.arrive_s[int(d[1:])] >= 0 else -SETTLE_S)
    for d in set(first_seen) - set(live):
        del first_seen[d]
    considered &= set(live)
    waiting = considered | (set(live) if chosen.on_join == "wait" and current is not None else set())
    decision = coordinator_policy.decide(
        current, live, first_seen, now, last_solve, min_peers=2, settle_s=SETTLE_S,
        replan_interval_s=chosen.replan_interval_s, considered=waiting, estimates_rechecked=True, measure_wait_s=0.0,
    )  # fmt: skip
    if not decision.solve:
        return None
    kind = reason_kind(decision)
    result.reasons[kind] = result.reasons.get(kind, 0) + 1
    result.events.append((now, kind))
    result.breaks += decision.broken
    problem = problem_over(swarm, seen, current)
    if decision.broken and chosen.on_break == "repair":
        started = time.process_time()
        mended = repair(current, problem, config)
        spent = time.process_time() - started
        result.planner_cpu_s += spent
        if mended is not None:
            result.repairs += 1
            result.published += 1
            considered.clear()
            repaired.add(mended.epoch)
            # a repair is no solve: the periodic re-solve still comes `replan_interval_s` after the last one
            return mended, mended, now + spent, float(mended.cost.get("move_s", 0.0)), last_solve, True
        result.repair_failures += 1
    try:
        solution, spent = solver(problem, current)
    except PlanningError:
        return current, None, now + config.time_budget_s, 0.0, now, decision.broken
    result.solves += 1
    result.planner_cpu_s += spent
    ready = now + config.time_budget_s  # the coordinator waits for the planner's budget
    usable = current if current is not None and not decision.broken else None
    current_s = coordinator_policy.running_report(problem, config, usable).objective if usable is not None else None
    same = usable is not None and solution.plan.stages == usable.stages
    publish, _ = coordinator_policy.worth_it(
        decision, solution.report.objective, current_s, chosen.gain, same, current is not None and current.epoch in repaired
    )
    if not publish:
        result.kept += 1
        known = set(current.devices) | set(current.standby)
        considered |= {d for d in live if d not in known}
        return current, None, ready, 0.0, now, False
    result.published += 1
    considered.clear()
    plan = replace(solution.plan, epoch=(current.epoch + 1) if current is not None else 1)
    return plan, plan, ready, float(solution.report.cost.get("move_s", 0.0)), now, decision.broken


def reason_kind(decision: coordinator_policy.Decision) -> str:
    """Why `decide` solved, in one word: break, join, periodic, first or other."""
    if decision.broken:
        return "break"
    for word, kind in (("joined", "join"), ("periodic", "periodic"), ("first plan", "first")):
        if word in decision.reason:
            return kind
    return "other"


def switch(
    swarm: Swarm, running: Running | None, plan: Plan, paused_until: float, tokens_per_step: int,
    index: dict[str, int], result: Result,
) -> Running:
    """The peers take up `plan`: count the switch and the devices that hold other layers than before."""
    before = {} if running is None else {d: (s.layer_start, s.layer_end) for s in running.plan.stages for d in s.devices}
    moved = sum(before.get(d) != (s.layer_start, s.layer_end) for s in plan.stages for d in s.devices)
    if running is not None:
        result.switches += 1
        result.moved += moved
    else:
        result.first = plan
    lanes = np.array([[index[d] for d in lane] for lane in plan.lanes])
    return Running(plan, lanes, tokens_per_step / plan.total_s, paused_until if running is not None else 0.0)


def account(swarm: Swarm, running: Running | None, start: float, end: float, result: Result) -> None:
    """Tokens trained in [start, end): nothing while weights move; else the full rate times the share of
    lanes whose members are all still there (checked at `start`: a heartbeat's resolution)."""
    span = end - start
    result.seconds += span
    if running is None:
        result.paused_s += span
        return
    idle = min(max(running.paused_until - start, 0.0), span)
    result.paused_s += idle
    stalled = int((swarm.leave_s[running.lanes] <= start).any(axis=1).sum())
    lanes = len(running.lanes)
    result.tokens += running.full_rate * (1 - stalled / lanes) * (span - idle)
    result.stalled_lane_s += stalled * (span - idle)
    result.lane_s += lanes * (span - idle)


def parse_policy(text: str) -> Policy:
    """`interval_s:gain:on_break:on_join`, e.g. 300:0.1:repair:wait."""
    try:
        interval, gain, on_break, on_join = text.split(":")
        chosen = Policy(float(interval), float(gain), on_break, on_join)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected interval_s:gain:solve|repair:solve|wait, got {text!r}") from None
    sane = chosen.replan_interval_s > 0 and 0 <= chosen.gain < 1
    if on_break not in ("solve", "repair") or on_join not in ("solve", "wait") or not sane:
        raise argparse.ArgumentTypeError(f"expected interval_s > 0, 0 <= gain < 1, solve|repair, solve|wait; got {text!r}")
    return chosen


def table(rows: list[list[str]]) -> None:
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000, help="peers in the swarm on average (default 1000)")
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours (default 1)")
    parser.add_argument("--budget", type=float, default=0.5, help="planner budget in CPU seconds, every policy (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the swarm and of the planner (default 0)")
    parser.add_argument("--session-shape", type=float, default=0.5, help="Weibull shape of sessions (assumed; default 0.5)")
    parser.add_argument("--session-mean-h", type=float, default=6.0, help="mean session in hours (assumed; default 6)")
    parser.add_argument("--policy", type=parse_policy, action="append", dest="policies",
                        help="interval_s:gain:solve|repair:solve|wait (repeatable; default a set of 11; the old defaults are always run)")
    parser.add_argument("--quick", action="store_true",
                        help="40 peers, 0.5 h, budget 0.25 s, mean session 1 h, 2 policies: for tests")
    parser.add_argument("--public", type=float, default=1.0, help="share of peers that are public (default 1: all)")
    parser.add_argument("--cone", type=float, default=0.0, help="share behind cone NATs (default 0; the rest symmetric)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    if args.quick:  # sessions shortened too, so that a few minutes see peers come and go
        args.peers, args.hours, args.budget, args.session_mean_h = 40, 0.5, 0.25, 1.0
    if args.peers < 4 or args.hours <= 0 or args.budget <= 0 or args.session_shape <= 0 or args.session_mean_h <= 0:
        parser.error("--peers must be at least 4; --hours, --budget, --session-shape and --session-mean-h positive")
    if not (0 < args.public <= 1 and 0 <= args.cone <= 1 - args.public):
        parser.error("--public must be in (0, 1] and --cone in [0, 1 - public]")
    policies = [BEFORE] + [p for p in (args.policies or (QUICK_POLICIES if args.quick else DEFAULT_POLICIES)) if p != BEFORE]
    started = time.perf_counter()
    swarm = make_swarm(args.peers, args.hours, args.session_shape, args.session_mean_h, args.seed, args.public, args.cone)
    horizon_s = args.hours * 3600
    arrived = int((swarm.arrive_s >= 0).sum())
    left = int((swarm.leave_s < horizon_s).sum())
    print(f"churn: {args.peers} peers, {args.hours:g} h, Weibull sessions shape {args.session_shape:g} mean "
          f"{args.session_mean_h:g} h; {arrived} arrived and {left} left in the window; planner budget "
          f"{args.budget:g} CPU s; seed {args.seed}" + (f"; {args.public:.0%} public, {args.cone:.0%} behind cone NATs, "
          f"{1 - args.public - args.cone:.0%} behind symmetric ones" if args.public < 1 else ""), flush=True)
    solver = Solver(args.budget, args.seed)
    results = []
    for chosen in policies:
        began = time.perf_counter()
        results.append(simulate(swarm, chosen, solver, args.hours))
        r = results[-1]
        print(f"  {chosen.name}: {r.tokens_per_s:,.0f} tokens/s, {r.solves} solves, {r.repairs} repairs, "
              f"{r.switches} switches ({time.perf_counter() - began:.0f} s)", flush=True)
    first = results[0].first
    if first is not None:
        print(f"  every policy starts from the same first plan: {len(first.stages)} stages x {first.group_size} lanes, "
              f"{len(first.standby)} on standby, predicted {first.total_s:.3f} s/step", flush=True)
    base = results[0].tokens_per_s
    rows = [["policy (break/join interval gain)", "tokens/s", "x before", "switches", "moved", "solves", "repairs",
             "breaks", "stalled", "paused s", "planner CPU s"]]
    for r in results:
        rows.append([r.policy.name, f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base:.3f}" if base else "n/a",
                     str(r.switches), str(r.moved), str(r.solves), str(r.repairs), str(r.breaks),
                     f"{r.stalled_lane_s / r.lane_s:.1%}" if r.lane_s else "n/a", f"{r.paused_s:.0f}", f"{r.planner_cpu_s:.1f}"])
    print()
    table(rows)
    top = max(results, key=lambda r: r.tokens_per_s)
    # Repairs take the CPU time they took, so equal policies differ in the last digits: among those within
    # TIE of the top, the one that spends the least planner CPU is the better default.
    best = min((r for r in results if r.tokens_per_s >= (1 - TIE) * top.tokens_per_s), key=lambda r: r.planner_cpu_s)
    print("\n  stalled: lane-seconds of the running plan with a member gone; paused: seconds without a plan or moving weights")
    print(f"most tokens/s: {top.policy.name}, {top.tokens_per_s / base:.3f} x the old defaults; within {TIE:.1%} of it at "
          f"the least planner CPU: {best.policy.name} ({time.perf_counter() - started:.0f} s)")
    if args.json:
        print(json.dumps({
            "peers": args.peers, "hours": args.hours, "budget_s": args.budget, "seed": args.seed,
            "session_shape": args.session_shape, "session_mean_h": args.session_mean_h, "arrived": arrived, "left": left,
            "public": args.public, "cone": args.cone,
            "results": [r.summary() for r in results], "top": top.policy.name, "best": best.policy.name,
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
