"""The local launcher: every peer of a plan on this machine, each in its own `hetpeer join` process.

It gives each peer a TCP port and a link key (its direct links' handshake proves it, and seals them), and a
P2P key where P2P is used, writes the address book, starts the peers, shows their output prefixed by device id,
and stops them all when one fails, when all are done, or on Ctrl+C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Sequence

from hetpeer import logline
from hetpeer.peer.reach import free_port
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.plan import Plan


def link_key_path(out_dir: Path, device: str) -> Path:
    """Where `write_address_book` keeps `device`'s link key."""
    return out_dir / f"{device}.link.key"


def write_address_book(devices: Sequence[str], out_dir: Path, links: str, host: str = "127.0.0.1") -> Path:
    """Ports, link keys and P2P keys for `devices` on this machine; the book is `out_dir/addresses.json`, the keys
    beside it. Direct TCP alone (`links` "tcp") runs no P2P daemon."""
    from hetpeer.protocol.identity import load_or_create_link_key

    peers = {}
    for device in devices:
        direct = digest = None
        if links in ("auto", "tcp"):
            direct = (host, free_port(host))
            digest = load_or_create_link_key(link_key_path(out_dir, device)).digest
        p2p: tuple[str, ...] = ()
        if links in ("auto", "p2p"):
            from hivemind.p2p import P2P

            from hetpeer.peer.node import p2p_peer_id

            key = out_dir / f"{device}.key"
            if not key.exists():
                P2P.generate_identity(str(key))
            p2p = (f"/ip4/{host}/tcp/{free_port(host)}/p2p/{p2p_peer_id(str(key))}",)
        peers[device] = PeerAddress(direct=direct, p2p=p2p, key=digest)
    path = out_dir / "addresses.json"
    path.write_text(json.dumps(AddressBook(peers).to_wire(), indent=1))
    return path


def launch(
    plan_path: Path, plan: Plan, out_dir: Path, steps: int, links: str, join_args: Sequence[str], echo: Callable[[str], None]
) -> int:
    """Run every peer of `plan` for `steps` steps; 0 when all finish, 1 (after stopping the rest) when one fails.
    `echo` is called from one thread at a time, whatever it writes to."""
    echo = _one_at_a_time(echo)
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = plan.devices
    book = write_address_book(devices, out_dir, links)
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    echo(logline.stamp(f"starting {len(devices)} peers ({threads} thread(s) each); address book and logs in {out_dir}"))
    processes: dict[str, subprocess.Popen] = {}
    readers = []
    try:
        for device in devices:
            command = [
                sys.executable, "-m", "hetpeer", "join", "--plan", str(plan_path), "--as", device,
                "--peers", str(book), "--steps", str(steps), "--link", links, "--threads", str(threads),
                *join_args,
            ]
            if links != "tcp":
                command += ["--identity", str(out_dir / f"{device}.key")]
            if links != "p2p":
                command += ["--link-key", str(link_key_path(out_dir, device))]
            processes[device] = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            reader = threading.Thread(target=_relay, args=(device, processes[device], out_dir, echo), daemon=True)
            reader.start()
            readers.append(reader)
        failed = _wait(processes)
        if failed:
            _stop(processes.values())
        for reader in readers:
            reader.join(timeout=5)
        if failed:
            device, code = failed
            echo(logline.stamp(f"peer {device} failed (exit {code}); the other peers were stopped. Its log: {out_dir / device}.log"))
            return 1
        echo(logline.stamp(f"done: {len(devices)} peer(s) finished {steps} step(s)"))
        return 0
    finally:
        _stop(processes.values())


def _one_at_a_time(echo: Callable[[str], None]) -> Callable[[str], None]:
    """`echo` behind a lock: each peer's output has its own thread, and print writes a line and its end apart,
    so two peers' lines printed at once could otherwise share a line."""
    lock = threading.Lock()

    def serialised(line: str) -> None:
        with lock:
            echo(line)

    return serialised


def _relay(device: str, process: subprocess.Popen, out_dir: Path, echo: Callable[[str], None]) -> None:
    with open(out_dir / f"{device}.log", "w") as log:
        for line in process.stdout:
            log.write(line)
            log.flush()
            echo(logline.relabel(line.rstrip(), device))


def _wait(processes: dict[str, subprocess.Popen]) -> tuple[str, int] | None:
    """Wait for all; the first (device, exit code) that failed, or None."""
    running = dict(processes)
    while running:
        for device, process in list(running.items()):
            try:
                code = process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            del running[device]
            if code != 0:
                return device, code
    return None


def _stop(processes) -> None:
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        process.terminate()
    for process in alive:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
