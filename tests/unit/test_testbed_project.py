"""The testbed's compose project from a topology (pure, no Docker): addresses, per-destination shaping,
emulated latency, compute slowdowns, the commands each container runs, and what is refused."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hetpeer import scenarios
from hetpeer.cli import build_parser
from hetpeer.protocol.topology import Topology
from hetpeer.testbed.project import (
    COORDINATOR,
    TestbedConfig,
    TestbedError,
    compose_project,
    latencies,
    memory_limits,
    peer_name,
    scripts,
    service_name,
    shaping,
    slowdowns,
    write,
)

TOPOLOGY = Topology.from_wire({
    "name": "two-sites",
    "devices": [{"id": "A-0", "region": "a", "tflops": 2.0}, {"id": "a.1", "region": "a", "tflops": 2.0},
                {"id": "b-0", "region": "b", "tflops": 1.0}],
    "regions": {"a": {"latency_ms": 2, "bandwidth_gbps": 0.2}, "b": {"latency_ms": 3, "bandwidth_gbps": 0.1}},
    "region_links": [{"a": "a", "b": "b", "latency_ms": 30, "bandwidth_gbps": 0.04}],
})  # fmt: skip


def config(**changes) -> TestbedConfig:
    return TestbedConfig(**{"topology": TOPOLOGY, "out": Path("/tmp/bed"), "subnet": "10.213.7.0/24", **changes})


def test_every_container_gets_a_fixed_address_after_the_gateway():
    assert config().addresses == {COORDINATOR: "10.213.7.2", "a-0": "10.213.7.3", "a-1": "10.213.7.4", "b-0": "10.213.7.5"}
    assert service_name("A-0") == "a-0" and peer_name("a.1") == "a_1"


def test_each_destination_is_shaped_to_its_link_times_the_scale():
    commands = shaping(config(scale=0.5), TOPOLOGY.devices[0])
    assert commands[0].startswith("tc qdisc replace dev eth0 root handle 1: htb")
    rates = {}
    for rule, flow in zip(commands[1::3], commands[3::3]):
        rate = int(re.search(r" rate (\d+)bit", rule).group(1))
        rates[re.search(r"match ip dst (\S+)/32", flow).group(1)] = rate
        assert rule.split("classid ")[1].split()[0] == flow.split("flowid ")[1]
    assert rates == {"10.213.7.4": 100_000_000, "10.213.7.5": 20_000_000}  # 0.2 and 0.04 Gbit/s, halved
    assert all("bfifo limit" in c for c in commands[2::3])


def test_latency_is_emulated_per_destination_and_compute_follows_tflops():
    assert latencies(config(), TOPOLOGY.devices[2]) == {"10.213.7.3": 30.0, "10.213.7.4": 30.0}
    assert slowdowns(config(slowdown=4.0)) == {"A-0": 4.0, "a.1": 4.0, "b-0": 8.0}


def test_the_containers_commands_are_what_the_cli_accepts():
    for name, text in scripts(config(steps=50)).items():
        lines = text.splitlines()
        assert lines[0] == "#!/bin/sh" and "set -e" in lines
        argv = shlex.split(lines[-1].removeprefix("exec "))
        assert argv[0] == "hetpeer"
        args = build_parser().parse_args(argv[1:])
        assert args.steps == 50
        if name == COORDINATOR:
            assert args.command == "coordinator" and args.min_peers == 3 and str(args.join_file) == "/swarm/join.json"
        else:
            assert args.command == "join" and args.announce_host == config().addresses[name]
            assert len(args.emulate_latency) == 2 and str(args.join_file) == "/swarm/join.json"
            assert sum(line.startswith("tc filter") for line in lines) == 2
    assert "--emulate-latency" not in scripts(config(emulate_latency=False))["a-0"]


def test_the_compose_project_puts_everyone_on_one_network_with_their_addresses(tmp_path):
    path = write(config(out=tmp_path, api_port=50999, http_port=8999))
    project = yaml.safe_load(path.read_text())
    assert project == compose_project(config(out=tmp_path, api_port=50999, http_port=8999))
    services = project["services"]
    assert services[COORDINATOR]["ports"] == ["127.0.0.1:50999:50051", "127.0.0.1:8999:8080"]
    assert all(services[n]["cap_add"] == ["NET_ADMIN"] for n in ("a-0", "a-1", "b-0"))
    assert all(services[n]["shm_size"] == 2 * 2**30 for n in ("a-0", "a-1", "b-0"))  # not Docker's 64 MB
    assert all(s["networks"]["wan"]["ipv4_address"] == config().addresses[n] for n, s in services.items())
    assert project["networks"]["wan"]["ipam"]["config"] == [{"subnet": "10.213.7.0/24"}]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [f"{n}.sh" for n in sorted(services)]


def test_a_device_that_states_its_memory_gets_a_container_of_that_size_and_no_swap(tmp_path):
    devices = [{"id": "A-0", "region": "a", "tflops": 2.0, "memory_gb": 1.25}, {"id": "b-0", "region": "b", "tflops": 1.0}]
    topology = Topology.from_wire({**TOPOLOGY.to_wire(), "devices": devices})
    services = compose_project(config(topology=topology, out=tmp_path))["services"]
    assert memory_limits(config(topology=topology)) == {"a-0": 1_250_000_000}
    assert services["a-0"]["mem_limit"] == services["a-0"]["memswap_limit"] == 1_250_000_000
    assert "mem_limit" not in services["b-0"] and "mem_limit" not in services[COORDINATOR]


def test_the_world_wide_scenario_fits_a_slash_24():
    world = Topology.from_wire(scenarios.load("world-wide"))
    assert len(config(topology=world).addresses) == 65


@pytest.mark.parametrize("change, fragment", [
    ({"scale": 0.0}, "scale"), ({"slowdown": 0.5}, "slowdown"), ({"subnet": "10.0.0.0/30"}, "no room"),
    ({"subnet": "fe80::/64"}, "IPv4"), ({"subnet": "10.0.0.300/24"}, "subnet"), ({"api_port": 0}, "api port"),
    ({"http_port": 70000}, "http port"), ({"http_port": 50051}, "two ports"),
    ({"batch": 2, "micro_batch": 4}, "micro"),
])
def test_impossible_testbeds_are_refused(change, fragment):
    with pytest.raises(TestbedError, match=fragment):
        config(**change)


def test_devices_need_tflops_and_distinct_service_names():
    no_tflops = Topology.from_wire({"devices": [{"id": "x", "region": "r"}], "regions": {"r": {"latency_ms": 1, "bandwidth_gbps": 1}}})
    with pytest.raises(TestbedError, match="tflops"):
        config(topology=no_tflops)
    clash = Topology.from_wire({"devices": [{"id": "x.1", "region": "r", "tflops": 1}, {"id": "x-1", "region": "r", "tflops": 1}],
                                "regions": {"r": {"latency_ms": 1, "bandwidth_gbps": 1}}})
    with pytest.raises(TestbedError, match="distinct"):
        replace(config(), topology=clash)


NATED = Topology.from_wire({
    "devices": [{"id": "pub", "region": "a", "tflops": 1.0}, {"id": "cone", "region": "a", "tflops": 1.0, "nat": "cone"},
                {"id": "sym", "region": "a", "tflops": 1.0, "nat": "symmetric"}],
    "regions": {"a": {"latency_ms": 4, "bandwidth_gbps": 0.2}},
})  # fmt: skip


def test_a_device_behind_nat_sits_alone_on_a_private_network_behind_its_router():
    made = config(topology=NATED, lan_subnets="10.214.4.0/23")
    assert made.addresses == {COORDINATOR: "10.213.7.2", "pub": "10.213.7.3", "cone-nat": "10.213.7.4", "sym-nat": "10.213.7.5"}
    assert made.lans == {"cone": ("10.214.4.0/24", "10.214.4.2", "10.214.4.3"), "sym": ("10.214.5.0/24", "10.214.5.2", "10.214.5.3")}
    project = compose_project(made)
    services, networks = project["services"], project["networks"]
    assert services["cone"]["networks"] == {"lan-cone": {"ipv4_address": "10.214.4.3"}}  # not on the shared network
    assert services["cone-nat"]["networks"] == {"wan": {"ipv4_address": "10.213.7.4"}, "lan-cone": {"ipv4_address": "10.214.4.2"}}
    assert networks["lan-cone"] == {"ipam": {"config": [{"subnet": "10.214.4.0/24"}]}}
    assert services["sym-nat"]["sysctls"] == {"net.ipv4.ip_forward": 1} and "NET_ADMIN" in services["sym-nat"]["cap_add"]
    run = scripts(made)
    assert "ip route replace default via 10.214.4.2" in run["cone"]
    assert "MASQUERADE\n" in run["cone-nat"] and "MASQUERADE --random-fully" in run["sym-nat"]
    assert "iptables -P FORWARD DROP" in run["sym-nat"] and "exec sleep infinity" in run["sym-nat"]


def test_a_peer_behind_nat_joins_with_no_address_flag_and_others_shape_towards_its_router():
    made = config(topology=NATED, lan_subnets="10.214.4.0/23")
    parser = build_parser()
    cone = parser.parse_args(shlex.split(scripts(made)["cone"].splitlines()[-1].removeprefix("exec "))[1:])
    assert cone.listen is None and cone.announce_host is None and cone.dht_listen is None and not cone.dht_announce
    pub = NATED.devices[0]
    assert any("match ip dst 10.213.7.4/32" in line for line in shaping(made, pub))  # cone's router, not cone
    assert latencies(made, pub) == {"10.213.7.4": 4.0, "10.213.7.5": 4.0}


@pytest.mark.parametrize("raw, match", [
    ({"nat": "full-cone"}, "must be one of none, cone, symmetric"),
    ({"nat": 1}, "must be a non-empty string"),
])
def test_an_unknown_nat_kind_is_refused(raw, match):
    with pytest.raises(Exception, match=match):
        Topology.from_wire({"devices": [{"id": "x", "region": "a", **raw}], "regions": {"a": {"latency_ms": 1, "bandwidth_gbps": 1}}})


def test_lan_subnets_must_hold_every_nated_device_apart_from_the_shared_network():
    with pytest.raises(TestbedError, match="room for 2 /24"):
        config(topology=NATED, lan_subnets="10.214.4.0/24")
    with pytest.raises(TestbedError, match="apart from 10.213.7.0/24"):
        config(topology=NATED, lan_subnets="10.213.0.0/16")
