"""How a swarm peer follows the coordinator's plans: which plan it takes and when, switching its stage and lane
(or to standby), and which frames it keeps meanwhile.

A plan takes effect at its `start_step`: a peer whose lane and group all survive in the new plan runs the
old one up to that step; when a member of the old plan is gone (membership broke), every peer drops the
step in progress (`Inbox.interrupt`) and switches at once, entering at `start_step`. A peer keeps its
parameters and optimizer state when its layers stay the same, and otherwise downloads them from the peers
that announce those layers (`handover.py`). A peer that enters a plan from outside it (standby, just
started) waits before its first step until its lane and group announce the plan: members of the plan
before finish that one up to the start step first.

The rules are pure functions (`switch_now`, `not_arrived`, `held_epochs`, `fetching`); `Following` is the
part of `SwarmPeer` (peer.py) that acts on them.
"""

from __future__ import annotations

import time
from typing import Mapping

from hetpeer import __version__
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.peer.data.sharing import from_peers
from hetpeer.peer.data.source import open_data
from hetpeer.peer.pipeline.worker import StageWorker
from hetpeer.peer.transport.inbox import Interrupted, Late
from hetpeer.protocol.control import key_digest
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord

RUNNING_KINDS = ("activation", "gradient", "labels", "params", "allreduce", "tied")  # frames that belong to a plan
FUTURE_EPOCHS = 2  # frames of plans this much newer than the newest this peer has read are kept for it
SHARD_WAIT_S = 10.0  # for each chunk of a shard asked of a group member, before the next member (or the URL)


def switch_now(running: Plan | None, new: Plan, step: int) -> bool:
    """Whether `new` must replace `running` at once rather than at its start step: a peer with no plan,
    a peer already past the start step, and every peer when a member of the running plan is gone from
    the new one (its lanes are broken; waiting for the start step would wait on a dead peer). The same
    answer on every peer that holds the same two plans, so lanes switch together."""
    if running is None or step >= new.start_step:
        return True
    return not set(running.devices) <= set(new.devices) | set(new.standby)


def not_arrived(plan: Plan, records: Mapping[str, PeerRecord], me: str) -> list[str]:
    """`me`'s lane and group neighbours under `plan` that do not yet announce it (or a later plan). A peer
    that enters a plan from outside waits for them before its first step: members of the previous plan
    finish that one up to the start step first, and its frames would wait for them against a timeout."""
    stage, lane = plan.position(me)
    neighbours = set(plan.lanes[lane]) | set(plan.stages[stage].devices)
    return sorted(d for d in neighbours - {me} if d not in records or records[d].epoch < plan.epoch)


def held_epochs(worked: Plan | None, running: Plan | None, pending: Plan | None, me: str) -> tuple[int, int]:
    """The plan epochs (first, last) whose frames this peer keeps before a worker of theirs reads them:
    from the one after the plan its worker runs (`worked`), up to `FUTURE_EPOCHS` past the newest plan it
    has read. Without a worker: from the running plan on while this peer is one of its members (its
    worker is being built, and lane neighbours already at work send to it), else from the one after."""
    newest = max((p.epoch for p in (worked, running, pending) if p is not None), default=0)
    if worked is not None:
        first = worked.epoch + 1
    elif running is not None:
        first = running.epoch if me in running.devices else running.epoch + 1
    else:
        first = 1
    return first, newest + FUTURE_EPOCHS


def fetching(plan: Plan, records: Mapping[str, PeerRecord], device: str) -> bool:
    """Whether `device` announces fetching its stage's state under `plan`: its lane neighbours wait for its
    first frames past their deadline (a stage's download over a slow link can take minutes), rather than
    stop their lanes and have the coordinator re-plan around a peer that is only arriving."""
    record = records.get(device)
    return record is not None and record.state == "fetching" and record.epoch == plan.epoch


