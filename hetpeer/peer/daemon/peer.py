"""The swarm peer's configuration, its life cycle and its loops; the package's other modules are mixins of
`SwarmPeer`, each over the state that `SwarmPeer.__init__` sets up."""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy
import torch

from hetpeer.peer.daemon.announcing import Announcing, Status, achieved_tflops
from hetpeer.peer.checkpoint import StageCheckpoint
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.data.shards import ShardedCorpus
from hetpeer.peer.data.sharing import ShardServer
from hetpeer.peer.data.source import DataCache
from hetpeer.peer.daemon.following import Following, not_arrived
from hetpeer.peer.gossip.state import StateServer
from hetpeer.peer.daemon.handover import Handover
from hetpeer.peer.daemon.measure import LinkHistory, LinkProber
from hetpeer.peer.node import format_step
from hetpeer.peer.pipeline.tally import Tally
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.probe import DeviceLoad, MachineProfile
from hetpeer.peer.daemon.probing import Probing
from hetpeer.peer.daemon.reaching import Reaching
from hetpeer.peer.daemon.suspects import Suspicion
from hetpeer.peer.transport.inbox import Interrupted, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.peer.transport.network import Emulation, NetworkTransport
from hetpeer.peer.transport.punch import Puncher
from hetpeer.peer.transport.relay import Relay, RelayLink
from hetpeer.protocol.addresses import AddressBook
from hetpeer.protocol.control import ControlPlane
from hetpeer.protocol.identity import device_id
from hetpeer.protocol.plan import Dataset, Plan
from hetpeer.protocol.records import TEAM_RE, TTL_HEARTBEATS, PeerRecord
from hetpeer.protocol.modelspec import PRESETS, ModelSpec

