"""Topology files: how links resolve, and that every bad value is reported with its dotted path."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hetpeer.coordinator.planner import Problem
from hetpeer.coordinator.planner.codecs import WORK_S_PER_VALUE, codec_rates
from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.topology import Link, Topology
from hetpeer.protocol.wire import SchemaError
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload


def base() -> dict:
    """Two regions, five devices; a and b are linked, c is only reachable through default_link."""
    return {
        "name": "t",
        "devices": [
            {"id": "a0", "region": "a", "tflops": 100.0, "memory_gb": 16.0},
            {"id": "a1", "region": "a", "tflops": 100.0, "memory_gb": 16.0},
            {"id": "b0", "region": "b", "tflops": 50, "memory_gb": 24},
            {"id": "b1", "region": "b"},
            {"id": "c0", "region": "c"},
        ],
        "regions": {
            "a": {"latency_ms": 1.0, "bandwidth_gbps": 10.0},
            "b": {"latency_ms": 2.0, "bandwidth_gbps": 20.0},
            "c": {"latency_ms": 3.0, "bandwidth_gbps": 30.0},
        },
        "region_links": [{"a": "a", "b": "b", "latency_ms": 40.0, "bandwidth_gbps": 1.0}],
        "default_link": {"latency_ms": 200.0, "bandwidth_gbps": 0.5},
    }


def devices(topology: Topology) -> dict:
    return {d.id: d for d in topology.devices}


def test_region_values_apply_inside_a_region_and_listed_pairs_in_both_directions():
    topology = Topology.from_wire(base())
    d = devices(topology)
    assert topology.link(d["a0"], d["a1"]) == Link(1.0, 10.0)
    assert topology.link(d["b1"], d["b0"]) == Link(2.0, 20.0)
    # region_links lists a -> b only: b -> a is the same link.
    assert topology.link(d["a0"], d["b0"]) == Link(40.0, 1.0)
    assert topology.link(d["b1"], d["a1"]) == Link(40.0, 1.0)


def test_default_link_for_unlisted_region_pairs():
    topology = Topology.from_wire(base())
    d = devices(topology)
    assert topology.link(d["a0"], d["c0"]) == Link(200.0, 0.5)
    assert topology.link(d["c0"], d["b1"]) == Link(200.0, 0.5)


def test_device_link_given_once_is_symmetric_and_overrides_region_values():
    raw = base()
    raw["links"] = [
        {"a": "a0", "b": "a1", "latency_ms": 0.5, "bandwidth_gbps": 100.0},  # same region
        {"a": "b0", "b": "a0", "latency_ms": 7.0, "bandwidth_gbps": 3.0},  # across regions
    ]
    topology = Topology.from_wire(raw)
    d = devices(topology)
    assert topology.link(d["a0"], d["a1"]) == Link(0.5, 100.0)
    assert topology.link(d["a1"], d["a0"]) == Link(0.5, 100.0)
    assert topology.link(d["a0"], d["b0"]) == Link(7.0, 3.0)
    assert topology.link(d["b0"], d["a0"]) == Link(7.0, 3.0)
    # Pairs without a device link keep the region values.
    assert topology.link(d["a1"], d["b0"]) == Link(40.0, 1.0)


def test_asymmetric_pairs_are_averaged():
    raw = base()
    raw["region_links"] = [
        {"a": "a", "b": "b", "latency_ms": 40.0, "bandwidth_gbps": 1.0},
        {"a": "b", "b": "a", "latency_ms": 60.0, "bandwidth_gbps": 3.0},
    ]
    raw["links"] = [
        {"a": "a0", "b": "c0", "latency_ms": 10.0, "bandwidth_gbps": 2.0},
        {"a": "c0", "b": "a0", "latency_ms": 30.0, "bandwidth_gbps": 6.0},
    ]
    topology = Topology.from_wire(raw)
    d = devices(topology)
    for x, y in (("a0", "b0"), ("b0", "a0")):
        assert topology.link(d[x], d[y]) == Link(50.0, 2.0)
    for x, y in (("a0", "c0"), ("c0", "a0")):
        assert topology.link(d[x], d[y]) == Link(20.0, 4.0)


def test_units_reach_the_problem_as_seconds_and_bytes_per_second():
    topology = Topology.from_wire(base())
    problem = Problem.from_topology(topology, Workload(preset("tiny"), batch=4))
    i, j = problem.device_ids.index("a0"), problem.device_ids.index("b0")
    assert problem.latency_s[i, j] == pytest.approx(40.0 / 1e3)
    assert problem.bandwidth_bytes_per_s[i, j] == pytest.approx(1.0 * 1e9 / 8)
    # b1 and c0 state no tflops: the problem has none (the time model refuses it). They state no
    # memory either: they are not limited, while the devices that state theirs still are.
    assert problem.tflops is None
    stated = {d["id"]: d.get("memory_gb") for d in base()["devices"]}
    for k, device in enumerate(problem.device_ids):
        expected = np.inf if stated[device] is None else stated[device] * 1e9
        assert problem.memory_bytes[k] == expected


def test_to_wire_round_trips():
    raw = base()
    raw["links"] = [{"a": "a0", "b": "c0", "latency_ms": 10.0, "bandwidth_gbps": 2.0}]
    topology = Topology.from_wire(raw)
    again = Topology.from_wire(topology.to_wire())
    assert again == topology
    assert again.to_wire() == topology.to_wire()


def test_codec_rates_a_device_measured_reach_the_problem_and_round_trip():
    raw = base()
    raw["devices"][0]["codec_s"] = {"int8": 4e-10, "int4": 9e-10}
    topology = Topology.from_wire(raw)
    assert devices(topology)["a0"].codec_s == (("int8", 4e-10), ("int4", 9e-10))
    assert Topology.from_wire(topology.to_wire()) == topology
    problem = Problem.from_topology(topology, Workload(preset("tiny"), batch=8))
    rates = codec_rates(problem.step_costs)
    assert rates[0, CODECS.index("int8")] == 4e-10 and rates[0, CODECS.index("int4")] == 9e-10
    assert rates[0, CODECS.index("bf16")] == WORK_S_PER_VALUE["bf16"]  # not measured: one CPU thread's
    assert (rates[1:, 1:] == [[WORK_S_PER_VALUE[c] for c in CODECS[1:]]]).all() and not rates[:, 0].any()
    assert Problem.from_topology(Topology.from_wire(base()), Workload(preset("tiny"), batch=8)).step_costs is None


def _edit(path: list, value=None, delete: bool = False) -> dict:
    raw = copy.deepcopy(base())
    target = raw
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return raw


def _no_default_link() -> dict:
    raw = base()
    del raw["default_link"]
    return raw


BAD = [
    ("missing field", _edit(["devices", 1, "region"], delete=True), "topology.devices[1].region", "missing"),
    ("missing devices", _edit(["devices"], delete=True), "topology.devices", "missing"),
    ("negative tflops", _edit(["devices", 2, "tflops"], -5.0), "topology.devices[2].tflops", "positive"),
    ("negative latency", _edit(["regions", "a", "latency_ms"], -1.0), "topology.regions.a.latency_ms", "negative"),
    ("zero bandwidth", _edit(["regions", "b", "bandwidth_gbps"], 0), "topology.regions.b.bandwidth_gbps", "positive"),
    ("zero link bandwidth", _edit(["region_links", 0, "bandwidth_gbps"], 0.0),
     "topology.region_links[0].bandwidth_gbps", "positive"),
    ("number as string", _edit(["devices", 0, "memory_gb"], "16"), "topology.devices[0].memory_gb", "number"),
    ("bool as number", _edit(["default_link", "latency_ms"], True), "topology.default_link.latency_ms", "number"),
    ("nan", _edit(["devices", 3, "tflops"], float("nan")), "topology.devices[3].tflops", "finite"),
    # found by fuzzing: these raised OverflowError and TypeError
    ("integer past a float's range", _edit(["regions", "a", "latency_ms"], 10**400), "topology.regions.a.latency_ms",
     "finite"),
    ("field names of two types", {**base(), 1: "x", "colour": "blue"}, "topology.1", "not a known field"),
    ("unknown region", _edit(["devices", 4, "region"], "mars"), "topology.devices[4].region", "mars"),
    ("duplicate id", _edit(["devices", 3, "id"], "a0"), "topology.devices[3].id", "a0"),
    ("empty id", _edit(["devices", 0, "id"], ""), "topology.devices[0].id", "non-empty"),
    ("unknown region in region_links", _edit(["region_links", 0, "b"], "mars"), "topology.region_links[0].b", "mars"),
    ("unknown device in links", _edit(["links"], [{"a": "a0", "b": "zz", "latency_ms": 1, "bandwidth_gbps": 1}]),
     "topology.links[0].b", "zz"),
    ("region pair without link", _no_default_link(), "topology.region_links", "no link"),
    ("unknown top-level field", _edit(["colour"], "blue"), "topology.colour", "not a known field"),
    ("unknown device field", _edit(["devices", 2, "gpus"], 2), "topology.devices[2].gpus", "not a known field"),
    ("unknown link field", _edit(["regions", "c", "jitter_ms"], 1), "topology.regions.c.jitter_ms",
     "not a known field"),
    ("empty devices", _edit(["devices"], []), "topology.devices", "at least one device"),
    ("unknown codec", _edit(["devices", 0, "codec_s"], {"int3": 1e-9}), "topology.devices[0].codec_s.int3", "unknown codec"),
    ("zero codec rate", _edit(["devices", 0, "codec_s"], {"int8": 0.0}), "topology.devices[0].codec_s.int8", "positive"),
    ("codec rate too slow", _edit(["devices", 0, "codec_s"], {"int8": 1e-3}), "topology.devices[0].codec_s.int8",
     "at most"),
    ("codec rates not an object", _edit(["devices", 0, "codec_s"], [1e-9]), "topology.devices[0].codec_s", "object"),
    ("devices not a list", _edit(["devices"], {"id": "a0"}), "topology.devices", "list"),
]


@pytest.mark.parametrize("raw, path, words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_values_name_their_path(raw, path, words):
    with pytest.raises(SchemaError) as caught:
        Topology.from_wire(raw)
    error = caught.value
    assert isinstance(error, ValueError)
    assert error.path == path
    assert str(error).startswith(f"{path}: ")
    assert words in str(error)


def test_region_pair_without_link_is_fine_when_no_device_uses_it():
    raw = _no_default_link()
    raw["devices"] = [d for d in raw["devices"] if d["region"] != "c"]
    topology = Topology.from_wire(raw)
    assert len(topology.devices) == 4


def test_not_an_object():
    with pytest.raises(SchemaError) as caught:
        Topology.from_wire([base()])
    assert caught.value.path == "topology"


def test_link_matrices_give_every_pair_what_link_gives():
    raw = base()
    raw["links"] = [
        {"a": "a0", "b": "c0", "latency_ms": 7.0, "bandwidth_gbps": 3.0},
        {"a": "b1", "b": "a1", "latency_ms": 10.0, "bandwidth_gbps": 2.0},
        {"a": "a1", "b": "b1", "latency_ms": 30.0, "bandwidth_gbps": 4.0},  # asymmetric: averaged
    ]
    raw["regions"]["unused"] = {"latency_ms": 9.0, "bandwidth_gbps": 9.0}  # no device, no links
    topology = Topology.from_wire(raw)
    latency, bandwidth = topology.link_matrices()
    assert latency.shape == bandwidth.shape == (5, 5)
    for i, a in enumerate(topology.devices):
        for j, b in enumerate(topology.devices):
            if i != j:
                assert (latency[i, j], bandwidth[i, j]) == (topology.link(a, b).latency_ms, topology.link(a, b).bandwidth_gbps)
    d = devices(topology)
    assert topology.link(d["a1"], d["b1"]) == topology.link(d["b1"], d["a1"]) == Link(20.0, 3.0)
    assert topology.link(d["c0"], d["a0"]) == Link(7.0, 3.0)
    assert topology.link(d["c0"], d["b0"]) == Link(200.0, 0.5)


def test_links_near_the_largest_float_average_to_finite_values():
    # found by fuzzing: (a + b) / 2 overflowed to inf for a link given once (or both ways) past 9e307
    raw = base()
    raw["links"] = [{"a": "a0", "b": "c0", "latency_ms": 1.5e308, "bandwidth_gbps": 1.7e308},
                    {"a": "c0", "b": "a0", "latency_ms": 1.7e308, "bandwidth_gbps": 1.7e308}]
    raw["region_links"][0]["bandwidth_gbps"] = 1.7e308
    topology = Topology.from_wire(raw)
    d = devices(topology)
    assert topology.link(d["a0"], d["c0"]) == topology.link(d["c0"], d["a0"]) == Link(1.6e308, 1.7e308)
    assert topology.link(d["a0"], d["b0"]).bandwidth_gbps == 1.7e308
    assert all(np.isfinite(matrix).all() for matrix in topology.link_matrices())


def test_a_field_name_that_would_break_a_log_line_is_escaped_in_the_message():
    with pytest.raises(SchemaError) as caught:
        Topology.from_wire(_edit(["colour\nERROR forged line"], "blue"))
    assert caught.value.path == "topology.colour\nERROR forged line"
    assert "\n" not in str(caught.value) and str(caught.value).startswith("topology.colour\\nERROR forged line: ")
