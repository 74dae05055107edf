"""Moving tensors between peers: frames, a direct TCP path, hivemind P2P, and an in-memory hub."""

from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.inbox import Interrupted, PeerUnreachable, TransportError, TransportTimeout
from hetpeer.peer.transport.links import P2PLink, TcpLink
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.peer.transport.memory import MemoryHub, MemoryTransport
from hetpeer.peer.transport.network import NetworkTransport

__all__ = [
    "Interrupted",
    "LinkIdentity",
    "MemoryHub",
    "MemoryTransport",
    "NetworkTransport",
    "P2PLink",
    "PeerUnreachable",
    "TcpLink",
    "Transport",
    "TransportError",
    "TransportTimeout",
]
