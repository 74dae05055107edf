"""How the coordinator acts on a decision to re-plan: solve, mend or resume a plan, and publish it.

- solve: the planner in the coordinator's executor with a time budget; the plan found is published when
  `policy.worth_it` says it beats the running one by enough to pay for moving weights;
- mend (`repair.py`): the running plan with its departed members replaced, instead of a search;
- resume: the plan the live peers' stage checkpoints make, for a swarm starting again after every peer stopped;
- publish: into the DHT under the coordinator's key, with the next epoch and the step it takes effect at,
  unless the swarm has done its steps before then.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import replace

import numpy as np

from hetpeer.coordinator import policy
from hetpeer.coordinator.planner import PlanningError, solve
from hetpeer.coordinator.planner.codecs import AUTO
from hetpeer.coordinator.planner.islands import IslandError
from hetpeer.coordinator.repair import repair
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import PeerRecord

RECENT_PLANS = 8  # plans kept to find the swarm's data position at a new plan's start step


class Publisher:
    """Mixed into `service.Coordinator`, whose state it reads and advances: `config`, `planner`, `executor`,
    `control`, `plan` and `plan_time`, `view`, `history`, `considered`, `reached`, `repaired_epoch`,
    `last_publish`, `_kept`, `_rng`, `recent_plans`, `dataset`, `search_memory`, `islands` and `calibration`; it says what it does with `report`, `_event` and `_log_once`."""

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
        started = time.perf_counter()
        left_out: list[str] = []  # peers behind NAT that the plan would make neighbours of one another
        while True:
            planned = {d: r for d, r in live.items() if d not in left_out}
            problem, estimated = policy.build_problem(planned, config.workload, current, self.calibration.overhead_s,
                                                      self._departure_stall(), self.apart)
            solution = self._search(problem)
            if solution is None:
                return
            crossing = policy.without_path(solution.plan, planned, self.apart)
            if not crossing:
                break
            out = policy.least_served(crossing)
            left_out.append(out)
            others = sorted({d for pair in crossing if out in pair for d in pair} - {out})
            failed = {d: policy.failure_words(planned, out, d) for d in others}
            why = ("it and these failed to reach each other: " if any(failed.values()) else
                   "nobody can dial it, nor " if planned[out].reachable == "none" else
                   "it and these are in dispute or failed to reach each other: ")
            self._log_once(f"no-path {out}", f"{out} stays on standby: {why}{', '.join(f'{d} ({how})' if how else d for d, how in failed.items())}, whom the plan needed as its "
                           "neighbours (a forwarded port on either side would give them a path)", "coordinator")
        if left_out:
            solution = replace(solution, plan=replace(solution.plan, standby=(*solution.plan.standby, *left_out)))
            if usable is not None and set(usable.devices) & set(left_out):
                usable = None  # the running plan holds a peer this one cannot serve: not comparable, and to be replaced
        searched_s = time.perf_counter() - started
        current_s = policy.running_report(problem, self.planner, usable).objective if usable is not None else None
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
        )
        self._say_orphans(plan, live)
        if self._publish(plan, f"{why}; searched {searched_s:.1f} s"):
            self.considered.clear()

    def _search(self, problem):
        """The planner's solution for `problem` within the time budget, or None (said as an event)."""
        config = self.config
        if problem.sharing is not None:
            self._log_once("sharing", problem.sharing.describe())
        rng = np.random.default_rng(self._rng.integers(2**32))
        try:
            # each round's search goes on from the last one's (`search.Memory`): a swarm that stays gets, round after
            # round, the plan of an ever longer search, and a plan change still has to pay for itself (--gain)
            future = self.executor.submit(solve, problem, self.planner, rng, memory=self.search_memory, islands=self.islands)
            solution = future.result(timeout=config.time_budget_s * 3 + 10)
            self.search_memory = solution.memory
            return solution
        except PlanningError as error:
            self._event("coordinator", f"no plan: {error}")
        except IslandError as error:  # a bug, or a worker killed: the rounds go on in this process alone
            self._event("coordinator", f"the planner goes on with one worker: {error}")
            self.islands, self.planner = None, replace(self.planner, workers=1)
        except concurrent.futures.TimeoutError:
            self._event("coordinator", f"the planner did not finish within {config.time_budget_s * 3 + 10:g} s")
        return None

    def _publish_recipe(self, ours: dict[str, PeerRecord]) -> None:
        """The running plan again under the organizer's recipe (a coordinator restarted with another one), from a
        step far enough ahead that every member reads it first: every member of every group switches at that
        step, and the optimizer's step count and schedule go on from it."""
        current = self.plan
        changed = "; ".join(current.recipe.changes(self.config.recipe))
        step = policy.start_step(current, ours, False, self.config.heartbeat_s, self.config.workload.model.seq_len, self.reached)
        self._event("coordinator", f"the organizer's recipe changed from epoch {current.epoch}'s: {changed}")
        self._publish(replace(current, epoch=current.epoch + 1, start_step=step), f"the recipe changed: {changed}")

    def _say_orphans(self, plan: Plan, live: dict[str, PeerRecord]) -> None:
        """An event when the plan holds layers no live peer holds: they start again from fresh weights."""
        lost = policy.orphaned_layers(live, plan.layers) if self.reached > 0 else []
        if lost:
            ranges = ", ".join(f"{a}-{b - 1}" for a, b in lost)
            self._event("coordinator", f"no live peer holds layers {ranges}: the swarm lost every peer that held them, so plan epoch "
                        f"{plan.epoch} trains them again from fresh weights from step {plan.start_step}")

    def _departure_stall(self) -> float:
        """The departures a peer and second this coordinator saw lately (`History.departure_rate`) x how long one
        stalls a plan whose groups wait for every member: until its record expires, and a repaired plan reaches the
        peers (`policy.STALL_HEARTBEATS`)."""
        return self.history.departure_rate() * policy.STALL_HEARTBEATS * self.config.heartbeat_s

    def _repair(self, decision: policy.Decision, live: dict[str, PeerRecord], ours: dict[str, PeerRecord]) -> bool:
        """Publish the running plan mended (`repair.py`: each departed member replaced by the best live peer outside
        it, or its lane dropped) instead of solving again; False when it cannot be mended that way."""
        config, current = self.config, self.plan
        if not live or any(r.checkpoint for r in live.values()) and not any(r.layers for r in live.values()):
            return False
        problem, estimated = policy.build_problem(live, config.workload, current, self.calibration.overhead_s,
                                                  self._departure_stall(), self.apart)
        repaired = repair(current, problem, self.planner)
        if repaired is None or policy.without_path(repaired, live, self.apart):
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
            seq_len=config.model.seq_len, stages=tuple(StagePlan(i, start, end, devices, "gossip" if lanes > 1 else "none")
                         for i, (start, end, devices) in enumerate(found.stages)),
            standby=found.standby, epoch=(current.epoch + 1) if current is not None else 1, start_step=found.step,
        )
        if config.compress != AUTO:  # codecs the organizer fixed; auto's are the next solve's to choose
            plan = plan.with_codecs(*config.compress)
        self._publish(plan, f"resumed from the peers' checkpoints at step {found.step}", data_position=found.data_position)

    def _data_position(self, step: int) -> int:
        """Windows the swarm will have read before `step`: by the latest plan it ran that starts by then (a plan
        published but superseded before its start step never ran, and one starting later has not yet)."""
        ran = [p for p in self.recent_plans if p.start_step <= step]
        return max(ran, key=lambda p: p.epoch).data_position_at(step) if ran else 0

    def _publish(self, plan: Plan, why: str, data_position: int | None = None) -> bool:
        """Store `plan` in the DHT; a new plan first gets the swarm's data position at its start step (from
        `data_position`, a resumption's, or the plans before it), the organizer's dataset and recipe."""
        if plan is not self.plan:
            position = self._data_position(plan.start_step) if data_position is None else data_position
            plan = replace(plan, data_position=position, dataset=self.dataset, recipe=self.config.recipe)
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
            self.recent_plans = [*self.recent_plans[-RECENT_PLANS + 1:], plan]
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
                hop = f"; to stage {s + 2} in {stage.hop_codecs}" if stage.hop_codecs else ""
                self.report(f"  stage {s + 1} layers {stage.layer_start}-{stage.layer_end - 1} ({stage.sync_words}{hop}): "
                            f"{', '.join(stage.devices)}")
            for line in plan.check_lines(first=1):
                self.report(f"  checks: {line}")
            if plan.estimated_links:
                self.report(f"  {len(plan.estimated_links)} link(s) not yet measured were estimated")
            for relay, pairs, carried in plan.relay_load:
                self.report(f"  relay {relay}: {pairs} pair(s) through it, {carried / 2**20:.2f} MiB a step (predicted)")
        return True
