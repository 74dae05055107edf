"""A path through a home router that dies without a word is found by both ends, and redialled when it returns.

A peer behind a cone NAT keeps a sealed connection to a public peer and trades a frame with it twice a second
(`link_peer.py`). Its router then drops everything, as a home link that goes down does: no reset, no error.
Both ends must notice that their connection is dead while the link is still down (keepalives on the idle end,
the bound on unacknowledged bytes on the sending one), and once the router forwards again the NATed peer's
next dial carries the frames. Without them the sender's connection would sit in retransmission for minutes
and the idle end's forever, so the "disconnected" events this test waits for would not come at all. The
seconds each took are printed (run with -s); the benchmark (`benchmarks/nat.py`, "link down") measures them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from lab import Lab

from hetpeer.protocol.identity import load_or_create_link_key

PEER = Path(__file__).with_name("link_peer.py")
PORT = 7000
DEADLINE_S = 120.0  # for each event: generous, they come in seconds


class Output:
    """A process's time-stamped lines (`link_peer.say`), read as they come."""

    def __init__(self, path: Path, process: subprocess.Popen) -> None:
        self.path, self.process = path, process

    def first(self, pattern: str, after: float = 0.0) -> float:
        """The time of the first line matching `pattern` stamped after `after`; fails when none comes in time."""
        regex = re.compile(rf"^(\d+\.\d+) {pattern}$", re.MULTILINE)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            text = self.path.read_text(errors="replace")
            for match in regex.finditer(text):
                if float(match.group(1)) > after:
                    return float(match.group(1))
            assert self.process.poll() is None, f"{self.path.name} ended (exit {self.process.returncode}):\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {after} in {self.path.name}:\n{text[-3000:]}"
            time.sleep(0.2)


def test_a_dead_path_through_a_nat_is_noticed_by_both_ends_and_redialled(lab: Lab, tmp_path: Path):
    hosts = {"pub": lab.public("pub"), "home": lab.behind_nat("home", "cone")}
    keys = {role: load_or_create_link_key(tmp_path / f"{role}.link.key").digest for role in hosts}
    book = tmp_path / "addresses.json"
    book.write_text(json.dumps({"version": 1, "peers": {
        role: {"direct": f"{host.address}:{PORT}", "key": keys[role]} for role, host in hosts.items()}}))
    processes, out = {}, {}
    try:
        for role, host in hosts.items():
            log = tmp_path / f"{role}.log"
            with open(log, "wb") as sink:
                processes[role] = host.popen([sys.executable, str(PEER), role, str(book), str(tmp_path)],
                                             stdout=sink, stderr=subprocess.STDOUT)
            out[role] = Output(log, processes[role])
        out["home"].first(r"answered \d+")

        down = time.time()
        lab.lossy(hosts["home"], 1.0)  # the router drops everything, both ways
        noticed = {role: out[role].first("disconnected", after=down) for role in hosts}
        up = time.time()
        lab.lossy(hosts["home"], 0.0)
        back = out["home"].first(r"answered \d+", after=up)
        assert out["pub"].first("connected", after=up) <= back + 1.0, "pub saw the NATed peer's new connection"
        print(f"link down: noticed by home in {noticed['home'] - down:.1f} s, by pub in {noticed['pub'] - down:.1f} s; "
              f"frames answered again {back - up:.1f} s after it returned")
    finally:
        for process in processes.values():
            process.kill()
            process.wait(timeout=30)
