"""The reach check: a peer asks the coordinator to dial it back, and learns what the swarm sees of it.

A peer behind a home router can dial out but nobody can dial in, and it does not know its public address.
It opens a TCP connection to the coordinator's reach service and sends one line of JSON:

    {"version": 2, "ports": [7000, 31338], "time": <the peer's clock>}

The service dials each port back *at the address the request came from* (never anywhere else: the
service cannot be pointed at a third party) and answers one line:

    {"version": 2, "observed": "203.0.113.7", "port": 40123, "open": [true, false], "time": <the coordinator's clock>,
     "held_s": 3.01}

From it the peer learns the address others see (`observed`), which of its ports others can dial
(`open`), how far its clock is from the coordinator's (`time`, when it answered, and `held_s`, how long it held
the request: waiting its turn and dialling, which can take seconds and is no part of the round trip), and the source
port the request arrived from (`port`): the peer sends it from a port of its choosing, so a `port` equal to that
one means its NAT (if any) keeps ports, and two such peers can punch a connection through their NATs
(`peer/transport/punch.py`). Version 2 added `port` and `held_s`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Any

from hetpeer.protocol.wire import SchemaError, field, need_int, need_list, need_mapping, need_number, need_str, no_extra_fields

REACH_VERSION = 2
MAX_PORTS = 4
MAX_LINE_BYTES = 1024
# the longest the service holds a request behind others from the same address (peers behind one router are
# answered in turn); an asker waits this long and a little more for its answer
TURN_WAIT_S = 60.0
MAX_HELD_S = 600.0  # a reply that says it held the request longer is nonsense
REACHABLE = ("direct", "none", "unknown")  # what a peer's record says of it: others can dial it, cannot, not checked,
VIA = "via:"  # or "via:<device>": others reach it through that peer's relay
# how a peer failed to reach another (`PeerRecord.unreachable_how`), in the words the organizer reads
FAILURES = {
    "refused": "refused (a reset)",  # a dial answered with a reset: a closed port, a router that answers for itself
    "timeout": "no answer",  # a dial nobody answered: a firewall, a router that drops, a host gone
    "punch": "no hole punched",  # both punch, and no attempt joined within the window
    "handshake": "link handshake failed",  # a connection, but not to the peer it should be, or cut during it
    "lost": "connection lost",  # frames stopped leaving on a connection that carried them
    "no-path": "no path",  # nobody can dial it, and it has no connection to this peer nor a relay
}


@dataclass(frozen=True, slots=True)
class ReachRequest:
    ports: tuple[int, ...]
    time: float

    def encode(self) -> bytes:
        return json.dumps({"version": REACH_VERSION, "ports": list(self.ports), "time": self.time}).encode() + b"\n"

    @staticmethod
    def decode(line: bytes) -> "ReachRequest":
        root = _line(line, "reach_request")
        no_extra_fields(root, {"version", "ports", "time"}, "reach_request")
        _version(root, "reach_request")
        ports = tuple(need_int(p, f"reach_request.ports[{i}]", minimum=1) for i, p in
                      enumerate(need_list(field(root, "ports", "reach_request"), "reach_request.ports")))
        if not 0 < len(ports) <= MAX_PORTS or max(ports) > 65535:
            raise SchemaError("reach_request.ports", f"1 to {MAX_PORTS} ports in 1..65535, got {list(ports)[:8]}")
        return ReachRequest(ports, need_number(field(root, "time", "reach_request"), "reach_request.time"))


@dataclass(frozen=True, slots=True)
class ReachReply:
    observed: str  # the address the request came from, as the coordinator saw it
    port: int  # the source port it came from
    open: tuple[bool, ...]  # per port asked, whether a connection to observed:port opened
    time: float  # the coordinator's clock when it answered
    held_s: float = 0.0  # how long it held the request before it answered

    def encode(self) -> bytes:
        return json.dumps({"version": REACH_VERSION, "observed": self.observed, "port": self.port,
                           "open": list(self.open), "time": self.time, "held_s": self.held_s}).encode() + b"\n"

    @staticmethod
    def decode(line: bytes, ports: int) -> "ReachReply":
        root = _line(line, "reach_reply")
        no_extra_fields(root, {"version", "observed", "port", "open", "time", "held_s"}, "reach_reply")
        _version(root, "reach_reply")
        observed = need_str(field(root, "observed", "reach_reply"), "reach_reply.observed")
        try:
            ipaddress.ip_address(observed)
        except ValueError:
            raise SchemaError("reach_reply.observed", f"must be an IP address, got {observed[:64]!r}") from None
        port = need_int(field(root, "port", "reach_reply"), "reach_reply.port", minimum=1)
        if port > 65535:
            raise SchemaError("reach_reply.port", f"must be a port in 1..65535, got {port}")
        opened = need_list(field(root, "open", "reach_reply"), "reach_reply.open")
        if len(opened) != ports or not all(isinstance(o, bool) for o in opened):
            raise SchemaError("reach_reply.open", f"must be {ports} booleans, one per port asked, got {opened[:8]!r}")
        answered = need_number(field(root, "time", "reach_reply"), "reach_reply.time")
        held_s = need_number(field(root, "held_s", "reach_reply"), "reach_reply.held_s")
        if not 0 <= held_s <= MAX_HELD_S:
            raise SchemaError("reach_reply.held_s", f"must be 0 to {MAX_HELD_S:g} s, got {held_s!r}")
        return ReachReply(observed, port, tuple(opened), answered, held_s)


def _line(line: bytes, path: str) -> dict[str, Any]:
    if len(line) > MAX_LINE_BYTES:
        raise SchemaError(path, f"longer than {MAX_LINE_BYTES} bytes")
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise SchemaError(path, f"is not JSON: {str(error)[:80]}") from None
    return dict(need_mapping(raw, path))


def _version(root: dict[str, Any], path: str) -> None:
    version = need_int(field(root, "version", path), f"{path}.version")
    if version != REACH_VERSION:
        raise SchemaError(f"{path}.version", f"must be {REACH_VERSION}, got {version}")


def relay_score(device_id: str, relay: str, weight: float) -> float:
    """A peer's score for a relay in weighted rendezvous hashing: -weight / ln(u), u uniform in (0, 1) from a hash
    of the pair. Each peer behind NAT registers at the relay it scores highest, so peers spread over relays in
    proportion to their weights with no word between them, and the same peer picks the same relay while the set
    of relays stays (`peer/daemon/reaching.pick_relay`; the planner's synthetic swarms pick alike)."""
    digest = hashlib.blake2b(f"{device_id}|{relay}".encode(), digest_size=8).digest()
    return -weight / math.log((int.from_bytes(digest, "big") + 0.5) / 2**64)

