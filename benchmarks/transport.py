"""Transport benchmark: moving 64 MB of activations between two processes on 127.0.0.1.

    python3 benchmarks/transport.py [--mbytes 64] [--repeats 5] [--codecs]

Three paths in one run, each timed from the sender's `send` until the receiver's acknowledgement
arrives (so the figure covers encoding, checksums, the copy through the kernel, decoding and the
finiteness check):

- plain TCP: `sendall` of the raw bytes into a receiver's preallocated buffer, a one-byte ack: the
  reference no transport that frames and checks its data can beat;
- direct: hetpeer's `NetworkTransport` over `TcpLink`;
- p2p: hetpeer's `NetworkTransport` over hivemind's `P2PLink` (libp2p streams through p2pd).

Goal: the direct path at 50% of plain TCP or better. `--codecs` adds the direct path with fp16, bf16
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
from pathlib import Path

import torch

from hetpeer.peer.launch import free_port
from hetpeer.peer.node import p2p_peer_id
from hetpeer.peer.transport.network import NetworkTransport, P2PLink, TcpLink
from hetpeer.protocol.addresses import AddressBook, PeerAddress

GOAL = 0.5
ACK = torch.zeros(1)


def book_for(folder: Path, mode: str) -> tuple[AddressBook, dict[str, str]]:
    from hivemind.p2p import P2P

    peers, keys = {}, {}
    for device in ("sender", "receiver"):
        if mode == "direct":
            peers[device] = PeerAddress(direct=("127.0.0.1", free_port()))
        else:
            keys[device] = str(folder / f"{device}.key")
            P2P.generate_identity(keys[device])
            peers[device] = PeerAddress(p2p=(f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{p2p_peer_id(keys[device])}",))
    return AddressBook(peers), keys


def transport_for(device: str, book: AddressBook, keys: dict[str, str], mode: str) -> NetworkTransport:
    address = book.get(device)
    if mode == "direct":
        link = TcpLink(*address.direct)
    else:
        link = P2PLink(identity_path=keys[device], host_maddrs=[address.p2p[0].rsplit("/p2p/", 1)[0]])
    return NetworkTransport(device, book, [link], max_frame_bytes=1 << 31)


def receiver(folder: Path, mode: str, rounds: int) -> None:
    book = AddressBook.load(folder / "addresses.json")
    keys = json.loads((folder / "keys.json").read_text())
    torch.set_num_threads(1)
    with transport_for("receiver", book, keys, mode) as transport:
        print("ready", flush=True)
        for step in range(rounds):
            transport.recv("activation", "sender", step, 0, timeout_s=120)
            transport.send("sender", "gradient", ACK, step=step)
            transport.flush(60)
        transport.recv("probe", "sender", 0, 0, timeout_s=60)  # the sender is done with us


def framed(mode: str, tensor: torch.Tensor, repeats: int, codec: str = "raw") -> list[float]:
    folder = Path(tempfile.mkdtemp(prefix="hetpeer-bench-"))
    book, keys = book_for(folder, mode)
    (folder / "addresses.json").write_text(json.dumps(book.to_wire()))
    (folder / "keys.json").write_text(json.dumps(keys))
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--mode", mode, "--folder", str(folder),
         "--rounds", str(repeats + 1)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready", "receiver did not start"
        times = []
        torch.set_num_threads(1)
        with transport_for("sender", book, keys, mode) as transport:
            for step in range(repeats + 1):  # the first round opens the connection and is not counted
                started = time.perf_counter()
                transport.send("receiver", "activation", tensor, step=step, codec=codec, copy=False)
                transport.recv("gradient", "receiver", step, 0, timeout_s=120)
                if step:
                    times.append(time.perf_counter() - started)
            transport.send("receiver", "probe", ACK, step=0)
            transport.flush(60)
        child.wait(timeout=60)
        return times
    finally:
        if child.poll() is None:
            child.kill()


def plain_tcp(payload: bytes, repeats: int) -> list[float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = (
        "import socket,sys\n"
        f"s=socket.create_connection(('127.0.0.1',{port}));buf=bytearray({len(payload)});v=memoryview(buf)\n"
        f"for _ in range({repeats + 1}):\n"
        "    got=0\n"
        f"    while got<{len(payload)}: got+=s.recv_into(v[got:])\n"
        "    s.sendall(b'k')\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = listener.accept()
        times = []
        for i in range(repeats + 1):
            started = time.perf_counter()
            conn.sendall(payload)
            conn.recv(1)
            if i:
                times.append(time.perf_counter() - started)
        child.wait(timeout=60)
        return times
    finally:
        listener.close()
        if child.poll() is None:
            child.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=int, default=64, help="size of the activation tensor in MB (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per path (default 5)")
    parser.add_argument("--codecs", action="store_true", help="also time fp16, bf16 and int8 frames on the direct path")
    parser.add_argument("--role", default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receiver":
        receiver(args.folder, args.mode, args.rounds)
        return 0

    size = args.mbytes * 10**6
    tensor = torch.randn(size // 4)  # fp32 activations
    rows = [("plain TCP socket", plain_tcp(tensor.numpy().tobytes(), args.repeats))]
    rows.append(("direct (NetworkTransport, TcpLink)", framed("direct", tensor, args.repeats)))
    rows.append(("hivemind P2P (NetworkTransport, P2PLink)", framed("p2p", tensor, args.repeats)))
    if args.codecs:
        for codec in ("fp16", "bf16", "int8"):
            rows.append((f"direct, {codec} frames", framed("direct", tensor, args.repeats, codec)))
    reference = statistics.median(rows[0][1])
    print(f"moving {args.mbytes} MB of fp32 activations between two processes on 127.0.0.1, "
          f"median of {args.repeats} (first transfer not counted)")
    print(f"{'path':44s} {'median s':>9s} {'MB/s':>8s} {'vs plain TCP':>13s}")
    for name, times in rows:
        median = statistics.median(times)
        print(f"{name:44s} {median:9.4f} {size / median / 1e6:8.0f} {reference / median:12.2f}x")
    direct = reference / statistics.median(rows[1][1])
    met = direct >= GOAL
    print(f"goal: direct path at {GOAL:.0%} of plain TCP or better: {direct:.0%} ({'met' if met else 'NOT met'})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
