"""Eight volunteers behind one home router (one public address, as a household, a campus or a carrier's NAT
puts them) join with the README's line alone: the coordinator's reach service answers every one of them,
each says it cannot be dialled at the router's address, and the coordinator plans every one (into a stage or
onto standby), beside a public peer that relays for them."""

from __future__ import annotations

import re
import time
from pathlib import Path

from lab import Lab
from runs import Start, start_coordinator, wait_for_line

HOME = 8
DEADLINE_S = 420.0  # ten peers starting on two cores; generous, this only stops a hang
# at 1 s, ten processes on two cores miss heartbeats: records lapse and come back, and each return holds the
# first plan back (211 to over 420 s here, against about 100 s at 2)
HEARTBEAT_S = "2"


def test_eight_peers_behind_one_address_are_all_answered_and_planned(lab: Lab, run: Start, tmp_path: Path):
    deadline = time.monotonic() + DEADLINE_S
    coordinator_host, public = lab.public("coord"), lab.public("pub")
    first = lab.behind_nat("home0", "cone")
    homes = {"home0": first, **{f"home{i}": lab.beside(first, f"home{i}") for i in range(1, HOME)}}
    coordinator, join = start_coordinator(run, coordinator_host, tmp_path, "home", deadline,
                                          "--min-peers", str(HOME + 1), "--heartbeat", HEARTBEAT_S)
    peers = {name: run(host, name, "join", "--join-file", str(join), "--name", name, "--home", str(tmp_path / name),
                       "--heartbeat", HEARTBEAT_S) for name, host in {"pub": public, **homes}.items()}
    for name in homes:
        said = wait_for_line(tmp_path / f"{name}.log", r"^.*reachable: .*$", peers[name], deadline).group(0)
        assert f"reachable: no, others cannot dial this peer at {first.public_address}" in said, said
    for name, proc in peers.items():  # every one planned: a stage of the plan, or standby
        wait_for_line(tmp_path / f"{name}.log", r"plan epoch \d+(: on standby| from step \d+: stage)", proc, deadline)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in homes}
    retried = [name for name, log in logs.items() if "reachable: asking again" in log]
    for name, log in logs.items():
        assert "reachable: unknown" not in log, log[-3000:]
    training = [name for name, log in logs.items() if re.search(r"plan epoch \d+ from step \d+: stage", log)]
    print(f"{HOME} peers behind {first.public_address}: all answered ({len(retried)} after a retry), all planned, "
          f"{len(training)} into a stage")
