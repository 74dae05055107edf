"""P2P identities for test peers: hivemind key files and their peer ids."""

from __future__ import annotations

from pathlib import Path


def make_keys(folder: Path, names) -> dict[str, tuple[str, str]]:
    """name -> (key file, base58 peer id), one fresh key per name under `folder`."""
    from hivemind.p2p import P2P

    from hetpeer.peer.node import p2p_peer_id

    keys = {}
    for name in names:
        path = folder / f"{name}.key"
        P2P.generate_identity(str(path))
        keys[name] = (str(path), p2p_peer_id(str(path)))
    return keys
