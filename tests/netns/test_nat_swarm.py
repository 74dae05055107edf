"""Peers behind home routers join with no address flags and train: a coordinator and a public peer on the
"internet", two peers behind cone NATs and one behind a symmetric NAT (real namespaces, real MASQUERADE).

Each peer learns from the coordinator's reach service whether others can dial it and says so; the peers
behind NAT run their DHT nodes in client mode, register at the public peer's relay, dial the peers they
work with, and frames to them travel back over those connections. Two stages of two lanes over four
peers need two pairs of NATed peers to exchange frames: they do, through the relay. One of them sits on a
link that drops 2% of its packets, as over Wi-Fi, and another's clock runs 90 s behind the swarm's: it
says so and trains, its records and plans read and written on the coordinator's clock."""

from __future__ import annotations

import re
import time
from pathlib import Path

from lab import Lab
from runs import Start, start_coordinator, wait_for_line

STEPS = 6
DEADLINE_S = 300.0


def test_peers_behind_cone_and_symmetric_nat_train_through_direct_links_and_a_relay(lab: Lab, run: Start, tmp_path: Path):
    deadline = time.monotonic() + DEADLINE_S
    coordinator_host = lab.public("coord")
    hosts = {"pub": lab.public("pub"), "cone": lab.behind_nat("cone", "cone"), "sym": lab.behind_nat("sym", "symmetric"),
             "cone2": lab.behind_nat("cone2", "cone")}
    nated = ("cone", "sym", "cone2")
    lab.lossy(hosts["cone"], 0.02)  # a Wi-Fi link that drops 2% of packets
    coordinator, join = start_coordinator(run, coordinator_host, tmp_path, "nat", deadline,
                                          "--min-peers", "4", "--stages", "2", "--group-size", "2", "--heartbeat", "1", "--steps", str(STEPS))
    skewed = {"cone2": ("--emulate-clock-skew", "-90")}  # a machine whose clock runs 90 s behind
    peers = {name: run(host, name, "join", "--join-file", str(join), "--name", name, "--home", str(tmp_path / name),
                       "--heartbeat", "1", "--steps", str(STEPS), *skewed.get(name, ()))
             for name, host in hosts.items()}  # no address flag: what a volunteer at home types

    said = {name: wait_for_line(tmp_path / f"{name}.log", r"^.*reachable: .*$", proc, deadline).group(0)
            for name, proc in peers.items()}
    assert f"others can dial this peer at {hosts['pub'].address}; nothing to do" in said["pub"]
    for name in nated:
        assert f"reachable: no, others cannot dial this peer at {hosts[name].public_address}" in said[name], said[name]
        assert "forward TCP port(s) 7000 (tensors), 7001 (DHT)" in said[name]
        wait_for_line(tmp_path / f"{name}.log", r"DHT: client mode", peers[name], deadline)
    said = wait_for_line(tmp_path / "cone2.log", r"Z clock: .*", peers["cone2"], deadline).group(0)
    assert "this machine's clock is 90 s behind the coordinator's" in said, said

    pub = wait_for_line(tmp_path / "pub.log", r"peer (pub-[0-9a-f]{12}) in swarm", peers["pub"], deadline).group(1)
    for name in nated:
        wait_for_line(tmp_path / f"{name}.log", rf"is registered at relay {pub}", peers[name], deadline)
    for name, proc in peers.items():  # every peer trains to the swarm's last step
        wait_for_line(tmp_path / f"{name}.log", rf"step {STEPS}/", proc, deadline)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in peers}
    for name, log in logs.items():
        assert "rejected a frame" not in log and "refused connection" not in log, log[-3000:]
        assert (name in skewed) == ("Z clock: " in log)
    assert "over the connection it opened" in logs["pub"], "frames to the NATed peers go back over their connections"
    assert re.search(r"relay: carried \d+\.\d MiB so far", logs["pub"]), logs["pub"][-3000:]
    assert any(re.search(r"reaches \S+ over relay", logs[name]) for name in nated), "NATed pairs talk through the relay"

