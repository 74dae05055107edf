"""What the pipeline and gossip code see of the network: send a tensor to a peer, receive an expected one.

Implementations: `NetworkTransport` (a direct TCP path with hivemind P2P as the fallback) and
`MemoryTransport` (in-process, for tests and simulations). Both run every frame through the same
encoding and the same `Inbox` checks, so what a test sees is what the network does.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod
from typing import Iterable

import torch

from hetpeer.peer.transport.codec import checksum, encode, wire_codec
from hetpeer.peer.transport.inbox import Inbox, Policy
from hetpeer.protocol.frame import FrameHeader

DEFAULT_MAX_FRAME_BYTES = 1 << 30


class Transport(ABC):
    def __init__(self, device: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.device = device
        self.inbox = Inbox(device, max_frame_bytes=max_frame_bytes)
        self.sent: collections.Counter[str] = collections.Counter()  # payload bytes queued per peer, probes aside
        self.encoded_on: collections.Counter[str] = collections.Counter()  # frames by the device they were encoded on

    def set_policy(self, policy: Policy) -> None:
        """What this peer accepts: a function of the header that returns a reason to refuse, or None."""
        self.inbox.policy = policy

    def send(
        self,
        to: str,
        kind: str,
        tensor: torch.Tensor,
        *,
        step: int,
        micro: int = 0,
        epoch: int = 0,
        codec: str = "raw",
        copy: bool = True,
    ) -> None:
        """Queue `tensor` for `to` and return; delivery errors surface at a later send or `flush`.

        With `copy=False` the frame may read the tensor's memory until it has left: the caller must not
        change the tensor before `flush` (the pipeline never changes activations or gradients it sent).
        """
        codec = wire_codec(tensor, codec)
        dtype, payload = encode(tensor, codec, copy=copy)
        header = FrameHeader(
            kind=kind,
            dtype=dtype,
            shape=tuple(tensor.shape),
            sender=self.device,
            step=step,
            micro=micro,
            epoch=epoch,
            codec=codec,
            checksum=checksum(payload),
        )
        if kind != "probe":
            self.sent[to] += payload.nbytes
        self.encoded_on[tensor.device.type] += 1
        self._send(to, header, payload)

    def recv(self, kind: str, sender: str, step: int, micro: int, timeout_s: float) -> torch.Tensor:
        return self.inbox.recv(kind, sender, step, micro, timeout_s)

    def take(self, kind: str, sender: str, step: int, micro: int, timeout_s: float) -> tuple[FrameHeader, torch.Tensor]:
        """`recv`, with the frame's header (its checksum says which bytes came)."""
        return self.inbox.take(kind, sender, step, micro, timeout_s)

    @abstractmethod
    def _send(self, to: str, header: FrameHeader, payload: memoryview) -> None: ...

    @abstractmethod
    def flush(self, timeout_s: float, to: Iterable[str] | None = None) -> None:
        """Block until every frame queued (for the peers `to`, or all) has left, or raise the error that
        stopped one: PeerUnreachable, or TransportTimeout past the deadline."""

    def arrived_bytes(self, sender: str) -> int:
        """Payload bytes of frames other than probes that have arrived from `sender` so far."""
        return self.inbox.received[sender]

    def reaches(self, peer: str) -> bool:
        """Whether this peer has a way to send to `peer` now, without waiting on `peer` to connect first (a transport
        that reaches every peer it knows says True)."""
        return True

    def unsent_bytes(self, to: str) -> int:
        """Of the bytes `sent` to `to`, how many have not crossed yet, as far as this end can tell."""
        return 0

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def __enter__(self) -> "Transport":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
