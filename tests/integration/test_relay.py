"""Two peers nobody can dial reach each other through a third that both can (real TCP on 127.0.0.1): the
relay splices their connections and counts the bytes; the two ends prove themselves to each other through
it and seal what they send, so the relay cannot read a frame, and an altered one never reaches the inbox."""

from __future__ import annotations

import pytest
import torch

from hetpeer.peer.reach import free_port
from hetpeer.peer.transport.inbox import PeerUnreachable, TransportTimeout
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.peer.transport.relay import Relay, RelayLink
from hetpeer.protocol.addresses import AddressBook, PeerAddress

from tests.integration.test_link_auth import identity, wait_for

PATTERN = torch.arange(4096, dtype=torch.float32) * 1.2345  # bytes easy to look for in what the relay carried


def peer(me, port: int | None = None):
    """A transport with a direct link (serving as a relay where it can be dialled) and a relay link."""
    tcp = TcpLink("127.0.0.1", port or free_port(), identity=me)
    tcp.relay = Relay(me.device)
    relay_link = RelayLink(me)
    transport = NetworkTransport(me.device, AddressBook({}), [tcp, relay_link], connect_timeout_s=5.0)
    relay_link.book = lambda: transport.book
    return transport, tcp.relay, relay_link


@pytest.fixture()
def swarm():
    """r can be dialled; a and b cannot (their book entries point at closed ports) and register at r."""
    r, a, b = identity("relay"), identity("alice"), identity("bob")
    r_port = free_port()
    book = AddressBook({
        r.device: PeerAddress(direct=("127.0.0.1", r_port)),
        a.device: PeerAddress(direct=("127.0.0.1", free_port()), dialable=False, relay=r.device),
        b.device: PeerAddress(direct=("127.0.0.1", free_port()), dialable=False, relay=r.device),
    })
    (tr, relay, _), (ta, _, la), (tb, _, lb) = peer(r, r_port), peer(a), peer(b)
    with tr, ta, tb:
        for t in (tr, ta, tb):
            t.book = book
        la.via = lb.via = r.device
        wait_for(lambda: la.registered == r.device and lb.registered == r.device, 20)
        yield r, a, b, tr, ta, tb, relay


def test_frames_cross_between_two_undialable_peers_through_the_relay_both_ways(swarm):
    r, a, b, tr, ta, tb, relay = swarm
    ta.send(b.device, "activation", PATTERN, step=0)
    ta.flush(15)
    assert torch.equal(tb.recv("activation", a.device, 0, 0, timeout_s=15), PATTERN)
    tb.send(a.device, "gradient", PATTERN * 2, step=0)  # back over the stream a opened through the relay
    tb.flush(15)
    assert torch.equal(ta.recv("gradient", b.device, 0, 0, timeout_s=15), PATTERN * 2)
    assert ta.routes[b.device] == "relay" and tb.routes[a.device] == "relay"  # b answers over the call a placed
    assert ta.paths()[b.device] == tb.paths()[a.device] == "relayed"
    assert relay.relayed_bytes > 2 * PATTERN.numel() * 4 and relay.calls[b.device] == 1
    assert not ta.inbox.misbehaving and not tb.inbox.misbehaving


def test_the_relay_cannot_read_what_it_carries(swarm, monkeypatch):
    r, a, b, tr, ta, tb, relay = swarm
    carried = bytearray()
    original = relay._splice

    async def sniffing(x, y):
        import asyncio

        loop = asyncio.get_running_loop()
        real = loop.sock_sendall

        async def sendall(sock, data):
            carried.extend(bytes(data))
            await real(sock, data)

        monkeypatch.setattr(loop, "sock_sendall", sendall)
        await original(x, y)

    monkeypatch.setattr(relay, "_splice", sniffing)
    ta.send(b.device, "activation", PATTERN, step=0)
    ta.flush(15)
    assert torch.equal(tb.recv("activation", a.device, 0, 0, timeout_s=15), PATTERN)
    assert len(carried) > PATTERN.numel() * 4
    assert PATTERN.numpy().tobytes()[:64] not in carried and a.device.encode() in carried  # ids in the proofs, no payload


def test_a_frame_altered_by_the_relay_never_reaches_the_inbox(swarm, monkeypatch, caplog):
    r, a, b, tr, ta, tb, relay = swarm

    async def tampering(x, y):
        import asyncio

        loop = asyncio.get_running_loop()
        real = loop.sock_sendall

        async def sendall(sock, data):
            data = bytearray(data)
            if len(data) > 4096:  # not a handshake message (about 1 KiB): a sealed frame; flip its last byte
                data[-1] ^= 0xFF
            await real(sock, data)

        monkeypatch.setattr(loop, "sock_sendall", sendall)
        await original(x, y)

    original = relay._splice
    monkeypatch.setattr(relay, "_splice", tampering)
    caplog.set_level("INFO", logger="hetpeer.transport")
    ta.send(b.device, "activation", PATTERN, step=0)
    ta.flush(15)
    with pytest.raises(TransportTimeout):
        tb.recv("activation", a.device, 0, 0, timeout_s=3)
    assert any("failed its integrity check" in rec.getMessage() for rec in caplog.records)
    assert not tb.inbox.misbehaving, "nothing counts against alice: the relay altered it"


def test_a_callee_not_registered_at_the_relay_is_a_clear_error(swarm):
    r, a, b, tr, ta, tb, relay = swarm
    ghost = identity("ghost")
    ta.book = AddressBook({**ta.book.peers, ghost.device: PeerAddress(direct=("127.0.0.1", free_port()), dialable=False,
                                                                        relay=r.device)})
    ta.send(ghost.device, "activation", PATTERN, step=0)
    with pytest.raises(PeerUnreachable, match=f"{ghost.device} is not registered at relay {r.device}"):
        ta.flush(15)
