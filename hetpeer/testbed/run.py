"""`hetpeer testbed`: write the project (`project.py`), start it, follow the swarm through the coordinator's
API with live progress, and at the end keep every container's log and a run report (`hetpeer swarm`'s
report) before removing the containers."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

from hetpeer import logline
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.swarm.report import Event, LaneStep, PeerInfo, PlanUse, RunReport, StageUse, lane_step, samples_from_lanes, summarize
from hetpeer.swarm.watch import describe, follow
from hetpeer.testbed.compose import Compose, ComposeError, check_docker, image_exists
from hetpeer.testbed.project import COORDINATOR, TestbedConfig, peer_name, service_name, slowdowns, write

GONE_CHECK_S = 5.0  # how often to ask Docker whether peers still run


def lane_steps(logs: dict[str, Path], origin_s: float = 0.0) -> list[LaneStep]:
    """Every lane step the peers' logs (service -> file, as `Testbed.logs` writes them) print, at its time
    stamp less `origin_s` (seconds since the epoch)."""
    steps = []
    for name, path in logs.items():
        if name == COORDINATOR:
            continue
        for line in path.read_text(errors="replace").splitlines():
            when, text = logline.split(line)
            if when is not None and (done := lane_step(text, logline.seconds(when) - origin_s)) is not None:
                steps.append(done)
    return steps


class Testbed:
    def __init__(self, config: TestbedConfig, echo: Callable[[str], None]) -> None:
        self.config, self.echo = config, echo
        self.compose = Compose(config.out / "compose.yaml", config.project)
        self.api_address = f"127.0.0.1:{config.api_port}"
        self.started_at = time.time()
        self.plans: dict[int, PlanUse] = {}
        self.events: list[Event] = []
        self.measured: dict[str, tuple[str, float]] = {}  # device id -> (device name, TFLOPS), from the API

    def start(self) -> "Testbed":
        check_docker()
        if not image_exists(self.config.image):
            raise ComposeError(f"no image {self.config.image}: build it first (docker/build.sh, see docker/README.md)")
        write(self.config)
        self.started_at = time.time()
        self.compose.up()
        self.event(f"started {len(self.config.topology.devices)} peer containers and a coordinator ({self.config.project})")
        return self

    def event(self, text: str) -> None:
        self.events.append(Event(time.time() - self.started_at, text))
        self.echo(logline.relabel(text, "testbed"))

    def run(self, status: Callable[[str], None]) -> str:
        """Follow the swarm until `steps` (forever without), or until every peer container has stopped."""
        target = self.config.steps if self.config.steps is not None else math.inf
        checked = {"at": 0.0, "gone": False}

        def gone() -> bool:
            if time.monotonic() - checked["at"] > GONE_CHECK_S:
                checked["at"], checked["gone"] = time.monotonic(), set(self.compose.running()) <= {COORDINATOR}
            return checked["gone"]

        def on_plan(plan) -> None:
            self.plans[plan.epoch] = PlanUse(
                plan.epoch, plan.start_step, time.time() - self.started_at,
                tuple(StageUse(s.layer_start, s.layer_end, s.devices) for s in plan.stages), plan.standby,
                predicted_step_s=plan.total_s,
            )
            self.event(f"plan epoch {plan.epoch}: {len(plan.stages)} stage(s) x {plan.group_size} lane(s) from step "
                       f"{plan.start_step}, predicted {plan.predicted}, standby {'; '.join(plan.standby_lines()) or 'none'}")
            for s, stage in enumerate(plan.stages):
                self.echo(logline.relabel(f"  stage {s + 1} layers {stage.layer_start}-{stage.layer_end - 1}: "
                                          f"{', '.join(stage.devices)}", "testbed"))

        def on_progress(progress) -> None:
            if len(self.measured) < len(self.config.topology.devices):
                try:
                    for peer in client.call_list_peers():
                        self.measured[peer.record.device_id] = (peer.record.device_name, peer.record.tflops)
                except ApiError:
                    pass
            status(describe(progress, target))

        with ApiClient(self.api_address, timeout_s=2.0) as client:
            ended = follow(client, target, stall_s=max(300.0, 60 * self.config.heartbeat_s), on_plan=on_plan,
                           on_progress=on_progress, gone=gone, gone_grace_s=2 * self.config.heartbeat_s + 1)
        self.event("every peer has left" if ended == "left" else f"the swarm reached step {self.config.steps}")
        return ended

    def logs(self) -> dict[str, Path]:
        """Every container's output, written to `out/logs/<service>.log`."""
        folder = self.config.out / "logs"
        folder.mkdir(exist_ok=True)
        paths = {}
        for name in [COORDINATOR] + [service_name(d.id) for d in self.config.topology.devices]:
            paths[name] = folder / f"{name}.log"
            try:
                paths[name].write_text(self.compose.logs(name) + "\n")
            except ComposeError as error:
                paths[name].write_text(f"(no log: {error})\n")
        return paths

    def report(self, logs: dict[str, Path]) -> RunReport:
        """The run report from the peers' step lines (their time stamps place each step in the run)."""
        samples = samples_from_lanes(lane_steps(logs, self.started_at))
        slow = slowdowns(self.config)
        peers = []
        for device in self.config.topology.devices:
            found = [d for d in self.measured if d.rsplit("-", 1)[0] == peer_name(device.id)]
            name, tflops = self.measured.get(found[0], ("container", None)) if found else ("container", None)
            peers.append(PeerInfo(found[0] if found else device.id, slow[device.id], None, tflops, name))
        return RunReport(
            swarm=self.config.swarm, model=self.config.model, steps=max((s.step + 1 for s in samples), default=0),
            wall_s=time.time() - self.started_at, peers=peers, plans=summarize(samples, list(self.plans.values())),
            samples=samples, events=self.events,
        )

    def shutdown(self) -> None:
        self.compose.down()

