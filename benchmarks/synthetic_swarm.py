"""A control plane whose DHT entries are made by a script: benchmarks of a coordinator that reads thousands of
peers without running thousands of processes.

`SyntheticControlPlane.read_peers` parses the entries with the DHT's own path (`ControlPlane.read_peers` ->
`PeerRecord.from_wire`, signature markers and all); only the DHT's network is left out. Subclasses say what
peer i announces (`record(i)`, a wire dict) and hold the running plan.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from pathlib import Path

from hetpeer.protocol.control import ControlPlane, SignedPlan
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.identity import device_id

COORDINATOR_KEY = b"ssh-rsa AAAAbenchmark-coordinator"


def spread(text: str) -> int:
    """A number from a name, the same in every run (str's hash() is salted per process)."""
    return zlib.crc32(text.encode())


def fake_key(i: int) -> bytes:
    """Bytes in the place of peer i's public key: records are bound to them as to a real key."""
    return b"ssh-rsa AAAA" + hashlib.sha256(f"peer {i}".encode()).hexdigest().encode()


class SyntheticControlPlane(ControlPlane):
    """`peers` peers named peer0..., each with its own key; the coordinator's plan is kept in memory."""

    def __init__(self, swarm: str, peers: int) -> None:
        super().__init__(swarm, Path("unused.key"))
        self.count = peers
        self.keys = [fake_key(i) for i in range(peers)]
        self.ids = [device_id(f"peer{i}", key) for i, key in enumerate(self.keys)]
        self.plan: Plan | None = None
        self.plan_time = time.time()
        self.clock = time.time()

    def record(self, i: int) -> dict:
        """Peer i's announcement as it travels: a wire dict."""
        raise NotImplementedError

    @property
    def public_key(self) -> bytes:
        return COORDINATOR_KEY

    def start(self) -> "SyntheticControlPlane":
        return self

    def shutdown(self) -> None:
        pass

    def now(self) -> float:
        return self.clock

    def visible_maddrs(self) -> list[str]:
        return ["/ip4/127.0.0.1/tcp/1/p2p/QmBenchmark"]

    def remember(self, maddrs) -> None:
        list(maddrs)

    def heal(self) -> None:
        return None

    def read_plans(self):
        return ([SignedPlan(self.plan, self.plan_time, COORDINATOR_KEY)] if self.plan is not None else []), []

    def publish_plan(self, plan, ttl_s: float) -> bool:
        self.plan, self.plan_time = plan, self.clock
        return True

    def _entries(self, key: str):
        return [(b"[owner:" + self.keys[i] + b"]", self.record(i)) for i in range(self.count)]
