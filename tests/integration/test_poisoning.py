"""A poisoning peer in a real swarm (a coordinator and four `hetpeer join` processes on 127.0.0.1, the recipe's
defaults). In one stage, in gossip and in all-reduce (what `auto` picks here): its group clips it or leaves it out
and reports it, the coordinator bans it (its dashboard says so), and the others train on without it. In two stages
of two lanes, lying about the activations it hands its lane: its partner's stage check catches it, the pair is
parted, its next partner catches it too, and it is banned with its credit for that plan voided."""

from __future__ import annotations

from dataclasses import replace

import json
import math
import re
import time
import urllib.request
from pathlib import Path

import pytest

from hetpeer.logline import unstamp
from hetpeer.peer.reach import free_port
from hetpeer.swarm.launcher import DEMO_RECIPE, LocalSwarm, SwarmConfig

pytestmark = pytest.mark.slow
POISON_PEER = Path(__file__).parents[2] / "benchmarks" / "poison_peer.py"
TIMEOUT_S = 180.0


class PoisonedSwarm(LocalSwarm):
    poison = "scale"

    def peer_command(self, i: int) -> list[str]:
        command = super().peer_command(i)
        if i == 3:  # `python -m hetpeer join ...` becomes `python poison_peer.py scale join ...`
            command[1:3] = [str(POISON_PEER), self.poison]
        return command


class LyingStageSwarm(PoisonedSwarm):
    poison = "stage-scale"  # what it hands its lane: activations forward, gradients back


def log(swarm: LocalSwarm, name: str) -> str:
    return "\n".join(map(unstamp, (swarm.config.out / f"{name}.log").read_text(errors="replace").splitlines()))


def wait_for(condition, what: str, swarm: LocalSwarm) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() >= deadline:  # what the coordinator saw is what tells a slow swarm from a wrong one
            tail = "\n".join(log(swarm, "coordinator").splitlines()[-30:])
            raise AssertionError(f"timed out after {TIMEOUT_S:g} s waiting for {what}; the coordinator's log ends:\n{tail}")
        time.sleep(0.5)


@pytest.mark.parametrize("sync", ["gossip", "allreduce"])
def test_a_poisoner_is_left_out_reported_banned_and_the_group_trains_on(tmp_path, sync):
    config = SwarmConfig(
        out=tmp_path, peers=4, steps=100_000, batch=64, heartbeat_s=1.0, replan_interval_s=3600,
        recipe=replace(DEMO_RECIPE, mix_deadline_s=2.0), time_budget_s=1.0,
        # the mode pinned, so that each run proves its own defence; the recipe's robust is its default
        coordinator_args=("--stages", "1", "--group-size", "4", "--min-peers", "4", "--sync", sync),
    )
    swarm = PoisonedSwarm(config, lambda line: None, free_port(), http_port=free_port())
    try:
        swarm.start()
        wait_for(lambda: "banned peer3-" in log(swarm, "coordinator"), "the coordinator to ban the poisoner", swarm)
        coordinator = log(swarm, "coordinator")
        first = re.search(r"published plan epoch 1 .*", coordinator).group(0)
        assert "1 stage(s) x 4 lane(s)" in first, f"the poisoner must be in the group for the test to mean anything: {first}"
        assert f"layers 0-3 ({sync})" in coordinator
        ban = re.search(r"banned (peer3-\S+) for 300 s \(ban 1\): reported by (\d) of the 3 other members", coordinator)
        assert ban and int(ban.group(2)) >= 2
        poisoner = ban.group(1)
        reporters = [i for i in range(3) if f"reports {poisoner} as misbehaving" in log(swarm, f"peer{i}")]
        assert len(reporters) >= 2
        wait_for(lambda: "published plan epoch" in log(swarm, "coordinator").split(f"banned {poisoner}")[1], "a plan after the ban", swarm)
        after = log(swarm, "coordinator").split(f"banned {poisoner}")[1]
        epoch = int(re.search(r"published plan epoch (\d+)", after).group(1))
        assert poisoner not in re.search(r"published plan epoch \d+ .*\n((?:  stage .*\n?)+)", after).group(1)
        with urllib.request.urlopen(swarm.dashboard_url + "api/state", timeout=10) as reply:  # the organizer sees it
            state = json.loads(reply.read())
        assert any(e["kind"] == "ban" and poisoner in e["text"] for e in state["history"]["events"])
        row = next(p for p in state["peers"] if p["device_id"] == poisoner)
        assert row["admission"].startswith("banned ") and state["progress"]["banned"] == 1

        def trained_after_ban() -> list[float]:
            return [float(loss) for i in range(3) for e, loss in
                    re.findall(r"^e(\d+) stage \d+ lane \d+ +step \S+ +loss (\S+)", log(swarm, f"peer{i}"), re.M)
                    if int(e) >= epoch and loss != "-"]

        wait_for(lambda: len(trained_after_ban()) >= 10, "the honest peers to train ten lane-steps without it", swarm)
        losses = trained_after_ban()
        assert all(math.isfinite(loss) and loss < 6.0 for loss in losses), losses  # 5.5 is a uniform guess
    finally:
        swarm.shutdown()


