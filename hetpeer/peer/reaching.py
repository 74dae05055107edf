"""How a swarm peer finds out whether others can dial it, and keeps the paths it has (a mixin of `SwarmPeer`).

Before its DHT node and transport start, the peer asks the coordinator's reach service to dial its two ports
back (`reach.py`), each on a bare listener: from the answer it takes the address others see (announced when it
listens on every interface and no address was given), whether its DHT node can take keys (client mode when its
port cannot be dialled) and the clock offset to the swarm. It says in one line which and what would help.

While it runs, each heartbeat: peers that announce they cannot be dialled are `passive` to its transport, and a
peer that cannot be dialled itself keeps connections open to the peers its plans make it work with, so they
can answer it. Two peers that cannot be dialled have no path: neither probes the other.
"""

from __future__ import annotations

import ipaddress
import logging

from hetpeer.peer.reach import ReachError, advice, ask, clock_words, listening
from hetpeer.protocol.addresses import MADDR_TCP_RE

log = logging.getLogger("hetpeer.peer")
WILDCARDS = ("0.0.0.0", "::")


class Reaching:
    """The part of `SwarmPeer` that checks its reachability (`_check_reach`, once, as it starts; sets
    `reachable`) and keeps its paths to other peers (`_keep_paths`, on the control thread)."""

    reachable = "unknown"

    def _check_reach(self) -> tuple[tuple[str, int], str | None]:
        """Where the transport listens and the host it announces; sets the DHT node's ports, client mode and clock.
        ReachError when a port cannot be listened on, or the address others see is needed and cannot be learnt."""
        config, control = self.config, self.control
        host, port = config.listen
        announce_host = config.announce_host
        guess = host in WILDCARDS and announce_host is None  # the address others see must be learnt
        dht = MADDR_TCP_RE.fullmatch(control.host_maddrs[0]) if control.host_maddrs else None
        if config.reach is None or dht is None:
            if guess:
                raise ReachError(f"listening on {host} with no reach service to learn the address others see: give "
                                 "--announce-host (or join with the coordinator's join file, which names the service)")
            return (host, port), announce_host
        dht_host = dht.group(2)
        with listening(host, port) as tensors, listening(dht_host, int(dht.group(3))) as node:
            port, dht_port = tensors.getsockname()[1], node.getsockname()[1]
            try:
                reach = ask(config.reach, (port, dht_port))
            except ReachError as error:
                if guess:
                    raise ReachError(f"{error}; without it this peer cannot tell the address others see: give "
                                     "--announce-host") from None
                self.report(f"reachable: unknown ({error}); others will dial the address announced")
                reach = None
        control.host_maddrs[0] = f"/{dht.group(1)}/{dht_host}/tcp/{dht_port}"  # the port the check found open (or not)
        if reach is None:
            return (host, port), announce_host
        tensors_open, dht_open = reach.open
        self.reachable = "direct" if tensors_open else "none"
        self.report(advice(reach, (port, dht_port), ("tensors", "DHT")))
        if guess:
            announce_host = reach.observed
        if not dht_open:
            control.client_mode = True
            self.report("DHT: client mode (this node stores no keys: others could not read them)")
        elif not control.announce_maddrs and dht_host in WILDCARDS:
            version = 6 if ipaddress.ip_address(reach.observed).version == 6 else 4
            control.announce_maddrs = [f"/ip{version}/{reach.observed}/tcp/{dht_port}"]
        control.clock_offset_s = reach.clock_offset_s
        said = clock_words(reach.clock_offset_s)
        if said is not None:
            self.report(said)
        return (host, port), announce_host

    def _keep_paths(self) -> None:
        """Tell the transport who cannot be dialled, and, when this peer cannot be, whom to stay connected to."""
        with self.lock:
            records = dict(self.records)
            wanted = self._plan_neighbours() if self.reachable == "none" else set()
        transport = self.transport
        transport.passive = frozenset(d for d, r in records.items() if r.reachable == "none" and d != self.device_id)
        transport.keep_connected(wanted - transport.passive)

    def _has_path(self, peer: str) -> bool:
        """Whether this peer can reach `peer` now: by dialling it, or over a connection `peer` opened."""
        record = self.records.get(peer)
        if record is None or record.reachable != "none":
            return True
        return self.transport.connected(peer)

    def _plan_neighbours(self) -> set[str]:
        """Whom this peer works with under its running and pending plans: lane neighbours, group members, and
        under a pending plan the peers holding its new layers now (the donors of its state). Under the lock."""
        near: set[str] = set()
        for plan in (self.running, self.pending):
            if plan is None or self.device_id not in plan.devices:
                continue
            near.update(plan.neighbours(self.device_id))
            if plan is self.pending and self.running is not None:
                stage = plan.stages[plan.position(self.device_id)[0]]
                for held in self.running.stages:
                    if held.layer_start < stage.layer_end and stage.layer_start < held.layer_end:
                        near.update(held.devices)
        near.discard(self.device_id)
        return near
