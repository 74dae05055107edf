"""`hetpeer swarm`'s configuration (pure): per-peer lists and what `SwarmConfig` refuses."""

from __future__ import annotations

import math

import pytest

from hetpeer.swarm.launcher import LocalSwarm, SwarmConfig, parse_per_peer


def test_a_list_is_repeated_to_cover_the_peers():
    assert parse_per_peer("1,2", 5, "--slowdowns") == (1.0, 2.0, 1.0, 2.0, 1.0)
    assert parse_per_peer(" 3 , 1.5 ", 2, "--slowdowns") == (3.0, 1.5)
    assert parse_per_peer("2", 3, "--slowdowns") == (2.0, 2.0, 2.0)


def test_nothing_given_is_an_empty_list():
    assert parse_per_peer("", 4, "--slowdowns") == ()
    assert parse_per_peer(None, 4, "--slowdowns") == ()


def test_the_none_word_stands_for_no_value_only_where_allowed():
    assert parse_per_peer("none,40", 3, "--bandwidth-caps", none_value="none") == (None, 40.0, None)
    with pytest.raises(ValueError, match="--slowdowns"):
        parse_per_peer("none,2", 3, "--slowdowns")


@pytest.mark.parametrize("text", ["1,x", "1,,2", "fast", "1;2"])
def test_what_is_no_number_is_refused_naming_the_option_and_the_text(text):
    with pytest.raises(ValueError) as error:
        parse_per_peer(text, 4, "--slowdowns")
    assert "--slowdowns" in str(error.value) and repr(text) in str(error.value)


def test_a_valid_config_answers_per_peer(tmp_path):
    config = SwarmConfig(out=tmp_path, peers=3, steps=5, slowdowns=(1.0, 2.0, 3.0), bandwidth_caps=(None, 40.0, None))
    assert [config.slowdown(i) for i in range(3)] == [1.0, 2.0, 3.0]
    assert [config.cap(i) for i in range(3)] == [None, 40.0, None]
    plain = SwarmConfig(out=tmp_path, peers=2, steps=5)
    assert [plain.slowdown(i) for i in range(2)] == [1.0, 1.0]
    assert [plain.cap(i) for i in range(2)] == [None, None]
    assert [plain.latency_ms(i) for i in range(2)] == [0.0, 0.0]


def test_an_emulated_latency_reaches_each_peer_as_its_transport_option(tmp_path):
    from hetpeer.cli import build_parser

    config = SwarmConfig(out=tmp_path, peers=3, steps=5, latencies_ms=(5.0, 0.0, 12.5))
    swarm = LocalSwarm(config, print, 1)
    swarm.key, swarm.dht_maddrs = "00" * 32, ["/ip4/127.0.0.1/tcp/1/p2p/x"]
    held = [build_parser().parse_args(swarm.peer_command(i)[3:]).emulate_latency for i in range(3)]
    assert held == [{"*": 0.005}, {}, {"*": 0.0125}]  # seconds, to every other peer; none asked: the option is left out


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(peers=0), "peer"),
        (dict(steps=0), "step"),
        (dict(slowdowns=(1.0, 2.0)), "2 slowdowns given for 3 peers"),
        (dict(bandwidth_caps=(None,) * 4), "4 bandwidth caps given for 3 peers"),
        (dict(slowdowns=(1.0, 0.5, 1.0)), "slowdowns must be finite numbers >= 1"),
        (dict(slowdowns=(1.0, math.nan, 1.0)), "slowdowns must be finite numbers >= 1"),
        (dict(bandwidth_caps=(None, 0.0, None)), "bandwidth caps must be finite positive numbers"),
        (dict(bandwidth_caps=(-5.0, None, None)), "bandwidth caps must be finite positive numbers"),
        (dict(bandwidth_caps=(math.nan, None, None)), "bandwidth caps must be finite positive numbers"),
        (dict(latencies_ms=(5.0, 5.0)), "2 latencies given for 3 peers"),
        (dict(latencies_ms=(5.0, -1.0, 5.0)), "latencies must be 0 to 10000 ms"),
        (dict(latencies_ms=(5.0, 20000.0, 5.0)), "latencies must be 0 to 10000 ms"),
        (dict(latencies_ms=(math.inf, 5.0, 5.0)), "latencies must be 0 to 10000 ms"),
    ],
)
def test_swarm_config_refuses(tmp_path, changes, fragment):
    fields = dict(out=tmp_path, peers=3, steps=5) | changes
    with pytest.raises(ValueError, match=fragment):
        SwarmConfig(**fields)