log = logging.getLogger("hetpeer.peer")
RATE_STEPS = 10  # the tokens/s a peer announces is its rate over this many steps


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
    data_cache: DataCache = DataCache()  # where shards a plan's dataset needs are downloaded to, and how much
    threads: int | None = None
    emulation: Emulation = Emulation()  # slow or far links emulated on a fast network (tests, demos, testbeds)
    probe_s: float = 1.0  # seconds of the compute probe
    save: Path | None = None  # folder for this peer's stage checkpoints (DEVICE.safetensors)
    save_every: int | None = None  # steps between checkpoints (and when it leaves); None: only when it leaves
    token: str | None = None  # a join token from the swarm's organizer (`hetpeer invite`), for swarms that need one
    reach: tuple[str, int] | None = None  # the coordinator's reach service (the join file names it); None: not checked
    clock_skew_s: float = 0.0  # emulated: this machine's clock reads this far off (tests and demos of the correction)
    memory_cap_bytes: int | None = None  # emulated: an accelerator with this much memory (the most it announces free)
    team: str | None = None  # the volunteer's team on the credit leaderboard

    def __post_init__(self) -> None:
        if len(self.coordinator_key) != 64 or not all(c in "0123456789abcdef" for c in self.coordinator_key):
            raise ValueError(f"coordinator key must be 64 lower-case hex digits (`hetpeer coordinator` prints it), got {self.coordinator_key!r}")
        if not self.heartbeat_s > 0 or self.probe_every < 1 or self.probe_targets < 0:
            raise ValueError(f"heartbeat must be positive and probing every >= 1 heartbeats: {self.heartbeat_s}, {self.probe_every}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.team is not None and not TEAM_RE.match(self.team):
            raise ValueError(f"team must be 1-32 of A-Z, a-z, 0-9, _, . and - starting with a letter or digit, got {self.team!r}")


class SwarmPeer(Following, Handover, Announcing, Probing, Reaching):
    def __init__(self, config: SwarmPeerConfig, report: Callable[[str], None]) -> None:
        self.config, self.report = config, report
        self.spec = config.model
        self.control = ControlPlane(
            config.swarm, config.home / "peer.key", config.initial_peers, config.dht_maddrs, config.dht_announce,
            identity_path=config.home / "dht.key", remember_path=config.home / "known_dht.json",
        )
        self.control.skew_s = config.clock_skew_s
        self.device_id = ""
        self.transport: NetworkTransport | None = None
        self.relay: Relay | None = None  # what this peer relays for peers nobody can dial
        self.relay_link: RelayLink | None = None
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
        self._corpus: Corpus | ShardedCorpus | None = None
        self._corpus_dataset: Dataset | None = None  # the plan's dataset it was opened for
        self._refused: set[tuple[str, int]] = set()
        self.unrunnable = False  # the coordinator's newest plan is one this peer cannot run: it stays on standby
        self._entering_until: float | None = None  # a peer that entered a plan from outside waits for its neighbours until then
        self.checkpoint: StageCheckpoint | None = None  # its own stage checkpoint, offered until a plan uses it
        self._profiled_at = 0.0
        self.device_load = DeviceLoad(config.worker.device)  # the load other work puts on its device, before training
        self._rng = numpy.random.default_rng()
        self.suspicion = Suspicion()
        self.suspects: tuple[str, ...] = ()  # what this peer reports, as of its last record
        self.tally = Tally()  # the work it did and took of others, under every plan it ran (its workers count into it)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "SwarmPeer":
        config = self.config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        (host, port), announce_host = self._check_reach()  # before the DHT node: it decides how the node runs
        self.control.start()
        self.device_id = device_id(config.name, self.control.public_key)
        identity = LinkIdentity(self.device_id, self.control.private_key)
        tcp = TcpLink(host, port, advertise_host=announce_host, identity=identity)
        tcp.relay = self.relay = Relay(self.device_id)  # serves only where others can dial this peer
        self.relay_link = RelayLink(identity, book=lambda: self.transport.book)
        puncher = Puncher(identity, host, self.punch_port, public_host=announce_host) if self.punch_port else None
        self.transport = NetworkTransport(
            self.device_id, AddressBook({}), [tcp, self.relay_link],
            connect_timeout_s=min(10.0, config.worker.timeout_s), emulation=config.emulation, puncher=puncher,
        )
        self.transport.start()
        self.transport.book = AddressBook({self.device_id: self.transport.address()})
        self.prober = LinkProber(self.transport, self.device_id, max_probe_bytes=config.probe_bytes)
        self.prober.install()
        self.server = StateServer(self.transport, self.device_id, known=lambda d: d in self.transport.book.peers)
        self.shards = ShardServer(self.transport, self.device_id, known=lambda d: d in self.transport.book.peers)
        self.transport.set_policy(self.accept)
        self.report(
            f"peer {self.device_id} in swarm {config.swarm}: tensors on {self.transport.address().direct[0]}:"
            f"{self.transport.address().direct[1]}, DHT on {', '.join(self.control.visible_maddrs())}"
        )
        self.report(f"trusting plans signed by coordinator key {config.coordinator_key[:16]}...")
        self.checkpoint = self._own_checkpoint()
        self.machine = self._fastest_known(self._profile())
        self.report(
            f"machine: {self.machine.device_name}, {self.machine.tflops * 1e3:.2f} GFLOPS achieved in {config.dtype} on "
            f"{config.model.name} blocks" + (f" (slowed {config.worker.slowdown:g}x)" if config.worker.slowdown != 1 else "")
            + (f", {self.machine.memory_bytes / 2**20:.1f} MiB free (emulated)" if config.memory_cap_bytes is not None
               else f", {self.machine.memory_bytes / 2**30:.1f} GiB free")
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
        if self._corpus is not None:
            self._corpus.close()  # its downloads stop
        self._linger_as_relay()
        self._say_relayed("in all")
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
            self._set(step=worker.step, loss=loss, val_loss=val_loss, noise_scale=worker.noise_scale(),
                      tokens_per_s=sum(t for t, _ in recent) / sum(s for _, s in recent),
                      achieved_tflops=achieved_tflops(worker.plan, self.device_id, self.spec, statistics.median(computed),
                                                      self.machine.step_costs))
            stage, lane = worker.plan.position(self.device_id)
            self.report(f"e{worker.plan.epoch} stage {stage + 1} lane {lane + 1}  "
                        + format_step(result, seconds, config.steps or 0).replace("/0 ", " "))
            if config.save is not None and config.save_every and worker.step % config.save_every == 0:
                self.report(f"saved {worker.save(config.save)} at step {worker.step}")

    # -- control (its own thread) --------------------------------------------------------------------
    def _control_loop(self) -> None:
        config = self.config
        ttl_s = TTL_HEARTBEATS * config.heartbeat_s
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self._control_round(ttl_s)
            except TransportError as error:  # a link that failed this round: the next one starts afresh
                log.warning("%s: control round failed: %s", self.device_id, error)
            self.plan_hint.wait(max(0.0, config.heartbeat_s - (time.monotonic() - started)))
            if self.plan_hint.is_set():
                self.plan_hint.clear()
                self._take_plans()

    def _control_round(self, ttl_s: float) -> None:
        """Read the swarm, take a new plan, keep this peer's paths, announce it: one heartbeat's work."""
        config = self.config
        records, _ = self.control.read_peers(max_age_s=ttl_s + config.heartbeat_s)
        self._correct_clock()
        # a peer back after its record lapsed (restarted, or cut off a while) is no longer one this peer failed to reach
        self.transport.forget_failures(set(records) - set(self.records))
        self.control.remember(r.dht for r in sorted(records.values(), key=lambda r: -r.time))
        book = {d: replace(r.address, dialable=not r.behind_nat, relay=r.relay, punch=r.punch or None) for d, r in records.items()}
        book[self.device_id] = self.transport.address()
        self.transport.book = AddressBook(book)
        with self.lock:
            self.records = records
        self._take_plans()
        self._keep_paths()
        self._measure_load()
        self.control.announce(self._record(), ttl_s=ttl_s)
        healed = self.control.heal()  # after a partition: find the swarm again
        if healed is not None:
            self.report(healed)

    def _set(self, **changes) -> None:
        with self.lock:
            self.status = replace(self.status, **changes)

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
