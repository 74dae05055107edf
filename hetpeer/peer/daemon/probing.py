"""What a swarm peer measures while it runs, on its own probe thread: latency and bandwidth to a few
peers every few heartbeats (lane and group neighbours first: `measure.py`), and its device's speed again
now and then while it does not train, more often before the swarm's first plan (`probe.py`); and on the
control thread, each heartbeat until the swarm's first plan reaches it, the load other work puts on its
device and its own process's (`probe.DeviceLoad`): from them the planner tells what to leave out of what
peers sharing one machine can compute.

The fastest a peer timed its device is kept in its home (`machine.json`, for `REMEMBER_S`): a peer that comes
back times its device while the peers it shares it with train (the demo's returning peer read 0.63 GFLOPS where
it read 0.95 before it left), and may not time it again while they do, so it announces the figure it had,
where the device, model, dtype, micro-batch and slowdown are the same.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from hetpeer.peer.daemon.measure import describe_links, pick_targets
from hetpeer.peer.pipeline.steptime import step_costs
from hetpeer.peer.probe import MachineProfile, profile_machine
from hetpeer.protocol.records import PeerRecord
from hetpeer.protocol.stepcosts import StepCosts

REPROFILE_S = 60.0  # a peer on standby times its device again this often
# and this often (14 s at the default heartbeat) before any plan has reached it: peers that start together probe
# in each other's way (the demo's eight, each emulating a device of its own, read up to 42% slow beside the
# others' start-up), and the swarm's first plan waits for every peer's second timing (`coordinator.policy`)
REPROFILE_WAITING_HEARTBEATS = 7
REMEMBER_S = 86400.0  # a device's fastest timing, kept in the peer's home, stands in for a slower one this long
MACHINE_FILE = "machine.json"


class Probing:
    """The part of `SwarmPeer` that runs its probe thread (`_probe_loop`): it adds what it measures to the
    peer's `links` under `lock`, and keeps its `machine` profile."""

    def _probe_loop(self) -> None:
        config = self.config
        self.stopping.wait(config.heartbeat_s)  # the first read of the swarm comes first
        links_due = 0.0
        while not self.stopping.is_set():
            self._profile_again()
            if time.monotonic() >= links_due:
                self._probe_links()
                links_due = time.monotonic() + config.probe_every * config.heartbeat_s
            # the device is timed again when it is due, not at the next round of link probes (which could be most
            # of a round late, and the first plan waits for it); a heartbeat at least between looks
            due = min(links_due, self._profile_due())
            self.stopping.wait(max(config.heartbeat_s, due - time.monotonic()))

    def _probe_links(self) -> None:
        config = self.config
        with self.lock:
            known = [d for d in self.records if d != self.device_id and self._worth_probing(d)]
            near = self.running.neighbours(self.device_id) if self.running is not None else []
            preferred = [d for d in near if self._worth_probing(d)]
            oldest = self.links.oldest_first()
        targets = pick_targets(self.device_id, known, preferred, config.probe_targets, self._rng, oldest)
        measured = self.prober.measure_many(targets, budget_bytes=config.probe_bytes, budget_s=config.heartbeat_s)
        with self.lock:
            self.links.add(measured)
            if set(self.records) - {self.device_id}:  # a peer cut off sees no one: it keeps what it knew
                self.links.keep_only(self.records)
        if measured:
            self.report(f"links measured: {describe_links(measured)}")

    def _measure_load(self) -> None:
        """Sample the device's background load while no plan has set anyone here to train: once peers train,
        what they compute is no longer the load that was there without them (nor for a peer that joins, or
        comes back, while the peers it shares its device with train)."""
        if self.running is not None or self.machine is None:
            return
        with self.lock:
            trains = device_trains(self.machine.compute_key, self.records, self.device_id)
        if trains:
            self.device_load.skip()
            return
        load = self.device_load.sample()
        if load is not None:
            with self.lock:  # the probe thread replaces it too
                self.machine = replace(self.machine, compute_background=load[0], compute_own=load[1])

    def _profile(self) -> MachineProfile:
        config = self.config
        self._profiled_at = time.monotonic()
        machine = profile_machine(self.spec, config.micro_batch, config.dtype, config.worker.device, config.worker.slowdown,
                                  config.probe_s, swarm=config.swarm)
        costs = step_costs(self.spec, config.micro_batch, config.worker.device, config.probe_s / 8, config.dtype,
                           config.worker.slowdown, tflops=machine.tflops)  # six timings of an eighth of the block's
        machine = replace(machine, step_costs=costs)
        if config.memory_cap_bytes is not None:
            machine = replace(machine, memory_bytes=min(machine.memory_bytes, config.memory_cap_bytes))
        return machine

    def _profile_due(self) -> float:
        """When (`time.monotonic`) `_profile_again` times the device again: infinity while the peer trains."""
        state = self.status.state
        if state == "waiting":
            return self._profiled_at + REPROFILE_WAITING_HEARTBEATS * self.config.heartbeat_s
        return self._profiled_at + REPROFILE_S if state == "standby" else float("inf")

    def _profile_again(self) -> None:
        """While not training (its device idle, and no peer sharing it training), time the device again now and
        then and keep the faster figure: a machine busy when the peer started (other programs, or peers starting
        beside it) read too slow. The record counts the timings: the swarm's first plan waits for a second."""
        if time.monotonic() < self._profile_due():
            return
        with self.lock:
            busy = device_trains(self.machine.compute_key, self.records, self.device_id)
        if busy:  # its device is training others' stages: timing it would slow them, and read their load
            return
        again = self._profile()
        with self.lock:
            was, timings = self.machine.tflops, self.machine.timings + 1
            if again.tflops > was:
                self.machine = replace(self.machine, tflops=again.tflops, step_costs=again.step_costs, timings=timings)
            else:
                self.machine = replace(self.machine, timings=timings)
        if again.tflops > was:
            self.report(f"machine: {again.tflops * 1e3:.2f} GFLOPS achieved now (was {was * 1e3:.2f} when busier)")
            self._remember(self.machine)

    def _timing_context(self) -> dict:
        """What a remembered timing must have been taken under to stand for this run's."""
        config = self.config
        return {"model": config.model.name, "dtype": config.dtype, "micro_batch": config.micro_batch,
                "slowdown": config.worker.slowdown, "device": config.worker.device}

    def _fastest_known(self, machine: MachineProfile) -> MachineProfile:
        """`machine` as just timed, or with the faster figure its home remembers for the same device and run
        settings (said in the log); the faster of the two is remembered."""
        path = self.config.home / MACHINE_FILE
        context = self._timing_context()
        try:
            known = recalled(path, context, machine)
        except ValueError as error:
            self.report(f"machine: {path} not used: {error}")
            known = None
        if known is not None and known[0] > machine.tflops:
            tflops, costs = known
            self.report(f"machine: timed {machine.tflops * 1e3:.2f} GFLOPS now, busier than when it timed "
                        f"{tflops * 1e3:.2f} (kept in {path}): it announces {tflops * 1e3:.2f} until it times as fast again")
            return replace(machine, tflops=tflops, step_costs=costs)
        self._remember(machine)
        return machine

    def _remember(self, machine: MachineProfile) -> None:
        """Keep `machine`'s timing in the peer's home; a home it cannot write to is said, not fatal."""
        try:
            remember(self.config.home / MACHINE_FILE, self._timing_context(), machine)
        except OSError as error:
            self.report(f"machine: its timing is not kept for a later start: {error}")