@pytest.mark.parametrize("changes", [dict(slowdowns=(1.0, math.inf, 1.0)), dict(bandwidth_caps=(None, math.inf, None))])
def test_swarm_config_refuses_what_its_peers_would_refuse(tmp_path, changes):
    # each peer gets `hetpeer join --slowdown X --bandwidth-cap Y`, which refuses infinity: refuse it up front
    with pytest.raises(ValueError):
        SwarmConfig(out=tmp_path, peers=3, steps=5, **changes)


def test_emulated_devices_ask_together_for_no_more_than_their_share_of_the_cores(tmp_path):
    from hetpeer.swarm.launcher import EMULATION_SHARE

    slowdowns = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0)
    config = SwarmConfig(out=tmp_path, peers=8, steps=5, slowdowns=slowdowns, emulate=True, cores=2)
    assert config.threads == 1
    asked = sum(config.threads / config.slowdown(i) for i in range(8))  # of the cores, computing flat out
    assert asked == pytest.approx(EMULATION_SHARE * 2)
    assert [config.slowdown(i) / config.slowdown(0) for i in range(8)] == pytest.approx(slowdowns)  # unequal as asked
    # without emulation, or where the cores have room for every peer, no more slowdown than asked
    assert SwarmConfig(out=tmp_path, peers=8, steps=5, slowdowns=slowdowns, cores=2).slowdown(4) == 2.0
    roomy = SwarmConfig(out=tmp_path, peers=2, steps=5, slowdowns=(4.0, 6.0), emulate=True, cores=64)
    assert roomy.threads == 32 and roomy.emulation == 1.0 and roomy.slowdown(1) == 6.0


def test_an_emulated_device_holds_too_little_for_the_whole_model(tmp_path):
    from hetpeer.protocol.modelspec import PRESETS
    from hetpeer.protocol.workload import Workload

    config = SwarmConfig(out=tmp_path, peers=4, steps=5, emulate=True, cores=2)
    spec = PRESETS["tiny"]
    workload = Workload(spec, batch=config.batch, micro_batch=config.micro_batch, dtype=config.dtype)
    whole = sum(workload.stage_memory(spec.layers, first=True, last=True, in_flight=1, micro_batch=2, group_size=2).values())
    half = sum(workload.stage_memory(spec.layers // 2, first=False, last=True, in_flight=1, micro_batch=2, group_size=2).values())
    assert half < config.memory_mib * 2**20 < whole
    assert SwarmConfig(out=tmp_path, peers=4, steps=5, cores=2).memory_mib is None
    assert SwarmConfig(out=tmp_path, peers=4, steps=5, emulate=True, small_devices=False, cores=2).memory_mib is None
    assert SwarmConfig(out=tmp_path, peers=4, steps=5, emulate=True, model="small", cores=2).memory_mib > config.memory_mib


@pytest.mark.parametrize("leave", [(0, 3), (3, 3), (4, 2), (2, 5), (2, 9)])
def test_a_peer_leaves_and_comes_back_within_the_run(tmp_path, leave):
    with pytest.raises(ValueError, match=f"need 0 < {leave[0]} \\(leave\\) < {leave[1]} \\(back\\) < 5 \\(steps\\)"):
        SwarmConfig(out=tmp_path, peers=3, steps=5, leave=leave)
    assert SwarmConfig(out=tmp_path, peers=3, steps=5, leave=(1, 4)).leave == (1, 4)


def test_leave_option_takes_two_steps_auto_or_none():
    import argparse

    from hetpeer.cli.swarm import LEAVE_MIN_STEPS, auto_leave, leave_choice

    assert leave_choice("100,160") == (100, 160) and leave_choice("none") is None and leave_choice("auto") == "auto"
    for text in ("100", "160,100", "0,5", "a,b", "1,2,3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            leave_choice(text)
    at, back = auto_leave(500)
    assert 0 < at < back < 500 and auto_leave(LEAVE_MIN_STEPS - 1) is None
