"""docker/compose.yaml as users start it, in one step: a coordinator and four unequal peers in containers,
each with its own address. The swarm trains; a peer killed, a peer cut off the network and the coordinator
killed are each survived, and each comes back."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import yaml

from compose_helpers import ROOT, unique, wait_for
from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.logline import unstamp
from hetpeer.peer.reach import free_port
from hetpeer.testbed.compose import Compose

PEERS = ("peer1", "peer2", "peer3", "peer4")


@pytest.fixture(scope="module")
def swarm(image, tmp_path_factory):
    port, http = free_port(), free_port()
    # The faults below are survived by groups, so the coordinator is held to groups of two: left to choose, it
    # may rightly find a pipeline of three single peers with one spare as fast on the host's two shared cores
    # (seen in CI: 3 x 1, predicted 0.279 s) and keep it for the whole module.
    coordinator = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["coordinator"]["command"]
    override = tmp_path_factory.mktemp("compose") / "groups.yaml"
    override.write_text(yaml.safe_dump({"services": {"coordinator": {"command": [*coordinator, "--group-size", "2"]}}}))
    compose = Compose(ROOT / "docker" / "compose.yaml", unique("hetpeer-compose"), overrides=[override],
                      env={"HETPEER_IMAGE": image, "HETPEER_API_PORT": str(port), "HETPEER_HTTP_PORT": str(http),
                           "HETPEER_SWARM": "ci",
                           # the four containers compute on this host's cores, and announce it (planner/sharing.py):
                           # slowed as GPUs slower than the cores, they leave room for the host's other work
                           "HETPEER_SLOWDOWN": "8", "HETPEER_PEER3_SLOWDOWN": "16"})
    try:
        compose.up()
        with ApiClient(f"127.0.0.1:{port}", timeout_s=5.0) as client:
            compose.client, compose.dashboard = client, f"http://127.0.0.1:{http}/"
            yield compose
    finally:
        compose.down()


def device_of(swarm: Compose, service: str) -> str:
    """The device id a service's peer announces (NAME-<key fingerprint>)."""
    return next(p.record.device_id for p in swarm.client.call_list_peers() if p.record.device_id.startswith(service + "-"))


def service_of(device: str) -> str:
    return device.rsplit("-", 1)[0]


def log_lines(swarm: Compose, service: str) -> list[str]:
    return [unstamp(line) for line in swarm.logs(service).splitlines()]


def steps_of(swarm: Compose, service: str) -> list[int]:
    return [int(m.group(1)) for line in log_lines(swarm, service) if (m := re.match(r"e\d+ stage \d+ lane \d+\s+step (\d+)", line))]


def coordinator_log(swarm: Compose) -> str:
    return "the coordinator's log ends:\n" + "\n".join(swarm.logs("coordinator").splitlines()[-25:])


def peer_logs(swarm: Compose, lines: int = 12) -> str:
    """The end of every peer's log."""
    return "\n".join(f"{service}'s log ends:\n" + "\n".join(log_lines(swarm, service)[-lines:]) for service in PEERS)


def fast_member(swarm: Compose, plan) -> str:
    """A member of the plan that computes at full speed and is not capped (peer1 or peer2)."""
    return next(d for d in plan.devices if service_of(d) in ("peer1", "peer2"))


def training_plan(swarm: Compose, after_epoch: int = 0, lanes: int = 2):
    """The running plan once it is newer than `after_epoch`, has `lanes` lanes or more and has run a few steps."""
    client = swarm.client

    def ready():
        plan, _ = client.call_get_plan()
        progress = client.call_get_progress()
        return plan if plan and plan.epoch > after_epoch and plan.group_size >= lanes and progress.epoch == plan.epoch \
            and progress.step >= plan.start_step + 3 else None

    return wait_for(ready, f"a plan after epoch {after_epoch} with {lanes}+ lanes to train", 300,
                    explain=lambda: coordinator_log(swarm) + "\n" + peer_logs(swarm, 30))


def test_the_compose_swarm_trains(swarm):
    plan = training_plan(swarm)
    # steps are counted from every peer's record, the loss from the last stage's, which may not have announced
    # its first loss by the time the first stage is a few steps in
    first = wait_for(lambda: (p := swarm.client.call_get_progress()).loss is not None and p, "the last stage's loss", 120,
                     explain=lambda: coordinator_log(swarm) + "\n" + peer_logs(swarm, 30))
    later = wait_for(lambda: (p := swarm.client.call_get_progress()).step >= first.step + 40 and p, "40 more steps", 300)
    assert later.loss < first.loss, (first, later)
    assert set(plan.devices) | set(plan.standby) == {device_of(swarm, s) for s in PEERS}
    # the dashboard, from the host: the same plan and peers, and the history of the run so far
    with urllib.request.urlopen(swarm.dashboard + "api/state", timeout=10) as reply:
        state = json.loads(reply.read())
    assert state["plan"]["epoch"] >= plan.epoch and {p["device_id"] for p in state["peers"]} == {device_of(swarm, s) for s in PEERS}
    samples = [dict(zip(state["history"]["sample_fields"], s)) for s in state["history"]["samples"]]
    steps = [s["step"] for s in samples]
    assert len(samples) >= 2 and steps == sorted(steps) and steps[-1] >= first.step, steps
    assert any(s["training"] for s in samples) and any(e["kind"] == "plan" for e in state["history"]["events"])
    with urllib.request.urlopen(swarm.dashboard + "metrics", timeout=10) as reply:
        assert re.search(r"^hetpeer_swarm_step \d", reply.read().decode(), re.M)


