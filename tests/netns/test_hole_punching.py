"""Volunteers who are all at home train with no public peer at all: every peer behind a cone NAT punches a
direct connection to each peer it works with, through both routers (`peer/transport/punch.py`).

Four peers, two behind each of two cone routers (Linux MASQUERADE, which keeps ports while they are free) that
answer what arrives unasked with a reset of their own (a Linux router with no firewall rule on its public side,
OpenWrt's default REJECT), so two peers share each public address; and one behind a symmetric router
(`--random-fully`) that drops. All join with the README's line alone; the coordinator, on the public side, is the
only host anyone can dial, and it relays nothing. Each cone peer learns from the reach check that its NAT kept the
port it asked from, and the symmetric one that its NAT changed it. The coordinator plans two stages of two lanes
over the four cone peers, each pair across the two routers (two peers behind one address cannot punch to each
other: that needs a router that hairpins), and leaves the symmetric peer on standby: nobody can dial it, it cannot
punch, and there is no relay, so it has no path to anyone. The four train to the swarm's last step over punched
connections (each a sealed link like any other), with no byte relayed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from lab import Lab
from runs import Start, start_coordinator, wait_for_line

STEPS = 6
DEADLINE_S = 300.0


def test_peers_two_behind_each_of_two_resetting_cone_nats_train_over_punched_connections_and_a_symmetric_one_waits(lab: Lab, run: Start,
                                                                                             tmp_path: Path):
    deadline = time.monotonic() + DEADLINE_S
    coordinator_host = lab.public("coord")
    first, second = lab.behind_nat("cone0", "cone", "reset"), lab.behind_nat("cone1", "cone", "reset")
    cones = {"cone0": first, "cone1": second, "cone2": lab.beside(first, "cone2"), "cone3": lab.beside(second, "cone3")}
    hosts = {**cones, "sym": lab.behind_nat("sym", "symmetric")}
    coordinator, join = start_coordinator(run, coordinator_host, tmp_path, "home", deadline,
                                          "--min-peers", "5", "--stages", "2", "--group-size", "2", "--heartbeat", "1", "--steps", str(STEPS))
    peers = {name: run(host, name, "join", "--join-file", str(join), "--name", name, "--home", str(tmp_path / name),
                       "--heartbeat", "1", "--steps", str(STEPS)) for name, host in hosts.items()}

    for name, proc in peers.items():
        said = wait_for_line(tmp_path / f"{name}.log", r"^.*reachable: (its NAT|no,).*$", proc, deadline).group(0)
        assert f"others cannot dial this peer at {hosts[name].public_address}" in said or "its NAT" in said, said
    for name in cones:
        said = wait_for_line(tmp_path / f"{name}.log", r"^.*reachable: its NAT .*$", peers[name], deadline).group(0)
        assert "kept port" in said and "punching a hole" in said, said
    said = wait_for_line(tmp_path / "sym.log", r"^.*reachable: its NAT .*$", peers["sym"], deadline).group(0)
    assert "changed the port" in said and "cannot punch holes" in said, said

    for name in cones:  # every cone peer trains to the swarm's last step
        wait_for_line(tmp_path / f"{name}.log", rf"step {STEPS}/", peers[name], deadline)
    wait_for_line(tmp_path / "sym.log", r"plan epoch \d+: on standby", peers["sym"], deadline)
    sym = wait_for_line(tmp_path / "sym.log", r"peer (sym-[0-9a-f]{12}) in swarm", peers["sym"], deadline).group(1)
    # the search itself leaves it out: every pair with it is `ABSENT_LINK` (or, held to it, the check before publishing)
    wait_for_line(tmp_path / "coordinator.log", rf"  standby: .*\b{sym}\b", coordinator, deadline)

    logs = {name: (tmp_path / f"{name}.log").read_text() for name in peers}
    for name in cones:
        log = logs[name]
        assert "rejected a frame" not in log and "refused connection" not in log, log[-3000:]
        assert "over a connection punched through both NATs" in log, log[-3000:]
        assert "over relay" not in log and "registered at relay" not in log, log[-3000:]
        punched = set(re.findall(r"reaches (cone\d-[0-9a-f]{12}) over a connection punched", log))
        assert len(punched) >= 2, f"{name} punched to {sorted(punched)}: its lane neighbour and group member at least"
        neighbour = {"cone0": "cone2", "cone1": "cone3", "cone2": "cone0", "cone3": "cone1"}[name]
        assert not any(p.startswith(neighbour + "-") for p in punched), f"{name} punched to {neighbour}, behind its own router"
