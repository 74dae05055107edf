"""Transport benchmark: moving 64 MB of activations between two processes on 127.0.0.1.

    python3 benchmarks/transport.py [--mbytes 64] [--repeats 15] [--codecs]

Three paths in one run, each timed from the sender's `send` until the receiver's acknowledgement
arrives (so the figure covers encoding, checksums, the copy through the kernel, decoding and the
finiteness check). The paths take turns within each round, so the shared machine's noise falls on
all of them alike; each figure is the median over the rounds:

- plain TCP: `sendall` of the raw bytes into a receiver's preallocated buffer, a one-byte ack: the
  reference no transport that frames and checks its data can beat;
- direct: hetpeer's `NetworkTransport` over `TcpLink` without a handshake: what framing and checks cost
  before sealing (no peer `hetpeer` runs goes without it);
- direct, sealed: the same with each end's key (`LinkIdentity`), as every peer runs it (a swarm's or a fixed
  plan's): the connection starts with the handshake that proves both device ids and agrees on keys, and every
  byte after it travels in AES-256-GCM records (`hetpeer/peer/transport/sealed.py`);
- relayed, sealed: the same, but the receiver cannot be dialled: it registered at a relay (a third
  process, `hetpeer/peer/transport/relay.py`), which splices the sender's connection to one the receiver
  opens; the two ends' handshake and sealing run through it (how two peers behind NAT meet);
- p2p: hetpeer's `NetworkTransport` over hivemind's `P2PLink` (libp2p streams through p2pd).

Goals: the direct path at 50% of plain TCP or better, and the sealed path at 1 GB/s or better: sealing
then never limits a link below 8 Gbit/s, eight times a fast home connection (its cost against the
unsealed path is printed beside it). `--codecs` adds the direct path with fp16, bf16
and int8 frames (time to move the same 64 MB tensor). Exit status 1 when the goal is missed.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from hetpeer.peer.launch import free_port
from hetpeer.peer.node import p2p_peer_id
from hetpeer.peer.transport.inbox import TransportTimeout
from hetpeer.peer.transport.links import P2PLink, TcpLink
from hetpeer.peer.transport.relay import Relay, RelayLink
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.control import load_or_create_key, public_key_bytes
from hetpeer.protocol.identity import device_id

GOAL = 0.5
SEALED_GOAL_BYTES_PER_S = 1e9  # the sealed direct path: never the bottleneck of a link below 8 Gbit/s
ACK = torch.zeros(1)


def device_of(role: str, folder: Path, mode: str) -> str:
    """A role's device id: bound to its swarm key on the sealed paths, the role's name elsewhere."""
    if mode not in ("authenticated", "relayed"):
        return role
    return device_id(role, public_key_bytes(load_or_create_key(folder / f"{role}.swarm.key")))


def book_for(folder: Path, mode: str) -> tuple[AddressBook, dict[str, str]]:
    from hivemind.p2p import P2P

    peers, keys = {}, {}
    for role in ("sender", "receiver") + (("relay",) if mode == "relayed" else ()):
        device = device_of(role, folder, mode)
        if mode in ("direct", "authenticated", "relayed"):
            peers[device] = PeerAddress(direct=("127.0.0.1", free_port()))
        else:
            keys[device] = str(folder / f"{device}.key")
            P2P.generate_identity(keys[device])
            peers[device] = PeerAddress(p2p=(f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{p2p_peer_id(keys[device])}",))
    return AddressBook(peers), keys


def transport_for(role: str, folder: Path, book: AddressBook, keys: dict[str, str], mode: str) -> NetworkTransport:
    device = device_of(role, folder, mode)
    address = book.get(device)
    if mode == "direct":
        links = [TcpLink(*address.direct)]
    elif mode in ("authenticated", "relayed"):
        identity = LinkIdentity(device, load_or_create_key(folder / f"{role}.swarm.key"))
        links = [TcpLink(*address.direct, identity=identity)]
    else:
        links = [P2PLink(identity_path=keys[device], host_maddrs=[address.p2p[0].rsplit("/p2p/", 1)[0]])]
    if mode == "relayed":  # the receiver is reached only through the relay: its book entry names it
        relay, receiver = device_of("relay", folder, mode), device_of("receiver", folder, mode)
        links[0].relay = Relay(device)
        links.append(RelayLink(identity))
        book = AddressBook({**book.peers, receiver: replace(book.get(receiver), dialable=False, relay=relay)})
    transport = NetworkTransport(device, book, links, max_frame_bytes=1 << 31)
    if mode == "relayed":
        links[1].book = lambda: transport.book
        if role == "receiver":
            links[1].via = relay
    return transport


def relay(folder: Path, mode: str) -> None:
    """The relay between sender and receiver: it only splices, until killed."""
    book = AddressBook.load(folder / "addresses.json")
    with transport_for("relay", folder, book, {}, mode):
        print("ready", flush=True)
        while True:
            time.sleep(60)


def receiver(folder: Path, mode: str) -> None:
    book = AddressBook.load(folder / "addresses.json")
    keys = json.loads((folder / "keys.json").read_text())
    torch.set_num_threads(1)
    sender = device_of("sender", folder, mode)
    with transport_for("receiver", folder, book, keys, mode) as transport:
        if mode == "relayed":
            deadline = time.monotonic() + 60
            while transport.links[1].registered is None and time.monotonic() < deadline:
                time.sleep(0.05)
        print("ready", flush=True)
        step = 0
        while True:
            try:
                transport.recv("activation", sender, step, 0, timeout_s=300)
            except TransportTimeout:
                return  # the sender is gone
            transport.send(sender, "gradient", ACK, step=step)
            transport.flush(60)
            step += 1


class Framed:
    """A sender here and a receiver process, over hetpeer's transport; `transfer` times one round trip."""

    def __init__(self, mode: str) -> None:
        self.mode, self.step = mode, 0
        folder = Path(tempfile.mkdtemp(prefix="hetpeer-bench-"))
        self.book, keys = book_for(folder, mode)
        (folder / "addresses.json").write_text(json.dumps(self.book.to_wire()))
        (folder / "keys.json").write_text(json.dumps(keys))
        self.relay = None
        if mode == "relayed":
            self.relay = subprocess.Popen([sys.executable, __file__, "--role", "relay", "--mode", mode, "--folder", str(folder)],
                                          stdout=subprocess.PIPE, text=True)
            if self.relay.stdout.readline().strip() != "ready":
                raise SystemExit("the relay did not start")
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--role", "receiver", "--mode", mode, "--folder", str(folder)],
            stdout=subprocess.PIPE, text=True,
        )
        if self.child.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {mode} receiver did not start")
        self.receiver = device_of("receiver", folder, mode)
        self.transport = transport_for("sender", folder, self.book, keys, mode)
        self.transport.start()

    def transfer(self, tensor: torch.Tensor, codec: str = "raw") -> float:
        started = time.perf_counter()
        self.transport.send(self.receiver, "activation", tensor, step=self.step, codec=codec, copy=False)
        self.transport.recv("gradient", self.receiver, self.step, 0, timeout_s=120)
        self.step += 1
        return time.perf_counter() - started

    def close(self) -> None:
        self.transport.shutdown()
        for child in (self.child, self.relay):
            if child is not None:
                child.kill()
                child.wait()


