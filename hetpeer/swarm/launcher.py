"""A whole swarm on this machine: one `hetpeer coordinator` and N `hetpeer join` processes.

`LocalSwarm` starts them (the coordinator first: peers need its DHT address and its key), watches the
swarm through the coordinator's gRPC API like any organizer's tool would, and can kill and restart
any process (the fault tests and benchmarks drive it). `run` trains until the swarm reaches the step
count, shows a live line, and returns what the run report needs; its loss curve comes from the step
lines the peers print (every step, where the API's view moves once a heartbeat). Every process gets its own home
folder (keys, so a restarted peer is the same peer) and log file under `out`.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from hetpeer import logline
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.peer.reach import free_port
from hetpeer.peer.transport.network import MAX_EMULATED_LATENCY_S
from hetpeer.protocol.dataset import is_prepared
from hetpeer.protocol.modelspec import PRESETS
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.workload import Workload
from hetpeer.swarm import DEMO_RECIPE
from hetpeer.coordinator.ledger import CreditBoard
from hetpeer.swarm.report import (ANY_STEP_RE, Event, LaneStep, PeerCredit, PeerInfo, PlanUse, RunReport, StageUse, lane_step,
                                  samples_from_lanes, summarize)
from hetpeer.swarm.watch import StalledError, describe, follow

KEY_RE = re.compile(r"its key \(give peers --coordinator-key\): ([0-9a-f]{64})")
DHT_RE = re.compile(r"^DHT: (\S+)")
PEER_RE = re.compile(r"^peer (\S+) in swarm \S+: tensors on \S+, DHT on (\S+)")
# a peer that enters a plan: how its stage came to it (kept, restored, downloaded from its group)
ENTERED_RE = re.compile(r"^plan epoch (\d+) from step (\d+): stage (\d+)/\d+ \(layers [^)]*\), lane \d+/\d+, group with [^;]*; (.*)$")
START_TIMEOUT_S = 120.0
CREDIT_WAIT_HEARTBEATS = 8  # after the last step: for the peers to leave and the ledger to take their last receipts
# emulated devices ask for at most this share of the cores: the rest is left to the coordinator, the DHT daemons
# and the peers' own threads (receiving, sending, probing, a returning peer's start-up), which would otherwise slow
# the emulated compute. In the 8-peer demo on 2 cores the DHT processes and p2pd daemons alone take a third of the
# cores; at half, a pass that waits for a core behind them ran late often enough that plans measured 0.7 to 1.6
# times their prediction (docs/swarm.md)
EMULATION_SHARE = 0.25
# the coordinator runs at this niceness beside the peers: on the organizer's own machine it would take no core from
# them, and here its rounds and its searches (a core for a second or two every re-solve) must not stall their passes
COORDINATOR_NICE = 10
# an emulated device holds this share of what training the whole model on one device takes: the model is split
EMULATED_MEMORY = 0.6


class SwarmError(RuntimeError):
    """A process of the swarm did not start or the swarm stopped making progress."""


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    out: Path
    peers: int = 8
    steps: int = 40
    slowdowns: tuple[float, ...] = ()  # per peer; empty: all 1
    bandwidth_caps: tuple[float | None, ...] = ()  # Mbit/s each peer sends at most, per destination; empty: none
    latencies_ms: tuple[float, ...] = ()  # one-way ms each peer's frames are held back before they leave; empty: none
    swarm: str = "demo"
    model: str = "tiny"
    batch: int = 16
    micro_batch: int = 2
    dtype: str = "fp32"
    heartbeat_s: float = 2.0
    replan_interval_s: float = 30.0
    time_budget_s: float = 2.0
    timeout_s: float = 10.0  # per frame a peer waits for
    recipe: Recipe = DEMO_RECIPE  # the coordinator's: every peer trains by it (its seed seeds the planner too)
    data: Path | None = None
    save: Path | None = None  # the peers' stage checkpoints: saved when they leave, resumed from when started again
    stall_s: float = 120.0  # give up when the swarm's step has not moved for this long
    coordinator_args: tuple[str, ...] = ()  # more `hetpeer coordinator` options, e.g. ("--stages", "2")
    peer_args: tuple[str, ...] = ()  # more `hetpeer join` options for every peer, e.g. ("--probe-targets", "8")
    # each peer as a device of its own: every peer's compute is slowed by one more factor (`emulation`), so that
    # together they ask no more of this machine's cores than they have; else they share the cores, as they are
    emulate: bool = False
    small_devices: bool = True  # with `emulate`: each device announces too little memory for the whole model (`memory_mib`)
    leave: tuple[int, int] | None = None  # (step, step): a peer of a group leaves at the first, is started again at the second
    cores: int = 0  # the cores the peers share; 0: this process's

    def __post_init__(self) -> None:
        if self.peers < 1 or self.steps < 1:
            raise ValueError(f"need at least one peer and one step, got {self.peers} and {self.steps}")
        if self.leave is not None and not 0 < self.leave[0] < self.leave[1] < self.steps:
            raise ValueError(f"a peer leaves and comes back within the run: need 0 < {self.leave[0]} (leave) "
                             f"< {self.leave[1]} (back) < {self.steps} (steps)")
        for name, values in (("slowdowns", self.slowdowns), ("bandwidth caps", self.bandwidth_caps), ("latencies", self.latencies_ms)):
            if values and len(values) != self.peers:
                raise ValueError(f"{len(values)} {name} given for {self.peers} peers")
        if any(not (math.isfinite(s) and s >= 1) for s in self.slowdowns):
            raise ValueError(f"slowdowns must be finite numbers >= 1, got {list(self.slowdowns)}")
        if any(c is not None and not (math.isfinite(c) and c > 0) for c in self.bandwidth_caps):
            raise ValueError(f"bandwidth caps must be finite positive numbers, got {list(self.bandwidth_caps)}")
        most = MAX_EMULATED_LATENCY_S * 1e3
        if any(not (math.isfinite(ms) and 0 <= ms <= most) for ms in self.latencies_ms):
            raise ValueError(f"latencies must be 0 to {most:g} ms, got {list(self.latencies_ms)}")

    def slowdown(self, i: int) -> float:
        """Peer `i`'s compute slowdown: its own, times the emulation's."""
        return (self.slowdowns[i] if self.slowdowns else 1.0) * self.emulation

    @property
    def memory_mib(self) -> float | None:
        """The memory each emulated device announces, in MiB: `EMULATED_MEMORY` of what training the whole model
        on one device takes (`Workload.stage_memory`). None without `emulate` and `small_devices`, or for a model
        that is no preset."""
        spec = PRESETS.get(self.model)
        if not (self.emulate and self.small_devices) or spec is None:
            return None
        workload = Workload(spec, batch=self.batch, micro_batch=self.micro_batch, dtype=self.dtype)
        whole = workload.stage_memory(spec.layers, first=True, last=True, in_flight=1, micro_batch=self.micro_batch, group_size=2)
        return EMULATED_MEMORY * sum(whole.values()) / 2**20

    @property
    def threads(self) -> int:
        """The threads each peer computes with: the cores shared out, one at least."""
        return max(1, self.cores_shared // self.peers)

    @property
    def emulation(self) -> float:
        """The slowdown every peer takes on top of its own where `emulate`: the cores the peers' threads ask for
        computing flat out (a peer slowed s times asks for 1/s of its threads), over `EMULATION_SHARE` of the
        cores there are. 1 without `emulate`, or where the cores have room for all of them."""
        if not self.emulate:
            return 1.0
        asked = sum(self.threads / (self.slowdowns[i] if self.slowdowns else 1.0) for i in range(self.peers))
        return max(1.0, asked / (EMULATION_SHARE * self.cores_shared))

    @property
    def cores_shared(self) -> int:
        """The cores the peers share: `cores`, else those this process may run on."""
        if self.cores:
            return self.cores
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def cap(self, i: int) -> float | None:
        return self.bandwidth_caps[i] if self.bandwidth_caps else None

    def latency_ms(self, i: int) -> float:
        return self.latencies_ms[i] if self.latencies_ms else 0.0


class Process:
    """One child process whose output goes to a log file and, line by line, to a callback."""

    def __init__(self, name: str, command: list[str], log_path: Path, on_line: Callable[[str, str], None], nice: int = 0) -> None:
        self.name, self.command, self.log_path, self.on_line, self.nice = name, command, log_path, on_line, nice
        self.popen: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None

    def start(self) -> "Process":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True,  # Ctrl+C at the terminal reaches the launcher only; it stops the children
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
        )
        self.reader = threading.Thread(target=self._relay, name=f"{self.name}-output", daemon=True)
        self.reader.start()
        return self

    def _relay(self) -> None:
        with open(self.log_path, "a") as log, self.popen.stdout:  # the pipe closes with the output: no file left open
            for line in self.popen.stdout:
                log.write(line)
                log.flush()
                self.on_line(self.name, line.rstrip("\n"))

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 20.0) -> int | None:
        """Ask the process to stop (SIGTERM: a peer announces that it leaves), kill it if it does not."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()  # what is left: the process itself if it did not stop, its DHT node and p2pd
        if self.reader is not None:
            self.reader.join(timeout=5)
        return self.popen.returncode

    def kill(self) -> None:
        """Die without a word, as a crashed machine would: the process, its DHT node and its p2pd at once."""
        if self.popen is not None:
            self._kill_group()
            if self.reader is not None:
                self.reader.join(timeout=5)

    def _kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # the process leads its own group (start_new_session)
        except ProcessLookupError:
            pass
        self.popen.wait()


