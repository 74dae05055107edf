"""A connection carries frames both ways: a peer nobody can dial (behind NAT: here, its announced address
refuses connections) keeps connections to the peers it works with, and frames to it travel back over them
(real TCP on 127.0.0.1, links authenticated)."""

from __future__ import annotations

import pytest
import torch

from hetpeer.peer.launch import free_port
from hetpeer.peer.daemon.measure import LinkProber
from hetpeer.peer.transport.inbox import PeerUnreachable
from hetpeer.protocol.addresses import AddressBook, PeerAddress

from tests.integration.test_link_auth import identity, transport, wait_for


@pytest.fixture()
def public_and_hidden():
    """`public` listens where its book entry says; `hidden` listens elsewhere than it is announced, and its entry
    says nobody can dial it, as a peer behind NAT whose public address forwards nothing."""
    public, hidden = identity("public"), identity("hidden")
    book = AddressBook({public.device: PeerAddress(direct=("127.0.0.1", free_port())),
                        hidden.device: PeerAddress(direct=("127.0.0.1", free_port()), dialable=False)})
    with transport(public, book, book.get(public.device).direct[1]) as tp, transport(hidden, book) as th:
        tp.connect_timeout_s = 3.0
        yield public, hidden, tp, th


def test_frames_reach_a_peer_that_cannot_be_dialled_over_its_own_connection(public_and_hidden):
    public, hidden, tp, th = public_and_hidden
    th.keep_connected([public.device])
    wait_for(lambda: tp.connected(hidden.device))
    tp.send(hidden.device, "activation", torch.arange(4.0), step=0)
    tp.flush(10)
    assert torch.equal(th.recv("activation", public.device, 0, 0, timeout_s=10), torch.arange(4.0))
    th.send(public.device, "gradient", torch.ones(3), step=0)
    th.flush(10)
    assert torch.equal(tp.recv("gradient", hidden.device, 0, 0, timeout_s=10), torch.ones(3))
    assert tp.routes[hidden.device] == "back" and th.routes[public.device] == "tcp"
    assert not tp.inbox.misbehaving and not th.inbox.misbehaving


def test_a_dropped_connection_is_opened_again_by_the_peer_that_must_dial(public_and_hidden):
    public, hidden, tp, th = public_and_hidden
    th.keep_connected([public.device])
    wait_for(lambda: tp.connected(hidden.device))
    for stream in list(tp._accepted[hidden.device]):  # the NAT forgot the mapping, say
        stream.close()
    wait_for(lambda: any(not s.closed for s in tp._accepted[hidden.device]))
    tp.send(hidden.device, "activation", torch.arange(2.0), step=1)
    tp.flush(10)
    assert torch.equal(th.recv("activation", public.device, 1, 0, timeout_s=10), torch.arange(2.0))


def test_without_its_connection_a_peer_nobody_can_dial_is_unreachable_and_the_error_says_why(public_and_hidden):
    public, hidden, tp, th = public_and_hidden
    tp.send(hidden.device, "activation", torch.arange(4.0), step=0)
    with pytest.raises(PeerUnreachable, match="cannot be dialled .* no connection to this peer"):
        tp.flush(10)


def test_probes_and_their_answers_cross_to_a_peer_that_cannot_be_dialled(public_and_hidden):
    """The hidden peer probes the public one: the answers come back over the connection the probe opened."""
    public, hidden, tp, th = public_and_hidden
    LinkProber(tp, public.device).install()
    prober = LinkProber(th, hidden.device)
    prober.install()
    measured = prober.measure(public.device, budget_bytes=1 << 18)
    assert measured.bandwidth_bytes_per_s > 0 and measured.latency_s < 1.0


def test_a_connection_kept_that_fails_is_unreachable_with_how_until_the_pair_connects(public_and_hidden):
    public, hidden, tp, th = public_and_hidden
    ghost = identity("ghost")  # announced where nothing listens: its dial is refused
    tp.book.peers[ghost.device] = PeerAddress(direct=("127.0.0.1", free_port()))
    tp.keep_connected([hidden.device, ghost.device])  # hidden: nobody can dial it, and it has not dialled yet
    wait_for(lambda: tp.unreachable(60) == {ghost.device: "refused", hidden.device: "no-path"}, timeout_s=30)
    th.keep_connected([public.device])  # hidden dials: the pair connects, and public stops reporting it
    wait_for(lambda: hidden.device not in tp.unreachable(60), timeout_s=30)
    assert tp.unreachable(60) == {ghost.device: "refused"}