def device_trains(key: str | None, records: Mapping[str, PeerRecord], own: str) -> bool:
    """Whether another peer that announces the device `key` (None: unknown, shared with nobody) trains on it."""
    return key is not None and any(r.compute_key == key and r.state == "training" for d, r in records.items() if d != own)


def remember(path: Path, context: dict, machine: MachineProfile) -> None:
    """Keep `machine`'s timing in `path`, for a later start under the same `context` (`recalled`)."""
    record = {**context, "device_name": machine.device_name, "compute_key": machine.compute_key,
              "tflops": machine.tflops, "step_costs": machine.step_costs.to_wire(), "time": time.time()}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    temporary.replace(path)


def recalled(path: Path, context: dict, machine: MachineProfile) -> tuple[float, StepCosts] | None:
    """The (TFLOPS, step costs) `path` remembers for `machine`'s device under `context`, if it was taken within
    `REMEMBER_S`; None where there is none that applies; ValueError naming what is wrong with a damaged file."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"it is not JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError("it is not a JSON object")
    now = time.time()
    same = all(record.get(k) == v for k, v in context.items()) and record.get("device_name") == machine.device_name \
        and record.get("compute_key") == machine.compute_key
    stamp = record.get("time")
    if not same or not isinstance(stamp, (int, float)) or not 0 <= now - stamp <= REMEMBER_S:
        return None
    tflops, costs = record.get("tflops"), record.get("step_costs")
    if not (isinstance(tflops, (int, float)) and not isinstance(tflops, bool) and 0 < tflops < float("inf")):
        raise ValueError(f"tflops must be a positive number, got {tflops!r}")
    if not (isinstance(costs, list) and len(costs) == len(StepCosts().to_wire())):
        raise ValueError(f"step_costs must be a list of {len(StepCosts().to_wire())} numbers")
    try:
        return float(tflops), StepCosts(*costs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"step_costs: {error}") from None
