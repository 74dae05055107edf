"""Direct links prove both ends' device ids: frames sent in a member's name by anyone without its key never
reach the member's inbox, and the honest frames still do (real TCP on 127.0.0.1). In a swarm an id is bound to
its key by its name; in a fixed plan by the address book."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from hetpeer.peer.launch import free_port
from hetpeer.peer.transport.inbox import PeerUnreachable
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.stream import LinkIdentity
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.identity import device_id, load_or_create_link_key

KINDS = ("activation", "gradient", "params", "state_request", "probe")


def identity(name: str) -> LinkIdentity:
    key = RSAPrivateKey()
    return LinkIdentity(device_id(name, key.get_public_key().to_bytes()), key)


def transport(me: LinkIdentity | str, book: AddressBook, port: int | None = None) -> NetworkTransport:
    device = me.device if isinstance(me, LinkIdentity) else me
    link = TcpLink("127.0.0.1", port or free_port(), identity=me if isinstance(me, LinkIdentity) else None)
    return NetworkTransport(device, book, [link], connect_timeout_s=2.0)


@pytest.fixture()
def members():
    a, b = identity("alice"), identity("bob")
    book = AddressBook({m.device: PeerAddress(direct=("127.0.0.1", free_port())) for m in (a, b)})
    with transport(a, book, book.get(a.device).direct[1]) as ta, transport(b, book, book.get(b.device).direct[1]) as tb:
        yield a, b, ta, tb, book


def attack(attacker: NetworkTransport, victim: str, name: str) -> None:
    """Every kind of frame, each claiming to come from `name` (the member impersonated)."""
    try:
        for kind in KINDS:
            attacker.send(victim, kind, torch.full((4,), 666.0), step=0)
        attacker.flush(5)
    except PeerUnreachable:
        pass  # the victim closed the connection: what it should do


def wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_honest_frames_arrive_over_an_authenticated_link(members):
    a, b, ta, tb, _ = members
    ta.send(b.device, "activation", torch.arange(4.0), step=0)
    ta.flush(10)
    assert torch.equal(tb.recv("activation", a.device, 0, 0, timeout_s=10), torch.arange(4.0))
    assert tb.inbox.unauthenticated == 0 and not tb.inbox.misbehaving


def test_a_link_without_the_handshake_carries_nothing(members):
    a, b, ta, tb, book = members
    with transport(a.device, book) as stranger:  # knows alice's device id and bob's address, has no key
        stranger.book = book
        attack(stranger, b.device, a.device)
        wait_for(lambda: tb.inbox.unauthenticated >= 1)
    ta.send(b.device, "activation", torch.arange(4.0), step=0)
    ta.flush(10)
    assert torch.equal(tb.recv("activation", a.device, 0, 0, timeout_s=10), torch.arange(4.0))
    assert not tb.inbox.misbehaving, "nothing counts against alice: she sent nothing wrong"
    assert "link handshake failed" in tb.inbox.rejections[0][1]


def test_another_key_cannot_prove_a_members_device_id(members):
    a, b, ta, tb, book = members
    impostor = LinkIdentity(a.device, RSAPrivateKey())  # alice's id, its own key
    with transport(impostor, book) as forged:
        attack(forged, b.device, a.device)
        wait_for(lambda: tb.inbox.unauthenticated >= 1)
    assert "not bound to the key" in tb.inbox.rejections[-1][1]
    ta.send(b.device, "gradient", torch.ones(4), step=0)
    ta.flush(10)
    assert torch.equal(tb.recv("gradient", a.device, 0, 0, timeout_s=10), torch.ones(4))
    with pytest.raises(Exception):  # the forged activation never reached the inbox
        tb.recv("activation", a.device, 0, 0, timeout_s=0.5)
    assert not tb.inbox.misbehaving


def test_a_proven_stranger_naming_a_member_in_its_frames_is_refused_and_blamed(members):
    a, b, ta, tb, book = members
    mallory = identity("mallory")
    book = AddressBook({**book.peers, mallory.device: PeerAddress(direct=("127.0.0.1", free_port()))})
    # mallory proves who she is, then writes alice into the header of every frame
    with transport(mallory, book, book.get(mallory.device).direct[1]) as tm:
        original = tm._send

        def as_alice(to, header, payload):
            original(to, replace(header, sender=a.device), payload)

        tm._send = as_alice
        attack(tm, b.device, a.device)
        wait_for(lambda: tb.inbox.misbehaving[mallory.device] >= 1)
    assert tb.inbox.misbehaving[a.device] == 0, "refusals count against the proven sender, never the named one"
    assert any("claims to be" in reason for _, reason in tb.inbox.rejections)
    ta.send(b.device, "params", torch.ones(4), step=0)
    ta.flush(10)
    assert torch.equal(tb.recv("params", a.device, 0, 0, timeout_s=10), torch.ones(4))


def test_a_listener_must_prove_it_is_the_peer_dialled(members):
    a, b, ta, tb, book = members
    squatter = identity("bob")  # another key listening where the book says bob is
    port = free_port()
    moved = AddressBook({**book.peers, b.device: PeerAddress(direct=("127.0.0.1", port))})
    with transport(squatter, moved, port):
        ta.book = moved
        ta.send(b.device, "activation", torch.ones(4), step=0)
        with pytest.raises(PeerUnreachable, match="during the link handshake"):
            ta.flush(10)


def test_a_silent_connection_is_closed_after_the_handshake_deadline(members, monkeypatch):
    from hetpeer.peer.transport import links

    a, b, ta, tb, book = members
    monkeypatch.setattr(links, "HANDSHAKE_TIMEOUT_S", 0.3)
    host, port = book.get(b.device).direct
    with socket.create_connection((host, port)) as idle:
        idle.settimeout(5)
        assert idle.recv(4) == b"HPA2"  # the challenge, then nothing from us
        wait_for(lambda: tb.inbox.unauthenticated >= 1)
        idle.recv(1 << 10)  # the rest of the challenge
        assert idle.recv(1) == b"", "the listener closed the connection"
    assert "no proof within" in tb.inbox.rejections[-1][1]


# -- a fixed plan: device ids the plan gives, bound to keys by the address book ---------------------------


@pytest.fixture()
def fixed(tmp_path):
    """d0 and d1 of a fixed plan, each proving itself with the link key whose digest the book gives it."""
    keys = {d: load_or_create_link_key(tmp_path / f"{d}.link.key") for d in ("d0", "d1")}
    book = AddressBook({d: PeerAddress(direct=("127.0.0.1", free_port()), key=k.digest) for d, k in keys.items()})
    ids = {d: LinkIdentity(d, k, book=book.keys()) for d, k in keys.items()}
    with transport(ids["d0"], book, book.get("d0").direct[1]) as t0, transport(ids["d1"], book, book.get("d1").direct[1]) as t1:
        yield ids, t0, t1, book


def test_fixed_plan_peers_prove_the_keys_their_book_gives(fixed):
    ids, t0, t1, book = fixed
    t0.send("d1", "activation", torch.arange(4.0), step=0)
    t0.flush(10)
    assert torch.equal(t1.recv("activation", "d0", 0, 0, timeout_s=10), torch.arange(4.0))
    t1.send("d0", "gradient", torch.ones(4), step=0)  # and the other way, dialled by d1
    t1.flush(10)
    assert torch.equal(t0.recv("gradient", "d1", 0, 0, timeout_s=10), torch.ones(4))
    assert t1.inbox.unauthenticated == 0 and t0.inbox.unauthenticated == 0


def test_a_fixed_plan_refuses_another_key_and_a_stranger_bound_to_its_own(fixed, tmp_path):
    ids, t0, t1, book = fixed
    impostor = LinkIdentity("d0", load_or_create_link_key(tmp_path / "impostor.key"), book=book.keys())
    with transport(impostor, book) as forged:  # d0's name, another key
        attack(forged, "d1", "d0")
        wait_for(lambda: t1.inbox.unauthenticated >= 1)
    assert "'d0' presented a key whose SHA-256 is" in t1.inbox.rejections[-1][1]
    swarm_peer = identity("mallory")  # an id bound to its key by its name, as in a swarm: not this plan's
    with transport(swarm_peer, book) as stranger:
        attack(stranger, "d1", "d0")
        wait_for(lambda: t1.inbox.unauthenticated >= 2)
    assert f"{swarm_peer.device!r} has no link key in this plan's address book" in t1.inbox.rejections[-1][1]
    with pytest.raises(Exception):  # nothing of either reached the inbox
        t1.recv("activation", "d0", 0, 0, timeout_s=0.5)
    t0.send("d1", "activation", torch.ones(4), step=0)
    t0.flush(10)
    assert torch.equal(t1.recv("activation", "d0", 0, 0, timeout_s=10), torch.ones(4))
    assert not t1.inbox.misbehaving


def test_a_fixed_plan_peer_does_not_send_to_a_listener_without_the_books_key(fixed, tmp_path):
    ids, t0, t1, book = fixed
    port = free_port()
    moved = AddressBook({**book.peers, "d1": PeerAddress(direct=("127.0.0.1", port), key=book.get("d1").key)})
    squatter = LinkIdentity("d1", load_or_create_link_key(tmp_path / "squatter.key"), book=book.keys())
    with transport(squatter, moved, port):
        t0.book = moved
        t0.send("d1", "activation", torch.ones(4), step=0)
        with pytest.raises(PeerUnreachable, match="presented a key whose SHA-256"):
            t0.flush(10)
