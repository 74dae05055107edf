"""What a link gives the transport: a stream of bytes to one other peer, and who that peer proved to be."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence


class Stream(ABC):
    remote: str  # for logs
    authenticated: str | None  # the device at the other end, when the link proves it
    closed = False
    # how it came: the name of the link that dialled it ("tcp", "relay", "p2p"; the transport sets it), "punched"
    # (`punch.py`), "relay" for a call answered through this peer's relay (`relay.py`), else "back": the other end
    # dialled this peer directly
    route = "back"
    _lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a whole frame is written: two channels may share a stream."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @abstractmethod
    async def read_exactly(self, n: int, progress: Progress | None = None) -> memoryview | bytearray:
        """Exactly n bytes in a writable buffer, or ConnectionError when the stream ends first;
        `progress(buffer, end)` hears of the bytes as they arrive."""

    async def read_some(self, into: memoryview) -> int:
        """Up to len(into) bytes, as many as have arrived (at least one); ConnectionError when the stream ended.
        Streams that a sealed stream wraps have it."""
        raise NotImplementedError(f"{type(self).__name__} reads only whole lengths")

    @abstractmethod
    async def write(self, parts: Sequence[bytes]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def unsent_bytes(self) -> int:
        """Bytes written but not yet across (as far as this end can tell)."""
        return 0

    def unread_bytes(self) -> int:
        """Bytes arrived but not yet read (as far as this end can tell)."""
        return 0


Serve = Callable[[Stream], Awaitable[None]]
Progress = Callable[[memoryview, int], None]
Identify = Callable[[str], "str | None"]
Refuse = Callable[[str, str], None]  # (remote, reason): a connection closed before it carried a frame


@dataclass(frozen=True, slots=True)
class LinkIdentity:
    """What a peer proves itself with on direct links: its device id and the key it is bound to (a hivemind
    RSAPrivateKey: a swarm peer's signs its records). In a fixed plan `book` maps each device of the address book
    to its key's SHA-256: the others prove themselves by those, not by their names (`handshake.check`)."""

    device: str
    private_key: object
    book: Mapping[str, str] | None = None
