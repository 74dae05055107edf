"""The network lab behaves like the internet it stands for: public hosts reach each other, NATed hosts dial
out under their router's address but cannot be dialled, a lossy link loses about the share it is told,
and nothing of a lab outlives it."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Callable, Iterator

import pytest

from lab import MARKER, Host, Lab, sweep

pytestmark = pytest.mark.usefixtures("netns_ready")

# Prints its port, then the address and port of each connection it accepts.
LISTEN = """
import socket
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, peer = server.accept()
    print(*peer, flush=True)
    conn.close()
"""

# argv: address port timeout. Prints "connected <local port>" or "failed <error>".
DIAL = """
import socket, sys
try:
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
except OSError as error:
    print("failed", type(error).__name__, error)
else:
    print("connected", conn.getsockname()[1])
"""

# argv: address port ttl. Dials with that TTL for 2 s; prints "connected" or "failed <error>".
TTL_DIAL = """
import socket, sys
conn = socket.socket()
conn.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, int(sys.argv[3]))
conn.settimeout(2.0)
try:
    conn.connect((sys.argv[1], int(sys.argv[2])))
except OSError as error:
    print("failed", type(error).__name__, error)
else:
    print("connected")
"""

# Prints its port, then how many datagrams came before the first b"end".
COUNT = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)  # SO_RCVBUFFORCE: the buffer, not the lab, must never drop
s.bind(("0.0.0.0", 0))
print(s.getsockname()[1], flush=True)
s.settimeout(60)
count = 0
while s.recv(16) != b"end":
    count += 1
print(count, flush=True)
"""

# argv: address port count. A lossy sender's own OUTPUT drops fail sendto() with EPERM: those count as lost.
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
target = (sys.argv[1], int(sys.argv[2]))
for payload in [b"x"] * int(sys.argv[3]) + [b"end"] * 100:
    try:
        s.sendto(payload, target)
    except PermissionError:
        pass
