"""What crosses a fixed plan's links, as a capture of the loopback interface sees it: `hetpeer launch` over
direct TCP sends no frame in the clear (each one starts with the frame magic), while the same capture does
see the frames of a link that runs without the handshake. A raw packet socket needs root, as this tier does."""

from __future__ import annotations

import collections
import json
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import torch

from hetpeer.peer.reach import free_port
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.frame import MAGIC
from hetpeer.protocol.handshake import MAGIC as CHALLENGE

ROOT = Path(__file__).resolve().parents[2]
ETH_P_ALL, PACKET_OUTGOING = 0x0003, 4
SO_RCVBUFFORCE = 33  # <asm-generic/socket.h>; the socket module does not name it
ETHERNET_BYTES = 14  # the loopback interface's link header, all zeros
HANG_GUARD_S = 300


class Capture:
    """Every TCP segment on the loopback interface while open, once (the copy the kernel delivers, not the one it
    sends): per (source port, destination port), the payload bytes and how often each of `needles` starts or sits
    in a segment's payload (a needle cut by a segment's end is missed; frames start at a write's start)."""

    def __init__(self, needles: tuple[bytes, ...]) -> None:
        self.needles = needles
        self.bytes: collections.Counter[tuple[int, int]] = collections.Counter()
        self.found: dict[bytes, collections.Counter[tuple[int, int]]] = {n: collections.Counter() for n in needles}
        self._socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._socket.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # room while the reader lags
        self._socket.bind(("lo", 0))
        self._socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> "Capture":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._socket.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                packet, address = self._socket.recvfrom(1 << 17)
            except socket.timeout:
                continue
            if address[2] == PACKET_OUTGOING or len(packet) < ETHERNET_BYTES + 20:
                continue
            ip = packet[ETHERNET_BYTES:]
            if ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
                continue
            tcp = ip[(ip[0] & 0x0F) * 4:]
            ports = struct.unpack("!HH", tcp[:4])
            payload = tcp[(tcp[12] >> 4) * 4:]
            self.bytes[ports] += len(payload)
            for needle in self.needles:
                if needle in payload:
                    self.found[needle][ports] += payload.count(needle)

    def on(self, ports: set[int], counter: collections.Counter) -> int:
        """What `counter` holds for the segments to or from any of `ports`."""
        return sum(n for (source, destination), n in counter.items() if source in ports or destination in ports)


def test_a_fixed_plans_links_carry_no_frame_in_the_clear(netns_ready, tmp_path: Path):
    out = tmp_path / "run"
    with Capture((MAGIC, CHALLENGE)) as capture:
        # the capture sees frames where they do travel in the clear: a link without the handshake
        book = AddressBook({name: PeerAddress(direct=("127.0.0.1", free_port())) for name in ("plain0", "plain1")})
        transports = [NetworkTransport(name, book, [TcpLink(*book.get(name).direct)]) for name in ("plain0", "plain1")]
        with transports[0] as sender, transports[1] as receiver:
            for step in range(3):
                sender.send("plain1", "activation", torch.ones(64), step=step)
            sender.flush(30)
            for step in range(3):
                receiver.recv("activation", "plain0", step, 0, timeout_s=30)
        done = subprocess.run(
            [sys.executable, "-m", "hetpeer", "launch", "--link", "tcp", "--steps", "10", "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plain = {address.direct[1] for address in book.peers.values()}
    assert capture.on(plain, capture.found[MAGIC]) >= 3, "the capture saw the plain link's frames"

    launched = AddressBook.load(out / "addresses.json")
    assert all(address.key is not None for address in launched.peers.values())
    ports = {address.direct[1] for address in launched.peers.values()}
    carried = capture.on(ports, capture.bytes)
    assert carried > 1 << 20, f"the launched peers' links carried {carried} bytes: the capture missed them"
    assert capture.on(ports, capture.found[MAGIC]) == 0, "a frame crossed a fixed plan's link in the clear"
    assert capture.on(ports, capture.found[CHALLENGE]) >= len(ports), "every peer answered connections with the handshake"
    assert json.loads((out / "plan.json").read_text())["stages"], "the demo plan ran"
