"""A swarm peer, behind `hetpeer join --swarm`: probe, announce, follow the coordinator's plans.

Three threads, each with one job:

- control (every heartbeat): read the swarm's announcements into the address book, read plans and keep
  the newest one signed by the trusted coordinator key, announce this peer's record (what it measured,
  what it holds, where it is). All DHT traffic goes through this one thread.
- probe (every few heartbeats): measure latency and bandwidth to a handful of peers (`measure.py`).
- main: train. A plan takes effect at its `start_step`: a peer whose lane and group all survive in the
  new plan runs the old one up to that step; when a member of the old plan is gone (membership broke),
  every peer drops the step in progress (`Inbox.interrupt`) and switches at once, entering at
  `start_step`. A peer keeps its parameters and optimizer state when its layers stay the same, and
  otherwise downloads them from the peers that announce those layers (`gossip/state.py`). A peer that
  enters a plan from outside it (standby, just started) waits before its first step until its lane and
  group announce the plan: members of the plan before finish that one up to the start step first.

A peer that loses its lane (a neighbour stopped answering) announces "waiting" under the plan's epoch,
which tells the coordinator that the plan is broken; it resumes with the next plan.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import numpy
import torch

from hetpeer import __version__
from hetpeer.peer.checkpoint import CheckpointError, StageCheckpoint
from hetpeer.peer.data.corpus import Corpus, open_corpus
from hetpeer.peer.gossip.state import StateDownloadError, StateServer
from hetpeer.peer.measure import LinkHistory, LinkProber, describe_links, pick_targets
from hetpeer.peer.probe import MachineProfile, profile_machine
from hetpeer.peer.node import format_step
from hetpeer.peer.pipeline.worker import STALE_STEPS, StageWorker, WorkerConfig
from hetpeer.peer.suspects import Suspicion
from hetpeer.peer.transport.inbox import Interrupted, Late, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.peer.transport.links import LinkIdentity, TcpLink
from hetpeer.peer.transport.network import Emulation, NetworkTransport
from hetpeer.protocol.addresses import AddressBook
from hetpeer.protocol.control import ControlPlane, key_digest
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.identity import DEVICE_RE, device_id
from hetpeer.protocol.records import TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.workload import PRESETS, ModelSpec, Workload

log = logging.getLogger("hetpeer.peer")
RUNNING_KINDS = ("activation", "gradient", "labels", "params", "allreduce", "tied")  # frames that belong to a plan
RATE_STEPS = 10  # the tokens/s a peer announces is its rate over this many steps
FUTURE_EPOCHS = 2  # frames of plans this much newer than the newest this peer has read are kept for it
REPROFILE_S = 60.0  # a peer not training times its device again this often


@dataclass(frozen=True, slots=True)
class SwarmPeerConfig:
    swarm: str
    name: str  # the readable part of the device id: NAME-<key fingerprint>
    home: Path  # keeps the key, so a restarted peer is the same peer
    coordinator_key: str  # SHA-256 (hex) of the coordinator's public key: plans under other keys are ignored
    worker: WorkerConfig
    initial_peers: tuple[str, ...] = ()
    model: ModelSpec = PRESETS["tiny"]  # a preset, or a model folder's spec (its weights: worker.weights)
    dtype: str = "fp32"
    micro_batch: int = 2  # of the compute probe
    listen: tuple[str, int] = ("127.0.0.1", 0)  # direct TCP for tensors
    announce_host: str | None = None  # the host others should dial, when it differs from the listen host
    dht_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    dht_announce: tuple[str, ...] = ()  # DHT multiaddrs others should dial, when they differ from dht_maddrs
    heartbeat_s: float = 2.0
    probe_every: int = 5  # heartbeats between rounds of link probes
    probe_targets: int = 4  # peers probed per round: lane and group neighbours first, then a sample
    probe_bytes: int = 2 << 20  # per peer probed: larger frames read a fast link's rate through timing noise
    steps: int | None = None  # leave once the swarm's step count reaches this
    data: str | None = None
    tokenizer: str | None = None  # tokenizer.json (or a folder with one); default: bytes
    threads: int | None = None
    emulation: Emulation = Emulation()  # slow or far links emulated on a fast network (tests, demos, testbeds)
    probe_s: float = 1.0  # seconds of the compute probe
    save: Path | None = None  # folder for this peer's stage checkpoints (DEVICE.safetensors)
    save_every: int | None = None  # steps between checkpoints (and when it leaves); None: only when it leaves
    token: str | None = None  # a join token from the swarm's organizer (`hetpeer invite`), for swarms that need one

    def __post_init__(self) -> None:
        if len(self.coordinator_key) != 64 or not all(c in "0123456789abcdef" for c in self.coordinator_key):
            raise ValueError(f"coordinator key must be 64 lower-case hex digits (`hetpeer coordinator` prints it), got {self.coordinator_key!r}")
        if not self.heartbeat_s > 0 or self.probe_every < 1 or self.probe_targets < 0:
            raise ValueError(f"heartbeat must be positive and probing every >= 1 heartbeats: {self.heartbeat_s}, {self.probe_every}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")


@dataclass(frozen=True, slots=True)
class Status:
    """What this peer announces about its training; replaced whole, so readers never see half an update."""

    state: str = "probing"
    epoch: int = -1
    layers: tuple[int, int] | None = None
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # its lane's latest validation loss (last stage)
    tokens_per_s: float = 0.0
    achieved_tflops: float | None = None  # of its training steps: the stage's FLOPs over the median compute time


def stage_flops(plan: Plan, me: str, spec: ModelSpec) -> float:
    """The FLOPs of `me`'s training step under `plan` (forward and backward: 3x forward), as the planner's time
    model counts them: its layers for the lane's batch (a recomputed one a forward more), and the output head on
    the last stage."""
    stage, _ = plan.position(me)
    workload = Workload(spec, batch=plan.batch, micro_batch=plan.micro_batch, dtype=plan.dtype)
    return workload.stage_flops(plan.stages[stage].layers, last=stage == len(plan.stages) - 1, sequences=plan.lane_batch,
                                recompute=plan.stages[stage].recompute)


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


def donors_for(records: Mapping[str, PeerRecord], layers: tuple[int, int], me: str) -> list[str]:
    """Peers that announce layers overlapping `layers`, exact holders first, then by most recent step;
    never a peer that announced it is leaving, nor one still downloading those layers itself."""
    start, end = layers
    found = [
        r for r in records.values()
        if r.device_id != me and r.state not in ("leaving", "fetching") and r.layers is not None
        and r.layers[0] < end and start < r.layers[1]
    ]
    found.sort(key=lambda r: (r.layers != layers, -r.step))
    return [r.device_id for r in found]


def still_fetched(plan: Plan, records: Mapping[str, PeerRecord], me: str, layers: tuple[int, int]) -> bool:
    """Whether a stage `me` held before `plan` (`layers`) may still be downloaded from it: some other member
    of `plan` whose layers overlap it does not yet announce training under `plan` (or a later one)."""
    start, end = layers
    for stage in plan.stages:
        if stage.layer_start < end and start < stage.layer_end:
            for device in stage.devices:
                record = records.get(device)
                if device != me and (record is None or record.epoch < plan.epoch or record.state != "training"):
                    return True
    return False


def fetching(plan: Plan, records: Mapping[str, PeerRecord], device: str) -> bool:
    """Whether `device` announces fetching its stage's state under `plan`: its lane neighbours wait for its
    first frames past their deadline (a stage's download over a slow link can take minutes), rather than
    stop their lanes and have the coordinator re-plan around a peer that is only arriving."""
    record = records.get(device)
    return record is not None and record.state == "fetching" and record.epoch == plan.epoch


class SwarmPeer:
    def __init__(self, config: SwarmPeerConfig, report: Callable[[str], None]) -> None:
        self.config, self.report = config, report
        self.spec = config.model
        self.control = ControlPlane(
            config.swarm, config.home / "peer.key", config.initial_peers, config.dht_maddrs, config.dht_announce,
            identity_path=config.home / "dht.key", remember_path=config.home / "known_dht.json",
        )
        self.device_id = ""
        self.transport: NetworkTransport | None = None
        self.prober: LinkProber | None = None
        self.server: StateServer | None = None
        self.machine: MachineProfile | None = None
        self.worker: StageWorker | None = None  # the stage this peer trains now
        self.previous: StageWorker | None = None  # the one before (kept to move state from, and to serve, until no one needs it)
        self.running: Plan | None = None
        self.pending: Plan | None = None
        self.records: dict[str, PeerRecord] = {}
        self.links = LinkHistory()  # what it measured to other peers, smoothed over rounds
        self.status = Status()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.plan_hint = threading.Event()  # a neighbour sent frames of a plan this peer has not read
        self.threads: list[threading.Thread] = []
        self._corpus: Corpus | None = None
        self._refused: set[tuple[str, int]] = set()
        self._entering_until: float | None = None  # a peer that entered a plan from outside waits for its neighbours until then
        self.checkpoint: StageCheckpoint | None = None  # its own stage checkpoint, offered until a plan uses it
        self._profiled_at = 0.0
        self._rng = numpy.random.default_rng()
        self.suspicion = Suspicion()
        self.suspects: tuple[str, ...] = ()  # what this peer reports, as of its last record

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "SwarmPeer":
        config = self.config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.control.start()
        self.device_id = device_id(config.name, self.control.public_key)
        host, port = config.listen
        self.transport = NetworkTransport(
            self.device_id, AddressBook({}),
            [TcpLink(host, port, advertise_host=config.announce_host, identity=LinkIdentity(self.device_id, self.control.private_key))],
            connect_timeout_s=min(10.0, config.worker.timeout_s), emulation=config.emulation,
        )
        self.transport.start()
        self.transport.book = AddressBook({self.device_id: self.transport.address()})
        self.prober = LinkProber(self.transport, self.device_id, max_probe_bytes=config.probe_bytes)
        self.prober.install()
        self.server = StateServer(self.transport, self.device_id, known=lambda d: d in self.transport.book.peers)
        self.transport.set_policy(self.accept)
        self.report(
            f"peer {self.device_id} in swarm {config.swarm}: tensors on {self.transport.address().direct[0]}:"
            f"{self.transport.address().direct[1]}, DHT on {', '.join(self.control.visible_maddrs())}"
        )
        self.report(f"trusting plans signed by coordinator key {config.coordinator_key[:16]}...")
        self.checkpoint = self._own_checkpoint()
        self.machine = self._profile()
        self.report(
            f"machine: {self.machine.device_name}, {self.machine.tflops * 1e3:.2f} GFLOPS achieved in {config.dtype} on "
            f"{config.model.name} blocks" + (f" (slowed {config.worker.slowdown:g}x)" if config.worker.slowdown != 1 else "")
            + f", {self.machine.memory_bytes / 2**30:.1f} GiB free"
        )
        self._set(state="waiting")
        for name, target in (("control", self._control_loop), ("probe", self._probe_loop)):
            thread = threading.Thread(target=self._guarded(target), name=f"{config.name}-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def shutdown(self) -> None:
        """Announce that this peer leaves (with its stage saved, under --save), stop the threads, close the
        transport and the DHT node."""
        self.stopping.set()
        if self.config.save is not None and self.worker is not None:
            self.report(f"saved {self.worker.save(self.config.save)} at step {self.worker.step}")
        self.plan_hint.set()  # wakes the control thread
        if self.transport is not None:
            self.transport.inbox.interrupt("leaving")
        for thread in self.threads:
            thread.join(timeout=10 * self.config.heartbeat_s)
        if self.control.dht is not None and self.device_id:
            self._set(state="leaving")
            try:
                # as long-lived as any record: the coordinator reads its last step after this peer is gone
                self.control.announce(self._record(), ttl_s=TTL_HEARTBEATS * self.config.heartbeat_s, timeout_s=10.0)
            except Exception as error:  # leaving must not fail on a DHT hiccup
                log.info("%s: could not announce leaving: %s", self.device_id, error)
        if self.transport is not None:
            self.transport.shutdown()
        self.control.shutdown()

    def __enter__(self) -> "SwarmPeer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- the frame policy -----------------------------------------------------------------------------
    def accept(self, header: FrameHeader) -> str | None:
        if header.kind == "probe":
            if header.sender not in self.transport.book.peers:  # its record may not have reached this peer yet
                return Late(f"{header.sender} is not (yet) a known peer of the swarm")
            return self.prober.accept(header)
        if header.kind in ("state_request", "state"):
            return self.server.accept(header)
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

    # -- training (main thread) ---------------------------------------------------------------------
    def run(self) -> None:
        """Train until `steps` or `stopping`; returns normally when done."""
        config = self.config
        recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_STEPS)  # (tokens, seconds) per step
        computed: collections.deque[float] = collections.deque(maxlen=RATE_STEPS)  # compute seconds per step
        while not self.stopping.is_set():
            plan = self._due()
            if plan is not None:
                recent.clear()  # another plan, another pace
                computed.clear()
                try:
                    self._switch(plan)
                except Interrupted:
                    self.transport.inbox.resume()  # a newer plan came while switching: take that one
                    continue
            self._release_previous()
            worker = self.worker
            if worker is None or self.status.state == "waiting":
                self.stopping.wait(0.1)
                continue
            if self._entering_until is not None:
                with self.lock:
                    missing = not_arrived(worker.plan, self.records, self.device_id)
                if missing and time.monotonic() < self._entering_until:
                    self.stopping.wait(0.1)
                    continue
                self._entering_until = None
            if config.steps is not None and worker.step >= config.steps:
                self.report(f"reached step {worker.step}: leaving")
                return
            started = time.perf_counter()
            try:
                last = config.steps is not None and worker.step + 1 >= config.steps
                result = worker.train_step(last=last)
            except Interrupted:
                self.transport.inbox.resume()
                continue
            except (TransportTimeout, PeerUnreachable) as error:
                self.report(f"lane stopped at step {worker.step}: {error}; waiting for a new plan")
                self._set(state="waiting")
                continue
            seconds = time.perf_counter() - started
            recent.append((result.tokens, seconds))
            computed.append(result.compute_s)
            loss = result.loss if result.loss is not None else self.status.loss
            val_loss = result.val_loss if result.val_loss is not None else self.status.val_loss
            # the rate over the last few steps: one step's swings with the machine's load
            self._set(step=worker.step, loss=loss, val_loss=val_loss, tokens_per_s=sum(t for t, _ in recent) / sum(s for _, s in recent),
                      achieved_tflops=stage_flops(worker.plan, self.device_id, self.spec) / statistics.median(computed) / 1e12)
            stage, lane = worker.plan.position(self.device_id)
            self.report(f"e{worker.plan.epoch} stage {stage + 1} lane {lane + 1}  "
                        + format_step(result, seconds, config.steps or 0).replace("/0 ", " "))
            if config.save is not None and config.save_every and worker.step % config.save_every == 0:
                self.report(f"saved {worker.save(config.save)} at step {worker.step}")

    def _due(self) -> Plan | None:
        """The pending plan if it takes effect now."""
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
        corpus = self._corpus_for(stage)
        if self.worker is None:  # entering from outside the plan: the first step waits for the neighbours (`not_arrived`)
            self._entering_until = time.monotonic() + min(self.config.worker.timeout_s, (TTL_HEARTBEATS + 1) * self.config.heartbeat_s)
        worker = StageWorker(plan, self.device_id, self.transport, corpus, self.config.worker, server=self.server)
        worker.patience = lambda sender: fetching(plan, self.records, sender)  # records are replaced whole, never changed
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

    def _own_checkpoint(self) -> StageCheckpoint | None:
        """This peer's checkpoint in --save, of this model: announced, so that a swarm starting again after
        every peer stopped resumes from it."""
        if self.config.save is None or not (path := self.config.save / f"{self.device_id}.safetensors").exists():
            return None
        try:
            checkpoint = StageCheckpoint.read(path)
        except CheckpointError as error:
            self.report(f"ignored its checkpoint: {error}")
            return None
        if checkpoint.spec.digest != self.spec.digest:
            self.report(f"ignored its checkpoint {path}: it is of model {checkpoint.spec.name}, this peer trains {self.spec.name}")
            return None
        self.report(f"holds a checkpoint of layers {checkpoint.layers[0]}-{checkpoint.layers[1] - 1} at step {checkpoint.step} "
                    f"({path}): offered to resume the swarm from")
        return checkpoint

    def _release_previous(self) -> None:
        """Let go of the stage held before the running plan once no member of that plan can still want to
        download it: a peer would otherwise hold two stages' state (a memory-bound peer has room for one).
        A peer on standby keeps it: that is its warm copy."""
        previous, running = self.previous, self.running
        if previous is None or running is None or self.worker is None:
            return
        with self.lock:
            needed = still_fetched(running, self.records, self.device_id, previous.layers)
        if not needed:
            self.previous = None
            if self.server is not None:
                self.server.release(previous.sync)
            log.info("%s: released the stage held before plan epoch %d (layers %d-%d)", self.device_id, running.epoch,
                     previous.layers[0], previous.layers[1] - 1)

    def _fill(self, worker: StageWorker, old: StageWorker | None, layers: tuple[int, int], epoch: int) -> str:
        """Put the stage's parameters and optimizer state in `worker`: its own checkpoint of exactly this stage
        (a swarm resuming after every peer stopped), the old worker's when it held the same layers lately, else
        what the old one held of them (unless that copy is `STALE_STEPS` behind the plan: a peer back from
        standby) and the rest downloaded from the peers that announce them; how, in words."""
        how = f"the model folder's weights ({worker.loaded_bytes / 2**20:.1f} MiB read)" if worker.loaded_bytes else "fresh weights"
        stale = old is not None and worker.plan.start_step - old.step >= STALE_STEPS  # a standby copy, say
        overlaps = old is not None and old.layers[0] < layers[1] and layers[0] < old.layers[1] and not stale
        if old is None and self.checkpoint is not None and self.checkpoint.layers == layers and not self._donors(layers):
            # a swarm resuming: no live peer holds these layers. In a running swarm its group's state is newer.
            checkpoint, self.checkpoint = self.checkpoint, None
            worker.restore(checkpoint.path)
            worker.step = worker.sync.step = worker.plan.start_step  # the plan resumes at the newest checkpoint's step
            how = f"resumed from its checkpoint (step {checkpoint.step}, plan epoch {checkpoint.epoch})"
        elif old is not None and old.param_range == worker.param_range and (not stale or not self._donors(layers)):
            with old.sync.lock:
                for mine, theirs in zip(worker.sync.state_tensors(), old.sync.state_tensors()):
                    mine.copy_(theirs)
                worker.sync.state.step = old.sync.state.step
            how = "kept its weights"
        else:  # a stage it did not hold, or held so long ago (on standby, say) that its copy is stale
            donors = self._donors(layers)
            if donors or overlaps:
                self._set(state="fetching", epoch=epoch, layers=layers)
                try:
                    try:
                        download = worker.fetch_state(donors, enter_at=worker.plan.start_step, keep_own=not stale)
                    except StateDownloadError:
                        if not stale:
                            raise
                        download = worker.fetch_state(donors, enter_at=worker.plan.start_step)  # stale beats fresh
                    how = (f"downloaded {download.bytes / 2**20:.1f} MiB of state in {download.chunks} chunk(s) from "
                           f"{', '.join(download.donors) or 'no one'} in {download.seconds:.2f} s")
                    if download.kept:
                        how += f", kept {download.kept / 2**20:.1f} MiB of its previous stage's"
                except StateDownloadError as error:
                    how = f"{how} ({error})"
        return how

    def _donors(self, layers: tuple[int, int]) -> list[str]:
        with self.lock:
            return donors_for(self.records, layers, self.device_id)

    def _corpus_for(self, stage: int) -> Corpus | None:
        if stage != 0:
            return None
        if self._corpus is None:
            self._corpus = open_corpus(self.config.data, self.config.tokenizer, self.spec.vocab, self.spec.seq_len)
        return self._corpus

    # -- control (its own thread) --------------------------------------------------------------------
    def _control_loop(self) -> None:
        config = self.config
        ttl_s = TTL_HEARTBEATS * config.heartbeat_s
        while not self.stopping.is_set():
            started = time.monotonic()
            records, _ = self.control.read_peers(max_age_s=ttl_s + config.heartbeat_s)
            self.control.remember(r.dht for r in sorted(records.values(), key=lambda r: -r.time))
            book = {d: r.address for d, r in records.items()}
            book[self.device_id] = self.transport.address()
            self.transport.book = AddressBook(book)
            with self.lock:
                self.records = records
            self._take_plans()
            self.control.announce(self._record(), ttl_s=ttl_s)
            healed = self.control.heal()  # after a partition: find the swarm again
            if healed is not None:
                self.report(healed)
            self.plan_hint.wait(max(0.0, config.heartbeat_s - (time.monotonic() - started)))
            if self.plan_hint.is_set():
                self.plan_hint.clear()
                self._take_plans()

    def _take_plans(self) -> None:
        plans, _ = self.control.read_plans()
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

    def _record(self) -> PeerRecord:
        status, machine = self.status, self.machine
        with self.lock:
            links = self.links.current()
        self._suspect()
        return PeerRecord(
            device_id=self.device_id,
            model=self.spec.name,
            dtype=self.config.dtype,
            device_name=machine.device_name,
            tflops=machine.tflops,
            memory_bytes=machine.memory_bytes,
            address=self.transport.address(),
            state=status.state,
            time=self.control.now(),
            epoch=status.epoch,
            layers=status.layers,
            step=status.step,
            loss=status.loss,
            val_loss=status.val_loss,
            checkpoint=(*checkpoint.layers, checkpoint.step) if (checkpoint := self.checkpoint) is not None else None,
            tokens_per_s=status.tokens_per_s,
            achieved_tflops=status.achieved_tflops,
            links=links,
            dht=self.control.dialable_maddrs(),
            token=self.config.token,
            suspects=self.suspects,
            software=f"hetpeer {__version__}",
        )

    def _suspect(self) -> None:
        """Update the peers this peer reports (`suspects.py`); say so when one is reported first."""
        worker = self.worker
        streaks = worker.sync.outliers(worker.sync.step) if worker is not None else {}
        misbehaving = {d: n for d, n in self.transport.inbox.misbehaving.items() if DEVICE_RE.match(d) and d != self.device_id}
        suspects = self.suspicion.update(misbehaving, streaks, time.monotonic())
        for device in set(suspects) - set(self.suspects):
            clipped = streaks.get(device, 0)
            self.report(f"reports {device} as misbehaving: " + (f"its parameters far past the clipping bound {clipped} rounds in a row"
                        if clipped else f"{self.transport.inbox.misbehaving[device]} frame(s) refused so far"))
        self.suspects = suspects

    def _set(self, **changes) -> None:
        with self.lock:
            self.status = replace(self.status, **changes)

    def _profile(self) -> MachineProfile:
        config = self.config
        self._profiled_at = time.monotonic()
        return profile_machine(self.spec, config.micro_batch, config.dtype, config.worker.device, config.worker.slowdown, config.probe_s)

    def _profile_again(self) -> None:
        """While not training (its device idle), time the device again now and then and keep the faster figure:
        a machine busy when the peer started (other programs, or peers starting beside it) read too slow."""
        if self.status.state not in ("waiting", "standby") or time.monotonic() - self._profiled_at < REPROFILE_S:
            return
        again = self._profile()
        if again.tflops > self.machine.tflops:
            self.report(f"machine: {again.tflops * 1e3:.2f} GFLOPS achieved now (was {self.machine.tflops * 1e3:.2f} when busier)")
            self.machine = replace(self.machine, tflops=again.tflops)

    # -- link probes (their own thread) ---------------------------------------------------------------
    def _probe_loop(self) -> None:
        config = self.config
        self.stopping.wait(config.heartbeat_s)  # the first read of the swarm comes first
        while not self.stopping.is_set():
            self._profile_again()
            with self.lock:
                known = [d for d in self.records if d != self.device_id]
                preferred = self._neighbours()
                oldest = self.links.oldest_first()
            targets = pick_targets(self.device_id, known, preferred, config.probe_targets, self._rng, oldest)
            measured = self.prober.measure_many(targets, budget_bytes=config.probe_bytes, budget_s=config.heartbeat_s)
            with self.lock:
                self.links.add(measured)
                if set(self.records) - {self.device_id}:  # a peer cut off sees no one: it keeps what it knew
                    self.links.keep_only(self.records)
            if measured:
                self.report(f"links measured: {describe_links(measured)}")
            self.stopping.wait(config.probe_every * config.heartbeat_s)

    def _neighbours(self) -> list[str]:
        """Lane neighbours, then group members, under the running plan (the caller holds the lock)."""
        plan = self.running
        if plan is None or self.device_id not in plan.devices:
            return []
        stage, lane = plan.position(self.device_id)
        chain = plan.lanes[lane]
        near = [chain[s] for s in (stage - 1, stage + 1) if 0 <= s < len(chain)]
        return near + [d for d in plan.stages[stage].devices if d != self.device_id]

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except TransportError as error:
                if not self.stopping.is_set():
                    log.error("%s: %s stopped: %s", self.device_id, threading.current_thread().name, error)
            except Exception:
                if not self.stopping.is_set():
                    log.exception("%s: %s failed", self.device_id, threading.current_thread().name)
                    self.stopping.set()
            else:
                log.debug("%s: %s ended", self.device_id, threading.current_thread().name)

        return run
