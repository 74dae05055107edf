"""The join file: what a peer is told to join a swarm, written by the coordinator, checked when read."""

from __future__ import annotations

import json

import pytest

from hetpeer.protocol.join import MAX_JOIN_FILE_BYTES, JoinInfo
from hetpeer.protocol.wire import SchemaError

KEY = "227589eb829af4308457c73f413bbec25bed31972677319fd300da405b61149e"
MADDR = "/dns4/coordinator/tcp/31337/p2p/12D3KooWJ3bHAf2PgnY6i3btRPVaUxCGXLyQ6AzXL2PvQeVSJ4r1"
INFO = JoinInfo("docker", KEY, (MADDR,), "tiny", "fp32")


def test_a_written_join_file_reads_back_the_same(tmp_path):
    path = tmp_path / "swarm" / "join.json"
    INFO.write(path)
    assert JoinInfo.load(path) == INFO
    assert [p.name for p in path.parent.iterdir()] == ["join.json"]  # no partial file left beside it
    INFO.write(path)  # rewriting (a restarted coordinator) replaces it whole
    assert JoinInfo.load(path) == INFO


def refused(raw, where: str) -> None:
    with pytest.raises(SchemaError) as caught:
        JoinInfo.from_wire(raw)
    assert caught.value.path == where, str(caught.value)


@pytest.mark.parametrize(
    "change, where",
    [
        ({"version": 2}, "join.version"),
        ({"coordinator_key": KEY.upper()}, "join.coordinator_key"),
        ({"coordinator_key": KEY[:-1]}, "join.coordinator_key"),
        ({"initial_peers": []}, "join.initial_peers"),
        ({"initial_peers": ["/ip4/10.0.0.2/tcp/31337"]}, "join.initial_peers[0]"),
        ({"initial_peers": MADDR}, "join.initial_peers"),
        ({"swarm": 7}, "join.swarm"),
        ({"api": "coordinator"}, "join.api"),
        ({"api": "coordinator:99999"}, "join.api"),
        ({"admin": True}, "join.admin"),
    ],
)
def test_a_bad_join_file_is_refused_naming_the_field(change, where):
    refused(INFO.to_wire() | change, where)


def test_the_coordinators_api_travels_in_the_join_file_when_given(tmp_path):
    with_api = JoinInfo("docker", KEY, (MADDR,), "tiny", "fp32", ("coordinator", 31339), ("coordinator", 31340))
    assert with_api.to_wire()["api"] == "coordinator:31340" and "api" not in INFO.to_wire()
    with_api.write(tmp_path / "join.json")
    assert JoinInfo.load(tmp_path / "join.json") == with_api


def test_a_missing_field_is_refused():
    raw = INFO.to_wire()
    del raw["model"]
    refused(raw, "join.model")


def test_unreadable_files_are_refused_with_the_path(tmp_path):
    with pytest.raises(SchemaError, match="cannot read"):
        JoinInfo.load(tmp_path / "absent.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(SchemaError, match="garbage.json is not JSON"):
        JoinInfo.load(garbage)
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(INFO.to_wire() | {"swarm": "x" * MAX_JOIN_FILE_BYTES}))
    with pytest.raises(SchemaError, match="larger than"):
        JoinInfo.load(huge)
