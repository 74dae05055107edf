"""Relays: how two peers that nobody can dial (both behind NAT) reach each other, through a peer both can dial.

A relay is a stranger: it splices two TCP connections and counts the bytes, and that is all it can do. The two
ends then run the link handshake through it (`sealed.py`): each proves its device id to the other, and the
keys that seal the stream are theirs alone, so the relay can neither read nor alter a frame (an altered
record ends the stream).

Every request starts where a dialer's proof would, after the relay's challenge (a proof's first two bytes are
a device id's length, never "HP"): RELAY_MAGIC, one byte of request, one byte of length, then that many bytes.

    LISTEN  device id + a proof (role dialer, over the relay's challenge)  the callee registers; it then hears
                                                                           a 16-byte token per call, over this
                                                                           connection
    CONNECT device id                                                      a caller asks for the callee; the
                                                                           relay answers one status byte (0:
                                                                           spliced; else a length and a reason)
    ACCEPT  16-byte token                                                  the callee's new connection for a call

`Relay` serves them on a public peer (its `TcpLink` hands it relay requests); `RelayLink` is the link that uses
one: it opens streams through the relay of a peer that announces one (`PeerAddress.relay`), and, while this
peer itself is reachable only through a relay (`via`), keeps its registration there and answers calls.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from typing import Callable

from hetpeer.peer.transport.links import HANDSHAKE_TIMEOUT_S, RELAY_MAGIC, Link, SocketStream, connect, spawn
from hetpeer.peer.transport.sealed import Hello, answer, dial, read_proof
from hetpeer.peer.transport.stream import Identify, LinkIdentity, Refuse, Serve, Stream
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.handshake import CHALLENGE_BYTES, LENGTHS, HandshakeError, check, prove, read_challenge

log = logging.getLogger("hetpeer.transport")
LISTEN, CONNECT, ACCEPT = 1, 2, 3
TOKEN_BYTES = 16
CALL_TIMEOUT_S = 10.0  # a caller waits this long for the callee to answer through the relay
MAX_CALLS = 64  # calls waiting for their callee at once, over all callees
SPLICE_BYTES = 1 << 18


class RelayRefused(ConnectionError):
    """The relay could not connect the call (the callee is not registered there, or did not answer)."""


def request(op: int, body: bytes) -> bytes:
    if len(body) > 255:
        raise ValueError(f"a relay request's body is at most 255 bytes, got {len(body)}")
    return RELAY_MAGIC + bytes((op, len(body))) + body


class Relay:
    """The relay side, on a peer others can dial: registrations, calls, and spliced pairs with their bytes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.relayed_bytes = 0  # both directions, every call
        self.calls: collections.Counter[str] = collections.Counter()  # calls connected, per callee
        self.active = 0  # spliced pairs now
        self._listening: dict[str, SocketStream] = {}
        self._waiting: dict[bytes, asyncio.Future] = {}

    async def handle(self, stream: SocketStream, head: bytes, hello: Hello, identity: LinkIdentity) -> None:
        op, length = head[len(RELAY_MAGIC)], head[len(RELAY_MAGIC) + 1]
        body = bytes(await asyncio.wait_for(stream.read_exactly(length), HANDSHAKE_TIMEOUT_S))
        if op == LISTEN:
            await self._listen(stream, body.decode(errors="replace"), hello, identity)
        elif op == CONNECT:
            await self._connect(stream, body.decode(errors="replace"))
        elif op == ACCEPT:
            waiting = self._waiting.pop(body, None)
            if waiting is None or waiting.done():
                raise HandshakeError("relay: an answer to no call")
            waiting.set_result(stream)  # the caller's task splices it
        else:
            raise HandshakeError(f"relay: unknown request {op}")

    async def _listen(self, stream: SocketStream, device: str, hello: Hello, identity: LinkIdentity) -> None:
        proof = await asyncio.wait_for(read_proof(stream), HANDSHAKE_TIMEOUT_S)
        check(proof, "dialer", hello.nonce, identity.device, hello.key.public, expected=device)
        old = self._listening.get(device)
        if old is not None:
            old.close()
        self._listening[device] = stream
        await stream.write([b"\0"])
        log.info("%s relays for %s", self.device, device)
        try:
            await stream.read_exactly(1)  # a callee sends nothing: this returns when its connection ends
        except ConnectionError:
            pass
        finally:
            if self._listening.get(device) is stream:
                del self._listening[device]
            stream.close()

    async def _connect(self, caller: SocketStream, device: str) -> None:
        callee = self._listening.get(device)
        if callee is None or len(self._waiting) >= MAX_CALLS:
            await _refuse(caller, f"{device} is not registered at relay {self.device}" if callee is None else
                          f"relay {self.device} has {MAX_CALLS} calls waiting")
            return
        token = os.urandom(TOKEN_BYTES)
        answered = self._waiting[token] = asyncio.get_running_loop().create_future()
        try:
            async with callee.lock:
                await callee.write([token])
            other = await asyncio.wait_for(answered, CALL_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, OSError) as error:
            await _refuse(caller, f"{device} did not answer through relay {self.device}: {str(error) or 'timed out'}")
            return
        finally:
            self._waiting.pop(token, None)
        self.calls[device] += 1
        await caller.write([b"\0"])
        await self._splice(caller, other)

    async def _splice(self, a: SocketStream, b: SocketStream) -> None:
        async def pump(source: SocketStream, sink: SocketStream) -> None:
            loop, buffer = asyncio.get_running_loop(), bytearray(SPLICE_BYTES)
            view = memoryview(buffer)
            try:
                while (n := await loop.sock_recv_into(source.sock, view)) > 0:
                    await loop.sock_sendall(sink.sock, view[:n])
                    self.relayed_bytes += n
                sink.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        self.active += 1
        try:
            await asyncio.gather(pump(a, b), pump(b, a))
        finally:
            self.active -= 1
            a.close()
            b.close()


