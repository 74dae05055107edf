"""The join file: everything a peer must be told to join a swarm, in one small JSON file.

`hetpeer coordinator --join-file PATH` writes it when it starts; `hetpeer join --join-file PATH` reads
it instead of `--swarm`, `--coordinator-key`, `--initial-peers`, `--model` and `--dtype`. An organizer
hands it to volunteers; containers of one compose project share it through a volume.

    {"version": 1, "swarm": "docker", "coordinator_key": "<64 hex digits>",
     "initial_peers": ["/dns4/coordinator/tcp/31337/p2p/12D3KooW..."], "model": "tiny", "dtype": "fp32",
     "reach": "coordinator:31339", "api": "coordinator:31340"}

`reach` (optional) is the coordinator's reach service (`protocol/reach.py`): a peer asks it whether others
can dial it, the address they see, and the swarm's clock. `api` (optional) is the coordinator's gRPC API, which
a peer asks for its credit when it leaves (`coordinator/ledger.py`).

The key digest is what a peer trusts plans by, so the file is trusted like the flag it replaces: read it
from where the organizer put it, never from another peer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpeer.protocol.addresses import host_port, peer_maddrs
from hetpeer.protocol.wire import SchemaError, field, need_int, need_mapping, need_str, no_extra_fields

JOIN_VERSION = 1
MAX_JOIN_FILE_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class JoinInfo:
    swarm: str
    coordinator_key: str  # SHA-256 of the coordinator's public key, 64 lower-case hex digits
    initial_peers: tuple[str, ...]  # DHT multiaddrs with /p2p/<id>, of the coordinator's node
    model: str
    dtype: str
    reach: tuple[str, int] | None = None  # the coordinator's reach service
    api: tuple[str, int] | None = None  # the coordinator's gRPC API (without TLS)

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "version": JOIN_VERSION, "swarm": self.swarm, "coordinator_key": self.coordinator_key,
            "initial_peers": list(self.initial_peers), "model": self.model, "dtype": self.dtype,
        }  # fmt: skip
        if self.reach is not None:
            wire["reach"] = f"{self.reach[0]}:{self.reach[1]}"
        if self.api is not None:
            wire["api"] = f"{self.api[0]}:{self.api[1]}"
        return wire

    @staticmethod
    def from_wire(raw: Any) -> "JoinInfo":
        root = need_mapping(raw, "join")
        no_extra_fields(root, {"version", "swarm", "coordinator_key", "initial_peers", "model", "dtype", "reach", "api"}, "join")
        version = need_int(field(root, "version", "join"), "join.version")
        if version != JOIN_VERSION:
            raise SchemaError("join.version", f"must be {JOIN_VERSION}, got {version}")
        key = need_str(field(root, "coordinator_key", "join"), "join.coordinator_key")
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise SchemaError("join.coordinator_key", f"must be 64 lower-case hex digits, got {key!r}")
        peers = peer_maddrs(field(root, "initial_peers", "join"), "join.initial_peers")
        if not peers:
            raise SchemaError("join.initial_peers", "must name at least one multiaddr")
        return JoinInfo(
            swarm=need_str(field(root, "swarm", "join"), "join.swarm"), coordinator_key=key, initial_peers=peers,
            model=need_str(field(root, "model", "join"), "join.model"), dtype=need_str(field(root, "dtype", "join"), "join.dtype"),
            reach=host_port(root["reach"], "join.reach") if "reach" in root else None,
            api=host_port(root["api"], "join.api") if "api" in root else None,
        )

    @staticmethod
    def load(path: str | Path) -> "JoinInfo":
        path = Path(path)
        try:
            with open(path, "rb") as file:
                text = file.read(MAX_JOIN_FILE_BYTES + 1)
        except OSError as error:
            raise SchemaError("join", f"cannot read {path}: {error.strerror or error}") from None
        if len(text) > MAX_JOIN_FILE_BYTES:
            raise SchemaError("join", f"{path} is larger than {MAX_JOIN_FILE_BYTES} bytes: not a join file")
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise SchemaError("join", f"{path} is not JSON: {error}") from None
        return JoinInfo.from_wire(raw)

    def write(self, path: str | Path) -> None:
        """Written whole and renamed into place: a reader never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(self.to_wire(), indent=1) + "\n")
        os.replace(partial, path)