class LocalSwarm:
    def __init__(self, config: SwarmConfig, echo: Callable[[str], None], api_port: int, http_port: int | None = None,
                 interrupted: threading.Event | None = None) -> None:
        self.config, self.echo, self.api_address = config, echo, f"127.0.0.1:{api_port}"
        if http_port is None and is_prepared(config.data):
            http_port = free_port()  # the coordinator serves the prepared corpus there
        self.http_listen = f"127.0.0.1:{http_port}" if http_port is not None else None  # the coordinator's --http
        self.dashboard_url = f"http://{self.http_listen}/" if self.http_listen else None
        self.coordinator: Process | None = None
        self.peers: list[Process] = []
        self.key: str | None = None
        self.dht_maddrs: list[str] = []
        self.device_ids: dict[int, str] = {}
        self.peer_maddrs: dict[int, str] = {}
        self.events: list[Event] = []
        self.lane_steps: list[LaneStep] = []  # what the lanes' last stages printed, step by step
        self.steps_done: dict[int, set[tuple[int, int]]] = {}  # peer -> (epoch, step) of the step lines it printed
        self.lane_sequences: dict[tuple[int, str], int] = {}  # (epoch, device) -> its lane's sequences a step
        self.credit: CreditBoard | None = None  # the ledger's, once the run is over
        self.plans: dict[int, PlanUse] = {}
        self.measured: dict[str, tuple[str, float]] = {}  # device id -> (device name, TFLOPS) it announced
        self.left: int | None = None  # the peer that left (`SwarmConfig.leave`), once it has
        self.churn = "running"  # of that peer: running, left, back (started again), trains (in a plan again)
        # set by whoever stops the run (Ctrl+C: `cli.common.interrupted_flag`): `run` ends at its next look at the
        # swarm, even where the interrupt itself came out of an API call as a failed call
        self.interrupted = interrupted or threading.Event()
        self.started = time.monotonic()
        self._seen = threading.Condition()

    # -- processes ----------------------------------------------------------------------------------
    def start(self) -> "LocalSwarm":
        self.config.out.mkdir(parents=True, exist_ok=True)
        for stale in self.config.out.glob("*/known_dht.json"):  # a run in the same folder before: its DHT is gone
            stale.unlink()
        self.start_coordinator()
        for i in range(self.config.peers):
            self.start_peer(i)
        return self

    def start_coordinator(self) -> None:
        c = self.config
        recipe = c.out / "recipe.json"
        recipe.write_text(c.recipe.to_text() + "\n")
        command = [
            sys.executable, "-m", "hetpeer", "coordinator", "--swarm", c.swarm, "--home", str(c.out / "coordinator"),
            "--recipe", str(recipe),
            "--api", self.api_address, "--heartbeat", repr(c.heartbeat_s), "--replan-interval", repr(c.replan_interval_s),
            "--model", c.model, "--batch", str(c.batch), "--micro-batch", str(c.micro_batch), "--dtype", c.dtype,
            # one planner worker: the peers on this machine have the cores
            "--time-budget", repr(c.time_budget_s), "--workers", "1", "--seed", str(c.recipe.seed), "--min-peers", str(min(2, c.peers)),
            "--steps", str(c.steps),
            *(("--http", self.http_listen) if self.http_listen else ()),
            *(("--data", str(c.data)) if is_prepared(c.data) else ()),  # served to the peers, which start without it
            *c.coordinator_args,
        ]
        alive = [self.peer_maddrs[i] for i, p in enumerate(self.peers) if p.alive and i in self.peer_maddrs]
        if alive:  # a restarted coordinator finds the swarm through its peers
            command += ["--initial-peers", *alive[:3]]
        with self._seen:
            self.key, self.dht_maddrs = None, []
        self.coordinator = Process("coordinator", command, c.out / "coordinator.log", self._on_line, nice=COORDINATOR_NICE).start()
        self._wait_for(lambda: self.key is not None and self.dht_maddrs, "the coordinator's key and DHT address", self.coordinator)
        self.event("coordinator started" + (" again" if alive else ""))

    def start_peer(self, i: int, extra_args: Sequence[str] = ()) -> None:
        """Start (or restart) peer `i`, with `extra_args` for `hetpeer join` beside its own."""
        c = self.config
        process = Process(f"peer{i}", [*self.peer_command(i), *extra_args], c.out / f"peer{i}.log", self._on_line)
        if i < len(self.peers):
            self.peers[i] = process
        else:
            self.peers.append(process)
        self.peer_maddrs.pop(i, None)
        process.start()

    def peer_command(self, i: int) -> list[str]:
        """The command line of peer `i`: `hetpeer join` into this swarm, with its slowdown, cap and options."""
        c = self.config
        command = [
            sys.executable, "-m", "hetpeer", "join", "--swarm", c.swarm, "--name", f"peer{i}",
            "--home", str(c.out / f"peer{i}"), "--coordinator-key", self.key, "--initial-peers", *self.dht_maddrs[:1],
            "--model", c.model, "--dtype", c.dtype, "--heartbeat", repr(c.heartbeat_s), "--steps", str(c.steps),
            "--threads", str(c.threads), "--timeout", repr(c.timeout_s), "--slowdown", repr(c.slowdown(i)),
            "--coordinator-api", self.api_address,
        ]
        if c.cap(i) is not None:
            command += ["--bandwidth-cap", repr(c.cap(i))]
        if c.latency_ms(i):  # the peers' transports all listen on this machine: `*` is every other peer
            command += ["--emulate-latency", f"*={c.latency_ms(i):g}"]
        if c.memory_mib is not None:
            command += ["--emulate-memory", f"{c.memory_mib:.3f}"]
        if c.save is not None:
            command += ["--save", str(c.save)]
        if is_prepared(c.data):
            command += ["--data-cache", str(c.out / f"peer{i}" / "data")]  # its own: it downloads what its lane reads
        elif c.data is not None:  # text: one peer prepares it when it is too large for memory, the others wait and share
            command += ["--data", str(c.data), "--data-cache", str(c.out / "data")]
        return command + list(c.peer_args)

    def kill_peer(self, i: int) -> None:
        self.peers[i].kill()
        self.event(f"peer{i} killed")

    def kill_coordinator(self) -> None:
        self.coordinator.kill()
        self.event("coordinator killed")

    def shutdown(self) -> None:
        processes = [p for p in self.peers if p.alive] + ([self.coordinator] if self.coordinator else [])
        for process in processes:  # all at once: peers leave together instead of timing out on each other
            if process.alive:
                process.popen.send_signal(signal.SIGTERM)
        for process in processes:
            process.stop()

    def __enter__(self) -> "LocalSwarm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def event(self, text: str) -> None:
        self.events.append(Event(self.elapsed(), text))
        self.echo(logline.relabel(text, "swarm"))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _on_line(self, name: str, stamped: str) -> None:
        line = logline.unstamp(stamped)
        if name.startswith("peer") and (done := ANY_STEP_RE.match(line)) is not None:
            with self._seen:
                self.steps_done.setdefault(int(name.removeprefix("peer")), set()).add((int(done.group(1)), int(done.group(4))))
        if name == "coordinator":
            key, dht = KEY_RE.search(line), DHT_RE.match(line)
            with self._seen:
                if key:
                    self.key = key.group(1)
                if dht:
                    self.dht_maddrs = line.split()[1:]
                self._seen.notify_all()
        elif (done := lane_step(line, self.elapsed())) is not None:
            with self._seen:
                self.lane_steps.append(done)
        elif (peer := PEER_RE.match(line)) is not None:
            i = int(name.removeprefix("peer"))
            with self._seen:
                self.device_ids[i], self.peer_maddrs[i] = peer.group(1), peer.group(2).rstrip(",")
                self._seen.notify_all()
        elif self.churn == "back" and name == f"peer{self.left}" and (entered := ENTERED_RE.match(line)) is not None:
            self.churn = "trains"
            self.event(f"{name} trains again: stage {entered.group(3)} of plan epoch {entered.group(1)} from step "
                       f"{entered.group(2)}, {entered.group(4)}")
        self.echo(logline.relabel(stamped, name))

    def _wait_for(self, ready: Callable[[], bool], what: str, process: Process) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._seen:
            while not ready():
                if not process.alive:
                    raise SwarmError(f"{process.name} exited (code {process.popen.returncode}) before printing {what}; "
                                     f"its log: {process.log_path}")
                if time.monotonic() > deadline:
                    raise SwarmError(f"{process.name} did not print {what} within {START_TIMEOUT_S:g} s; log: {process.log_path}")
                self._seen.wait(0.5)

    # -- watching through the API ---------------------------------------------------------------------
    def run(self, until_step: int | None = None, status: Callable[[str], None] | None = None) -> RunReport:
        """Watch until the swarm has completed `until_step` steps (default: the configured count), every
        peer has left, or progress stalls; then the report (processes keep running: `shutdown` stops them)."""
        target = until_step if until_step is not None else self.config.steps

        def on_plan(plan) -> None:
            for lane, devices in enumerate(plan.lanes):
                for device in devices:
                    self.lane_sequences[(plan.epoch, device)] = plan.lane_sequences(lane)
            self.plans[plan.epoch] = PlanUse(
                plan.epoch, plan.start_step, self.elapsed(), tuple(StageUse(s.layer_start, s.layer_end, s.devices) for s in plan.stages),
                plan.standby, predicted_step_s=plan.total_s,
            )
            self.event(f"plan epoch {plan.epoch}: {len(plan.stages)} stage(s) x {plan.group_size} lane(s) "
                       f"from step {plan.start_step}, predicted {plan.predicted}")

        def on_progress(progress) -> None:
            if self.interrupted.is_set():
                raise KeyboardInterrupt
            if len(self.measured) < len(self.device_ids):
                try:
                    for peer in client.call_list_peers():
                        self.measured[peer.record.device_id] = (peer.record.device_name, peer.record.tflops)
                except ApiError:
                    pass  # next time
            if status is not None and progress.loss is not None:
                status(describe(progress, target))
            self._churn(progress.step)

        with ApiClient(self.api_address, timeout_s=2.0) as client:
            try:
                # peers that reached the last step announced it as they left: the coordinator reads it within a round or two
                ended = follow(client, target, stall_s=self.config.stall_s, on_plan=on_plan, on_progress=on_progress,
                               gone=lambda: not any(p.alive for p in self.peers), gone_grace_s=2 * self.config.heartbeat_s + 1)
            except StalledError as error:
                raise SwarmError(f"{error}; logs in {self.config.out}") from None
            if ended == "left":
                self.event("every peer has left")
            self.credit = self._settled_credit(client)
        return self.report()

    def _settled_credit(self, client: ApiClient) -> CreditBoard | None:
        """The ledger once the peers have left (they do at the last step) and two rounds in a row credit the same:
        their last steps' receipts are in. None where the coordinator does not answer."""
        deadline = time.monotonic() + CREDIT_WAIT_HEARTBEATS * self.config.heartbeat_s
        last = None
        while True:
            try:
                board = client.call_get_credit()
            except ApiError:
                board = None
            settled = board is not None and last is not None and board.volunteers == last.volunteers
            if (settled and not any(p.alive for p in self.peers)) or time.monotonic() > deadline or self.interrupted.is_set():
                return board
            last = board
            time.sleep(self.config.heartbeat_s)

    def _churn(self, step: int) -> None:
        """`SwarmConfig.leave`: at its first step a peer of a group leaves (stopped as a volunteer stops it); at its
        second it is started again, and the swarm takes it back with its group's state."""
        if self.config.leave is None:
            return
        at, back = self.config.leave
        if self.churn == "running" and step >= at:
            self.left = self._leaver()
            if self.left is not None:
                self.churn = "left"
                self.peers[self.left].popen.send_signal(signal.SIGTERM)
                self.event(f"peer{self.left} leaves at step {step} ({self.device_ids[self.left]}); it comes back at step {back}")
        elif self.churn == "left" and step >= back and not self.peers[self.left].alive:
            self.churn = "back"
            self.start_peer(self.left)
            self.event(f"peer{self.left} comes back at step {step}")

    def _leaver(self) -> int | None:
        """A peer of the newest plan's largest group (the last of its lanes), to leave; None until a plan has a group."""
        if not self.plans:
            return None
        plan = self.plans[max(self.plans)]
        stage = max(plan.stages, key=lambda s: len(s.devices))
        index = {device: i for i, device in self.device_ids.items()}
        members = [index[d] for d in stage.devices if d in index and self.peers[index[d]].alive]
        return members[-1] if len(members) > 1 else None

    def report(self) -> RunReport:
        """What was seen so far, for the run report: the loss curve from every step the peers printed."""
        c = self.config
        with self._seen:
            samples = samples_from_lanes(self.lane_steps)
        peers = []
        for i in range(c.peers):
            device = self.device_ids.get(i, f"peer{i}")
            name, tflops = self.measured.get(device, ("local process", None))
            peers.append(PeerInfo(device, c.slowdown(i), c.cap(i), tflops, name, c.latency_ms(i)))
        return RunReport(
            swarm=c.swarm, model=c.model, steps=max((s.step + 1 for s in samples), default=0), wall_s=self.elapsed(),
            peers=peers, plans=summarize(samples, list(self.plans.values())), samples=list(samples), events=list(self.events),
            credit=self._credit_rows(),
        )

    def _credit_rows(self) -> list[PeerCredit]:
        """Each peer's step lines beside its credit in the ledger (none before the run has one)."""
        if self.credit is None:
            return []
        rows = []
        with self._seen:
            done = {i: sorted(steps) for i, steps in self.steps_done.items()}
        for i, device in sorted(self.device_ids.items()):
            steps = done.get(i, [])
            credit = self.credit.of(device)
            rows.append(PeerCredit(device, len(steps), sum(self.lane_sequences.get((e, device), 0) for e, _ in steps),
                                   credit.sequences if credit else 0, credit.tokens if credit else 0,
                                   credit.flops if credit else 0.0))
        return rows


def parse_per_peer(text: str | None, peers: int, what: str, none_value: str | None = None) -> tuple:
    """A comma-separated list of per-peer figures, repeated to cover `peers` ("1,2" -> 1,2,1,2,...)."""
    if not text:
        return ()
    values = []
    for part in text.split(","):
        part = part.strip()
        if none_value is not None and part == none_value:
            values.append(None)
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"{what} must be numbers separated by commas, got {text!r}") from None
    return tuple(values[i % len(values)] for i in range(peers))