class PlainTcp:
    """The reference: a blocking socket, `sendall` into a receiver's preallocated buffer, a one-byte ack."""

    def __init__(self, size: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        code = (
            "import socket\n"
            f"s=socket.create_connection(('127.0.0.1',{listener.getsockname()[1]}))\n"
            f"buf=bytearray({size});v=memoryview(buf)\n"
            "while True:\n"
            "    got=0\n"
            f"    while got<{size}:\n"
            "        n=s.recv_into(v[got:])\n"
            "        if n==0: raise SystemExit\n"
            "        got+=n\n"
            "    s.sendall(b'k')\n"
        )
        self.child = subprocess.Popen([sys.executable, "-c", code])
        self.conn, _ = listener.accept()
        listener.close()

    def transfer(self, payload: bytes) -> float:
        started = time.perf_counter()
        self.conn.sendall(payload)
        self.conn.recv(1)
        return time.perf_counter() - started

    def close(self) -> None:
        self.conn.close()
        self.child.wait(timeout=30)


def framed(mode: str, tensor: torch.Tensor, repeats: int, codec: str = "raw") -> list[float]:
    """`repeats` timed transfers of `tensor` over `mode` (after one untimed that opens the connection)."""
    path = Framed(mode)
    try:
        path.transfer(tensor, codec)
        return [path.transfer(tensor, codec) for _ in range(repeats)]
    finally:
        path.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=int, default=64, help="size of the activation tensor in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--codecs", action="store_true", help="also time fp16, bf16 and int8 frames on the direct path")
    parser.add_argument("--role", default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role in ("receiver", "relay"):
        (receiver if args.role == "receiver" else relay)(args.folder, args.mode)
        return 0

    size = args.mbytes * 10**6
    tensor = torch.randn(size // 4)  # fp32 activations
    payload = tensor.numpy().tobytes()
    torch.set_num_threads(1)
    # Every round times each path once, in turn, so that the shared machine's noise falls on all of them.
    paths = {"plain TCP socket": PlainTcp(size), "direct (NetworkTransport, TcpLink)": Framed("direct"),
             "direct, sealed (LinkIdentity)": Framed("authenticated"),
             "relayed, sealed (RelayLink)": Framed("relayed"),
             "hivemind P2P (NetworkTransport, P2PLink)": Framed("p2p")}
    codecs = ("fp16", "bf16", "int8") if args.codecs else ()
    times: dict[str, list[float]] = {name: [] for name in paths}
    times.update({f"direct, {codec} frames": [] for codec in codecs})
    try:
        for round_ in range(args.repeats + 1):  # the first round opens connections and is not counted
            measured = {name: path.transfer(payload) if isinstance(path, PlainTcp) else path.transfer(tensor)
                        for name, path in paths.items()}
            for codec in codecs:
                measured[f"direct, {codec} frames"] = paths["direct (NetworkTransport, TcpLink)"].transfer(tensor, codec)
            if round_:
                for name, seconds in measured.items():
                    times[name].append(seconds)
    finally:
        for path in paths.values():
            path.close()
    rows = list(times.items())
    reference = statistics.median(rows[0][1])
    print(f"moving {args.mbytes} MB of fp32 activations between two processes on 127.0.0.1, "
          f"median of {args.repeats} rounds (paths take turns within a round; the first round is not counted)")
    print(f"{'path':44s} {'median s':>9s} {'MB/s':>8s} {'vs plain TCP':>13s}")
    for name, times in rows:
        median = statistics.median(times)
        print(f"{name:44s} {median:9.4f} {size / median / 1e6:8.0f} {reference / median:12.2f}x")
    direct = reference / statistics.median(rows[1][1])
    sealed = statistics.median(rows[1][1]) / statistics.median(rows[2][1])
    sealed_rate = size / statistics.median(rows[2][1])
    met = direct >= GOAL
    print(f"goal: direct path at {GOAL:.0%} of plain TCP or better: {direct:.0%} ({'met' if met else 'NOT met'})")
    met_sealed = sealed_rate >= SEALED_GOAL_BYTES_PER_S
    print(f"goal: sealed direct path at {SEALED_GOAL_BYTES_PER_S / 1e9:g} GB/s or better: {sealed_rate / 1e9:.2f} GB/s "
          f"({'met' if met_sealed else 'NOT met'}); it runs at {sealed:.0%} of the unsealed path's speed")
    relayed = statistics.median(rows[2][1]) / statistics.median(rows[3][1])
    print(f"relayed: {size / statistics.median(rows[3][1]) / 1e9:.2f} GB/s, {relayed:.0%} of the sealed direct path "
          "(the relay's splice copies every byte once more, on the same machine)")
    return 0 if met and met_sealed else 1


if __name__ == "__main__":
    sys.exit(main())
