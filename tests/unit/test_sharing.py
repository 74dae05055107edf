"""Peers on one device: the fair share by hand, the time model slowing exactly the peers that share,
plans of peers on separate devices unchanged, and the coordinator's reading of what a sharing peer achieved."""

from __future__ import annotations

import numpy as np
import pytest

from hetpeer.coordinator import policy
from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve
from hetpeer.coordinator.planner.lanes import lane_times
from hetpeer.coordinator.planner.sharing import Sharing, fair_level
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import LinkMeasurement, PeerRecord
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload
from hetpeer.protocol.addresses import PeerAddress

WORKLOAD = Workload(preset("tiny", 4), batch=16, micro_batch=2)


def test_fair_level_by_hand():
    rows = np.array([
        [0.5] * 8,  # 4 cores' worth on one: each gets 1/8
        [0.25] * 4 + [0.0] * 4,  # fits
        [0.5, 0.25, 0.25, 1 / 6, 1 / 6, 0, 0, 0],  # the two sixths run at their pace, the rest share 2/3
        [1.0, 1.0, 0.1, 0, 0, 0, 0, 0],
    ])
    np.testing.assert_allclose(fair_level(rows), [0.125, np.inf, 2 / 9, 0.45])


def test_peers_with_a_device_each_or_none_announced_share_nothing():
    assert Sharing.from_keys(["a", "b", None, None], [1.0, 1.0, 1.0, 1.0]) is None
    sharing = Sharing.from_keys(["a", "b", "a", None], [0.5, 1.0, 0.5, 1.0])
    assert sharing.group.tolist() == [0, -1, 0, -1] and sharing.groups == 1
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        Sharing.from_keys(["a", "a"], [0.5, 1.5])


def test_slowdowns_count_only_the_devices_a_grid_puts_to_work():
    # four peers on one machine, each using half of it, and one peer with its own device
    sharing = Sharing.from_keys(["m", "m", "m", "m", None], [0.5, 0.5, 0.5, 0.5, 1.0])
    all_four = sharing.slowdowns(np.array([[[0, 1], [2, 3]]]))
    np.testing.assert_allclose(all_four, 2.0)  # 2 machines' worth asked of one
    two = sharing.slowdowns(np.array([[[0, 4], [1, 4]]]))  # two of them and the other: the machine suffices
    np.testing.assert_allclose(two, 1.0)
    three = sharing.slowdowns(np.array([[[0, 1, 2]]]))
    np.testing.assert_allclose(three, 1.5)


def topology(n: int) -> Topology:
    return Topology.from_wire({
        "devices": [{"id": f"d{i}", "region": "r", "tflops": 0.01, "memory_gb": 8.0} for i in range(n)],
        "regions": {"r": {"latency_ms": 0.1, "bandwidth_gbps": 10.0}},
    })


def test_the_time_model_slows_the_compute_of_peers_sharing_a_device():
    alone = Problem.from_topology(topology(8), WORKLOAD)
    shared = Problem.from_topology(topology(8), WORKLOAD)
    shared = Problem(**{**{f: getattr(shared, f) for f in ("device_ids", "latency_s", "bandwidth_bytes_per_s", "workload",
                                                             "tflops", "memory_bytes")},
                        "sharing": Sharing.from_keys(["cpu"] * 8, [0.5] * 8)})
    grid = np.arange(8).reshape(2, 4)
    for sync in ("allreduce", "gossip"):
        config = PlannerConfig(sync=sync)
        a = make_model(alone, config, Shape(2, 4)).report(grid)
        b = make_model(shared, config, Shape(2, 4)).report(grid)
        assert b.layers == a.layers
        assert b.cost["compute_s"] == pytest.approx(4 * a.cost["compute_s"], rel=1e-9)
        assert b.cost["bubble_s"] == pytest.approx(4 * a.cost["bubble_s"], rel=1e-9)


