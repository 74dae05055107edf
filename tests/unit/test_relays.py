"""Relayed pairs in the planner (`planner/relays.py`): their links are the relay's two hops, the pairs a grid routes
through one relay share its link, and the report says what each relay carries a step (the screens hold a grid's
relay load: `test_timemodel.py`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model
from hetpeer.coordinator.planner.relays import route
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

WORKLOAD = Workload(preset("tiny", 4), batch=8, micro_batch=2, dtype="fp32")
IDS = ("r", "s", "a", "b", "c", "d")  # r and s public relays; a, b, c, d behind NAT


def links(n: int = len(IDS), bandwidth: float = 100e6, latency: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    lat, bw = np.full((n, n), latency), np.full((n, n), bandwidth)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return lat, bw


def nat_problem(relay_of: dict[str, str], capacity: float) -> Problem:
    """IDS with every pair of a, b, c, d relayed through the relay of either (`relay_of`), relays of `capacity`."""
    latency, bandwidth = links()
    behind = np.array([d in "abcd" for d in IDS])
    relay = np.array([IDS.index(relay_of[d]) if d in relay_of else -1 for d in IDS])
    relays = route(latency, bandwidth, behind, relay, np.zeros((6, 6), dtype=bool), np.full(6, capacity), IDS)
    return Problem(IDS, latency, bandwidth, WORKLOAD, tflops=np.full(6, 1.0), relays=relays)


def test_route_takes_the_better_relay_of_a_pair_and_names_the_relays_used():
    latency, bandwidth = links()
    bandwidth[2, 0] = bandwidth[0, 2] = 10e6  # a's link to r is slow
    latency[3, 1] = latency[1, 3] = 0.05
    behind = np.array([False, False, True, True, True, True])
    relay = np.array([-1, -1, 0, 1, 0, -1])  # a at r, b at s, c at r, d at none
    direct = np.zeros((6, 6), dtype=bool)
    direct[4, 5] = direct[5, 4] = True  # c and d punched a hole
    relays = route(latency, bandwidth, behind, relay, direct, np.array([50e6, 70e6, 0, 0, 0, 0]), IDS)
    assert relays.names == ("r", "s") and relays.capacity.tolist() == [50e6, 70e6]
    a, b, c, d = 2, 3, 4, 5
    # a-b: through a's relay r is 10 MB/s, through b's relay s 100 MB/s at 0.06 s: s
    assert relays.via[a, b] == relays.via[b, a] == 1
    assert bandwidth[a, b] == 100e6 and latency[a, b] == pytest.approx(0.06)
    assert relays.via[a, c] == 0 and bandwidth[a, c] == 10e6 and latency[a, c] == pytest.approx(0.02)  # both at r
    assert relays.via[c, d] == -1 and bandwidth[c, d] == 100e6  # punched: as it was
    assert relays.via[b, d] == 1 and relays.via[0, a] == -1  # a public peer's pair is its own
    assert route(*links(), behind, np.full(6, -1), direct, np.ones(6), IDS) is None  # no relay: nothing relayed


def test_a_grid_counts_each_relayed_pair_once_per_relay():
    problem = nat_problem({"a": "r", "b": "r", "c": "s", "d": "s"}, 1e9)
    i = {d: k for k, d in enumerate(IDS)}
    grid = np.array([[i["a"], i["b"]], [i["c"], i["d"]]])  # hops a-c, b-d; groups a-b, c-d
    load = problem.relays.load(grid[None])
    via = problem.relays.via
    assert (via == via.T).all()  # a pair goes through one relay whichever end is asked: a tie too (every link alike)
    expected = np.bincount([via[i["a"], i["c"]], via[i["b"], i["d"]], via[i["a"], i["b"]], via[i["c"], i["d"]]],
                           minlength=2)
    assert load.tolist() == [expected.tolist()] and expected.sum() == 4
    public = np.array([[i["r"], i["a"]], [i["s"], i["b"]]])  # pairs with a public end are not relayed
    assert problem.relays.load(public[None]).tolist() == [[1.0, 1.0]]  # at least one: a pair a swap adds is alone
    assert problem.subset(np.array([0, 2, 3])).relays.via.tolist() == via[np.ix_([0, 2, 3], [0, 2, 3])].tolist()


@pytest.mark.parametrize("sync", ["allreduce", "gossip"])
def test_pairs_through_one_relay_each_get_its_capacity_shared_out(sync):
    """Four relayed pairs through r: the prediction is the one with each of their links at r's capacity / 4 (where
    that is below their own), and a relay with room to spare costs nothing."""
    i = {d: k for k, d in enumerate(IDS)}
    grid = np.array([[i["a"], i["b"]], [i["c"], i["d"]]])
    shape, config = Shape(2, 2), PlannerConfig(sync=sync)
    relayed = nat_problem({d: "r" for d in "abcd"}, 40e6)
    capped = dataclasses.replace(relayed, relays=None, bandwidth_bytes_per_s=np.where(
        relayed.relays.via >= 0, np.minimum(relayed.bandwidth_bytes_per_s, 40e6 / 4), relayed.bandwidth_bytes_per_s))
    plain = dataclasses.replace(relayed, relays=None)
    shared = make_model(relayed, config, shape).report(grid)
    assert shared.cost["total_s"] == pytest.approx(make_model(capped, config, shape).report(grid).cost["total_s"], rel=1e-12)
    assert shared.cost["total_s"] > make_model(plain, config, shape).report(grid).cost["total_s"]
    roomy = nat_problem({d: "r" for d in "abcd"}, 1e12)
    assert make_model(roomy, config, shape).report(grid).cost["total_s"] == pytest.approx(
        make_model(plain, config, shape).report(grid).cost["total_s"], rel=1e-12)
    # the same pairs spread over two relays of that capacity: two each, faster
    spread = nat_problem({"a": "r", "b": "r", "c": "s", "d": "s"}, 40e6)
    assert make_model(spread, config, shape).report(grid).cost["total_s"] < shared.cost["total_s"]


def test_the_report_says_what_each_relay_carries_a_step():
    """All-reduce on 2 x 2: each lane's hop sends its micro-batches forward and back, each group of two sends its
    stage both ways once a step."""
    i = {d: k for k, d in enumerate(IDS)}
    grid = np.array([[i["a"], i["b"]], [i["c"], i["d"]]])
    problem = nat_problem({d: "r" for d in "abcd"}, 1e9)
    model = make_model(problem, PlannerConfig(sync="allreduce"), Shape(2, 2))
    report = model.report(grid)
    e = model._evaluate(grid[None])
    model_spec = WORKLOAD.model
    activation = WORKLOAD.micro_batch * model_spec.seq_len * model_spec.hidden * WORKLOAD.dtype_bytes
    hops = sum(2 * activation * micro for micro in e["micro"][0])
    stage_bytes = e["counts"][0] * model.wire_per_layer + model.wire_fixed
    assert report.relay_load == (("r", 4, pytest.approx(hops + 2 * stage_bytes.sum(), rel=1e-9)),)
    assert make_model(dataclasses.replace(problem, relays=None), PlannerConfig(), Shape(2, 2)).report(grid).relay_load == ()
