"""Two volunteers that cannot reach each other by any route (a filter between them that drops every packet, which
the reach check cannot see: both are public) join a swarm of four held to 2 stages x 2 lanes. Each reports the
other in its signed record with how it failed (no answer), and the coordinator plans the pair apart: of the
plans it publishes, none after the first puts the two in one lane or group, and all four train to the last step.
Their records, read from the coordinator's API, say it; `hetpeer status` shows the plan's routes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from lab import Lab
from runs import Start, start_coordinator, wait_for_line

STEPS = 8
DEADLINE_S = 420.0
STAGE = re.compile(r"^\S+   stage (\d+) layers .*?: (.+)$", re.MULTILINE)
PUBLISHED = re.compile(r"^\S+ published plan epoch (\d+)", re.MULTILINE)


def plans(log: str) -> list[list[list[str]]]:
    """Each published plan's stages, each its devices in lane order (the coordinator's own lines)."""
    found, starts = [], [m.end() for m in PUBLISHED.finditer(log)] + [len(log)]
    for begin, end in zip(starts, starts[1:]):
        found.append([devices.split(", ") for _, devices in STAGE.findall(log[begin:end])])
    return found


def together(plan: list[list[str]], a: str, b: str) -> bool:
    lanes = list(zip(*plan))
    return any(a in group and b in group for group in [*plan, *lanes])


def test_a_pair_with_no_route_between_them_is_planned_apart_and_the_swarm_trains(lab: Lab, run: Start, tmp_path: Path):
    deadline = time.monotonic() + DEADLINE_S
    coordinator_host = lab.public("coord")
    hosts = {f"p{i}": lab.public(f"p{i}") for i in range(4)}
    lab.cut(hosts["p0"], hosts["p1"])
    coordinator, join = start_coordinator(run, coordinator_host, tmp_path, "cut", deadline, "--min-peers", "4",
                                          "--stages", "2", "--group-size", "2", "--heartbeat", "1", "--steps", str(STEPS),
                                          "--api", "0.0.0.0:50051")
    peers = {name: run(host, name, "join", "--join-file", str(join), "--name", name, "--home", str(tmp_path / name),
                       "--heartbeat", "1", "--steps", str(STEPS)) for name, host in hosts.items()}
    ids = {name: wait_for_line(tmp_path / f"{name}.log", rf"peer ({name}-[0-9a-f]{{12}}) in swarm", proc, deadline).group(1)
           for name, proc in peers.items()}
    # their records say it, with how (read while they run: the API lists live peers)
    for name, other in (("p0", "p1"), ("p1", "p0")):
        while True:
            listed = coordinator_host.run([sys.executable, "-m", "hetpeer.cli", "status", "--api",
                                           f"{coordinator_host.address}:50051", "--json"], timeout=60)
            records = {p["device_id"]: p for p in json.loads(listed.stdout)["peers"]}
            mine = records.get(ids[name], {})
            if ids[other] in mine.get("unreachable", []):
                assert mine["unreachable_how"][mine["unreachable"].index(ids[other])] == "timeout", mine
                break
            assert time.monotonic() < deadline, f"{name} never reported {other}: {mine}"
            time.sleep(1.0)
    for name, proc in peers.items():
        wait_for_line(tmp_path / f"{name}.log", rf"step {STEPS}/", proc, deadline)
    published = plans((tmp_path / "coordinator.log").read_text())
    assert published and all(len(plan) == 2 for plan in published), published
    paired = [i for i, plan in enumerate(published) if together(plan, ids["p0"], ids["p1"])]
    assert paired in ([], [0]), f"plans {paired} of {published} put the pair together"
