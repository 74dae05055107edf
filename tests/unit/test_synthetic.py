"""The planner's swarm generators: each makes a valid topology of its kind, the same for the same seed."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, solve, synthetic
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload

DEVICES = 128


def made(kind: str, devices: int = DEVICES, seed: int = 0) -> Topology:
    return Topology.from_wire(synthetic.generate(kind, devices, seed))


@pytest.mark.parametrize("kind", list(synthetic.GENERATORS))
def test_every_generator_makes_a_valid_topology_of_the_size_asked_the_same_for_a_seed(kind, check_plan):
    topology = made(kind)
    assert len(topology.devices) == DEVICES and len({d.id for d in topology.devices}) == DEVICES
    latency, bandwidth = topology.link_matrices()
    assert np.all(latency > 0) and np.all(bandwidth > 0)
    assert synthetic.generate(kind, DEVICES, 0) == synthetic.generate(kind, DEVICES, 0)
    assert synthetic.generate(kind, DEVICES, 0) != synthetic.generate(kind, DEVICES, 1)
    problem = Problem.from_topology(made(kind, 24), Workload(preset("gpt3-xl", 8), batch=32))
    check_plan(problem, solve(problem, PlannerConfig(time_budget_s=0.5), np.random.default_rng(0)))


def test_geo_is_the_random_topology_with_a_region_per_16_devices():
    assert synthetic.generate("geo", DEVICES, 5) == synthetic.random_topology(DEVICES, DEVICES // 16, np.random.default_rng(5))


def test_mixed_has_regions_of_32_and_eight_generations_of_gpu():
    topology = made("mixed", 1024)
    per_region = collections.Counter(d.region for d in topology.devices)
    assert len(per_region) == 32 and set(per_region.values()) == {32}
    kinds = {(d.tflops, d.memory_gb) for d in topology.devices}
    assert kinds == set(synthetic.MIXED_CLASSES)
    assert min(t for t, _ in kinds) == 8 and max(t for t, _ in kinds) == 312
    assert min(m for _, m in kinds) == 8 and max(m for _, m in kinds) == 80


def test_many_small_regions_hold_four_devices_each_on_average():
    assert len({d.region for d in made("regions").devices}) > DEVICES // 4 * 0.9


def test_sites_hold_three_quarters_in_four_fast_data_centres_of_one_gpu_each():
    topology = made("sites")
    centres = {name: link for name, link in topology.regions.items() if name.startswith("dc")}
    assert len(centres) == 4 and all(link.bandwidth_gbps == 100.0 for link in centres.values())
    inside = [d for d in topology.devices if d.region in centres]
    assert len(inside) == DEVICES - DEVICES // 4
    assert all(len({(d.tflops, d.memory_gb) for d in inside if d.region == c}) == 1 for c in centres)


def test_home_links_are_slow_and_some_devices_fit_no_stage_of_a_large_model():
    topology = made("home", 256)
    _, bandwidth = topology.link_matrices()
    assert bandwidth.max() <= 0.3
    problem = Problem.from_topology(topology, Workload(preset("gpt3-xl"), batch=512))
    solution = solve(problem, PlannerConfig(time_budget_s=0.5), np.random.default_rng(0))
    small = {d.id for d in topology.devices if d.memory_gb <= 1.0}
    assert small and small.isdisjoint(solution.plan.devices)
    assert sum(count for reason, count in solution.plan.standby_reasons if reason.startswith("too small")) == len(small)


def test_an_unknown_generator_or_no_devices_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown swarm generator 'moon'.*geo, mixed, regions, sites, home"):
        synthetic.generate("moon", 8, 0)
    with pytest.raises(ValueError, match="at least one device"):
        synthetic.generate("home", 0, 0)
