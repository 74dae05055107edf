"""The coordinator behind `hetpeer coordinator`: read the swarm, decide, publish plans, serve the API.

Its loop, every heartbeat: fetch (the peers' announcements and the newest plan under its own key),
decide (`policy.py`, pure), act (run the planner in an executor with a time budget; publish a plan
with the next epoch and the step it takes effect at). It keeps nothing that is not in the DHT: the
running plan is read back from there, so a restarted coordinator (same key file) carries on with the
plan the peers are running and publishes a new one only for the reasons a running one would.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from hetpeer.coordinator import gate, policy
from hetpeer.coordinator.repair import repair
from hetpeer.coordinator.api import ApiServer, ServerTls, SwarmView, progress
from hetpeer.coordinator.board import Board
from hetpeer.coordinator.history import History
from hetpeer.coordinator.web import DashboardServer
from hetpeer.coordinator.planner import PlannerConfig, PlanningError, solve
from hetpeer.protocol.admission import AdmissionError, Allowlist
from hetpeer.protocol.control import ControlPlane, key_digest
from hetpeer.protocol.join import JoinInfo
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.workload import PRESETS, ModelSpec, Workload

log = logging.getLogger("hetpeer.coordinator")


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    swarm: str
    home: Path  # keeps the coordinator's key: peers trust plans signed by it
    initial_peers: tuple[str, ...] = ()
    dht_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    dht_announce: tuple[str, ...] = ()  # DHT multiaddrs peers should dial, when they differ from dht_maddrs
    api_listen: str | None = "127.0.0.1:0"  # None: no gRPC API
    api_tls: ServerTls | None = None  # the API's certificate and key: serve it (and the dashboard) over TLS
    http_listen: str | None = None  # where to serve the web dashboard and /metrics; None: nowhere
    model: ModelSpec = PRESETS["tiny"]  # a preset, or a model folder's spec (`workload.load_model`)
    batch: int = 16
    micro_batch: int = 2
    dtype: str = "fp32"
    heartbeat_s: float = 2.0
    replan_interval_s: float = 300.0  # docs/churn.md: breaks are repaired at once; a full re-solve this often
    settle_s: float | None = None  # default: two heartbeats
    min_peers: int = 2
    gain: float = 0.1  # a new plan must predict a step this much faster (moving weights included)
    time_budget_s: float = 2.0
    stages: int | None = None
    group_size: int | None = None
    seed: int = 0
    plan_ttl_s: float = 3600.0  # the plan stays in the DHT this long after its last (re)publication
    steps: int | None = None  # the swarm's last step: no new plan once the running one reaches it
    join_file: Path | None = None  # where to write what peers need to join (`hetpeer join --join-file`)
    eval_every: int = 0  # plans ask every lane for its validation loss at the steps divisible by this (0: never)
    eval_batch: int = 8  # held-out sequences per lane for it
    admission: str = "open"  # who may be planned: open, allowlist (of `allowlist`) or token (`hetpeer invite`)
    allowlist: Path | None = None  # read again whenever it changes
    ban_period_s: float = 300.0  # the first ban of a peer its group reports; doubles on each repeat; 0: no bans

    def __post_init__(self) -> None:
        self.workload  # a ValueError naming what does not fit
        if self.admission not in gate.ADMISSIONS or (self.admission == "allowlist") != (self.allowlist is not None):
            raise ValueError(f"admission must be one of {', '.join(gate.ADMISSIONS)}, with an allow-list file exactly "
                             f"for 'allowlist'; got {self.admission!r} and {self.allowlist}")
        if not self.ban_period_s >= 0:
            raise ValueError(f"ban period must be a non-negative number of seconds, got {self.ban_period_s}")
        if not self.heartbeat_s > 0 or not self.replan_interval_s > 0 or not self.time_budget_s > 0:
            raise ValueError("heartbeat, re-plan interval and time budget must be positive")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.eval_every < 0 or self.eval_batch < 1:
            raise ValueError(f"eval_every must be >= 0 and eval_batch >= 1, got {self.eval_every}, {self.eval_batch}")
        if self.min_peers < 1 or not 0 <= self.gain < 1:
            raise ValueError(f"min_peers must be >= 1 and gain in [0, 1), got {self.min_peers}, {self.gain}")

    @property
    def workload(self) -> Workload:
        return Workload(self.model, batch=self.batch, micro_batch=self.micro_batch, dtype=self.dtype)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, report: Callable[[str], None]) -> None:
        self.config, self.report = config, report
        self.control = ControlPlane(
            config.swarm, config.home / "coordinator.key", config.initial_peers, config.dht_maddrs, config.dht_announce,
            identity_path=config.home / "dht.key", remember_path=config.home / "known_dht.json",
        )
        self.planner = PlannerConfig(
            cost_model="time", stages=config.stages, group_size=config.group_size, time_budget_s=config.time_budget_s
        )
        self.api: ApiServer | None = None
        self.dashboard: DashboardServer | None = None
        self.history = History()
        self.board: Board | None = None  # what the dashboard shows: taken at the end of each round
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.stopping = threading.Event()
        self.view = SwarmView(config.swarm, "", None, None, {}, 0, 0.0)
        self.plan: Plan | None = None
        self.plan_time: float | None = None
        self.first_seen: dict[str, float] = {}
        self.considered: set[str] = set()  # newcomers the running plan was kept without (see `policy.decide`)
        self.rechecked_epoch = -1  # the plan whose estimated links were solved again once measured
        self.repaired_epoch = -1  # the plan a repair made: a stopgap, which a solve replaces without the --gain hysteresis
        self.reached = 0  # the furthest step the swarm announced: no plan starts below it
        self.finished = False  # the swarm reached --steps: no more plans, even when its peers have left
        self.last_solve = 0.0
        self.last_publish = 0.0
        self._logged: set[tuple[str, str]] = set()
        self._rng = np.random.default_rng(config.seed)
        self.admission = gate.Admission()
        self._allowlist_mtime: float | None = None
        self.bans: dict[str, gate.Ban] = {}  # kept while the coordinator runs; a restart forgives
        self.refused: dict[str, str] = {}  # peers left out of plans this round, and why
        self._kept: set[int] = set()  # epochs a re-solve kept, as events (once each: a re-solve comes every interval)

    @property
    def key(self) -> str:
        return key_digest(self.control.public_key)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "Coordinator":
        self._read_allowlist()  # before anything starts: a bad file is an error naming its line
        self.control.start()
        if self.config.admission == "token":
            self.admission = gate.Admission("token", coordinator_key=self.control.public_key, swarm=self.config.swarm)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        if self.config.api_listen is not None:
            self.api = ApiServer(lambda: self.view, self.config.api_listen, tls=self.config.api_tls)
            self.api.start()
        if self.config.http_listen is not None:
            self.dashboard = DashboardServer(lambda: self.board, self.config.http_listen, tls=self.config.api_tls).start()
        self.view = replace(self.view, coordinator_key=self.key)
        self.last_solve = self.control.now()  # a (re)started coordinator waits a full interval before a periodic re-solve
        self.report(f"coordinator of swarm {self.config.swarm}; its key (give peers --coordinator-key): {self.key}")
        self.report(f"DHT: {' '.join(self.control.visible_maddrs())}")
        self.report(f"admission: {self._admission_words()}; bans "
                    + (f"of {self.config.ban_period_s:g} s on a group's report" if self.config.ban_period_s else "off"))
        if self.api is not None:
            self.report(f"API: {self.api.address} (hetpeer status --api {self.api.address})")
        if self.dashboard is not None:
            self.report(f"dashboard: {self.dashboard.url} (Prometheus: {self.dashboard.url}metrics)")
        self.history.event(self.control.now(), "coordinator", "coordinator started")
        if self.config.join_file is not None:
            c = self.config
            JoinInfo(c.swarm, self.key, self.control.dialable_maddrs(), c.model.name, c.dtype).write(c.join_file)
            self.report(f"join file: {c.join_file} (hetpeer join --join-file {c.join_file})")
        return self

    def shutdown(self) -> None:
        self.stopping.set()
        if self.api is not None:
            self.api.shutdown()
        if self.dashboard is not None:
            self.dashboard.shutdown()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.control.shutdown()

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            self.tick()
            self.stopping.wait(max(0.0, self.config.heartbeat_s - (time.monotonic() - started)))

    # -- one round: fetch, decide, act --------------------------------------------------------------
    def tick(self) -> None:
        try:
            self._round()
        finally:
            self._take_board()

    def _take_board(self) -> None:
        """The round as the dashboard shows it: the view, the history so far, who is left out and why."""
        view = self.view
        figures = progress(view)
        self.history.observe(view.now, view.peers, view.plan, view.plan_time, figures.step, figures.loss,
                             figures.val_loss, figures.tokens_per_s)
        self.board = Board(view, self.history.snapshot(), dict(self.refused), dict(self.bans), self._admission_words())
        if self.dashboard is not None:
            self.dashboard.prepare(self.board)

    def _round(self) -> None:
        config = self.config
        now = self.control.now()
        records, dropped = self.control.read_peers(max_age_s=(TTL_HEARTBEATS + 1) * config.heartbeat_s)
        self.control.remember(r.dht for r in sorted(records.values(), key=lambda r: -r.time))  # a restart finds them
        healed = self.control.heal()  # after a partition: find the swarm again
        if healed is not None:
            self._event("coordinator", healed)
        for item in dropped:
            self._log_once(item.signer, f"dropped a peer record signed by {item.signer}: {item.reason}")
        ours = {}
        for d, record in records.items():
            if (record.model, record.dtype) != (config.model.name, config.dtype):
                self._log_once(d, f"ignored {d}: it trains {record.model} in {record.dtype}, this swarm {config.model.name} in {config.dtype}")
            else:
                ours[d] = record
        live = {d: r for d, r in ours.items() if r.state != "leaving"}
        for d in live:
            self.first_seen.setdefault(d, now)
        for d in set(self.first_seen) - set(live):
            del self.first_seen[d]
        self.considered &= set(live)  # one that left and came back is a newcomer again
        self._read_running_plan()
        live = self._gate(live, now)
        self.view = SwarmView(config.swarm, self.key, self.plan, self.plan_time, ours, len(dropped), now)
        if self.plan is not None:
            self.reached = max(self.reached, policy.furthest_step(self.plan, ours))
        if self.finished or (config.steps is not None and self.reached >= config.steps):
            self.finished = True  # for good: the peers leave now, and those left on standby are not a swarm to train
            self._log_once("done", f"the swarm reached step {config.steps}: no more plans", kind="coordinator")
            return
        decision = policy.decide(
            self.plan, live, self.first_seen, now, self.last_solve, min_peers=config.min_peers,
            settle_s=config.settle_s if config.settle_s is not None else 2 * config.heartbeat_s,
            replan_interval_s=config.replan_interval_s, considered=self.considered,
            estimates_rechecked=self.plan is not None and self.rechecked_epoch == self.plan.epoch,
            links_wait_s=policy.LINKS_WAIT_HEARTBEATS * config.heartbeat_s,
        )
        if decision.solve:
            if decision.broken and self._repair(decision, live, ours):
                return  # the periodic re-solve stays due when it was: a repair is no search (docs/churn.md)
            self.last_solve = now
            if self.plan is not None:
                self.rechecked_epoch = self.plan.epoch  # any solve under it uses every measurement there is
            self._solve_and_publish(decision, live, ours)
        elif self.plan is not None and now - self.last_publish > config.plan_ttl_s / 3:
            self._publish(self.plan, "kept alive")

    def _gate(self, live: dict[str, PeerRecord], now: float) -> dict[str, PeerRecord]:
        """The live peers the planner may use: admitted and not banned (bans judged from the records first)."""
        self._read_allowlist()
        self.bans, news = gate.judge(self.plan, live, self.bans, now, self.config.ban_period_s)
        for line in news:
            self._event("ban", line)
        kept, self.refused = gate.plannable(live, self.admission, self.bans, now)
        for device, why in self.refused.items():
            if device not in self.bans or self.bans[device].until <= now:  # a ban was said when it began
                self._log_once(device, f"left {device} out of plans: {why}", kind="refused")
        return kept

    def _read_allowlist(self) -> None:
        """(Re)read the allow-list when its file changed; a file that no longer parses keeps the last good list."""
        path = self.config.allowlist
        if path is None:
            return
        try:
            mtime = path.stat().st_mtime
        except OSError as error:
            if self._allowlist_mtime is None:
                raise AdmissionError(f"cannot read allow-list {path}: {error.strerror}") from None
            self._log_once("allowlist", f"cannot read allow-list {path} ({error.strerror}): keeping the last one read")
            return
        if mtime == self._allowlist_mtime:
            return
        try:
            allowlist = Allowlist.read(path)
        except AdmissionError as error:
            if self._allowlist_mtime is None:
                raise
            self._log_once("allowlist", f"{error}: keeping the last allow-list read")
            return
        first = self._allowlist_mtime is None
        self.admission, self._allowlist_mtime = gate.Admission("allowlist", allowlist=allowlist), mtime
        if not first:
            self.report(f"read allow-list {path} again: {self._admission_words()}")

    def _admission_words(self) -> str:
        admission = self.admission
        if admission.mode == "allowlist":
            return (f"peers on allow-list {self.config.allowlist} ({len(admission.allowlist.devices)} device id(s), "
                    f"{len(admission.allowlist.fingerprints)} key fingerprint(s))")
        return "peers with a join token of this coordinator (hetpeer invite)" if admission.mode == "token" else "open to every peer"

    def _read_running_plan(self) -> None:
        plans, dropped = self.control.read_plans()
        for item in dropped:
            self._log_once(item.signer, f"dropped a plan record signed by {item.signer}: {item.reason}")
        mine = [p for p in plans if key_digest(p.signer) == self.key]
        for other in plans:
            if key_digest(other.signer) != self.key:
                self._log_once(f"plan {other.plan.epoch}", f"ignored plan epoch {other.plan.epoch} signed by another key "
                               f"({key_digest(other.signer)[:16]}...)")
        if mine and (self.plan is None or mine[0].plan.epoch >= self.plan.epoch):
            if self.plan is None:
                self.report(f"running plan from the DHT: epoch {mine[0].plan.epoch}")
                # its estimated links were solved again once measured, or will be at the next periodic re-solve:
                # a restart is no news, and re-planning on it moved weights for a few percent (measurements vary)
                self.rechecked_epoch = mine[0].plan.epoch
            self.plan, self.plan_time = mine[0].plan, mine[0].time

    def _solve_and_publish(self, decision: policy.Decision, live: dict[str, PeerRecord], ours: dict[str, PeerRecord]) -> None:
        """Plan over the `live` peers; `ours` (leaving peers included) tells how far the swarm got."""
        config, current = self.config, self.plan
        if len(live) < 1:
            self._log_once("none", f"cannot re-plan ({decision.reason}): no peer is announcing")
            return
        if any(r.checkpoint for r in live.values()) and not any(r.layers for r in live.values()):
            self._resume(live)  # a swarm starting again after every peer stopped: its checkpoints are the model
            return
        self.report(f"solving: {decision.reason}")
        usable = current if current is not None and not decision.broken else None
        problem, estimated = policy.build_problem(live, config.workload, current)
        rng = np.random.default_rng(self._rng.integers(2**32))
        started = time.perf_counter()
        try:
            future = self.executor.submit(solve, problem, self.planner, rng)
            solution = future.result(timeout=config.time_budget_s * 3 + 10)
        except PlanningError as error:
            self._event("coordinator", f"no plan: {error}")
            return
        except concurrent.futures.TimeoutError:
            self._event("coordinator", f"the planner did not finish within {config.time_budget_s * 3 + 10:g} s")
            return
        searched_s = time.perf_counter() - started
        current_s = policy.predicted_step_s(problem, self.planner, usable) if usable is not None else None
        same = usable is not None and solution.plan.stages == usable.stages
        repaired = current is not None and current.epoch == self.repaired_epoch
        publish, why = policy.worth_it(decision, solution.report.objective, current_s, config.gain, same, repaired)
        if not publish:
            known = set(current.devices) | set(current.standby)
            self.considered |= {d for d in live if d not in known}
            line = f"kept epoch {current.epoch}: {why} (searched {searched_s:.1f} s)"
            self.report(line)
            if current.epoch not in self._kept:  # a re-solve comes every interval: one event a plan, not thousands
                self._kept.add(current.epoch)
                self.history.event(self.control.now(), "plan", f"{line}; later re-solves that keep it are not listed")
            return
        step = policy.start_step(current, ours, decision.broken, config.heartbeat_s, config.workload.model.seq_len, self.reached)
        plan = replace(
            solution.plan, epoch=(current.epoch + 1) if current is not None else 1, start_step=step,
            estimated_links=policy.estimated_links(solution.plan, problem.device_ids, estimated),
            eval_every=config.eval_every, eval_batch=config.eval_batch if config.eval_every else 0,
        )
        self._say_orphans(plan, live)
        if self._publish(plan, f"{why}; searched {searched_s:.1f} s"):
            self.considered.clear()

    def _say_orphans(self, plan: Plan, live: dict[str, PeerRecord]) -> None:
        """An event when the plan holds layers no live peer holds: they start again from fresh weights."""
        lost = policy.orphaned_layers(live, plan.layers) if self.reached > 0 else []
        if lost:
            ranges = ", ".join(f"{a}-{b - 1}" for a, b in lost)
            self._event("coordinator", f"no live peer holds layers {ranges}: the swarm lost every peer that held them, so plan epoch "
                        f"{plan.epoch} trains them again from fresh weights from step {plan.start_step}")

    def _repair(self, decision: policy.Decision, live: dict[str, PeerRecord], ours: dict[str, PeerRecord]) -> bool:
        """Publish the running plan mended (`repair.py`: each departed member replaced by the best live peer outside
        it, or its lane dropped) instead of solving again; False when it cannot be mended that way."""
        config, current = self.config, self.plan
        if not live or any(r.checkpoint for r in live.values()) and not any(r.layers for r in live.values()):
            return False
        problem, estimated = policy.build_problem(live, config.workload, current)
        repaired = repair(current, problem, self.planner)
        if repaired is None:
            return False
        step = policy.start_step(current, ours, True, config.heartbeat_s, config.workload.model.seq_len, self.reached)
        plan = replace(repaired, start_step=step, estimated_links=policy.estimated_links(repaired, problem.device_ids, estimated))
        gone = [d for d in current.devices if d not in repaired.devices and d not in live]
        self._say_orphans(plan, live)
        published = self._publish(plan, f"repaired: {decision.reason}; {len(gone)} member(s) replaced or their lanes dropped")
        if published:
            self.repaired_epoch = plan.epoch
        return published

    def _resume(self, live: dict[str, PeerRecord]) -> None:
        """Publish the plan the live peers' stage checkpoints make, from the step they were saved at; while a
        layer is in no checkpoint, say which and wait (peers that hold it may still be starting)."""
        config, current = self.config, self.plan
        found = policy.resume_from_checkpoints(live, config.model.layers)
        if isinstance(found, str):
            self._log_once(f"resume {found}", found)
            return
        lanes = len(found.stages[0][2])
        lane_batch = -(-config.batch // lanes)
        micro_batch = min(config.micro_batch, lane_batch)
        plan = Plan(
            cost_model="time", model=config.model.name, layers=config.model.layers, batch=config.batch,
            micro_batch=micro_batch, micro_batches=-(-lane_batch // micro_batch), dtype=config.dtype,
            stages=tuple(StagePlan(i, start, end, devices, "gossip" if lanes > 1 else "none")
                         for i, (start, end, devices) in enumerate(found.stages)),
            standby=found.standby, epoch=(current.epoch + 1) if current is not None else 1, start_step=found.step,
            eval_every=config.eval_every, eval_batch=config.eval_batch if config.eval_every else 0,
        )
        self._publish(plan, f"resumed from the peers' checkpoints at step {found.step}")

    def _publish(self, plan: Plan, why: str) -> bool:
        steps = self.config.steps
        if plan is not self.plan and self.plan is not None and steps is not None and plan.start_step >= steps:
            # the swarm ends before it would take effect; its peers leave under the running plan, whose progress
            # (and a watcher waiting for the last step) their leaving records then show
            self._log_once("after the end", f"kept epoch {self.plan.epoch}: a new plan would start at step {plan.start_step}, "
                           f"when the swarm has done its {steps} steps")
            return False
        if not self.control.publish_plan(plan, ttl_s=self.config.plan_ttl_s):
            self.report(f"could not store plan epoch {plan.epoch} in the DHT; trying again next round")
            return False
        self.last_publish = self.control.now()
        if plan is not self.plan:
            self.plan, self.plan_time = plan, self.last_publish
            self.view = replace(self.view, plan=plan, plan_time=self.last_publish)  # the API shows it now, not a round later
            self.history.plan(plan, self.last_publish, why)
            shape = f"{len(plan.stages)} stage(s) x {plan.group_size} lane(s)"
            self.report(
                f"published plan epoch {plan.epoch} from step {plan.start_step}: {shape}, predicted "
                f"{plan.predicted} ({why})"
            )
            for line in plan.standby_lines():
                self.report(f"  standby: {line}")
            for s, stage in enumerate(plan.stages):
                self.report(f"  stage {s + 1} layers {stage.layer_start}-{stage.layer_end - 1} ({stage.sync}): {', '.join(stage.devices)}")
            if plan.estimated_links:
                self.report(f"  {len(plan.estimated_links)} link(s) not yet measured were estimated")
        return True

    def _log_once(self, key: str, line: str, kind: str | None = None) -> None:
        """Say `line` the first time it comes up for `key`; an event of `kind` on the dashboard too, when given."""
        if (key, line) not in self._logged:
            self._logged.add((key, line))
            self._event(kind, line) if kind is not None else self.report(line)

    def _event(self, kind: str, line: str) -> None:
        self.report(line)
        self.history.event(self.control.now(), kind, line)
