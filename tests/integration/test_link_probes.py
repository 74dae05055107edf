"""Link probes between two peers' real transports on 127.0.0.1, one of them with its uplink capped the
way `hetpeer swarm --bandwidth-caps` caps it: each side measures its own direction."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hetpeer.peer.daemon.measure import LinkProber
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import Emulation, NetworkTransport
from hetpeer.protocol.addresses import AddressBook

CAP_BYTES_PER_S = 40e6 / 8  # 40 Mbit/s
LATENCY_S = 0.040


@pytest.fixture
def probers():
    yield from linked_probers({"fast": Emulation(), "capped": Emulation(rate_bytes_per_s=CAP_BYTES_PER_S)})


@pytest.fixture
def far_probers():
    """Two peers 40 ms apart one way (`--emulate-latency '*=40'` on both)."""
    yield from linked_probers({"a": Emulation(latency_s={"*": LATENCY_S}), "b": Emulation(latency_s={"*": LATENCY_S})})


def linked_probers(emulations: dict[str, Emulation]):
    transports = {name: NetworkTransport(name, AddressBook({}), [TcpLink("127.0.0.1", 0)], emulation=emulation)
                  for name, emulation in emulations.items()}
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
    assert 0.8 * CAP_BYTES_PER_S <= up.bandwidth_bytes_per_s <= 1.1 * CAP_BYTES_PER_S
    assert down.bandwidth_bytes_per_s > CAP_BYTES_PER_S  # the other direction is loopback, uncapped
    for link in (up, down):
        assert 0 < link.latency_s < 1.0
    for prober in probers.values():
        assert not prober.transport.inbox.misbehaving


def test_an_emulated_latency_is_measured_one_way_and_frames_in_flight_overlap(far_probers):
    link = far_probers["a"].measure("b", budget_bytes=256 << 10, budget_s=3.0)
    assert LATENCY_S <= link.latency_s < LATENCY_S + 0.015  # half the round trip: 40 ms each way
    a, b = far_probers["a"].transport, far_probers["b"].transport
    arrived = []
    b.inbox.handlers["probe"] = lambda header, tensor: arrived.append(time.monotonic())
    started = time.monotonic()
    for i in range(20):  # pings to b, each one frame: 20 of them delayed one by one would take 0.8 s
        a.send("b", "probe", torch.zeros(1), step=10_000 + i, micro=0)
    deadline = started + 5.0
    while len(arrived) < 20 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(arrived) == 20
    assert LATENCY_S <= arrived[0] - started and arrived[-1] - started < 2 * LATENCY_S


def test_a_link_busy_with_training_is_measured_whole(probers):
    """Training frames stream up the capped link the whole time, so each probe frame gets a share of it;
    the receiver counts what else arrived from the prober meanwhile, and the probe reads the whole cap."""
    capped, fast = probers["capped"].transport, probers["fast"].transport
    fast.set_policy(lambda header: None if header.kind == "activation" else probers["fast"].accept(header))
    sent, stop = [], threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            capped.send("fast", "activation", torch.ones(64 << 10), step=step)  # 256 KB, about 50 ms of the cap
            sent.append(step)
            step += 1
            capped.flush(10.0, ["fast"])

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        time.sleep(0.3)  # the link is busy
        link = probers["capped"].measure("fast", budget_bytes=1 << 20, budget_s=3.0)
    finally:
        stop.set()
        trainer.join(20)
    assert 0.8 * CAP_BYTES_PER_S <= link.bandwidth_bytes_per_s <= 1.1 * CAP_BYTES_PER_S
    assert len(sent) >= 3
    for step in sent:
        assert fast.recv("activation", "capped", step, 0, timeout_s=10.0).numel() == 64 << 10
    assert capped.sent["fast"] == fast.inbox.received["capped"] == len(sent) * (256 << 10)  # probes aside
    assert capped.unsent_bytes("fast") == 0