def test_a_stage_that_lies_to_its_lane_is_caught_parted_from_its_accuser_and_banned_by_its_next_partner(tmp_path):
    config = SwarmConfig(
        out=tmp_path, peers=4, steps=100_000, batch=64, heartbeat_s=1.0, replan_interval_s=3600, time_budget_s=1.0,
        coordinator_args=("--stages", "2", "--group-size", "2", "--min-peers", "4"),
    )
    swarm = LyingStageSwarm(config, lambda line: None, free_port())
    try:
        swarm.start()
        wait_for(lambda: "banned peer3-" in log(swarm, "coordinator"), "the coordinator to ban the lying stage", swarm)
        coordinator = log(swarm, "coordinator")
        assert "2 stage(s) x 2 lane(s)" in re.search(r"published plan epoch 1 .*", coordinator).group(0)
        assert "checks: stage 1: checked in a pair" in coordinator  # the plan says how its stages are checked
        dispute = re.search(r"(peer\d-\S+) reports (peer3-\S+), its only partner at stage \d: a dispute", coordinator)
        assert dispute, "the first accusation is a dispute, not a verdict"
        accuser, liar = dispute.groups()
        assert f"solving: parting {min(accuser, liar)} and {max(accuser, liar)}" in coordinator
        ban = re.search(rf"banned {liar} for 300 s \(ban 1\): reported by 2 partners in turn \({accuser}, (peer\d-\S+)\)",
                        coordinator)
        assert ban and ban.group(1) != accuser
        assert re.search(rf"voided {liar}'s credit for plan epoch \d+, where it was banned", coordinator)
        caught = [i for i in range(3) if f"reports {liar} as misbehaving: a check caught it: its " in log(swarm, f"peer{i}")]
        assert len(caught) >= 2
        assert not re.search(r"banned peer[012]-", coordinator), "no honest peer is banned"
        wait_for(lambda: "published plan epoch" in log(swarm, "coordinator").split(f"banned {liar}")[1], "a plan after the ban", swarm)
        after = log(swarm, "coordinator").split(f"banned {liar}")[1]
        epoch = int(re.search(r"published plan epoch (\d+)", after).group(1))
        planned = re.search(r"published plan epoch \d+ .*\n((?:  .*\n?)+)", after).group(1)  # standby lines, then stages
        assert liar not in "".join(line for line in planned.splitlines() if line.startswith("  stage "))

        def trained_after_ban() -> list[float]:
            return [float(loss) for i in range(3) for e, loss in
                    re.findall(r"^e(\d+) stage \d+ lane \d+ +step \S+ +loss (\S+)", log(swarm, f"peer{i}"), re.M)
                    if int(e) >= epoch and loss != "-"]

        wait_for(lambda: len(trained_after_ban()) >= 10, "the honest peers to train ten lane-steps without it", swarm)
        assert all(math.isfinite(loss) and loss < 6.0 for loss in trained_after_ban())
    finally:
        swarm.shutdown()
