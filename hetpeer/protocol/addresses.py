"""Where each peer can be reached: a direct TCP address and hivemind P2P multiaddrs.

The address book maps device ids to addresses. A static run reads it from a file that the local
launcher writes (or that the organisers of a fixed set of machines write by hand); its wire form:

    {"version": 1,
     "peers": {"DEVICE": {"direct": "HOST:PORT",                        # optional
                          "key": "<SHA-256 of its link key, 64 hex>",   # with "direct"
                          "p2p": ["/ip4/.../tcp/PORT/p2p/PEER_ID", ...]}}} # optional, may be empty

A peer with neither kind of address cannot be reached and is refused at parse time. A direct link opens
with the handshake of `handshake.py` and is sealed: in a fixed plan a peer proves its device id with the key
whose digest the book gives it (`hetpeer key` prints a key's), so the book of a peer with a direct address
must carry one. P2P streams are authenticated by their peer id and sealed by libp2p.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hetpeer.protocol.wire import SchemaError, field, need_int, need_list, need_mapping, need_str, no_extra_fields

BOOK_VERSION = 1
MADDR_TCP_RE = re.compile(r"/(ip4|ip6|dns4|dns6|dns)/([^/]+)/tcp/(\d+)")  # protocol, host, port of a TCP multiaddr
LINK_CHOICES = ("auto", "tcp", "p2p")  # how peers reach each other: direct TCP falling back to P2P, or only one
KEY_RE = re.compile(r"[0-9a-f]{64}\Z")  # a key's whole SHA-256 (`identity.key_digest`)


@dataclass(frozen=True, slots=True)
class PeerAddress:
    direct: tuple[str, int] | None = None  # (host, port)
    p2p: tuple[str, ...] = ()  # multiaddrs that end in /p2p/<peer id>
    # from its record, not the wire: whether others can dial it (else frames to it use its own connections), and
    # the device that relays for it
    dialable: bool = True
    relay: str | None = None
    punch: int | None = None  # the port it punches holes from (`peer/transport/punch.py`), when it does
    key: str | None = None  # in a fixed plan's book: the SHA-256 of the link key the peer proves itself with

    @property
    def p2p_peer_id(self) -> str | None:
        return self.p2p[0].rsplit("/p2p/", 1)[1] if self.p2p else None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"p2p": list(self.p2p)}
        if self.direct is not None:
            wire["direct"] = f"{self.direct[0]}:{self.direct[1]}"
        if self.key is not None:
            wire["key"] = self.key
        return wire

    @staticmethod
    def from_wire(raw: Any, path: str) -> "PeerAddress":
        record = need_mapping(raw, path)
        no_extra_fields(record, {"direct", "p2p", "key"}, path)
        direct = host_port(record["direct"], f"{path}.direct") if "direct" in record else None
        p2p = peer_maddrs(record.get("p2p", []), f"{path}.p2p")
        if direct is None and not p2p:
            raise SchemaError(path, "has neither a direct address nor a p2p multiaddr")
        key = None
        if "key" in record:
            key = need_str(record["key"], f"{path}.key")
            if not KEY_RE.match(key):
                raise SchemaError(f"{path}.key", f"must be the SHA-256 of a link key, 64 lowercase hex digits "
                                                 f"(`hetpeer key FILE` prints it), got {key[:80]!r}")
        return PeerAddress(direct=direct, p2p=p2p, key=key)


@dataclass(frozen=True, slots=True)
class AddressBook:
    peers: Mapping[str, PeerAddress]

    def get(self, device: str) -> PeerAddress:
        if device not in self.peers:
            raise KeyError(f"no address for peer {device!r} in the address book")
        return self.peers[device]

    def keys(self) -> dict[str, str]:
        """Device id -> the SHA-256 of its link key, for every peer the book gives one (a fixed plan's)."""
        return {device: address.key for device, address in self.peers.items() if address.key is not None}

    def device_of_p2p_id(self, peer_id: str) -> str | None:
        """The device whose P2P identity is `peer_id`: P2P streams authenticate their remote end."""
        for device, address in self.peers.items():
            if address.p2p_peer_id == peer_id:
                return device
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"version": BOOK_VERSION, "peers": {d: a.to_wire() for d, a in sorted(self.peers.items())}}

    @staticmethod
    def from_wire(raw: Any) -> "AddressBook":
        root = need_mapping(raw, "addresses")
        no_extra_fields(root, {"version", "peers"}, "addresses")
        version = need_int(field(root, "version", "addresses"), "addresses.version")
        if version != BOOK_VERSION:
            raise SchemaError("addresses.version", f"must be {BOOK_VERSION}, got {version}")
        peers = need_mapping(field(root, "peers", "addresses"), "addresses.peers")
        book = AddressBook(
            {need_str(d, "addresses.peers"): PeerAddress.from_wire(a, f"addresses.peers.{d}") for d, a in peers.items()}
        )
        for device, address in sorted(book.peers.items()):
            if address.direct is not None and address.key is None:
                raise SchemaError(f"addresses.peers.{device}.key", "missing: a peer with a direct address proves itself "
                                  "with the link key whose SHA-256 this gives (on its machine, `hetpeer key FILE` makes "
                                  "one and prints it; `hetpeer launch` writes them)")
        return book

    @staticmethod
    def load(path: str | Path) -> "AddressBook":
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as error:
            raise SchemaError("addresses", f"cannot read {path}: {error.strerror or error}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SchemaError("addresses", f"{path} is not JSON: {error}") from None
        return AddressBook.from_wire(raw)


def maddr_host(maddr: str) -> str | None:
    """The host of a TCP multiaddr (/ip4/HOST/tcp/..., /dns4/HOST/tcp/..., ...), None for others."""
    match = MADDR_TCP_RE.match(maddr)
    return match.group(2) if match else None


def peer_maddrs(raw: Any, path: str) -> tuple[str, ...]:
    """Multiaddrs of one libp2p peer: each ends in /p2p/<peer id>, all with the same id."""
    maddrs = tuple(need_str(maddr, f"{path}[{i}]") for i, maddr in enumerate(need_list(raw, path)))
    ids = set()
    for i, maddr in enumerate(maddrs):
        if "/p2p/" not in maddr or not maddr.startswith("/") or not maddr.rsplit("/p2p/", 1)[1]:
            raise SchemaError(f"{path}[{i}]", f"must be a multiaddr ending in /p2p/<peer id>, got {maddr!r}")
        ids.add(maddr.rsplit("/p2p/", 1)[1])
    if len(ids) > 1:
        raise SchemaError(path, f"multiaddrs name different peer ids: {sorted(ids)}")
    return maddrs


def host_port(raw: Any, path: str) -> tuple[str, int]:
    """(host, port) from "HOST:PORT" (or "[IPv6]:PORT"); SchemaError at `path` when it is not one."""
    text = need_str(raw, path)
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")  # [IPv6]:PORT
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise SchemaError(path, f"must be HOST:PORT with a port in 1..65535, got {text!r}")
    return host, int(port)
