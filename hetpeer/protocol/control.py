"""The door to a swarm's DHT, shared by peers and the coordinator: keys, signed writes, checked reads.

Every participant holds an RSA key pair in a file (created on first use, reused on restart, so a
restarted peer keeps its identity). Writes go under the writer's owner marker and are signed by
hivemind's RSASignatureValidator with that key (not the process-wide default key). Reads return only
records that parse (`records.py`); what is dropped comes back with the reason, for the caller to log.

Staying in the swarm. A DHT node forgets every node that fails to answer it, and they forget it: after a
partition (a cable pulled, a laptop asleep) a node can be left knowing no one, and no one knowing it,
for good. So each participant remembers the DHT addresses that others announce (`remember`, kept in a
file beside its key, so a restarted coordinator finds the running swarm without being told), and
`heal`, called once a round, restarts the DHT node through them and the initial peers once it has known
no other node for `ISOLATED_ROUNDS` rounds.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from hetpeer.protocol.plan import Plan
from hetpeer.protocol.identity import KeyFileError, fingerprint, key_digest, load_or_create_link_key
from hetpeer.protocol.records import (
    SCHEMA,
    PeerRecord,
    check_age,
    owner_key,
    peers_key,
    plan_from_wire,
    plan_key,
    plan_to_wire,
)
from hetpeer.protocol.wire import SchemaError

log = logging.getLogger("hetpeer.control")
REMEMBER = 16  # DHT addresses of other participants kept for the next start, the most recently seen first
ISOLATED_ROUNDS = 3  # rounds a DHT node may know no other node before it is restarted through the ones it remembers
# Every participant reads the swarm's two keys once a round anyway, so hivemind's own refreshing of cached
# values before they expire, and its copying of each value found to one more node, only add work: every
# node that receives a value checks each record in it (schema and signature), and in a swarm of n peers
# a round already costs O(n^2) such checks.
DHT_OPTIONS = {"cache_refresh_before_expiry": 0, "cache_nearest": 0}
# A value lives on the key's 5 nearest nodes (hivemind's replication); a search that keeps 5 candidates
# finds them all without asking (and checking the answer of) every node of a small swarm.
BEAM = 5
# The DHT node (and its p2pd) runs at this niceness: it yields the CPU to training where they share one. Its work
# comes in bursts, a round's stores and their checks on every node at once (the demo's eight peers on two cores:
# up to half a core for a few hundred ms each heartbeat), and a pass that waits for a core behind them holds up
# its whole pipeline: at nice 0, 15 to 18% of the demo's steps took 1.3x their median or more, in step with the
# heartbeat; at nice 10, 5 to 6%. None of it needs the CPU within milliseconds; CFS still gives it a share.
DHT_NICE = 10


class ControlError(RuntimeError):
    """The DHT could not be reached or started."""


def yield_cpu(pid: int | None, nice: int) -> None:
    """Lower every thread of process `pid` and of its descendants to niceness `nice` (Linux sets it per thread;
    one already nicer is left alone). Where it cannot (no /proc, a process gone meanwhile), it leaves things
    as they are: a priority is a courtesy, not a condition of running."""
    pending = [pid] if pid is not None else []
    while pending:
        process = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                if os.getpriority(os.PRIO_PROCESS, int(task)) < nice:
                    os.setpriority(os.PRIO_PROCESS, int(task), nice)
                with open(f"/proc/{process}/task/{task}/children") as children:
                    pending += [int(child) for child in children.read().split()]
            except OSError as error:
                log.debug("could not lower the priority of thread %s of process %s: %s", task, process, error)


def load_or_create_key(path: str | Path):
    """The RSA private key in `path` (DER), created there (mode 0600) if the file does not exist, as hivemind's
    RSAPrivateKey (what signs DHT records)."""
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        der = load_or_create_link_key(path).to_bytes()
    except KeyFileError as error:
        raise ControlError(str(error)) from None
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own (pickle) path to a key from bytes
    return key


def public_key_bytes(private_key) -> bytes:
    return private_key.get_public_key().to_bytes()


@dataclass(frozen=True, slots=True)
class Dropped:
    """A record that was read and refused: whose key wrote it (fingerprint) and why."""

    signer: str
    reason: str
    digest: str = ""  # of a plan record: the SHA-256 of the key that signed it (what peers are told to trust)


@dataclass(frozen=True, slots=True)
class SignedPlan:
    plan: Plan
    time: float
    signer: bytes


class ControlPlane:
    def __init__(
        self,
        swarm: str,
        key_path: str | Path,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: str | Path | None = None,
        remember_path: str | Path | None = None,
    ) -> None:
        if not swarm or not swarm.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"swarm name must be letters, digits, - and _, got {swarm!r}")
        self.swarm, self.key_path = swarm, Path(key_path)
        self.initial_peers, self.host_maddrs, self.announce_maddrs = list(initial_peers), list(host_maddrs), list(announce_maddrs)
        self.identity_path = Path(identity_path) if identity_path is not None else None  # the DHT node's libp2p key
        self.remember_path = Path(remember_path) if remember_path is not None else None
        self.remembered: list[tuple[str, ...]] = []  # other nodes' multiaddrs, one tuple per node, newest first
        self.maddrs: list[str] = []  # where this node can be dialed, once started
        # a node others cannot dial stores no keys (as Petals learned, a key on it is a key nobody can read)
        self.client_mode = False
        self.clock_offset_s = 0.0  # add to this machine's clock to read the swarm's (the coordinator's)
        self.skew_s = 0.0  # emulated: this machine's clock reads this far off (tests and demos)
        # of the other peers' records last read (every check passed but their age): how far each one's time is ahead
        # of this side's swarm time, refused for it or not; where no reach check gave the offset, they give one
        self.record_leads_s: list[float] = []
        self.dht = None
        self.private_key = None
        self._lock = None
        self._validators = None
        self._alone_rounds = 0

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> "ControlPlane":
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.dht.schema import SchemaValidator

        self._lock_home()
        try:
            self.private_key = load_or_create_key(self.key_path)
            if self.identity_path is not None and not self.identity_path.exists():  # a stable DHT address
                from hivemind.p2p import P2P

                self.identity_path.parent.mkdir(parents=True, exist_ok=True)
                P2P.generate_identity(str(self.identity_path))
            self._validators = [
                SchemaValidator(SCHEMA, allow_extra_keys=False, prefix=self.swarm),
                RSASignatureValidator(self.private_key),
            ]
            self.remembered = load_remembered(self.remember_path) if self.remember_path is not None else []
            self._start_dht(must_join=bool(self.initial_peers))
        except BaseException:
            self.shutdown()  # releases the lock
            raise
        return self

    def _start_dht(self, must_join: bool) -> None:
        """A DHT node joined through the initial peers and the remembered ones. When none of them answers:
        ControlError if `must_join`, else a node of its own (the first of a swarm, or one cut off for now)."""
        from hivemind import DHT

        identity = {}
        if self.identity_path is not None:
            # the home lock keeps two live processes off one identity; hivemind's own check would also refuse
            # a peer restarted after a crash, whose old identity other nodes still remember
            identity = {"identity_path": str(self.identity_path), "check_if_identity_free": False}
        through = self.initial_peers + [m for node in self.remembered for m in node if m not in self.initial_peers]
        for peers in ([through, []] if through and not must_join else [through]):
            try:
                self.dht = DHT(
                    initial_peers=peers or None, start=True, record_validators=self._validators, host_maddrs=self.host_maddrs,
                    announce_maddrs=self.announce_maddrs or None, ensure_bootstrap_success=False, client_mode=self.client_mode,
                    **identity, **DHT_OPTIONS,
                )
                break
            except Exception as error:  # hivemind raises plain exceptions when no initial peer answers
                if must_join:
                    raise ControlError(f"cannot join the DHT through {', '.join(self.initial_peers)}: {error}") from None
                log.warning("none of the %d known DHT address(es) answered (%s): starting a DHT node of its own",
                            len(peers), str(error).splitlines()[0][:200])
        yield_cpu(self.dht.pid, DHT_NICE)
        if self.skew_s + self.clock_offset_s:
            self.dht.run_coroutine(functools.partial(_set_clock, offset_s=self.skew_s + self.clock_offset_s))
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    # -- staying in the swarm -------------------------------------------------------------------------
    def remember(self, maddrs: Iterable[Sequence[str]]) -> None:
        """Keep the DHT addresses other participants announce (one sequence per node, most recent first)
        for `heal` and for the next start; written to `remember_path` when the set changes."""
        me = _peer_id(self.maddrs[0]) if self.maddrs else None
        fresh = [tuple(node) for node in maddrs if node and _peer_id(node[0]) != me]
        seen = {_peer_id(node[0]) for node in fresh}
        merged = (fresh + [node for node in self.remembered if _peer_id(node[0]) not in seen])[:REMEMBER]
        changed = set(merged) != set(self.remembered)
        self.remembered = merged
        if changed and self.remember_path is not None:
            save_remembered(self.remember_path, merged)

    def heal(self) -> str | None:
        """Once a round: when this node has known no other DHT node for `ISOLATED_ROUNDS` rounds and there
        is anyone to ask, restart it through the initial and remembered peers; what it did, in words."""
        if self._dht_neighbours() > 0:
            self._alone_rounds = 0
            return None
        self._alone_rounds += 1
        known = len(self.initial_peers) + len(self.remembered)
        if self._alone_rounds < ISOLATED_ROUNDS or not known:
            return None
        self._alone_rounds = 0
        self.dht.shutdown()
        self.dht = None
        self._start_dht(must_join=False)
        found = self._dht_neighbours()
        return (f"the DHT node knew no other node for {ISOLATED_ROUNDS} rounds: restarted it through {known} known "
                f"address(es); it now knows {found} node(s)")

    def _dht_neighbours(self) -> int:
        return self.dht.run_coroutine(_routing_table_size)

    def _lock_home(self) -> None:
        """One live process per key file: a second one would announce as the same peer. A POSIX record
        lock: it belongs to this process alone (the DHT's forked child does not inherit it) and goes with it."""
        import fcntl

        self.key_path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.key_path.with_name(self.key_path.name + ".lock"), "w")
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ControlError(f"another process is using the key {self.key_path} (one process per --home)") from None
        self._lock = lock

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- identity -----------------------------------------------------------------------------------
    @property
    def public_key(self) -> bytes:
        return public_key_bytes(self.private_key)

    @property
    def owner(self) -> bytes:
        return b"[owner:" + self.public_key + b"]"

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def visible_maddrs(self) -> list[str]:
        return list(self.maddrs)

    def dialable_maddrs(self) -> tuple[str, ...]:
        """What others should dial: loopback addresses only when there are no others (one machine); nothing
        for a node in client mode (nobody can dial it: its addresses are on its own side of a NAT)."""
        if self.client_mode:
            return ()
        outside = [m for m in self.maddrs if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
        return tuple(outside or self.maddrs)

    def now(self) -> float:
        """The swarm's time: this machine's clock corrected by `clock_offset_s`."""
        from hivemind.utils import get_dht_time

        return get_dht_time() + self.skew_s + self.clock_offset_s

    # -- writes -------------------------------------------------------------------------------------
    def announce(self, record: PeerRecord, ttl_s: float, timeout_s: float | None = None) -> bool:
        """Store this participant's record; with `timeout_s`, give up (False) after that long: a DHT process
        that died (Ctrl+C reaches it too) would otherwise hold a peer that is leaving forever."""
        stored = self.dht.store(peers_key(self.swarm), record.to_wire(), self.now() + ttl_s, subkey=self.owner,
                                beam_size=BEAM, return_future=True)
        try:
            return bool(stored.result(timeout_s))
        except concurrent.futures.TimeoutError:
            stored.cancel()
            return False

    def publish_plan(self, plan: Plan, ttl_s: float) -> bool:
        now = self.now()
        return bool(self.dht.store(plan_key(self.swarm), plan_to_wire(plan, now), now + ttl_s, subkey=self.owner, beam_size=BEAM))

    def store_raw(self, key: str, value: Any, ttl_s: float, subkey: Any) -> bool:
        """Write anything (tests and tools that check what the swarm refuses)."""
        return bool(self.dht.store(key, value, self.now() + ttl_s, subkey=subkey))

    # -- reads --------------------------------------------------------------------------------------
    def read_peers(self, max_age_s: float) -> tuple[dict[str, PeerRecord], list[Dropped]]:
        """Fresh, valid announcements by device id, and what was dropped with why. Sets `record_leads_s`."""
        now, own = self.now(), self.owner
        records: dict[str, PeerRecord] = {}
        dropped: list[Dropped] = []
        leads = []
        for subkey, raw in self._entries(peers_key(self.swarm)):
            try:
                record = PeerRecord.from_wire(raw, owner_key(subkey), now, math.inf)  # every check but its age
                if subkey != own:
                    leads.append(record.time - now)  # too old or too new for this side's clock or not
                check_age(record.time, now, max_age_s)
            except SchemaError as error:
                dropped.append(Dropped(_signer(subkey), str(error)))
                continue
            records[record.device_id] = record
        self.record_leads_s = leads
        return records, dropped

    def set_clock_offset(self, offset_s: float) -> None:
        """Read the swarm's time as this machine's clock + `offset_s` from now on, the DHT node's expiry times too."""
        self.clock_offset_s = offset_s
        if self.dht is not None:
            self.dht.run_coroutine(functools.partial(_set_clock, offset_s=self.skew_s + offset_s))

    def read_plans(self) -> tuple[list[SignedPlan], list[Dropped]]:
        """Every plan record that parses, newest epoch first, with the key that signed each."""
        plans, dropped = [], []
        for subkey, raw in self._entries(plan_key(self.swarm)):
            try:
                signer = owner_key(subkey)
            except SchemaError as error:
                dropped.append(Dropped(_signer(subkey), str(error)))
                continue
            try:
                plan, time = plan_from_wire(raw)
            except SchemaError as error:  # a newer coordinator's plan, say: its signer's peers say why they refuse it
                dropped.append(Dropped(_signer(subkey), str(error), key_digest(signer)))
                continue
            plans.append(SignedPlan(plan, time, signer))
        plans.sort(key=lambda p: (-p.plan.epoch, -p.time))
        return plans, dropped

    def _entries(self, key: str) -> list[tuple[Any, Any]]:
        found = self.dht.get(key, latest=True, beam_size=BEAM)
        if found is None or not isinstance(found.value, dict):
            return []
        return [(subkey, entry.value) for subkey, entry in found.value.items()]


async def _set_clock(dht, node, offset_s: float) -> None:
    """Run in the DHT's process: its node reads the swarm's time, so what it stores and returns expires by the
    swarm's clocks, not by this machine's (hivemind reads `get_dht_time` from each module that imported it)."""
    import sys
    import time

    def swarm_time() -> float:
        return time.time() + offset_s

    for name, module in list(sys.modules.items()):
        if name.startswith("hivemind") and hasattr(module, "get_dht_time"):
            module.get_dht_time = swarm_time


async def _routing_table_size(dht, node) -> int:
    """Run in the DHT's process (`DHT.run_coroutine`): how many other nodes it knows."""
    return len(node.protocol.routing_table.uid_to_peer_id)


def _peer_id(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[-1]


def load_remembered(path: Path) -> list[tuple[str, ...]]:
    """The addresses a previous run remembered; an unreadable file is logged and forgotten, never fatal."""
    if not path.exists():
        return []
    try:
        raw = json.loads(path.read_text())
        nodes = [tuple(node) for node in raw["nodes"]]
        if raw.get("version") != 1 or not all(node and all(isinstance(m, str) and "/p2p/" in m for m in node) for node in nodes):
            raise ValueError("not a list of multiaddr lists")
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("ignored %s (remembered DHT addresses): %s", path, error)
        return []
    return nodes[:REMEMBER]


def save_remembered(path: Path, nodes: Sequence[tuple[str, ...]]) -> None:
    """Written whole and renamed into place: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"version": 1, "nodes": [list(node) for node in nodes]}, indent=1))
    os.replace(partial, path)


def _signer(subkey: Any) -> str:
    try:
        return fingerprint(owner_key(subkey))
    except SchemaError:
        return "unsigned"
