"""A network lab of Linux namespaces: a "public internet" on one bridge, with hosts on it or behind NAT routers.

Tests use it to run peers as real processes on real addresses, where a peer behind NAT can dial out but
cannot be dialled, and where a link can lose packets. Needs root, `ip` and `iptables` (no netem).

    with Lab() as lab:
        a = lab.public("a")
        b = lab.behind_nat("b", "symmetric")
        a.popen([sys.executable, "-c", ...])
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Literal

Nat = Literal["none", "cone", "symmetric"]
Router = Literal["drop", "reset"]
ROUTERS = ("drop", "reset")  # what a NAT router does with what arrives unasked

# Every namespace of every lab is named MARKER + "<creator pid>-<token>-...", so that sweep() can tell
# leftovers of crashed runs (creator dead) from namespaces of a lab that is running right now.
MARKER = "hpl-"
_NAME = re.compile(r"[a-z][a-z0-9]{0,15}")
_OURS = re.compile(re.escape(MARKER) + r"(\d+)-")


class LabError(RuntimeError):
    """A command that sets up or tears down the lab failed."""


def _valid(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"a host's name is a lowercase letter then up to 15 letters or digits, not {name!r}")
    return name


def _sh(*argv: str) -> str:
    """Run one command; raise LabError naming it and its stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _in(netns: str, *argv: str) -> str:
    return _sh("ip", "netns", "exec", netns, *argv)


def _namespaces() -> list[str]:
    # Lines read "name" or "name (id: 3)".
    return [line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()]


def _delete(netns: str) -> None:
    # A concurrent sweep may have deleted it already; only a namespace still listed is an error.
    try:
        _sh("ip", "netns", "delete", netns)
    except LabError:
        if netns in _namespaces():
            raise