"""

Spawn = Callable[..., subprocess.Popen]


@pytest.fixture
def spawn(lab: Lab) -> Iterator[Spawn]:
    """spawn(host, script, *args): a Python script in the host's namespace, killed before the lab closes."""
    started: list[subprocess.Popen] = []

    def start(host: Host, script: str, *args: object) -> subprocess.Popen:
        argv = [sys.executable, "-c", script, *map(str, args)]
        started.append(host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def read_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """The process's next line of output, waiting at most `timeout` seconds for it."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise AssertionError(f"no line within {timeout} s from {proc.args}; so far {line!r}")
        byte = os.read(proc.stdout.fileno(), 1)
        if not byte:
            raise AssertionError(f"{proc.args} ended (exit {proc.wait()}) after {line!r}")
        line += byte
    return line.decode().strip()


def listen(spawn: Spawn, host: Host) -> tuple[subprocess.Popen, int]:
    server = spawn(host, LISTEN)
    return server, int(read_line(server))


def accepted(server: subprocess.Popen) -> tuple[str, int]:
    """Source address and port of the next connection the listener accepted."""
    address, port = read_line(server).split()
    return address, int(port)


def dial(host: Host, address: str, port: int, timeout: float = 2.0) -> str:
    return host.run([sys.executable, "-c", DIAL, address, str(port), str(timeout)], timeout=30).stdout.strip()


def local_port(result: str) -> int:
    assert result.startswith("connected "), result
    return int(result.split()[1])


def lab_namespaces(lab: Lab) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(lab.prefix)]


def test_public_hosts_reach_each_other(lab: Lab, spawn: Spawn) -> None:
    a, b = lab.public("a"), lab.public("b")
    assert a.address != b.address and (a.public_address, a.nat) == (a.address, "none")
    for client, host in ((a, b), (b, a)):
        server, port = listen(spawn, host)
        port_used = local_port(dial(client, host.address, port))
        assert accepted(server) == (client.address, port_used)


@pytest.mark.parametrize("kind", ["cone", "symmetric"])
def test_nated_host_dials_out_under_its_routers_address(lab: Lab, spawn: Spawn, kind: str) -> None:
    a, b = lab.public("a"), lab.behind_nat("b", kind)  # type: ignore[arg-type]
    assert b.nat == kind and b.address.startswith("192.168.")
    assert b.public_address.startswith(lab.public_net + ".") and b.public_address != a.address
    server, port = listen(spawn, a)
    port_used = local_port(dial(b, a.address, port))
    source, source_port = accepted(server)
    assert source == b.public_address
    if kind == "cone":  # MASQUERADE keeps a port that is free on the router; --random-fully need not
        assert source_port == port_used


@pytest.mark.parametrize("kind,router", [("cone", "drop"), ("symmetric", "drop"), ("cone", "reset")])
def test_nobody_dials_a_nated_host(lab: Lab, spawn: Spawn, kind: str, router: str) -> None:
    a, b = lab.public("a"), lab.behind_nat("b", kind, router)  # type: ignore[arg-type]
    server, port = listen(spawn, b)
    assert dial(a, b.address, port).startswith("failed ")  # the public side has no route to the LAN
    # no DNAT: the router drops the SYN without a word, or its own kernel answers with a reset
    said = dial(a, b.public_address, port)
    assert said.startswith("failed " + {"drop": "TimeoutError", "reset": "ConnectionRefusedError"}[router]), said
    # Even a neighbour routing the LAN via the router gets nothing in: it forwards only replies inwards.
    lan = b.address.rsplit(".", 1)[0]
    a.run(["ip", "route", "add", f"{lan}.0/24", "via", b.public_address])
    assert dial(a, b.address, port).startswith("failed ")
    # The listener was up all along, and the first connection it accepted is this one, none of a's.
    port_used = local_port(dial(b, b.address, port))
    assert accepted(server) == (b.address, port_used)


def test_nated_hosts_cannot_dial_each_other(lab: Lab, spawn: Spawn) -> None:
    a, b, c = lab.public("a"), lab.behind_nat("b", "cone"), lab.behind_nat("c", "symmetric")
    assert b.address.rsplit(".", 1)[0] != c.address.rsplit(".", 1)[0]
    assert b.public_address != c.public_address
    for client, host in ((b, c), (c, b)):
        server, port = listen(spawn, host)
        assert dial(client, host.address, port).startswith("failed ")
        assert dial(client, host.public_address, port).startswith("failed ")
        port_used = local_port(dial(host, host.address, port))
        assert accepted(server) == (host.address, port_used)
    # Both are online all the same.
    server, port = listen(spawn, a)
    for client in (b, c):
        local_port(dial(client, a.address, port))
        assert accepted(server)[0] == client.public_address


def test_hosts_beside_each_other_share_their_routers_address(lab: Lab, spawn: Spawn) -> None:
    a, b = lab.public("a"), lab.behind_nat("b", "cone")
    c = lab.beside(b, "c")
    assert (c.public_address, c.nat, c.router) == (b.public_address, "cone", b.router)
    assert c.address.rsplit(".", 1)[0] == b.address.rsplit(".", 1)[0] and c.address != b.address
    server, port = listen(spawn, a)
    for client in (b, c):  # both dial out under the one public address
        local_port(dial(client, a.address, port))
        assert accepted(server)[0] == b.public_address
    server, port = listen(spawn, c)  # and reach each other on their own network, as a household's machines do
    port_used = local_port(dial(b, c.address, port))
    assert accepted(server) == (b.address, port_used)
    assert dial(a, c.public_address, port).startswith("failed ")  # nobody outside dials in
    with pytest.raises(ValueError, match="not behind a NAT router"):
        lab.beside(a, "d")


def udp_arrivals(spawn: Spawn, sender: Host, receiver: Host, count: int) -> int:
    counter = spawn(receiver, COUNT)
    port = int(read_line(counter))
    sender.run([sys.executable, "-c", SEND, receiver.address, str(port), str(count)], timeout=60)
    return int(read_line(counter, timeout=60))


def test_a_nated_host_is_three_hops_from_another_router_and_a_packet_with_fewer_dies_on_the_way(lab: Lab, spawn: Spawn) -> None:
    # A host behind a router that resets: a SYN that reaches the router's public address is refused at once, one
    # whose TTL runs out first is not answered at all (what punching's opening SYN relies on).
    a, b = lab.behind_nat("a", "cone"), lab.behind_nat("b", "cone", "reset")
    def dial_with(ttl: int) -> str:
        return a.run([sys.executable, "-c", TTL_DIAL, b.public_address, "9", str(ttl)], timeout=30).stdout.strip()

    assert dial_with(4).startswith("failed ConnectionRefusedError"), dial_with(4)
    said = dial_with(3)  # timed out, or the time-exceeded message of the provider's router: no reset
    assert said.startswith("failed ") and "Refused" not in said, said


def test_lossy_link_drops_about_that_share(lab: Lab, spawn: Spawn) -> None:
    a, b, c = lab.public("a"), lab.public("b"), lab.behind_nat("c", "cone")
    sent, share = 2000, 0.3
    assert udp_arrivals(spawn, a, b, sent) == sent
    lab.lossy(b, share)
    lab.lossy(c, share)
    # 2000 tries at 70%: 1400 expected, standard deviation 20.5; the bounds are 7 of those away.
    for sender, receiver in ((a, b), (b, a), (c, a)):
        assert 1250 <= udp_arrivals(spawn, sender, receiver, sent) <= 1550, (sender.name, receiver.name)
    lab.lossy(b, 0)  # a second call replaces the loss
    assert udp_arrivals(spawn, a, b, sent) == sent


def test_close_deletes_every_namespace_even_after_a_partial_step() -> None:
    Lab().close()  # never started
    lab = Lab()
    with lab:
        lab.public("a")
        lab.behind_nat("b", "symmetric")
        with pytest.raises(ValueError):
            lab.behind_nat("a", "cone")  # makes the router a-gw, then finds "a" taken
        assert sorted(lab_namespaces(lab)) == sorted(lab.namespaces)
        assert len(lab.namespaces) == 7  # the bridge's, a, b, b's router and its provider's, a's router and its provider's
    assert lab_namespaces(lab) == []
    lab.close()  # again: nothing left to do, and no error


def test_sweep_deletes_only_leftovers_of_dead_processes() -> None:
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    leftover, live = f"{MARKER}{ended.pid}-dead-net", f"{MARKER}{os.getpid()}-live-net"
    for name in (leftover, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert leftover in sweep()
        listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
        names = [line.split()[0] for line in listed.splitlines()]
        assert leftover not in names and live in names
    finally:
        for name in (leftover, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
