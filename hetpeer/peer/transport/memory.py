"""An in-process transport: peers in one process exchange frames through a shared hub.

Frames are encoded, screened and decoded exactly as on the network; only the sockets are missing.
A hub can cut a peer off (`unplug`) so tests can fault a peer without copying production code.
"""

from __future__ import annotations

import threading
from typing import Iterable

from hetpeer.peer.transport.base import DEFAULT_MAX_FRAME_BYTES, Transport
from hetpeer.peer.transport.inbox import PeerUnreachable
from hetpeer.protocol.frame import FrameHeader


class MemoryHub:
    def __init__(self) -> None:
        self.peers: dict[str, "MemoryTransport"] = {}
        self.unplugged: set[str] = set()
        self.lock = threading.Lock()

    def unplug(self, device: str) -> None:
        with self.lock:
            self.unplugged.add(device)


class MemoryTransport(Transport):
    def __init__(self, device: str, hub: MemoryHub, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        super().__init__(device, max_frame_bytes=max_frame_bytes)
        self.hub = hub

    def start(self) -> None:
        with self.hub.lock:
            self.hub.peers[self.device] = self

    def shutdown(self) -> None:
        with self.hub.lock:
            self.hub.peers.pop(self.device, None)

    def _send(self, to: str, header: FrameHeader, payload: memoryview) -> None:
        with self.hub.lock:
            target = self.hub.peers.get(to)
            cut = {to, self.device} & self.hub.unplugged
        if target is None or cut:
            raise PeerUnreachable(f"{self.device}: peer {to} is not reachable")
        target.deliver(header, payload)

    def deliver(self, header: FrameHeader, payload: bytes, authenticated: str | None = None) -> bool:
        """Hand over one frame as if it came off the wire; False when it was refused."""
        reason = self.inbox.screen(header, authenticated)
        if reason is not None:
            self.inbox.refuse(header, reason)
            return False
        if header.kind != "probe":
            self.inbox.received[header.sender] += len(payload)
        return self.inbox.offer(header, bytearray(payload))

    def flush(self, timeout_s: float, to: Iterable[str] | None = None) -> None:
        return None  # delivery happened in `send`
