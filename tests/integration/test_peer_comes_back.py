"""A peer that died and came back, over real transports on 127.0.0.1: the failure to reach the dead
one is reported once, and once the peer is heard from again it is history, so the next send goes out.
(A rejoining peer's first requests are answered; before, the donor's first answer was dropped.)"""

from __future__ import annotations

import time

import pytest
import torch

from hetpeer.peer.transport import PeerUnreachable
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import NetworkTransport
from hetpeer.protocol.addresses import AddressBook


def transport(name: str) -> NetworkTransport:
    t = NetworkTransport(name, AddressBook({}), [TcpLink("127.0.0.1", 0)], connect_timeout_s=0.5)
    t.set_policy(lambda header: None)
    t.start()
    return t


def test_a_peer_heard_from_again_is_sent_to_again():
    donor, joiner = transport("donor"), transport("joiner")
    back = None
    try:
        donor.book = joiner.book = AddressBook({"donor": donor.address(), "joiner": joiner.address()})
        joiner.shutdown()  # it dies: the donor's frames to it cannot leave
        donor.send("joiner", "params", torch.ones(4), step=1)
        with pytest.raises(PeerUnreachable, match="sending to joiner failed"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the failure surfaces at a later send, once the connect timed out
                donor.send("joiner", "params", torch.ones(4), step=2)
                time.sleep(0.1)

        donor.send("joiner", "params", torch.ones(4), step=3)  # lost too (the peer is still down)
        time.sleep(1.0)  # its connect times out: a failure is on record again
        back = transport("joiner")  # the same peer, back at a new address
        book = AddressBook({"donor": donor.address(), "joiner": back.address()})
        donor.book = back.book = book
        back.send("donor", "params", torch.full((4,), 7.0), step=10)
        assert torch.equal(donor.recv("params", "joiner", 10, 0, timeout_s=10), torch.full((4,), 7.0))

        donor.send("joiner", "params", torch.full((4,), 8.0), step=11)  # no stale failure in the way
        assert torch.equal(back.recv("params", "donor", 11, 0, timeout_s=10), torch.full((4,), 8.0))
    finally:
        for t in (donor, back):
            if t is not None:
                t.shutdown()
