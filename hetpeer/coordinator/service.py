"""The coordinator behind `hetpeer coordinator`: its life cycle and its round: read the swarm, decide, act.

Its loop, every heartbeat: fetch (the peers' announcements and the newest plan under its own key),
gate (`gatekeeper.py`: admission and bans), decide (`policy.py`, pure), act (`publishing.py`: run the
planner in an executor with a time budget; publish a plan with the next epoch and the step it takes
effect at). It keeps nothing it needs that is not in the DHT: the running plan is read back from there, so a
restarted coordinator (same key file) carries on with the plan the peers are running and publishes a
new one only for the reasons a running one would; only the planner's memory of its last search, which each
search goes on from, is lost, and the first search after a restart starts afresh. It serves what it read through the gRPC API
(`api.py`) and the dashboard (`web.py`); what it is told is a `config.CoordinatorConfig`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from hetpeer.coordinator import calibration, gate, policy
from hetpeer.coordinator.api import ApiServer
from hetpeer.coordinator.board import Board
from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.gatekeeper import Gatekeeper
from hetpeer.coordinator.history import History, Pace
from hetpeer.coordinator.ledger import CreditBoard, Ledger
from hetpeer.coordinator.planner import Memory, PlannerConfig
from hetpeer.coordinator.planner.islands import Archipelago, Islands
from hetpeer.coordinator.publishing import RECENT_PLANS, Publisher
from hetpeer.coordinator.reach import ReachServer
from hetpeer.coordinator.view import SwarmView, progress
from hetpeer.coordinator.web import DashboardServer
from hetpeer.protocol.addresses import maddr_host
from hetpeer.protocol.control import ControlPlane, key_digest
from hetpeer.protocol.join import JoinInfo
from hetpeer.protocol.dataset import MANIFEST, Manifest, served_files
from hetpeer.protocol.plan import Dataset, Plan
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.wire import SchemaError

log = logging.getLogger("hetpeer.coordinator")
LEDGER_SAVE_S = 30.0  # the credit ledger is written this often (and when the coordinator stops)


class Coordinator(Gatekeeper, Publisher):
    def __init__(self, config: CoordinatorConfig, report: Callable[[str], None]) -> None:
        self.config, self.report = config, report
        self.control = ControlPlane(
            config.swarm, config.home / "coordinator.key", config.initial_peers, config.dht_maddrs, config.dht_announce,
            identity_path=config.home / "dht.key", remember_path=config.home / "known_dht.json",
        )
        self.planner = PlannerConfig(
            cost_model="time", stages=config.stages, group_size=config.group_size, time_budget_s=config.time_budget_s,
            workers=config.workers, compress=config.compress, sync=config.sync, outer_every=config.outer_every,
            robust=config.recipe.robust > 0,
        )
        self.api: ApiServer | None = None
        self.dashboard: DashboardServer | None = None
        self.reach: ReachServer | None = None
        self.history = History()
        self.board: Board | None = None  # what the dashboard shows: taken at the end of each round
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.stopping = threading.Event()
        self.view = SwarmView(config.swarm, "", None, None, {}, 0, 0.0)
        self.plan: Plan | None = None
        self.plan_time: float | None = None
        self.dataset: Dataset | None = None  # what plans name: the configured dataset, with where it is served
        self.recent_plans: list[Plan] = []  # the last plans published or found: where the swarm's data position comes from
        # where the last solve stopped (each island's, with workers), which the next goes on from (not in the DHT)
        self.search_memory: Memory | Archipelago | None = None
        # the planner's worker processes, beyond its own thread (started at the first solve, kept between rounds)
        self.islands = Islands(config.workers) if config.workers > 1 else None
        self.calibration = calibration.Calibration()  # what the running plans' steps took beyond their prediction (not in the DHT)
        self.first_seen: dict[str, float] = {}
        self.considered: set[str] = set()  # newcomers the running plan was kept without (see `policy.decide`)
        self.rechecked_epoch = -1  # the plan whose estimated links were solved again once measured
        self.repaired_epoch = -1  # the plan a repair made: a stopgap, which a solve replaces without the --gain hysteresis
        self.reached = 0  # the furthest step the swarm announced: no plan starts below it
        self.finished = False  # the swarm reached --steps: no more plans, even when its peers have left
        self.last_solve = 0.0
        self.last_publish = 0.0
        self._logged: set[tuple[str, str]] = set()
        self._waiting_for = ""  # what the first plan waits for, as last said (its counts left out)
        self._rng = np.random.default_rng(config.seed)
        self.admission = gate.Admission()
        self._allowlist_mtime: float | None = None
        self.bans: dict[str, gate.Ban] = {}  # kept while the coordinator runs; a restart forgives
        self.disputed: gate.Disputes = {}  # accusations within pairs (`gate.disputes`), likewise
        self.apart: set[tuple[str, str]] = set()  # the pairs they keep apart in plans
        self.parting: set[tuple[str, str]] = set()  # the pairs a re-plan was asked to part (once each)
        self.refused: dict[str, str] = {}  # peers left out of plans this round, and why
        self._kept: set[int] = set()  # epochs a re-solve kept, as events (once each: a re-solve comes every interval)
        # the volunteers' confirmed work: kept in the home (records expire, credit must not), loaded at start
        self.ledger_path = config.home / "credit.json"
        self.ledger = Ledger(config.model.seq_len)  # `start` reads the one the home keeps
        self.credit: CreditBoard | None = None
        self._saved_round = 0.0

    @property
    def key(self) -> str:
        return key_digest(self.control.public_key)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "Coordinator":
        self._read_allowlist()  # before anything starts: a bad file is an error naming its line
        self.ledger = Ledger.load(self.ledger_path, self.config.model.seq_len)  # a LedgerError names a bad file
        self.control.start()
        if self.config.admission == "token":
            self.admission = gate.Admission("token", coordinator_key=self.control.public_key, swarm=self.config.swarm)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        if self.config.api_listen is not None:
            self.api = ApiServer(lambda: self.view, self.config.api_listen, tls=self.config.api_tls, get_credit=lambda: self.credit)
            self.api.start()
        if self.config.http_listen is not None:
            self.dashboard = DashboardServer(lambda: self.board, self.config.http_listen, tls=self.config.api_tls,
                                             data=self._served_data()).start()
        self.dataset = self._dataset()
        if self.config.reach_port is not None:
            self.reach = ReachServer(maddr_host(self.config.dht_maddrs[0]) or "127.0.0.1", self.config.reach_port,
                                     clock=self.control.now).start()
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
        if self.dataset is not None:
            self.report(f"data: plans name dataset {self.dataset.manifest[:16]}..., which peers fetch from {self.dataset.url}")
        if self.reach is not None:
            self.report(f"reach service: port {self.reach.port} (peers learn there whether others can dial them: docs/nat.md)")
        self.history.event(self.control.now(), "coordinator", "coordinator started")
        if self.config.join_file is not None:
            c = self.config
            dialable = self.control.dialable_maddrs()
            host = (maddr_host(dialable[0]) if dialable else None) or "127.0.0.1"
            reach = None if self.reach is None else (host, self.reach.port)
            api = None if self.api is None or c.api_tls is not None else (host, self.api.port)  # a TLS API needs its CA
            JoinInfo(c.swarm, self.key, self.control.dialable_maddrs(), c.model.name, c.dtype, reach, api).write(c.join_file)
            self.report(f"join file: {c.join_file} (hetpeer join --join-file {c.join_file})")
        return self

    def shutdown(self) -> None:
        self.stopping.set()
        if self.control.dht is not None:  # it started: its ledger is the home's
            self._save_ledger()
        if self.api is not None:
            self.api.shutdown()
        if self.dashboard is not None:
            self.dashboard.shutdown()
        if self.reach is not None:
            self.reach.shutdown()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.islands is not None:
            self.islands.close()
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
                             figures.val_loss, figures.tokens_per_s, figures.noise_scale)
        self.board = Board(view, self.history.snapshot(), dict(self.refused), dict(self.bans), self._admission_words(), self.credit)
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
        self._calibrate(live)
        self.view = SwarmView(config.swarm, self.key, self.plan, self.plan_time, ours, len(dropped), now, self.calibration.overhead_s)
        if self.plan is not None:
            self.reached = max(self.reached, policy.furthest_step(self.plan, ours))
        self._credit(ours, now)
        if self.finished or (config.steps is not None and self.reached >= config.steps):
            self.finished = True  # for good: the peers leave now, and those left on standby are not a swarm to train
            self._log_once("done", f"the swarm reached step {config.steps}: no more plans", kind="coordinator")
            return
        decision = policy.decide(
            self.plan, live, self.first_seen, now, self.last_solve, min_peers=config.min_peers,
            settle_s=config.settle_s if config.settle_s is not None else 2 * config.heartbeat_s,
            replan_interval_s=config.replan_interval_s, considered=self.considered,
            estimates_rechecked=self.plan is not None and self.rechecked_epoch == self.plan.epoch,
            measure_wait_s=policy.MEASURE_WAIT_HEARTBEATS * config.heartbeat_s, plan_measured=calibration.measured(self._running_pace()),
            parted=gate.parted(self.plan, self.disputed, self.parting) if self.plan is not None else None,
        )
        if self.plan is None and not decision.solve:
            self._say_waiting(decision.reason)
        try:
            self._act(decision, live, ours, now)
        except SchemaError as error:
            # a plan this coordinator made that its own peers would refuse: a defect, and no reason to leave the swarm
            # without a coordinator; the running plan goes on, and the next round tries again
            running = f"epoch {self.plan.epoch} goes on" if self.plan is not None else "no plan runs yet"
            self._log_once(f"schema {error}", f"the plan made ({decision.reason}) is not published, it fails the plan schema: "
                           f"{error}; {running} (please report this)", kind="coordinator")

    def _act(self, decision: policy.Decision, live: dict[str, PeerRecord], ours: dict[str, PeerRecord], now: float) -> None:
        """What the round's decision asks for: the organizer's new recipe, a repair or a solve, or the plan kept alive."""
        config = self.config
        if self.plan is not None and not decision.broken and self.plan.recipe != config.recipe:
            self._publish_recipe(ours)
        elif decision.solve:
            if decision.broken and self._repair(decision, live, ours):
                return  # the periodic re-solve stays due when it was: a repair is no search (docs/churn.md)
            self.last_solve = now
            if self.plan is not None:
                self.rechecked_epoch = self.plan.epoch  # any solve under it uses every measurement there is
            self._solve_and_publish(decision, live, ours)
        elif self.plan is not None and now - self.last_publish > config.plan_ttl_s / 3:
            self._publish(self.plan, "kept alive")

    def _credit(self, ours: dict[str, PeerRecord], now: float) -> None:
        """Fold the round's records (leaving peers' last ones too) into the credit ledger; save it every
        `LEDGER_SAVE_S` and at shutdown."""
        plans = [*self.recent_plans, *([self.plan] if self.plan is not None else [])]
        for line in self.ledger.fold(plans, ours, now, self.config.workload):
            self._event("credit", line)
        if self.ledger.board_due:  # a large swarm's board is made afresh every few rounds, or when a peer comes or goes
            self.credit = self.ledger.board(now)
        if now - self._saved_round >= LEDGER_SAVE_S:
            self._save_ledger()

    def _save_ledger(self) -> None:
        try:
            self.ledger.save(self.ledger_path)
            self._saved_round = self.control.now()
        except OSError as error:  # a full disk must not stop the swarm: say so, and try again later
            self._log_once(f"ledger {error}", f"could not save the credit ledger to {self.ledger_path}: {error}")

    def _running_pace(self) -> Pace | None:
        """The running plan's pace so far (None: no plan, or no step of it seen yet)."""
        entry = self.history.current(self.plan.epoch) if self.plan is not None else None
        return entry.pace if entry is not None else None

    def _calibrate(self, live: dict[str, PeerRecord]) -> None:
        """Learn the step's overhead afresh when the running plan's pace has closed another window."""
        pace = self._running_pace()
        if not calibration.due(self.calibration, self.plan, pace):
            return
        learned = calibration.learn(self.plan, pace, live, self.config.workload, self.planner)
        if learned is None:
            return
        if calibration.news(self.calibration, learned):
            self.report(learned.describe())
        self.calibration = learned

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
            if self.plan is None or mine[0].plan.epoch > self.plan.epoch:
                self.recent_plans = [*self.recent_plans[-RECENT_PLANS + 1:], mine[0].plan]
            self.plan, self.plan_time = mine[0].plan, mine[0].time

    def _served_data(self) -> tuple[Path, frozenset[str]] | None:
        """The prepared folder the dashboard serves, with the files of it peers may fetch."""
        folder = self.config.data_folder
        if folder is None:
            return None
        manifest = Manifest.from_bytes((folder / MANIFEST).read_bytes(), str(folder / MANIFEST))
        return folder, served_files(manifest)

    def _dataset(self) -> Dataset | None:
        """The configured dataset; with no URL of its own, at the dashboard's: its host, or where peers dial the DHT
        when the dashboard listens on every address."""
        dataset = self.config.dataset
        if dataset is None or dataset.url:
            return dataset
        host = self.config.http_listen.rpartition(":")[0].strip("[]")
        if host in ("", "0.0.0.0", "::"):
            announced = map(maddr_host, self.config.dht_announce or self.config.dht_maddrs)
            host = next((h for h in announced if h and h not in ("0.0.0.0", "::")), "127.0.0.1")
        host = f"[{host}]" if ":" in host else host
        return replace(dataset, url=f"{'https' if self.config.api_tls else 'http'}://{host}:{self.dashboard.port}/data/")

    def _say_waiting(self, reason: str) -> None:
        """Say what the first plan waits for when that changes, not each time one of its counts does."""
        gist = re.sub(r"[0-9.]+", "N", reason)
        if gist != self._waiting_for:
            self._waiting_for = gist
            self.report(f"first plan: {reason}")

    def _log_once(self, key: str, line: str, kind: str | None = None) -> None:
        """Say `line` the first time it comes up for `key`; an event of `kind` on the dashboard too, when given."""
        if (key, line) not in self._logged:
            self._logged.add((key, line))
            self._event(kind, line) if kind is not None else self.report(line)

    def _event(self, kind: str, line: str) -> None:
        self.report(line)
        self.history.event(self.control.now(), kind, line)
