"""One end of a kept link for the lab's tests: a peer others can dial ("pub"), or one behind NAT ("home") that
keeps a connection to it. Not a test module: `test_dead_paths.py` starts one in each host's namespace.

    python link_peer.py {pub,home} BOOK.json KEY_DIR

Both run hetpeer's transport over a sealed `TcpLink`, ids bound to keys by the book (as a fixed plan's are),
and print, time-stamped, each change of whether a live connection joins them ("connected", "disconnected"):

- home dials pub (`keep_connected`), sends an activation each ROUND_S, and prints "answered STEP" when
  pub's gradient for it came back;
- pub answers each activation as it arrives with a gradient of the same step, over the connection home
  opened (the book says home cannot be dialled).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from hetpeer.peer.transport import TransportError
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.protocol.addresses import AddressBook
from hetpeer.protocol.identity import load_or_create_link_key

ROUND_S = 0.5


def say(line: str) -> None:
    print(f"{time.time():.3f} {line}", flush=True)


def watch(transport: NetworkTransport, other: str) -> None:
    was = None
    while True:
        now = transport.connected(other)
        if now != was:
            say("connected" if now else "disconnected")
            was = now
        time.sleep(0.1)


def main() -> int:
    role, book_path, keys = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    other = "home" if role == "pub" else "pub"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    book = AddressBook.load(book_path)
    book = AddressBook({**book.peers, "home": replace(book.get("home"), dialable=False)})  # it is behind NAT
    identity = LinkIdentity(role, load_or_create_link_key(keys / f"{role}.link.key"), book=book.keys())
    host, port = book.get(role).direct
    with NetworkTransport(role, book, [TcpLink("0.0.0.0", port, advertise_host=host, identity=identity)],
                          connect_timeout_s=5.0) as transport:
        threading.Thread(target=watch, args=(transport, other), daemon=True).start()
        if role == "home":
            transport.keep_connected([other])
        if role == "pub":  # answered on the transport's own thread, as each activation arrives
            def answer(header, tensor) -> None:
                try:
                    transport.send(other, "gradient", tensor, step=header.step)
                except TransportError as error:  # an earlier answer did not leave: this one may
                    say(f"not answered {header.step}: {error}")

            transport.inbox.handlers["activation"] = answer
            threading.Event().wait()
        step = 0
        while True:
            try:
                transport.send(other, "activation", torch.full((256,), float(step)), step=step)
                transport.recv("gradient", other, step, 0, timeout_s=ROUND_S * 2)
                say(f"answered {step}")
            except TransportError as error:
                say(f"lost {step}: {type(error).__name__}")
            time.sleep(ROUND_S)
            step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
