"""The examples in docs/ are what the code accepts and says."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from hetpeer.protocol.topology import Topology
from hetpeer.protocol.wire import SchemaError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def topology_example() -> dict:
    text = (DOCS / "topology.md").read_text()
    return json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))


def test_the_topology_example_parses():
    topology = Topology.from_wire(topology_example())
    assert [d.id for d in topology.devices] == ["a100-0", "a100-1", "3090-home"]
    by_id = {d.id: d for d in topology.devices}
    assert topology.link(by_id["a100-1"], by_id["3090-home"]).bandwidth_gbps == 0.3  # the device override
    assert topology.link(by_id["a100-0"], by_id["3090-home"]).bandwidth_gbps == 0.8  # the region link


def test_the_documented_error_is_the_one_given():
    text = (DOCS / "topology.md").read_text()
    shown = re.search(r"hetpeer plan: error: (topology\.devices\[2\]\.region: .*)", text).group(1)
    raw = copy.deepcopy(topology_example())
    raw["devices"][2]["region"] = "lyom"
    with pytest.raises(SchemaError) as error:
        Topology.from_wire(raw)
    assert str(error.value) == shown
