"""Emulated links (`--bandwidth-cap`, `--emulate-latency`): which latency a destination gets, and what is refused."""

from __future__ import annotations

import math

import pytest

from hetpeer.cli import build_parser
from hetpeer.peer.transport.network import Emulation
from hetpeer.protocol.addresses import PeerAddress


def test_a_destination_gets_its_host_and_port_then_its_host_then_the_default():
    emulation = Emulation(latency_s={"10.0.0.2:7000": 0.3, "10.0.0.2": 0.2, "*": 0.05})
    assert emulation.latency_to(PeerAddress(direct=("10.0.0.2", 7000))) == 0.3
    assert emulation.latency_to(PeerAddress(direct=("10.0.0.2", 7001))) == 0.2
    assert emulation.latency_to(PeerAddress(direct=("10.0.0.3", 7000))) == 0.05
    assert emulation.latency_to(None) == 0.05  # a peer that left the book: still not faster than the rest
    assert Emulation(latency_s={"10.0.0.2": 0.2}).latency_to(PeerAddress(direct=("10.0.0.3", 7000))) == 0.0
    assert Emulation().latency_to(PeerAddress(direct=("10.0.0.2", 7000))) == 0.0


@pytest.mark.parametrize("bad", [{"rate_bytes_per_s": 0.0}, {"rate_bytes_per_s": math.inf}, {"latency_s": {"h": -0.1}},
                                 {"latency_s": {"h": math.nan}}, {"latency_s": {"h": 11.0}}])
def test_impossible_links_are_refused(bad):
    with pytest.raises(ValueError, match="emulated"):
        Emulation(**bad)


def test_the_option_reads_milliseconds_per_host():
    args = build_parser().parse_args(["join", "--swarm", "s", "--emulate-latency", "10.0.0.2=150, peer3:7000=0.5,*=20"])
    assert args.emulate_latency == {"10.0.0.2": 0.15, "peer3:7000": 0.0005, "*": 0.02}


@pytest.mark.parametrize("bad", ["10.0.0.2", "=5", "h=x", "h=-1", "h=20000", "h=nan"])
def test_a_bad_latency_option_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["join", "--swarm", "s", "--emulate-latency", bad])
    assert done.value.code == 2
    assert "--emulate-latency" in capsys.readouterr().err