def netns_missing() -> str | None:
    """Why the lab cannot run on this machine, or None when it can (checks each feature the lab uses)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    probe = f"{MARKER}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _sh("ip", "netns", "add", probe)
    except LabError as error:
        return f"cannot create a network namespace: {error}"
    try:
        _sh("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _sh("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        _in(probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "v0", "-j", "MASQUERADE", "--random-fully")
        _in(probe, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED", "-j", "ACCEPT")
        _in(probe, "iptables", "-A", "INPUT", "-m", "statistic", "--mode", "random", "--probability", "0.5", "-j", "DROP")
    except LabError as error:
        return f"a namespace lacks a feature the lab needs: {error}"
    finally:
        _delete(probe)
    return None


def sweep() -> list[str]:
    """Delete the namespaces that labs of dead processes left behind; return their names.

    A lab of a live process is left alone, whichever process it is. (A recycled pid can only keep
    a leftover alive until a later sweep, never delete a live lab.)
    """
    swept = []
    for netns in _namespaces():
        match = _OURS.match(netns)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _delete(netns)
            swept.append(netns)
    return swept


@dataclass(frozen=True)
class Host:
    """One machine of the lab: a namespace with one interface, eth0."""

    name: str
    netns: str
    address: str  # its own IP, on eth0
    public_address: str  # the source address others see: its own, or its NAT router's public one
    nat: Nat
    router: str | None = None  # the namespace of its NAT router, if behind one

    def argv(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(cmd), **kwargs)

    def run(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        options: dict[str, Any] = {"check": True, "capture_output": True, "text": True, **kwargs}
        return subprocess.run(self.argv(cmd), **options)


class Lab:
    """The public bridge, plus the hosts and NAT routers made on it; close() deletes every namespace."""

    def __init__(self, subnet_octet: int | None = None) -> None:
        self.subnet_octet = subnet_octet
        self.prefix = f"{MARKER}{os.getpid()}-{secrets.token_hex(2)}-"
        self.namespaces: list[str] = []
        self._lossy: set[str] = set()
        self._homes: dict[str, tuple[str, int]] = {}  # router namespace -> (its LAN's /24 prefix, the next host octet)
        self._started = False

    # 10.<octet>.0.0/24. Each lab's subnet lives in its own namespaces, so no two can clash; a random octet
    # keeps the addresses of concurrent labs, and of docker's 172.x and 10.213.x, apart in logs all the same.
    @property
    def public_net(self) -> str:
        return f"10.{self.subnet_octet}.0"

    def start(self) -> Lab:
        if self._started:
            return self
        self._started = True
        sweep()
        if self.subnet_octet is None:
            self.subnet_octet = random.randint(100, 250)
        # The bridge lives in a namespace of its own: docker sets the root namespace's FORWARD policy
        # to DROP. A new namespace calls iptables on bridged frames (bridge-nf-call-iptables starts at 1
        # when br_netfilter is loaded); the switch should be a plain switch.
        self._bridge = self._add_namespace("net")
        _sh("ip", "-n", self._bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self._bridge, "link", "set", "br0", "up")
        if os.path.exists("/proc/sys/net/bridge"):
            _in(self._bridge, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
        self._next_public = 10
        self._next_lan = 1
        return self

    def close(self) -> None:
        """Delete every namespace made so far (that takes their veths and the bridge along); idempotent.

        Processes still running in a namespace keep it alive, unnamed, until they end: callers own them.
        """
        while self.namespaces:
            _delete(self.namespaces.pop())

    def __enter__(self) -> Lab:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def public(self, name: str) -> Host:
        """A host with an address of its own on the public subnet."""
        netns = self._add_namespace(_valid(name))
        address = self._plug(netns, "eth0")
        return Host(name, netns, address, address, "none")

    def behind_nat(self, name: str, kind: Literal["cone", "symmetric"], router: Router = "drop") -> Host:
        """A host on a private /24 whose router masquerades it onto the public subnet, one provider hop away.

        "cone": MASQUERADE keeps the host's source port when it is free on the router (endpoint-independent
        mapping), so two hosts behind cone routers can punch a TCP connection through them. "symmetric":
        --random-fully picks a random port for each connection. Either way the router forwards only replies
        from the public side: with no DNAT nothing can dial the host. What arrives unasked at the router's public
        address is, by `router`: "drop", dropped without an answer (a firewall's DROP); "reset", answered by the
        router's own kernel (a TCP reset, an ICMP port unreachable), as a Linux router with no firewall rule on its
        public side does, and OpenWrt's default REJECT. The private network is a bridge in the router (`lan0`),
        so `beside` can put more hosts on it.

        The router's public address is on the public subnet, but the router is not on the bridge: a provider's
        router (`<name>-isp`) stands between, answering ARP for it (proxy ARP) and forwarding, so that a packet from
        the host crosses three hops to another router's public address, as at home (the host's router, its
        provider's, the far provider's), and a packet whose TTL runs out after the host's router dies before the
        far one (`peer/transport/punch.py`).
        """
        if kind not in ("cone", "symmetric"):
            raise ValueError(f"kind must be 'cone' or 'symmetric', not {kind!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
        gateway = self._add_namespace(f"{_valid(name)}-gw")
        public = self._provider(f"{name}-isp", gateway)  # `name` checked above
        lan, self._next_lan = f"192.168.{self._next_lan}", self._next_lan + 1
        _sh("ip", "-n", gateway, "link", "add", "lan0", "type", "bridge")
        _sh("ip", "-n", gateway, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _sh("ip", "-n", gateway, "link", "set", "lan0", "up")
        if os.path.exists("/proc/sys/net/bridge"):  # frames between the LAN's hosts are switched, not filtered
            _in(gateway, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
        _in(gateway, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        iptables = ("ip", "netns", "exec", gateway, "iptables")
        _sh(*iptables, "-P", "FORWARD", "DROP")
        _sh(*iptables, "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        _sh(*iptables, "-A", "FORWARD", "-i", "wan0", "-o", "lan0",
            "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        if router == "drop":
            _sh(*iptables, "-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate", "NEW,INVALID", "-j", "DROP")
        masquerade = ["-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"]
        _sh(*iptables, *masquerade, *(["--random-fully"] if kind == "symmetric" else []))
        self._homes[gateway] = (lan, 2)
        return self._home_host(name, gateway, public, kind)

    def _provider(self, name: str, gateway: str) -> str:
        """A provider's router on the bridge for `gateway` (its `wan0`); return the gateway's public address."""
        provider = self._add_namespace(name)
        self._plug(provider, "up0")
        if self._next_public > 254:
            raise LabError("the public subnet is full")
        public, self._next_public = f"{self.public_net}.{self._next_public}", self._next_public + 1
        _sh("ip", "-n", provider, "link", "add", "down0", "type", "veth", "peer", "name", "wan0", "netns", gateway)
        _sh("ip", "-n", provider, "link", "set", "down0", "up")
        for setting in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                        "net.ipv4.conf.up0.proxy_arp=1", "net.ipv4.conf.down0.proxy_arp=1",
                        # answered at once: the default holds proxy answers back 0.8 s, the first packets queue and drop
                        "net.ipv4.neigh.up0.proxy_delay=0", "net.ipv4.neigh.down0.proxy_delay=0"):
            _in(provider, "sysctl", "-qw", setting)
        _sh("ip", "-n", provider, "route", "add", f"{public}/32", "dev", "down0")
        _sh("ip", "-n", gateway, "addr", "add", f"{public}/32", "dev", "wan0")
        _sh("ip", "-n", gateway, "link", "set", "wan0", "up")
        _sh("ip", "-n", gateway, "route", "add", f"{self.public_net}.0/24", "dev", "wan0")  # the provider answers ARP
        return public

    def beside(self, neighbour: Host, name: str) -> Host:
        """Another host on `neighbour`'s home network, behind the same router: the same public address, as a
        household's second machine, a campus or a carrier's NAT puts many volunteers behind one."""
        if neighbour.router not in self._homes:
            raise ValueError(f"{neighbour.name} is not behind a NAT router of this lab")
        return self._home_host(name, neighbour.router, neighbour.public_address, neighbour.nat)

    def _home_host(self, name: str, router: str, public: str, kind: Nat) -> Host:
        lan, octet = self._homes[router]
        if octet > 254:
            raise LabError(f"the home network {lan}.0/24 is full")
        self._homes[router] = (lan, octet + 1)
        netns = self._add_namespace(_valid(name))
        port = f"h{octet}"  # the host's end in the router, on its bridge
        _sh("ip", "-n", netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", router)
        _sh("ip", "-n", router, "link", "set", port, "master", "lan0", "up")
        _sh("ip", "-n", netns, "addr", "add", f"{lan}.{octet}/24", "dev", "eth0")
        _sh("ip", "-n", netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", netns, "route", "add", "default", "via", f"{lan}.1")
        return Host(name, netns, f"{lan}.{octet}", public, kind, router)

    def lossy(self, host: Host, share: float) -> None:
        """Drop `share` of the packets in and, independently, out of the host's link; 0 restores it, 1 is a link
        that went down without a word (no reset, no error: `test_dead_paths.py`).

        A round trip then survives with probability (1 - share) ** 2. For a NATed host the drops happen
        in its router's FORWARD chain on the LAN leg, so they are silent, as on Wi-Fi, and fall on every host
        of that home network (`beside`) alike. A public host's
        link ends on the bridge, which iptables does not see (no br_netfilter wanted), so its drops happen
        in its own INPUT and OUTPUT chains: there a dropped outgoing UDP datagram fails its sendto() with
        EPERM (TCP just retransmits).
        """
        if not 0 <= share <= 1:
            raise ValueError(f"share must be within [0, 1], not {share}")
        if host.nat == "none":
            netns, hooks = host.netns, (("INPUT", "-i", "eth0"), ("OUTPUT", "-o", "eth0"))
        else:
            netns, hooks = host.router, (("FORWARD", "-i", "lan0"), ("FORWARD", "-o", "lan0"))
        iptables = ("ip", "netns", "exec", netns, "iptables")
        # A chain of its own, so that a later call replaces the loss rather than adding to it.
        if netns not in self._lossy:
            _sh(*iptables, "-N", "LOSSY")
            for chain, direction, interface in hooks:
                _sh(*iptables, "-I", chain, "1", direction, interface, "-j", "LOSSY")
            self._lossy.add(netns)
        _sh(*iptables, "-F", "LOSSY")
        if share > 0:
            _sh(*iptables, "-A", "LOSSY", "-m", "statistic", "--mode", "random",
                "--probability", str(share), "-j", "DROP")

    def cut(self, a: Host, b: Host) -> None:
        """A filter between two public hosts: each drops every packet from the other, without a word (no route
        between them, whatever either tries)."""
        for host, other in ((a, b), (b, a)):
            if host.nat != "none":
                raise ValueError(f"{host.name} is behind NAT: cut public hosts")
            _in(host.netns, "iptables", "-A", "INPUT", "-s", other.address, "-j", "DROP")

    def _add_namespace(self, name: str) -> str:
        if not self._started:
            raise LabError("start the lab first")
        netns = self.prefix + name
        if netns in self.namespaces:
            raise ValueError(f"the lab already has {name!r}")
        _sh("ip", "netns", "add", netns)
        self.namespaces.append(netns)
        # ip_forward of a new namespace copies the root namespace's (1 where docker runs): hosts must not route.
        _in(netns, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        _sh("ip", "-n", netns, "link", "set", "lo", "up")
        return netns

    def _plug(self, netns: str, interface: str) -> str:
        """Wire the namespace's `interface` into the bridge; return its new public address."""
        # Interface names are per namespace, so short fixed ones cannot clash with other labs'.
        if self._next_public > 254:
            raise LabError("the public subnet is full")
        port = f"p{self._next_public}"
        address, self._next_public = f"{self.public_net}.{self._next_public}", self._next_public + 1
        _sh("ip", "-n", netns, "link", "add", interface, "type", "veth", "peer", "name", port, "netns", self._bridge)
        _sh("ip", "-n", self._bridge, "link", "set", port, "master", "br0", "up")
        _sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", interface)
        _sh("ip", "-n", netns, "link", "set", interface, "up")
        return address