def test_a_killed_peer_is_planned_around_and_rejoins_with_its_groups_state(swarm):
    plan = training_plan(swarm)
    victim = fast_member(swarm, plan)  # it has a group: the plan has two lanes or more
    swarm.kill(service_of(victim))
    without = training_plan(swarm, plan.epoch, lanes=1)
    assert victim not in without.devices
    swarm.start(service_of(victim))
    back = wait_for(lambda: (p := swarm.client.call_get_plan()[0]) and victim in p.devices and p, "a plan with it back", 300,
                    explain=lambda: coordinator_log(swarm))
    # it trains in that plan or a later one (a repair may replace the plan before its first step)
    wait_for(lambda: any((m := re.match(r"e(\d+) stage", line)) and int(m.group(1)) >= back.epoch
                         for line in log_lines(swarm, service_of(victim))),
             "it to train again", 300, explain=lambda: peer_logs(swarm) + "\n" + coordinator_log(swarm))
    assert any(re.search(r"downloaded [\d.]+ MiB of state in \d+ chunk\(s\) from", line) for line in log_lines(swarm, service_of(victim)))


def test_a_peer_cut_off_the_network_is_dropped_and_comes_back(swarm):
    plan = training_plan(swarm)
    victim = fast_member(swarm, plan)
    swarm.disconnect(service_of(victim))
    try:
        without = training_plan(swarm, plan.epoch, lanes=1)
        assert victim not in without.devices
        moved = swarm.client.call_get_progress().step
        wait_for(lambda: swarm.client.call_get_progress().step >= moved + 10, "the others to train on", 120)
    finally:
        seen = len(swarm.logs("coordinator").splitlines())
        swarm.connect(service_of(victim))
    # Back on the network it announces again, and the coordinator solves for it as a newcomer. Whether the plan
    # takes it back depends on what it adds: the four containers compute on this host's cores, which they announce
    # as one shared device (planner/sharing.py), so a lane more may only share them and the running plan be kept.
    back_s = CoordinatorConfig.__dataclass_fields__["replan_interval_s"].default + 120

    def weighed():
        current = swarm.client.call_get_plan()[0]
        if current is not None and current.epoch > without.epoch and victim in current.devices:
            return True
        later = "\n".join(unstamp(line) for line in swarm.logs("coordinator").splitlines()[seen:])
        solved = re.search(rf"solving: .*{re.escape(victim)}.*joined", later)
        return solved and re.search(r"^(published plan epoch|kept epoch)", later[solved.end():], re.M)

    wait_for(weighed, "the coordinator to see it again and plan for it", back_s, explain=lambda: coordinator_log(swarm))
    back = swarm.client.call_get_plan()[0]
    if victim in back.devices:
        wait_for(lambda: any(re.match(rf"e{back.epoch} stage", line) for line in log_lines(swarm, service_of(victim))),
                 "it to train again", 300, explain=lambda: "its log ends:\n" + "\n".join(log_lines(swarm, service_of(victim))[-30:])
                 + "\n" + coordinator_log(swarm))


def test_the_peers_train_on_without_the_coordinator_and_a_restarted_one_carries_on(swarm):
    plan = training_plan(swarm)
    trainer = service_of(plan.devices[0])
    swarm.kill("coordinator")
    at_kill = max(steps_of(swarm, trainer))
    wait_for(lambda: max(steps_of(swarm, trainer)) >= at_kill + 10, "the peers to train on without it", 120)
    swarm.start("coordinator")
    wait_for(lambda: f"running plan from the DHT: epoch {plan.epoch}" in swarm.logs("coordinator"),
             "the restarted coordinator to read the running plan back", 120)
    resumed = wait_for(lambda: (p := swarm.client.call_get_progress()).epoch == plan.epoch and p.step > at_kill + 10 and p,
                       "the restarted coordinator to see the swarm's progress", 120)
    later = wait_for(lambda: (p := swarm.client.call_get_progress()).step >= resumed.step + 10 and p, "training to go on", 120)
    assert later.epoch == plan.epoch  # it carried on with the running plan: nothing broke, nothing to re-plan