async def _refuse(stream: SocketStream, reason: str) -> None:
    text = reason.encode()[:255]
    try:
        await stream.write([bytes((1, len(text))), text])
    finally:
        stream.close()


class RelayLink(Link):
    """Streams through a relay: to peers that announce one, and, with `via` set, from them to this peer."""

    name = "relay"
    errors = (OSError, asyncio.TimeoutError, HandshakeError)

    def __init__(self, identity: LinkIdentity, book: Callable[[], AddressBook] = lambda: AddressBook({})) -> None:
        self.identity, self.book = identity, book
        self.via: str | None = None  # the relay this peer registers at, when nobody can dial it
        self.registered: str | None = None  # where it is registered now
        self._task: asyncio.Task | None = None

    async def start(self, device: str, identify: Identify, serve: Serve, refuse: Refuse) -> None:
        self._task = spawn(self._stay_registered(serve, refuse), f"{device}-relay-registration")

    def address(self) -> PeerAddress:
        return PeerAddress()

    def reaches(self, address: PeerAddress) -> bool:
        # a relay does not call its own callees: they connect to it anyway, and their bytes would count as relayed
        return address.relay is not None and address.relay != self.identity.device

    async def open(self, to: str, address: PeerAddress) -> Stream:
        stream, _ = await self._at_relay(address.relay)
        try:
            await stream.write([request(CONNECT, to.encode())])
            status = bytes(await stream.read_exactly(1))
            if status != b"\0":
                reason = bytes(await stream.read_exactly(bytes(await stream.read_exactly(1))[0])).decode(errors="replace")
                raise RelayRefused(f"relay {address.relay}: {reason}")
            return await asyncio.wait_for(dial(stream, self.identity, to), HANDSHAKE_TIMEOUT_S)
        except BaseException:
            stream.close()
            raise

    async def _at_relay(self, relay: str) -> tuple[SocketStream, tuple[bytes, bytes]]:
        """A connection to `relay`, and the (nonce, X25519 key) of its challenge, read off it."""
        address = self.book().peers.get(relay)
        if address is None or address.direct is None:
            raise RelayRefused(f"relay {relay} has no direct address in the address book")
        stream = await connect(*address.direct)
        try:
            return stream, read_challenge(bytes(await asyncio.wait_for(stream.read_exactly(CHALLENGE_BYTES), HANDSHAKE_TIMEOUT_S)))
        except BaseException:
            stream.close()
            raise

    async def _stay_registered(self, serve: Serve, refuse: Refuse) -> None:
        """While `via` names a relay: be registered there and answer its calls; re-register when it drops."""
        while True:
            relay = self.via
            if relay is None:
                await asyncio.sleep(0.5)
                continue
            try:
                stream, (nonce, key) = await self._at_relay(relay)
                me = self.identity.device
                await stream.write([request(LISTEN, me.encode()), prove(self.identity.private_key, "dialer", nonce, me, relay, key).encode()])
                if bytes(await asyncio.wait_for(stream.read_exactly(1), HANDSHAKE_TIMEOUT_S)) != b"\0":
                    raise RelayRefused(f"relay {relay} refused the registration")
                self.registered = relay
                log.info("%s is registered at relay %s", me, relay)
                watching = spawn(self._watch(relay, stream), f"{me}-relay-watch")
                try:
                    while True:
                        token = bytes(await stream.read_exactly(TOKEN_BYTES))
                        spawn(self._answer(relay, token, serve, refuse), f"{me}-relay-call")
                finally:
                    watching.cancel()
                    stream.close()
            except (OSError, asyncio.TimeoutError, HandshakeError) as error:
                log.info("%s: registration at relay %s ended: %s", self.identity.device, relay, error)
            self.registered = None
            await asyncio.sleep(1.0)

    async def _watch(self, relay: str, stream: SocketStream) -> None:
        """Close the registration when `via` moves to another relay."""
        while self.via == relay:
            await asyncio.sleep(0.5)
        stream.close()

    async def _answer(self, relay: str, token: bytes, serve: Serve, refuse: Refuse) -> None:
        """A call: a new connection to the relay answers it, then this peer listens on it, as on its own port."""
        try:
            stream, _ = await self._at_relay(relay)
        except (OSError, asyncio.TimeoutError, HandshakeError) as error:
            log.info("%s: cannot answer a call at relay %s: %s", self.identity.device, relay, error)
            return
        hello = Hello()
        try:
            await stream.write([request(ACCEPT, token), hello.challenge()])
            head = bytes(await asyncio.wait_for(stream.read_exactly(LENGTHS.size), HANDSHAKE_TIMEOUT_S))
            sealed = await asyncio.wait_for(answer(stream, self.identity, hello, head), HANDSHAKE_TIMEOUT_S)
        except (HandshakeError, ConnectionError, OSError, asyncio.TimeoutError) as error:
            refuse(f"relay {relay}", f"link handshake through the relay failed: {error or 'timed out'}")
            stream.close()
            return
        sealed.route = "relay"  # the caller's frames come through the relay, and frames back go the same way
        await serve(sealed)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
