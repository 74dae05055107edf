"""`hetpeer swarm`'s configuration (pure): per-peer lists and what `SwarmConfig` refuses."""

from __future__ import annotations

import math

import pytest

from hetpeer.swarm.launcher import SwarmConfig, parse_per_peer


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