class Following:
    """The part of `SwarmPeer` that follows plans: reads them (control thread), switches to them when due
    (main thread) and routes frames (the transport's policy). It changes the peer's `pending` and `running`
    plans and its `worker` and `previous` stages; a new stage's state comes from `Handover._fill`, a first
    stage's data from `open_data`, its shards from its group (`shards`) before the plan's URL."""

    # -- the frame policy -----------------------------------------------------------------------------
    def accept(self, header: FrameHeader) -> str | None:
        if header.kind == "probe":
            if header.sender not in self.transport.book.peers:  # its record may not have reached this peer yet
                return Late(f"{header.sender} is not (yet) a known peer of the swarm")
            return self.prober.accept(header)
        if header.kind in ("state_request", "state"):
            return self.server.accept(header)
        if header.kind in ("shard_request", "shard"):
            return self.shards.accept(header)
        worker = self.worker
        if worker is not None and header.epoch == worker.plan.epoch:
            return worker.accept(header)
        first, last = held_epochs(worker.plan if worker is not None else None, self.running, self.pending, self.device_id)
        if first <= header.epoch <= last and header.kind in RUNNING_KINDS and header.sender in self.transport.book.peers:
            # a neighbour runs a plan this peer has not read or not switched to yet: keep the frame; the worker of that plan
            # screens it again (`Inbox.rescreen`) before reading it. And read plans now rather than at the next heartbeat.
            if header.epoch > last - FUTURE_EPOCHS:
                self.plan_hint.set()
            return None
        return Late(f"plan epoch {header.epoch}, this peer runs {worker.plan.epoch if worker else 'no plan'}")

    # -- plans ------------------------------------------------------------------------------------------
    def _take_plans(self) -> None:
        plans, dropped = self.control.read_plans()
        refused = [d.reason for d in dropped if d.digest == self.config.coordinator_key]
        if refused and (refused[0], 0) not in self._refused:
            # the coordinator's newest plan asks for what this peer cannot do (a recipe field it does not know):
            # training on under the old plan would break its lanes, and under rules it does not know, its group
            self._refused.add((refused[0], 0))
            self.report(f"refused the coordinator's plan: {refused[0]}; on standby until a plan this hetpeer can run "
                        f"(hetpeer {__version__} here: upgrade it)")
            self.unrunnable = True
            if self.worker is not None:
                self.transport.inbox.interrupt("the coordinator's plan is one this peer cannot run")
        for signed in plans:
            plan, signer = signed.plan, key_digest(signed.signer)
            if signer != self.config.coordinator_key:
                if (signer, plan.epoch) not in self._refused:
                    self._refused.add((signer, plan.epoch))
                    self.report(f"ignored plan epoch {plan.epoch} signed by key {signer[:16]}..., not the coordinator's")
                continue
            if plan.model != self.spec.name or plan.layers != self.spec.layers or plan.dtype != self.config.dtype:
                if ("model", plan.epoch) not in self._refused:
                    self._refused.add(("model", plan.epoch))
                    self.report(f"ignored plan epoch {plan.epoch}: it trains {plan.model} ({plan.layers} layers, "
                                f"{plan.dtype}); this peer joined for {self.spec.name} in {self.config.dtype}")
                continue
            self.unrunnable = False
            with self.lock:
                newest = max((p.epoch for p in (self.running, self.pending) if p is not None), default=-1)
                if plan.epoch <= newest:
                    return
                self.pending = plan
                step = self.worker.step if self.worker is not None else 0
                now = switch_now(self.running, plan, step)
            if now and self.worker is not None:
                self.transport.inbox.interrupt(f"plan epoch {plan.epoch} replaces epoch {self.running.epoch}")
            return

    def _due(self) -> Plan | None:
        """The pending plan if it takes effect now; a peer that cannot run the coordinator's plan goes on standby."""
        if self.unrunnable and self.worker is not None:
            self.previous, self.worker = self.worker, None
            self._set(state="standby")
        with self.lock:
            plan = self.pending
            if plan is None:
                return None
            step = self.worker.step if self.worker is not None else 0
            if self.worker is None or self.status.state == "waiting" or step >= plan.start_step or switch_now(self.running, plan, step):
                self.pending = None
                return plan
        return None

    def _switch(self, plan: Plan) -> None:
        inbox = self.transport.inbox
        inbox.resume()
        inbox.discard_before(0, epoch=plan.epoch)
        old = self.worker or self.previous
        if self.running is None or self.running.recipe != plan.recipe:
            changed = "; ".join(self.running.recipe.changes(plan.recipe)) if self.running is not None else ""
            self.report(f"plan epoch {plan.epoch} from step {plan.start_step}: "
                        + (f"the recipe changed: {changed}" if changed else f"recipe: {plan.recipe.words}"))
        self.running = plan
        if self.device_id not in plan.devices:
            if self.worker is not None:
                self.previous, self.worker = self.worker, None
            self._set(state="standby", epoch=plan.epoch)
            self.report(f"plan epoch {plan.epoch}: on standby")
            return
        stage, lane = plan.position(self.device_id)
        stage_plan = plan.stages[stage]
        layers = (stage_plan.layer_start, stage_plan.layer_end)
        corpus = self._corpus_for(stage, plan)
        if self.worker is None:  # entering from outside the plan: the first step waits for the neighbours (`not_arrived`)
            self._entering_until = time.monotonic() + min(self.config.worker.timeout_s, (TTL_HEARTBEATS + 1) * self.config.heartbeat_s)
        worker = StageWorker(plan, self.device_id, self.transport, corpus, self.config.worker, server=self.server)
        worker.patience = lambda sender: fetching(plan, self.records, sender)  # records are replaced whole, never changed
        worker.tally = self.tally
        self.transport.set_policy(self.accept)  # the worker's constructor set its own; this one routes to it
        self.worker, self.previous = worker, old  # frames of this plan now reach it
        inbox.rescreen()
        try:
            how = self._fill(worker, old, layers, plan.epoch)
        except Interrupted:
            self.worker = None  # a newer plan came: this one never ran; `old` still holds the state to move
            raise
        assert worker.step == worker.sync.step == plan.start_step, "a worker enters at its plan's start step"
        self._set(state="training", epoch=plan.epoch, layers=layers, step=plan.start_step)
        group = ", ".join(d for d in stage_plan.devices if d != self.device_id) or "none"
        self.report(
            f"plan epoch {plan.epoch} from step {plan.start_step}: stage {stage + 1}/{len(plan.stages)} (layers "
            f"{layers[0]}-{layers[1] - 1}), lane {lane + 1}/{plan.group_size}, group with {group}; {how}"
        )

    def _corpus_for(self, stage: int, plan: Plan):
        """The data a first stage reads (None on the others): opened once, and again when a plan names other data."""
        if stage != 0:
            return None
        if self._corpus is None or self._corpus_dataset != plan.dataset:
            if self._corpus is not None:
                self._corpus.close()
            self._corpus = open_data(self.config.data, self.config.tokenizer, self.spec.vocab, self.spec.seq_len,
                                     dataset=plan.dataset, cache=self.config.data_cache, say=self.report)
            self._corpus_dataset = plan.dataset
            store = self._corpus.store if isinstance(self._corpus, ShardedCorpus) else None  # shared with the group
            if store is not None and store.local is None:
                group = lambda: [d for d in (self.running or plan).stages[0].devices if d != self.device_id]
                store.peers = from_peers(self.shards, store, group, min(SHARD_WAIT_S, self.config.worker.timeout_s))
            self.shards.offer(store)
            self.report(f"data: {self._corpus.description}")
        return self._corpus