def test_a_planner_with_shared_devices_predicts_their_sharing_and_leaves_idle_who_would_only_share():
    """Eight peers on one machine, each asking all of it: compute is no faster with all eight at work, so
    the plan puts fewer to work than the eight it uses when each has a device of its own, and predicts
    what the model gives its grid with the sharing counted."""
    problem = Problem.from_topology(topology(8), WORKLOAD)
    alone = solve(problem, PlannerConfig(time_budget_s=2.0), np.random.default_rng(0))
    shared = Problem(**{**{f: getattr(problem, f) for f in ("device_ids", "latency_s", "bandwidth_bytes_per_s",
                                                              "workload", "tflops", "memory_bytes")},
                        "sharing": Sharing.from_keys(["cpu"] * 8, [1.0] * 8)})
    together = solve(shared, PlannerConfig(time_budget_s=2.0), np.random.default_rng(0))
    assert len(alone.plan.standby) == 0 and len(together.plan.standby) > 0, (alone.plan.standby, together.plan.standby)
    assert together.plan.cost["total_s"] > alone.plan.cost["total_s"]
    model = make_model(shared, PlannerConfig(), together.shape)
    assert model.report(together.grid).cost["total_s"] == pytest.approx(together.plan.cost["total_s"], rel=1e-9)


def record(i: int, key: str | None, share: float, achieved: float | None = None, epoch: int = -1) -> PeerRecord:
    return PeerRecord(
        device_id=f"p{i}-{'0' * 16}", model="tiny", dtype="fp32", device_name="cpu", tflops=0.01, memory_bytes=8 << 30,
        address=PeerAddress(direct=("127.0.0.1", 7000 + i)), state="training", time=0.0, epoch=epoch,
        links={f"p{j}-{'0' * 16}": LinkMeasurement(1e-4, 1e9) for j in range(4) if j != i},
        achieved_tflops=achieved, compute_key=key, compute_share=share,
    )


def test_the_coordinator_reads_what_a_sharing_peer_achieved_as_what_it_would_alone():
    key = "0123456789abcdef"
    records = {r.device_id: r for r in (record(i, key, 0.5, achieved=0.004, epoch=1) for i in range(4))}
    ids = sorted(records)
    current = Plan(cost_model="time", model="tiny", layers=4, batch=16, micro_batch=2, micro_batches=4, dtype="fp32",
                   stages=(StagePlan(0, 0, 2, tuple(ids[:2]), "allreduce"), StagePlan(1, 2, 4, tuple(ids[2:]), "allreduce")), epoch=1)
    problem, _ = policy.build_problem(records, WORKLOAD, current)
    assert problem.sharing is not None and problem.sharing.group.tolist() == [0, 0, 0, 0]
    # four peers asking half the machine each ran at half their pace: alone they do twice what they achieved
    np.testing.assert_allclose(problem.tflops, 0.008)
    # the same peers announcing no device key: taken as they are, and nothing shared
    plain = {d: record(i, None, 1.0, achieved=0.004, epoch=1) for i, d in enumerate(ids)}
    problem, _ = policy.build_problem(plain, WORKLOAD, current)
    assert problem.sharing is None
    np.testing.assert_allclose(problem.tflops, 0.004)


