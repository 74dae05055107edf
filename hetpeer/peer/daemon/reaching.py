"""How a swarm peer finds out whether others can dial it, and keeps the paths it has (a mixin of `SwarmPeer`).

Before its DHT node and transport start, the peer asks the coordinator's reach service to dial its two ports
back (`reach.py`), each on a bare listener: from the answer it takes the address others see (announced when it
listens on every interface and no address was given), whether its DHT node can take keys (client mode when its
port cannot be dialled) and the clock offset to the swarm. It says in one line which and what would help. It asks
from a third port, the one it would punch holes from: a peer nobody can dial whose NAT kept that port punches
(`transport/punch.py`), and says so.
A peer that got no answer (or has no reach service) takes the offset from the other peers' signed records
instead (`_correct_clock`, each heartbeat).

While it runs, each heartbeat, a peer that cannot be dialled keeps connections open to the peers its plans make
it work with, so they can answer it (the address book marks who cannot be dialled, from their records). Two
peers that cannot be dialled, neither through a relay, have no path: neither probes the other, unless both punch.
A peer that punches calls (`calling` in its record) its plan neighbours that punch too, and up to `MAX_CALLING`
with some others to measure; it keeps a punched connection to each peer it calls and to each that calls it, so
both ends of a pair dial at once. A peer another reports it could not reach (`unreachable`) keeps a connection
to that one too: either the pair connects, or both report it (with how: `protocol.reach.FAILURES`), and the
coordinator plans the pair apart (`coordinator/policy.py`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import statistics
import time

from hetpeer.peer.reach import ReachError, advice, ask_patiently, clock_words, free_port, listening
from hetpeer.protocol.addresses import MADDR_TCP_RE
from hetpeer.protocol.reach import VIA, relay_score
from hetpeer.protocol.records import MAX_CALLING, PeerRecord

log = logging.getLogger("hetpeer.peer")
WILDCARDS = ("0.0.0.0", "::")
RELAY_SAY_S = 30.0
RELAY_LINGER_HEARTBEATS = 5
RELAY_SWITCH = 0.5  # a peer keeps its relay while that one scores at least this share of the best (`pick_relay`)
# a peer without the reach check's offset corrects its clock when the other peers' records read this far off the
# swarm's time it keeps (a record is up to a heartbeat old when read, and one refused waits another heartbeat)
CLOCK_OFF_HEARTBEATS = 2


def pick_relay(device_id: str, current: str | None, public: dict[str, float | None]) -> str | None:
    """The relay for `device_id` among the `public` peers (each with the bandwidth this peer measured to it, None
    where not yet measured; those count as the median of the others): weighted rendezvous hashing, so that the
    peers behind NAT spread over the relays in proportion to their links, each picking alone and the same one
    heartbeat after heartbeat (a relay that leaves moves only its own peers; one that joins takes its share). The
    `current` one is kept while its score is within `RELAY_SWITCH` of the best (measurements move). None while
    there is no public peer."""
    if not public:
        return None
    known = [b for b in public.values() if b is not None and b > 0]
    typical = statistics.median(known) if known else 1.0

    def score(relay: str) -> float:
        return relay_score(device_id, relay, public[relay] if public[relay] is not None and public[relay] > 0 else typical)

    best = max(sorted(public), key=score)
    if current in public and score(current) >= RELAY_SWITCH * score(best):
        return current
    return best


class Reaching:
    """The part of `SwarmPeer` that checks its reachability (`_check_reach`, once, as it starts; sets
    `reachable`) and keeps its paths to other peers (`_keep_paths`, on the control thread)."""

    reachable = "unknown"  # what the reach check found: "direct", "none" or "unknown"
    punch_port = 0  # behind a NAT that keeps ports: the port this peer punches holes from (0: it does not punch)
    calling: tuple[str, ...] = ()  # the peers it calls now, to punch a hole to each
    clock_from_reach = False  # whether the reach check gave the clock offset (else the records give it)
    _relay_said = (0, 0.0)  # (bytes relayed when last said, when)

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
            punch_port = free_port(host)
            try:
                reach = ask_patiently(config.reach, (port, dht_port), self.report, clock=lambda: time.time() + control.skew_s,
                                      source=(host, punch_port))
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
        if not tensors_open:
            self.punch_port = punch_port if reach.keeps_port else 0
            self.report(f"reachable: its NAT kept port {punch_port} (the service saw it come from {reach.observed}:"
                        f"{reach.seen_port}): peers behind NAT that keep ports too connect to it directly, punching a "
                        f"hole through both NATs from that port" if reach.keeps_port else
                        f"reachable: its NAT changed the port it dialled from ({punch_port} went out as {reach.seen_port}): "
                        "it cannot punch holes; peers behind NAT reach it through a relay")
        if guess:
            announce_host = reach.observed
        if not dht_open:
            control.client_mode = True
            self.report("DHT: client mode (this node stores no keys: others could not read them)")
        elif not control.announce_maddrs and dht_host in WILDCARDS:
            version = 6 if ipaddress.ip_address(reach.observed).version == 6 else 4
            control.announce_maddrs = [f"/ip{version}/{reach.observed}/tcp/{dht_port}"]
        control.clock_offset_s, self.clock_from_reach = reach.clock_offset_s, True
        said = clock_words(reach.clock_offset_s)
        if said is not None:
            self.report(said)
        return (host, port), announce_host

    def _correct_clock(self) -> None:
        """Where the reach check gave no offset: when the other peers' records, as just read, are on the median
        more than `CLOCK_OFF_HEARTBEATS` ahead of this peer's swarm time or behind it, take their median as the
        swarm's time. Each record is signed and checked (all but its age), and one peer in a swarm moves the median
        only as far as the records on its side of it; a clock so far ahead that the records expire before this
        peer's DHT node reads them gives none to go by."""
        control = self.control
        leads = control.record_leads_s
        if self.clock_from_reach or not leads:
            return
        lead = statistics.median(leads)
        if abs(lead) <= CLOCK_OFF_HEARTBEATS * self.config.heartbeat_s:
            return
        control.set_clock_offset(control.clock_offset_s + lead)
        said = clock_words(control.clock_offset_s) or f"clock: corrected by {lead:+.1f} s"
        self.report(f"{said} (from the median of {len(leads)} other peer(s)' signed records: the reach service gave "
                    "no offset)")

    @property
    def announced_reachable(self) -> str:
        """What the record says: through the relay it is registered at, once it is, when nobody can dial it."""
        if self.reachable == "none" and self.relay_link.registered is not None:
            return VIA + self.relay_link.registered
        return self.reachable

    def _keep_paths(self) -> None:
        """When this peer cannot be dialled, pick its relay and the peers to stay connected to; say now and then
        what this peer relayed for others."""
        with self.lock:
            records = dict(self.records)
            wanted = self._plan_neighbours() if self.reachable == "none" else set()
        keep = {d for d in wanted if d in records and records[d].reachable != "none"}
        # a peer that reports it could not reach this one is tried from this side too: the pair then connects (and
        # frames can go back over it), or this peer reports it as well, and the coordinator plans around the pair
        keep |= {d for d, r in records.items() if self.device_id in r.unreachable and d != self.device_id
                 and (r.reachable != "none" or self.transport.punchable(d))}
        if self.punch_port:
            punching = {d for d in records if d != self.device_id and self.transport.punchable(d)}
            self.calling = self._to_call(punching & wanted, punching - wanted)
            keep |= set(self.calling) | {d for d in punching if self.device_id in records[d].calling}
        self.transport.keep_connected(keep)
        if self.reachable == "none":
            self.relay_link.via = self._pick_relay(records)
        if time.monotonic() - self._relay_said[1] > RELAY_SAY_S:
            self._say_relayed("so far")

    def _to_call(self, neighbours: set[str], others: set[str]) -> tuple[str, ...]:
        """Whom to call: the plan's neighbours, then others to measure, up to `MAX_CALLING`. The others go by a hash
        of the pair, so each peer calls a spread of them, the same ones heartbeat after heartbeat."""
        def spread(d: str) -> bytes:
            return hashlib.blake2b("|".join(sorted((self.device_id, d))).encode(), digest_size=8).digest()

        chosen = sorted(neighbours)[:MAX_CALLING]
        return tuple(chosen + sorted(others, key=spread)[: MAX_CALLING - len(chosen)])

    def _linger_as_relay(self) -> None:
        """A relay that leaves keeps the calls it carries up a little while (until they end, at most
        `RELAY_LINGER_HEARTBEATS`): its callees may need one more exchange to finish a step, or to find
        another relay, and the frames in flight through it would be lost."""
        if self.relay is None or not self.relay.active:
            return
        linger_s = RELAY_LINGER_HEARTBEATS * self.config.heartbeat_s
        self.report(f"relay: keeping {self.relay.active} relayed call(s) up for at most {linger_s:g} s while their peers finish")
        deadline = time.monotonic() + linger_s
        while self.relay.active and time.monotonic() < deadline:
            time.sleep(0.1)

    def _say_relayed(self, when: str) -> None:
        """A line on what this peer relayed for others, when that grew since the last one."""
        if self.relay is None or self.relay.relayed_bytes <= self._relay_said[0]:
            return
        self._relay_said = (self.relay.relayed_bytes, time.monotonic())
        self.report(f"relay: carried {self.relay.relayed_bytes / 2**20:.1f} MiB {when}, for "
                    f"{', '.join(f'{d} ({n} call(s))' for d, n in sorted(self.relay.calls.items()))}")

    def _pick_relay(self, records: dict[str, PeerRecord]) -> str | None:
        """The peer to relay for this one, among the public peers in the records (`pick_relay`)."""
        public = [d for d, r in records.items() if r.reachable == "direct" and r.state != "leaving" and d != self.device_id]
        with self.lock:
            measured = self.links.current()
        return pick_relay(self.device_id, self.relay_link.via,
                          {d: measured[d].bandwidth_bytes_per_s if d in measured else None for d in public})

    def _has_path(self, peer: str) -> bool:
        """Whether this peer can reach `peer` now: by dialling it or its relay, or over a connection it opened."""
        record = self.records.get(peer)
        if record is None or not record.behind_nat or (record.relay is not None and record.relay != self.device_id):
            return True
        return self.transport.connected(peer)

    def _worth_probing(self, peer: str) -> bool:
        """Whether a probe to `peer` measures a link the planner uses: it has a path, and not only through a relay
        (both peers behind NAT, no hole to punch between them). The planner takes such a pair at its relay's two
        hops (`coordinator/planner/relays.py`), so a probe through the relay would only load the relay's link."""
        record = self.records.get(peer)
        relayed = (self.reachable == "none" and record is not None and record.behind_nat
                   and not self.transport.punchable(peer))
        return self._has_path(peer) and not relayed

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
