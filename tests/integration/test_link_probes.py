"""Link probes between two peers' real transports on 127.0.0.1, one of them with its uplink capped the
way `hetpeer swarm --bandwidth-caps` caps it: each side measures its own direction."""

from __future__ import annotations

import pytest

from hetpeer.peer.measure import LinkProber
from hetpeer.peer.transport.network import NetworkTransport, TcpLink
from hetpeer.protocol.addresses import AddressBook

CAP_BYTES_PER_S = 40e6 / 8  # 40 Mbit/s


@pytest.fixture
def probers():
    transports = {
        "fast": NetworkTransport("fast", AddressBook({}), [TcpLink("127.0.0.1", 0)]),
        "capped": NetworkTransport("capped", AddressBook({}), [TcpLink("127.0.0.1", 0)], rate_limit_bytes_per_s=CAP_BYTES_PER_S),
    }
    found = {}
    try:
        for name, transport in transports.items():
            transport.start()
            prober = LinkProber(transport, name)
            transport.set_policy(prober.accept)
            prober.install()
            found[name] = prober
        book = AddressBook({name: t.address() for name, t in transports.items()})
        for transport in transports.values():
            transport.book = book
        yield found
    finally:
        for transport in transports.values():
            transport.shutdown()


def test_a_capped_uplink_is_measured_at_its_cap_and_only_in_its_direction(probers):
    up = probers["capped"].measure("fast", budget_bytes=1 << 20, budget_s=2.0)
    down = probers["fast"].measure("capped", budget_bytes=1 << 20, budget_s=2.0)
    # the cap holds every data frame on the wire for size / cap at least: the probe cannot read more
    assert up.bandwidth_bytes_per_s <= 1.1 * CAP_BYTES_PER_S
    assert down.bandwidth_bytes_per_s > CAP_BYTES_PER_S  # the other direction is loopback, uncapped
    for link in (up, down):
        assert 0 < link.latency_s < 1.0
    for prober in probers.values():
        assert not prober.transport.inbox.misbehaving