def test_screens_hold_the_grids_sharing():
    """A swap inside the grid keeps who computes, so its screen is the full evaluation with the split held;
    an exchange of stages between lanes likewise."""
    from hetpeer.coordinator.planner.screens import _segments

    rng = np.random.default_rng(3)
    n, shape = 12, Shape(2, 4)
    problem = Problem.from_topology(topology(n), WORKLOAD)
    keys = ["a"] * 6 + ["b"] * 4 + [None] * 2
    shares = rng.uniform(0.2, 1.0, n)
    problem = Problem(**{**{f: getattr(problem, f) for f in ("device_ids", "latency_s", "bandwidth_bytes_per_s",
                                                               "workload", "memory_bytes")},
                         "tflops": rng.uniform(0.005, 0.02, n), "sharing": Sharing.from_keys(keys, shares)})
    model = make_model(problem, PlannerConfig(), shape)
    grid = rng.permutation(n)[: shape.devices].reshape(shape.stages, shape.group_size)
    counts = np.array(model.report(grid).layers)
    cells = np.array([(a, b) for a in range(8) for b in range(8) if a < b])
    batch = np.repeat(grid[None], len(cells), axis=0)
    flat = batch.reshape(len(cells), -1)
    rows = np.arange(len(cells))
    flat[rows, cells[:, 0]], flat[rows, cells[:, 1]] = grid.ravel()[cells[:, 1]], grid.ravel()[cells[:, 0]]
    slowdown = model._slowdowns(batch).transpose(0, 2, 1)
    *parts, _, _ = model._lane_parts(batch.transpose(0, 2, 1), counts[None, None, :], slowdown)
    lane = lane_times(*parts, model._allocate(*parts), shape.stages)  # the step shared out over the lanes
    stage_bytes = np.broadcast_to(counts * model.wire_per_layer + model.wire_fixed, (len(batch), shape.stages))
    allreduce, gossip = model._groups(batch, stage_bytes)
    need = np.broadcast_to(model.mem_fixed + counts * model.mem_per_layer, stage_bytes.shape)
    overflow = model._overflow(batch, need)
    update = model._update(batch, np.broadcast_to(counts, (len(batch), shape.stages)))
    sync_s, *_, factor, departures = model._sync(allreduce, gossip, lane.max(axis=1), lane.max(axis=1) + update,
                                     model._outer_fits(batch, need, stage_bytes))
    held = model._objective(lane, sync_s, overflow, np.zeros(len(batch)), update, factor * departures)
    np.testing.assert_allclose(model.screen(grid, batch, cells), held, rtol=1e-12)
    assert not np.allclose(slowdown, 1.0)  # the case means something: some devices are slowed

    a, b = np.array([(0, 1), (2, 3)]).T
    new = model._exchanged_lanes(grid, counts, _segments(2), a, b, model.micro_batches)
    for k in range(len(a)):
        for j, (s1, s2) in enumerate(_segments(2)):
            g = grid.copy()
            g[s1:s2, a[k]], g[s1:s2, b[k]] = grid[s1:s2, b[k]], grid[s1:s2, a[k]]
            *parts, _, _ = model._lane_parts(g.T[None], counts[None, None, :], model._slowdowns(g[None]).transpose(0, 2, 1))
            lanes = lane_times(*parts, model.micro_batches, 2)
            assert new[k, j] == pytest.approx(lanes[0, a[k]], rel=1e-12)


def test_other_work_on_a_device_leaves_its_peers_less():
    np.testing.assert_allclose(fair_level(np.array([[0.5, 0.5], [0.2, 0.2]]), np.array([0.6, 0.6])), [0.3, np.inf])
    # two peers each asking half the machine, which other work keeps 40% busy (the median of what its peers saw)
    sharing = Sharing.from_keys(["m", "m", "m"], [0.5, 0.5, 0.5], [0.4, 0.35, 0.9])
    assert sharing.capacity.tolist() == pytest.approx([0.6])
    np.testing.assert_allclose(sharing.slowdowns(np.array([[[0, 1]]])), 0.5 / 0.3)
    np.testing.assert_allclose(sharing.slowdowns(np.array([[[0]]])), 1.0)  # alone, it fits in what is left
    assert "3 peers compute on 1 shared device(s); other work takes 40%" in sharing.describe()
    with pytest.raises(ValueError, match="background"):
        Sharing.from_keys(["m", "m"], [0.5, 0.5], [0.4, 1.0])
    with pytest.raises(ValueError, match="own load"):
        Sharing.from_keys(["m", "m"], [0.5, 0.5], [0.4, 0.4], [0.1, -0.1])


def test_what_the_peers_of_a_device_do_themselves_is_not_other_work():
    # four peers starting beside each other: each sees the others' start-up as other work (50% and 55%), and
    # announces its own (5% each): of the device's 60% busy, 20% was theirs, 40% other programs
    sharing = Sharing.from_keys(["m"] * 4, [0.2] * 4, [0.55, 0.55, 0.55, 0.5], [0.05] * 4)
    assert sharing.capacity.tolist() == pytest.approx([0.6])
    # peers that announce nothing of their own (older ones) keep what they measured
    assert Sharing.from_keys(["m"] * 4, [0.2] * 4, [0.55] * 4).capacity.tolist() == pytest.approx([0.45])
    # what they announce as their own never makes the device freer than nothing running, nor busier than they saw
    assert Sharing.from_keys(["m"] * 2, [0.2] * 2, [0.1, 0.1], [0.3, 0.3]).capacity.tolist() == pytest.approx([1.0])
