"""The time cost model on cases small enough to work out from the formulas in its docstring."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, Shape, make_model, solve, synthetic
from hetpeer.coordinator.planner.codecs import WORK_S_PER_VALUE
from hetpeer.coordinator.planner.lanes import lane_times
from hetpeer.coordinator.planner.quality import TABLE
from hetpeer.coordinator.planner.relays import route
from hetpeer.coordinator.planner.timemodel import TIE_BREAK
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.stepcosts import FIELDS as STEP_COSTS
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

# tiny: hidden 64, seq 64, vocab 256.
H, SEQ, VOCAB = 64, 64, 256
LAYER_FLOPS = SEQ * (24 * H * H + 4 * SEQ * H)  # forward, per sequence
HEAD_FLOPS = SEQ * 2 * H * VOCAB
BOUNDARY_BYTES = SEQ * H * 2  # fp16 activations per sequence
LAYER_PARAMS = 12 * H * H + 13 * H
EMBEDDING_PARAMS = VOCAB * H + SEQ * H
HEAD_PARAMS = VOCAB * H + 2 * H
ACTIVATIONS = 38 * SEQ * H  # what a layer keeps for one fp16 micro-batch's backward (Workload.layer_activation_bytes)
COPIES = 2 * LAYER_PARAMS  # and the fp16 copy of its weights
LOGITS = 12 * SEQ * VOCAB + 2 * VOCAB * H  # the last stage's logits at the loss's backward, and the head's fp16 copy
EMBEDDING_GRADIENT = 4 * VOCAB * H  # the first stage's dense embedding gradient
# one device holding the whole model, one micro-batch in flight
WHOLE = 4 * (16 * LAYER_PARAMS + ACTIVATIONS + COPIES) + 16 * (EMBEDDING_PARAMS + HEAD_PARAMS) + LOGITS + EMBEDDING_GRADIENT


def topology(tflops: list[float], latency_ms: float, gbps: float, memory_gb: list[float] | None = None) -> Topology:
    memory_gb = memory_gb or [100.0] * len(tflops)
    return Topology.from_wire(
        {
            "devices": [
                {"id": f"d{i}", "region": "r", "tflops": t, "memory_gb": m}
                for i, (t, m) in enumerate(zip(tflops, memory_gb))
            ],
            "regions": {"r": {"latency_ms": latency_ms, "bandwidth_gbps": gbps}},
        }
    )


def pipeline_step(stage_tflops: list[float], layers: int, micro_batches: int, latency_s: float, transfer_s: float) -> tuple:
    """One lane, one device per stage: the min-max layer split (brute force, must be unique), and
    T = C + (M - 1) max(max t, max x, C / S if M > S), C = sum t + 2 sum (latency + x)."""

    def times(split):
        t = [n * 3 * LAYER_FLOPS / (f * 1e12) for n, f in zip(split, stage_tflops)]
        t[-1] += 3 * HEAD_FLOPS / (stage_tflops[-1] * 1e12)
        return t

    S = len(stage_tflops)
    splits = [c for c in itertools.product(range(1, layers + 1), repeat=S) if sum(c) == layers]
    best = min(max(times(c)) for c in splits)
    winners = [c for c in splits if max(times(c)) == best]
    assert len(winners) == 1, "pick numbers with a unique best split"
    t = times(winners[0])
    round_trip = sum(t) + 2 * (S - 1) * (latency_s + transfer_s)
    period = max(max(t), transfer_s if S > 1 else 0.0, round_trip / S if micro_batches > S else 0.0)
    return winners[0], round_trip + (micro_batches - 1) * period, t


@pytest.mark.parametrize(
    "latency_ms, gbps, bound",
    [(0.5, 1.0, "compute"), (50.0, 0.01, "round trip")],
)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_stage_lane_by_hand(latency_ms, gbps, bound, order):
    # d0 twice as fast as d1; 4 layers, batch 4 in micro-batches of 1: M = 4.
    tflops = [2e-3, 1e-3]
    problem = Problem.from_topology(topology(tflops, latency_ms, gbps), Workload(preset("tiny", 4), batch=4))
    model = make_model(problem, PlannerConfig(stages=2, group_size=1), Shape(2, 1))
    grid = np.array([[order[0]], [order[1]]])

    transfer_s = BOUNDARY_BYTES / (gbps * 1e9 / 8)
    hop_s = latency_ms / 1e3 + transfer_s
    split, total, t = pipeline_step([tflops[d] for d in order], 4, 4, latency_ms / 1e3, transfer_s)
    # M = 4 micro-batches on S = 2 stages: a stage's compute bounds each further one, or (far stages) the
    # round trip of the two in flight
    assert (max(t) > (sum(t) + 2 * hop_s) / 2) == (bound == "compute")
    if order == (0, 1):
        # By hand: from (1, 1), adding a layer to the fast first stage finishes sooner twice: (3, 1).
        assert split == (3, 1)

    report = model.report(grid)
    assert report.layers == split
    assert report.sync == ("none", "none")
    assert report.fits_memory
    assert report.cost["total_s"] == pytest.approx(total, rel=1e-12)
    # One lane, no sync: the search's tie-break adds TIE_BREAK x that lane's time.
    assert report.objective == pytest.approx(total * (1 + TIE_BREAK), rel=1e-12)
    assert model.batch_cost(grid[None])[0] == pytest.approx(total * (1 + TIE_BREAK), rel=1e-12)
    # The parts add up to the step: compute of the bottleneck, fill and drain, exposed transfers.
    M = 4
    assert report.cost["compute_s"] == pytest.approx(M * max(t))
    assert report.cost["bubble_s"] == pytest.approx(sum(t) - max(t))
    period = max(max(t), transfer_s, (sum(t) + 2 * hop_s) / 2)  # M = 4 > S = 2: a round trip per two
    assert report.cost["activation_s"] == pytest.approx(2 * hop_s + (M - 1) * (period - max(t)))
    assert report.cost["sync_s"] == 0.0
    parts = sum(v for k, v in report.cost.items() if k != "total_s")
    assert parts == pytest.approx(report.cost["total_s"])



def test_codecs_between_stages_shrink_the_hops_by_hand():
    """Two stages of one lane on a slow link, one micro-batch: activations forward in int4, their gradients
    back in int8. Each way the hop carries what its codec puts on the wire (4.5 and 8.5 bits a value); the
    plan names both codecs on the first stage's hop; the codecs' work counts too."""
    tflops, latency_s, gbps = [2e-3, 1e-3], 0.05, 0.01
    problem = Problem.from_topology(topology(tflops, latency_s * 1e3, gbps), Workload(preset("tiny", 4), batch=1))
    grid = np.array([[0], [1]])
    values = SEQ * H  # one sequence's activation, each way
    seconds = {codec: values * bits / 8 / (gbps * 1e9 / 8) for codec, bits in (("raw", 16), ("int4", 4.5), ("int8", 8.5))}

    def step(compress):
        config = PlannerConfig(stages=2, group_size=1, compress=compress)
        return make_model(problem, config, Shape(2, 1)).report(grid), solve(problem, config, np.random.default_rng(0))

    (raw, _), (packed, solution) = step(("raw", "raw")), step(("int4", "int8"))
    compute = raw.cost["total_s"] - 2 * (latency_s + seconds["raw"])  # M = 1: C = sum t + both ways of the hop
    work = values * (WORK_S_PER_VALUE["int4"] + WORK_S_PER_VALUE["int8"])  # encoding and decoding, both ways
    assert packed.cost["total_s"] == pytest.approx(compute + 2 * latency_s + seconds["int4"] + seconds["int8"] + work, rel=1e-9)
    assert packed.codecs == ((("int4", "int8"),),) and raw.codecs == ((("raw", "raw"),),)  # per hop, per lane
    assert [(s.forward, s.backward) for s in solution.plan.stages] == [(("int4",), ("int8",)), ((), ())]
    with pytest.raises(ValueError, match="compress must be auto or a \\(forward, backward\\) pair"):
        PlannerConfig(compress=("int4", "int3"))
    with pytest.raises(ValueError, match="time cost model only"):
        PlannerConfig(cost_model="dtfm", compress=("int8", "int8"))


@pytest.fixture
def measured(monkeypatch):
    """Codec tables of a known shape: int8 and int4 forward within a 1% budget, int4 both ways past it, none costing
    steps (`test_codecs_that_cost_steps_are_weighed_in_time_to_loss` weighs those); the 4-bit codec costs 4 ns a
    value to encode and decode, int8 2 ns, bf16 1 ns, raw nothing."""
    from hetpeer.coordinator.planner import codecs

    monkeypatch.setattr(codecs, "LOSS_GAP", {("raw", "raw"): 0.0, ("bf16", "bf16"): 0.0, ("int8", "int8"): 0.001,
                                             ("int4", "int8"): 0.004, ("int4", "int4"): 0.05})
    monkeypatch.setattr(codecs, "STEPS_FACTOR", {pair: 1.0 for pair in codecs.LOSS_GAP})
    monkeypatch.setattr(codecs, "QUALITY_BUDGET", 0.01)
    monkeypatch.setattr(codecs, "WORK_S_PER_VALUE", {"raw": 0.0, "fp16": 1e-9, "bf16": 1e-9, "int8": 2e-9, "int4": 4e-9,
                                                     "int6": 3e-9})
    return codecs


def test_auto_takes_per_hop_the_shortest_pair_within_the_budget(measured):
    """On a slow link the fewest bytes win (int4 forward; int4 back is past the budget), on a fast one the
    codec's work costs more than its bytes save, and raw wins; each hop is the minimum over the pairs."""
    hops = measured.HopCodecs(measured.AUTO, values=1e6, dtype="fp32")
    assert ("int4", "int4") not in hops.pairs and ("int4", "int8") in hops.pairs
    per_byte = np.array([8 / 1e6, 8 / 1e11])  # 1 Mbit/s and 100 Gbit/s
    mean, larger, choice = hops.occupancy(per_byte, np.array([0, 1]), np.array([1, 0]))
    assert [hops.pairs[c] for c in choice] == [("int4", "int8"), ("raw", "raw")]
    wire = {"raw": 4.0, "bf16": 2.0, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 64}  # bytes a value
    work = {"raw": 0.0, "bf16": 1e-9, "int8": 2e-9, "int4": 4e-9}
    for k, pb in enumerate(per_byte):
        each = [1e6 * ((wire[f] + wire[b]) / 2 * pb + (work[f] + work[b]) / 2) for f, b in hops.pairs]
        assert mean[k] == pytest.approx(min(each), rel=1e-12)
        f, b = hops.pairs[choice[k]]
        assert larger[k] == pytest.approx(1e6 * (max(wire[f], wire[b]) * pb + (work[f] + work[b]) / 2), rel=1e-12)
    assert hops.cheapest(per_byte) == pytest.approx(mean, rel=1e-12)


def test_auto_plans_codecs_lane_by_lane(measured):
    """Two stages x two lanes: lane 0's hop crosses 10 Mbit/s, lane 1's stays on 100 Gbit/s. The plan
    compresses lane 0's hop and leaves lane 1's raw, as the time model counted them."""
    raw = {
        "devices": [{"id": d, "region": r, "tflops": 1e-3, "memory_gb": 100.0}
                    for d, r in (("a0", "x"), ("b0", "y"), ("a1", "z"), ("b1", "z"))],
        "regions": {"x": {"latency_ms": 1, "bandwidth_gbps": 100}, "y": {"latency_ms": 1, "bandwidth_gbps": 100},
                    "z": {"latency_ms": 0.1, "bandwidth_gbps": 100}},
        "region_links": [{"a": "x", "b": "y", "latency_ms": 20, "bandwidth_gbps": 0.01},
                         {"a": "x", "b": "z", "latency_ms": 20, "bandwidth_gbps": 0.01},
                         {"a": "y", "b": "z", "latency_ms": 20, "bandwidth_gbps": 0.01}],
    }  # fmt: skip
    # one micro-batch a lane (two in all): however the hops cost, lane 0 stays the slowest, which the costs describe
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=2))
    config = PlannerConfig(stages=2, group_size=2, compress=measured.AUTO, allow_standby=False)
    grid = np.array([[0, 2], [1, 3]])  # lane 0: a0 -> b0 across, lane 1: a1 -> b1 inside z
    model = make_model(problem, config, Shape(2, 2))
    report = model.report(grid)
    assert report.codecs == ((("int4", "int8"), ("raw", "raw")),)
    fixed = make_model(problem, PlannerConfig(stages=2, group_size=2, compress=("raw", "raw")), Shape(2, 2)).report(grid)
    assert report.cost["activation_s"] < fixed.cost["activation_s"]  # the slow lane's transfers shrank
    plan = solve(problem, config, np.random.default_rng(0)).plan  # whatever lanes it finds, each hop as its link
    index = {d: i for i, d in enumerate(problem.device_ids)}
    for lane, (first, second) in enumerate(plan.lanes):
        crossing = problem.bandwidth_bytes_per_s[index[first], index[second]] < 1e8
        assert plan.stages[0].codecs(lane) == (("int4", "int8") if crossing else ("raw", "raw")), plan.lanes


def two_devices_over(bandwidth_gbps: float, codec_s: list[dict | None]) -> Problem:
    """Two devices, a0 and b0, across a link of `bandwidth_gbps`, each with the codec rates it measured (None:
    none), for 2 stages x 1 lane of the tiny model."""
    raw = {
        "devices": [{"id": d, "region": r, "tflops": 1.0, "memory_gb": 100.0, **({"codec_s": c} if c else {})}
                    for d, r, c in (("a0", "x", codec_s[0]), ("b0", "y", codec_s[1]))],
        "regions": {"x": {"latency_ms": 1, "bandwidth_gbps": 100}, "y": {"latency_ms": 1, "bandwidth_gbps": 100}},
        "region_links": [{"a": "x", "b": "y", "latency_ms": 20, "bandwidth_gbps": bandwidth_gbps}],
    }  # fmt: skip
    return Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=2))


def test_each_peer_s_measured_codec_rates_cost_its_ends_of_a_hop(measured):
    """A hop's codec work is its two devices' own: a quarter of each one's encode plus decode rate for each of
    the pair's two codecs. Devices that measured nothing count the one-thread table; a fast (GPU) device on
    both ends makes the compressed hop cheaper than slow (CPU) ones, on the same link."""
    config = PlannerConfig(stages=2, group_size=1, compress=("int4", "int8"), allow_standby=False)
    problem = two_devices_over(0.05, [None, None])
    spec = problem.workload.model
    values = problem.lane_micro_batch(1) * spec.seq_len * spec.hidden  # a micro-batch's activation
    grid = np.array([[0], [1]])

    def hop_work(codec_s):
        model = make_model(two_devices_over(0.05, codec_s), config, Shape(2, 1))
        _, per_byte = model._pairs(grid[:-1], grid[1:])
        mean, _, _ = model.hops.occupancy(per_byte, grid[:-1], grid[1:])
        wire = model.hops.mean_bytes[0] * per_byte
        return float((mean - wire)[0, 0]), model.report(grid).cost["total_s"]

    cpu = {"int4": 4e-9, "int8": 2e-9}  # the table's figures, measured
    gpu = {"int4": 2e-10, "int8": 1e-10}
    unmeasured_s, unmeasured_step = hop_work([None, None])
    assert unmeasured_s == pytest.approx(values * (4e-9 + 2e-9) / 2, rel=1e-12)
    assert hop_work([cpu, cpu])[0] == pytest.approx(unmeasured_s, rel=1e-12)
    gpu_s, gpu_step = hop_work([gpu, gpu])
    assert gpu_s == pytest.approx(values * (2e-10 + 1e-10) / 2, rel=1e-12)
    mixed_s, _ = hop_work([gpu, None])  # one end measured, the other at the table's rates
    assert mixed_s == pytest.approx(values * ((2e-10 + 1e-10) + (4e-9 + 2e-9)) / 4, rel=1e-12)
    assert gpu_step < unmeasured_step


def test_a_gpu_peer_s_rates_change_the_codecs_auto_takes(measured):
    """On a 100 Gbit/s link a byte costs 8e-11 s: int8 saves a bf16 activation 0.94 bytes a value, 7.5e-11 s, far
    less than a CPU thread's 2e-9 s of encoding and decoding, and auto sends raw between CPU peers; between GPU
    peers that measured 100 times faster rates, it compresses."""
    config = PlannerConfig(stages=2, group_size=1, compress=measured.AUTO, allow_standby=False)
    grid = np.array([[0], [1]])
    gpu = {"fp16": 1e-11, "bf16": 1e-11, "int8": 2e-11, "int4": 4e-11}
    cpu_plan = make_model(two_devices_over(100.0, [None, None]), config, Shape(2, 1)).report(grid)
    gpu_plan = make_model(two_devices_over(100.0, [gpu, gpu]), config, Shape(2, 1)).report(grid)
    assert cpu_plan.codecs == ((("raw", "raw"),),)
    assert gpu_plan.codecs != cpu_plan.codecs and gpu_plan.cost["total_s"] < cpu_plan.cost["total_s"]


@pytest.mark.parametrize("int4_factor", [1.03, 3.0])
def test_codecs_that_cost_steps_are_weighed_in_time_to_loss(measured, monkeypatch, int4_factor):
    """int4 activations cost steps (`STEPS_FACTOR`). Across 10 Mbit/s, where the hop is most of the step, the
    model takes int4/int8 at x1.03 and counts its factor in the plan's; at x3 the same hop is worth less than
    int8's, which costs no steps. Either way it takes the tier whose step x factor is least, by hand."""
    monkeypatch.setattr(measured, "STEPS_FACTOR", {**measured.STEPS_FACTOR, ("int4", "int8"): int4_factor})
    problem = two_devices_over(0.01, [None, None])
    grid = np.array([[0], [1]])
    config = PlannerConfig(stages=2, group_size=1, compress=measured.AUTO, allow_standby=False)
    report = make_model(problem, config, Shape(2, 1)).report(grid)

    def fixed(pair):
        return make_model(problem, dataclasses.replace(config, compress=pair), Shape(2, 1)).report(grid)

    int4, int8 = fixed(("int4", "int8")), fixed(("int8", "int8"))
    assert int4.cost["total_s"] < int8.cost["total_s"]  # the fewest bytes make the shortest step
    assert int4.steps_factor == pytest.approx(int4_factor) and int8.steps_factor == 1.0
    # one lane, no group: the step is the lane's, and the objective its time to loss with the tie-break
    assert int4.objective == pytest.approx(int4.cost["total_s"] * (1 + TIE_BREAK) * int4_factor, rel=1e-12)
    best = min((int4, int8), key=lambda r: r.cost["total_s"] * r.steps_factor)
    assert best is (int4 if int4_factor < 1.5 else int8)
    assert report.codecs == best.codecs and report.steps_factor == best.steps_factor
    assert report.objective == pytest.approx(best.objective, rel=1e-12)
    plan = solve(problem, config, np.random.default_rng(0)).plan  # the published plan says so
    assert plan.steps_factor == pytest.approx(best.steps_factor) and plan.stages[0].codecs(0) == best.codecs[0][0]


def test_fixed_hop_codecs_are_counted_whatever_the_configuration_would_choose(measured):
    """A model told a hop's codecs (a running plan's) counts that hop in them, even a pair outside its
    candidates: int4/int4 (past the budget here) on a fast link where auto would send raw."""
    problem = two_devices_over(100.0, [None, None])
    grid = np.array([[0], [1]])
    config = PlannerConfig(stages=2, group_size=1, compress=measured.AUTO, allow_standby=False)
    chosen = make_model(problem, config, Shape(2, 1)).report(grid)
    assert chosen.codecs == ((("raw", "raw"),),)
    held = make_model(problem, config, Shape(2, 1), hop_codecs={(0, 1): ("int4", "int4")}).report(grid)
    assert held.codecs == ((("int4", "int4"),),)
    fixed = make_model(problem, PlannerConfig(stages=2, group_size=1, compress=("int4", "int4"), allow_standby=False),
                       Shape(2, 1)).report(grid)
    assert held.cost["total_s"] == pytest.approx(fixed.cost["total_s"], rel=1e-12)
    assert held.cost["total_s"] > chosen.cost["total_s"]



@pytest.mark.parametrize("tflops", [1e-3, 1.0])
@pytest.mark.parametrize("sync", ["allreduce", "gossip", "auto"])
def test_one_stage_two_lanes_sync_by_hand(tflops, sync):
    latency_s, bandwidth = 0.005, 0.1 * 1e9 / 8
    problem = Problem.from_topology(topology([tflops, tflops], 5.0, 0.1), Workload(preset("tiny", 4), batch=4))
    model = make_model(problem, PlannerConfig(stages=1, group_size=2, sync=sync, outer_every=None), Shape(1, 2))
    report = model.report(np.array([[0, 1]]))

    # Each lane: 2 sequences, M = 2 micro-batches through one stage holding all 4 layers and the head.
    t = (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / (tflops * 1e12)
    lane_s = 2 * t
    stage_bytes = (4 * LAYER_PARAMS + EMBEDDING_PARAMS + HEAD_PARAMS) * 2
    allreduce = latency_s + (2 - 1) * stage_bytes / bandwidth  # robust (the default): the stage to the other, one round
    gossip = max(0.0, latency_s + stage_bytes / bandwidth - lane_s)  # one round: lane 0 <-> lane 1
    if sync == "auto":  # outer steps forbidden here: the least (step x steps factor), a tie to all-reduce
        factor = TABLE.factor("gossip", 2, 2 * SEQ)
        sync = "gossip" if (lane_s + gossip) * factor < lane_s + allreduce else "allreduce"
    expected_sync = allreduce if sync == "allreduce" else gossip

    assert report.layers == (4,)
    assert report.sync == (sync,)
    assert report.cost["sync_s"] == pytest.approx(expected_sync, rel=1e-12)
    assert report.cost["total_s"] == pytest.approx(lane_s + expected_sync, rel=1e-12)


def four_lanes_slow_across(tflops: float, sync: str):
    """The report of 1 stage x 4 lanes: ring neighbours on 8 Gbit/s (1e9 B/s), opposite lanes (d0-d2,
    d1-d3) on 0.8 Gbit/s."""
    raw = {
        "devices": [{"id": f"d{i}", "region": "r", "tflops": tflops, "memory_gb": 100.0} for i in range(4)],
        "regions": {"r": {"latency_ms": 0.0, "bandwidth_gbps": 8.0}},
        "links": [{"a": "d0", "b": "d2", "latency_ms": 0.0, "bandwidth_gbps": 0.8},
                  {"a": "d1", "b": "d3", "latency_ms": 0.0, "bandwidth_gbps": 0.8}],
    }  # fmt: skip
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 4), batch=4))
    config = PlannerConfig(stages=1, group_size=4, sync=sync, outer_every=None)
    return make_model(problem, config, Shape(1, 4)).report(np.array([[0, 1, 2, 3]]))


@pytest.mark.parametrize("sync", ["gossip", "auto"])
def test_gossip_rounds_of_the_exponential_graph_by_hand(sync):
    # 1 stage x 4 lanes; ring neighbours on 8 Gbit/s (1e9 B/s), opposite lanes (d0-d2, d1-d3) on 0.8 Gbit/s.
    # Gossip round 0 pairs lane l with l + 1, round 1 with l + 2: one round a step, in turn; both outlast
    # this (fast) step, so a step pays the mean round less the step.
    report = four_lanes_slow_across(1000.0, sync)
    stage_bytes = (4 * LAYER_PARAMS + EMBEDDING_PARAMS + HEAD_PARAMS) * 2  # 473_856
    lane_s = (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / 1000e12  # M = 1
    gossip = (stage_bytes / 1e9 + stage_bytes / 1e8) / 2 - lane_s
    # robust all-reduce: every member's stage to the 3 others; the model takes the ring d0 d1 d2 d3 for the group's
    # pairs, fast links only (the runtime crosses d0-d2 and d1-d3 too: the approximation timemodel's docstring states)
    allreduce = 3 * stage_bytes / 1e9
    if sync == "gossip":
        assert report.sync == ("gossip",)
        assert report.cost["sync_s"] == pytest.approx(gossip, rel=1e-9)
    else:
        assert allreduce < gossip  # so auto keeps exact averaging
        assert report.sync == ("allreduce",)
        assert report.cost["sync_s"] == pytest.approx(allreduce, rel=1e-9)
    assert report.cost["total_s"] == pytest.approx(lane_s + report.cost["sync_s"], rel=1e-9)


def test_a_slow_gossip_round_is_not_hidden_behind_a_fast_one():
    # As above, but the step lasts longer than round 0 (fast links) and shorter than round 1 (slow ones):
    # round 0 hides entirely behind the step, round 1 shows its excess, every other step.
    report = four_lanes_slow_across(0.05, "gossip")
    stage_bytes = (4 * LAYER_PARAMS + EMBEDDING_PARAMS + HEAD_PARAMS) * 2
    lane_s = (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / 0.05e12
    fast, slow = stage_bytes / 1e9, stage_bytes / 1e8
    assert fast < lane_s < slow and (fast + slow) / 2 < lane_s + (slow - lane_s) / 2
    assert report.cost["sync_s"] == pytest.approx((slow - lane_s) / 2, rel=1e-9)  # not (fast + slow) / 2 - lane_s
    assert report.cost["total_s"] == pytest.approx(lane_s + (slow - lane_s) / 2, rel=1e-9)


def test_memory_by_hand_and_overflow_penalty():
    workload = Workload(preset("tiny", 4), batch=1)
    # One device holds everything: 16 bytes per parameter of state; for its one micro-batch in flight each
    # layer's stored activations and the fp16 copy of its weights; 12 bytes per logit and the head's fp16 copy;
    # the embedding's dense gradient.
    need = WHOLE
    config = PlannerConfig(stages=1, group_size=1, memory_reserve=0.0, recompute="never")
    grid = np.array([[0]])

    roomy = Problem.from_topology(topology([1.0], 1.0, 1.0, [need * 1.001 / 1e9]), workload)
    report = make_model(roomy, config, Shape(1, 1)).report(grid)
    assert report.fits_memory and report.recompute == (0,)
    assert report.objective == pytest.approx(report.cost["total_s"] * (1 + TIE_BREAK))

    tight = Problem.from_topology(topology([1.0], 1.0, 1.0, [need * 0.999 / 1e9]), workload)
    report = make_model(tight, config, Shape(1, 1)).report(grid)
    assert not report.fits_memory
    overflow = need - need * 0.999
    penalty = report.objective - report.cost["total_s"] * (1 + TIE_BREAK)
    assert penalty == pytest.approx(1e4 * overflow / 1e9, rel=1e-6)

    # The reserve is taken off the top: with 10% kept back, the roomy device no longer fits.
    reserved = make_model(roomy, PlannerConfig(stages=1, group_size=1, memory_reserve=0.1, recompute="never"), Shape(1, 1))
    assert not reserved.report(grid).fits_memory


def test_a_stage_that_does_not_fit_recomputes_the_fewest_layers_that_make_it_fit():
    workload = Workload(preset("tiny", 4), batch=1)
    full = 16 * LAYER_PARAMS + ACTIVATIONS + COPIES  # a layer, its activations kept
    recomputed = 16 * LAYER_PARAMS + 4 * SEQ * H  # a layer that keeps only its fp32 input
    fixed = 16 * (EMBEDDING_PARAMS + HEAD_PARAMS) + LOGITS + EMBEDDING_GRADIENT
    rebuilt = ACTIVATIONS + COPIES  # the one layer the backward pass runs forward again
    grid = np.array([[0]])
    plain = make_model(Problem.from_topology(topology([1.0], 1.0, 1.0), workload), PlannerConfig(stages=1, group_size=1), Shape(1, 1))
    plain_s = plain.report(grid).cost["total_s"]
    layer_s = 3 * LAYER_FLOPS / 1e12
    # With one micro-batch in flight, recomputing one layer saves nothing (the backward pass rebuilds one): two
    # is the fewest that helps.
    assert fixed + 3 * full + recomputed + rebuilt > fixed + 4 * full
    for k in (2, 3, 4):
        need = fixed + (4 - k) * full + k * recomputed + rebuilt
        problem = Problem.from_topology(topology([1.0], 1.0, 1.0, [need * 1.0001 / 1e9]), workload)
        report = make_model(problem, PlannerConfig(stages=1, group_size=1, memory_reserve=0.0), Shape(1, 1)).report(grid)
        assert report.fits_memory and report.recompute == (k,)
        assert report.cost["total_s"] == pytest.approx(plain_s + k * layer_s / 3, rel=1e-9)  # one more forward each
        # a device that timed what recomputing costs it (`StepCosts.recompute_share`) pays that instead
        timed = make_model(replace_costs(problem, np.array([[0.0, 0.0, 0.0, 0.0, 0.85]])),
                           PlannerConfig(stages=1, group_size=1, memory_reserve=0.0), Shape(1, 1)).report(grid)
        assert timed.recompute == (k,) and timed.cost["total_s"] == pytest.approx(plain_s + k * 0.85 * layer_s, rel=1e-9)
        never = make_model(problem, PlannerConfig(stages=1, group_size=1, memory_reserve=0.0, recompute="never"), Shape(1, 1))
        assert not never.report(grid).fits_memory
    always = make_model(Problem.from_topology(topology([1.0], 1.0, 1.0), workload),
                        PlannerConfig(stages=1, group_size=1, recompute="always"), Shape(1, 1)).report(grid)
    assert always.recompute == (4,) and always.cost["total_s"] == pytest.approx(plain_s + 4 * layer_s / 3, rel=1e-9)
    # Too small even with every layer recomputed: it overflows, by what recomputing everything still needs.
    need = fixed + 4 * recomputed + rebuilt
    problem = Problem.from_topology(topology([1.0], 1.0, 1.0, [need * 0.999 / 1e9]), workload)
    report = make_model(problem, PlannerConfig(stages=1, group_size=1, memory_reserve=0.0), Shape(1, 1)).report(grid)
    assert not report.fits_memory and report.recompute == (4,)


def test_memory_caps_a_fast_stage():
    # d0 is 10x faster but, as stage 0 with 2 micro-batches in flight, has room for one layer only
    # (without recomputation; with it, two fit): fixed (embeddings) + per layer <= 2.3e6 < fixed + 2 per layer.
    per_layer = 16 * LAYER_PARAMS + 2 * (ACTIVATIONS + COPIES)
    fixed = 16 * EMBEDDING_PARAMS + EMBEDDING_GRADIENT
    recomputed, rebuilt = 16 * LAYER_PARAMS + 2 * 4 * SEQ * H, ACTIVATIONS + COPIES
    assert fixed + per_layer <= 2.4e6 < fixed + 2 * per_layer
    assert fixed + 2 * recomputed + rebuilt <= 2.4e6
    problem = Problem.from_topology(
        topology([1e-2, 1e-3], 1.0, 10.0, [2.4e-3, 100.0]), Workload(preset("tiny", 4), batch=4)
    )
    config = PlannerConfig(stages=2, group_size=1, memory_reserve=0.0, recompute="never")
    report = make_model(problem, config, Shape(2, 1)).report(np.array([[0], [1]]))
    assert report.layers == (1, 3)
    assert report.fits_memory
    # Without the cap the fast stage would take more layers; recomputing, it takes more and fits.
    free = Problem.from_topology(topology([1e-2, 1e-3], 1.0, 10.0), Workload(preset("tiny", 4), batch=4))
    assert make_model(free, config, Shape(2, 1)).report(np.array([[0], [1]])).layers[0] > 1
    recomputing = make_model(problem, PlannerConfig(stages=2, group_size=1, memory_reserve=0.0), Shape(2, 1))
    report = recomputing.report(np.array([[0], [1]]))
    assert report.layers == (2, 2) and report.recompute == (2, 0) and report.fits_memory
    # d0 only twice as fast: at a third of a layer a recomputed layer costs, two recomputed layers still beat three
    # on d1; where d0 timed recomputing at three times a layer's forward and backward, it keeps one layer
    config = PlannerConfig(stages=2, group_size=1, memory_reserve=0.0)
    twice = Problem.from_topology(topology([2e-3, 1e-3], 1.0, 10.0, [2.4e-3, 100.0]), Workload(preset("tiny", 4), batch=4))
    assert make_model(twice, config, Shape(2, 1)).report(np.array([[0], [1]])).layers == (2, 2)
    costly = replace_costs(twice, np.array([[0.0, 0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]]))
    report = make_model(costly, config, Shape(2, 1)).report(np.array([[0], [1]]))
    assert report.layers == (1, 3) and report.recompute == (0, 0)


def test_moving_weights_from_the_current_plan_is_amortised():
    tflops, gbps = [2e-3, 1e-3], 1.0
    current = Plan(
        cost_model="time", model="tiny", layers=4, batch=4, micro_batch=1, micro_batches=4, dtype="fp16",
        stages=(StagePlan(0, 0, 3, ("d0",), "none"), StagePlan(1, 3, 4, ("d1",), "none")),
    )  # fmt: skip
    problem = Problem.from_topology(
        topology(tflops, 10.0, gbps), Workload(preset("tiny", 4), batch=4), current=current
    )
    model = make_model(problem, PlannerConfig(stages=2, group_size=1, horizon_steps=10), Shape(2, 1))

    same = model.report(np.array([[0], [1]]))  # layers (3, 1): exactly what each device holds now
    assert same.layers == (3, 1)
    assert same.cost["move_s"] == 0.0
    assert same.objective == pytest.approx(same.cost["total_s"] * (1 + TIE_BREAK))

    swapped = model.report(np.array([[1], [0]]))
    # The fast d0 is now last: split (1, 3) (see the brute force), so d1 needs layer 0 it does not hold,
    # d0 needs layers 1-3 and holds 1-2: one layer of training state each, over the 1 Gbit/s link.
    assert swapped.layers == pipeline_step([1e-3, 2e-3], 4, 4, 0.0, 0.0)[0] == (1, 3)
    move_s = LAYER_PARAMS * 16 / (gbps * 1e9 / 8)
    assert swapped.cost["move_s"] == pytest.approx(move_s)
    assert swapped.objective == pytest.approx(swapped.cost["total_s"] * (1 + TIE_BREAK) + move_s / 10)


def test_a_lane_computes_only_its_share_of_the_batch():
    """batch 8 in micro-batches of 8 over 4 lanes: each lane holds 2 sequences, so it cannot take as
    long as one device running all 8."""
    problem = Problem.from_topology(
        topology([1e-3] * 4, 0.01, 100.0), Workload(preset("tiny", 4), batch=8, micro_batch=8)
    )
    config = PlannerConfig(sync="allreduce")
    alone = make_model(problem, config, Shape(1, 1)).report(np.array([[0]]))
    four = make_model(problem, config, Shape(1, 4)).report(np.array([[0, 1, 2, 3]]))
    per_sequence = (4 * 3 * LAYER_FLOPS + 3 * HEAD_FLOPS) / 1e9
    assert alone.cost["compute_s"] == pytest.approx(8 * per_sequence)
    assert four.cost["compute_s"] == pytest.approx(2 * per_sequence)
    assert four.cost["total_s"] < alone.cost["total_s"]


def test_time_model_needs_tflops():
    raw = {"devices": [{"id": "a", "region": "r"}, {"id": "b", "region": "r", "tflops": 1.0}],
           "regions": {"r": {"latency_ms": 1.0, "bandwidth_gbps": 1.0}}}  # fmt: skip
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny"), batch=2))
    with pytest.raises(PlanningError, match="tflops"):
        make_model(problem, PlannerConfig(), Shape(1, 2))



def test_a_device_that_moves_must_fit_its_old_stage_beside_its_new_one():
    # room for either stage of a 2-stage split, not for the whole model: a device that changes stages keeps
    # the one it held (its successor downloads it) while it fills the new one, and that overflows
    workload = Workload(preset("tiny", 4), batch=4)
    whole = WHOLE
    config = PlannerConfig(stages=2, group_size=1, memory_reserve=0.0)
    devices = topology([1e-3, 1e-3], 1.0, 10.0, [0.75 * whole / 1e9] * 2)
    fresh = make_model(Problem.from_topology(devices, workload), config, Shape(2, 1))
    held, swapped = np.array([[0], [1]]), np.array([[1], [0]])
    assert fresh.report(held).fits_memory and fresh.report(swapped).fits_memory
    cut = fresh.report(held).layers[0]
    current = Plan(
        cost_model="time", model="tiny", layers=4, batch=4, micro_batch=1, micro_batches=4, dtype="fp16",
        stages=(StagePlan(0, 0, cut, ("d0",), "none"), StagePlan(1, cut, 4, ("d1",), "none")),
    )  # fmt: skip
    moving = make_model(Problem.from_topology(devices, workload, current=current), config, Shape(2, 1))
    assert moving.report(held).fits_memory  # nobody moves
    assert not moving.report(swapped).fits_memory


def test_a_device_that_moves_must_also_fit_the_state_it_downloads_staged_beside_both():
    # room for the whole model and then some (1.1x): the old stage and the new one fit side by side, but
    # not with the new stage's download staged until it is complete (16 bytes a parameter of 2 layers)
    workload = Workload(preset("tiny", 4), batch=4)
    whole = WHOLE
    current = Plan(
        cost_model="time", model="tiny", layers=4, batch=4, micro_batch=1, micro_batches=4, dtype="fp16",
        stages=(StagePlan(0, 0, 2, ("d0",), "none"), StagePlan(1, 2, 4, ("d1",), "none")),
    )  # fmt: skip
    config = PlannerConfig(stages=2, group_size=1, memory_reserve=0.0)

    def fits(memory: float, grid: list[list[int]]) -> bool:
        devices = topology([1e-3, 1e-3], 1.0, 10.0, [memory / 1e9] * 2)
        model = make_model(Problem.from_topology(devices, workload, current=current), config, Shape(2, 1))
        return model.report(np.array(grid)).fits_memory

    assert fits(1.1 * whole, [[0], [1]]) and not fits(1.1 * whole, [[1], [0]])
    assert fits(1.1 * whole + 2 * LAYER_PARAMS * 16, [[1], [0]])  # the staged download is what it lacked


def test_a_tied_head_adds_its_gradient_exchange_between_the_lane_ends():
    """A tied model's two-stage lane pays latency + vocab x hidden x dtype bytes / bandwidth once a step (both
    ways at once); one stage holds both copies and pays nothing; an untied model pays nothing."""
    from hetpeer.protocol.modelspec import ModelSpec

    latency_ms, gbps = 5.0, 0.1
    gpt2 = {"model_type": "gpt2", "n_embd": H, "n_head": 4, "n_layer": 4, "n_positions": SEQ, "vocab_size": VOCAB}
    costs = {}
    for name, tie in (("tied", True), ("untied", False)):
        spec = ModelSpec.from_config(gpt2 | {"tie_word_embeddings": tie})
        problem = Problem.from_topology(topology([1e-3, 1e-3], latency_ms, gbps), Workload(spec, batch=4))
        model = make_model(problem, PlannerConfig(stages=2, group_size=1), Shape(2, 1))
        costs[name] = model.report(np.array([[0], [1]])).cost["total_s"]
        one = make_model(problem, PlannerConfig(stages=1, group_size=1), Shape(1, 1)).report(np.array([[0]]))
        costs[name + "-one"] = one.cost["total_s"]
    exchange = latency_ms / 1e3 + VOCAB * H * 2 / (gbps * 1e9 / 8)
    assert costs["tied"] - costs["untied"] == pytest.approx(exchange, rel=1e-9)
    assert costs["tied-one"] == pytest.approx(costs["untied-one"], rel=1e-12)


def swaps(grid: np.ndarray, n: int, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`count` random swaps of a grid, as the local search makes them: two cells (in one group or
    in two), or a cell and a standby device. Returns the swapped grids and the changed cells."""
    S, m = grid.shape
    standby = np.setdiff1d(np.arange(n), grid.ravel())
    batch = np.repeat(grid[None], count, axis=0)
    cells = np.empty((count, 2), dtype=np.int64)
    for k in range(count):
        flat = batch[k].reshape(-1)
        a = int(rng.integers(S * m))
        kind = rng.integers(3) if len(standby) else rng.integers(2)
        if kind == 0:  # within a group
            b = int(a // m * m + rng.integers(m))
        elif kind == 1:  # anywhere
            b = int(rng.integers(S * m))
        else:  # with standby
            b = a
            flat[a] = standby[rng.integers(len(standby))]
        flat[a], flat[b] = (flat[b], flat[a]) if b != a else (flat[a], flat[b])
        cells[k] = a, b
    return batch, cells


def held_split_objective(model, grids: np.ndarray, counts: np.ndarray, load: np.ndarray | None = None,
                         exact: bool = False) -> np.ndarray:
    """The full evaluation of every lane and group of `grids` with the layer split `counts` (S,) held (and relays'
    `load`, (1, R), where given; the hops' codecs in the tier `exact` says, their steps factor counted)."""
    K = len(grids)
    *parts, _, lane_factor = model._lane_parts(grids.transpose(0, 2, 1), counts[None, None, :], 1.0, load, exact)
    lane = lane_times(*parts, model._allocate(*parts), len(counts))  # the step shared out over the lanes
    stage_bytes = np.broadcast_to(counts * model.wire_per_layer + model.wire_fixed, (K, len(counts)))
    allreduce, gossip = model._groups(grids, stage_bytes, load)
    need = np.broadcast_to(model.mem_fixed + counts * model.mem_per_layer, stage_bytes.shape)
    overflow = model._overflow(grids, need)
    update = model._update(grids, np.broadcast_to(counts, (K, len(counts))))
    outer_fits = model._outer_fits(grids, need, stage_bytes)
    sync_s, *_, factor, departures = model._sync(allreduce, gossip, lane.max(axis=1), lane.max(axis=1) + update, outer_fits)
    return model._objective(lane, sync_s, overflow, np.zeros(K), update, factor * lane_factor.max(axis=1) * departures)


@pytest.mark.parametrize("shape", [Shape(1, 6), Shape(2, 2), Shape(3, 4), Shape(2, 5), Shape(4, 7), Shape(8, 3)])
@pytest.mark.parametrize("sync", ["allreduce", "gossip", "auto", "outer"])
@pytest.mark.parametrize("seed", range(3))
def test_the_screen_is_the_full_evaluation_with_the_split_held(shape, sync, seed):
    """The screen re-evaluates only the pairs a swap changes; it must give what evaluating every
    lane and group of the swapped grid gives, with the base grid's layer split."""
    rng = np.random.default_rng(seed)
    n = 40
    raw = synthetic.random_topology(n, 4, rng)
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 8), batch=64))
    if seed % 2:  # devices that measured what their stages' steps cost beyond the blocks
        problem = with_step_costs(problem, rng)
    if seed == 2:  # an overhead a coordinator learned, below 0 (its model over-predicted)
        problem = dataclasses.replace(problem, step_overhead_s=-1e-4)
    model = make_model(problem, PlannerConfig(sync=sync), shape)
    for _ in range(3):  # several base grids, so that the screen's kept state is refreshed
        grid = rng.permutation(n)[: shape.devices].reshape(shape.stages, shape.group_size)
        batch, cells = swaps(grid, n, 50, rng)
        counts = np.array(model.report(grid).layers)
        np.testing.assert_allclose(
            model.screen(grid, batch, cells), held_split_objective(model, batch, counts), rtol=1e-12
        )


def test_a_screened_swap_holds_the_grids_codec_tier_and_counts_its_lanes_codec_factors():
    """With `--compress auto` on links slow enough that int4 (which costs steps) wins some hops, the screen keeps
    the base grid's codec tier and counts the swapped lanes' codec factors anew: against every lane and group of
    the swapped grid evaluated in that tier, it is exact. The base grids take both tiers."""
    rng = np.random.default_rng(0)
    n = 24
    raw = synthetic.random_topology(n, 4, rng)
    for link in raw["region_links"]:
        link["bandwidth_gbps"] = link["bandwidth_gbps"] / 200  # between regions: a few Mbit/s
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 8), batch=64))
    model = make_model(problem, PlannerConfig(sync="auto", compress=("auto", "auto")), Shape(3, 4))
    assert model.hops.tiered
    tiers, costly = set(), 0
    for _ in range(12):
        grid = rng.permutation(n)[:12].reshape(3, 4)
        batch, cells = swaps(grid, n, 30, rng)
        base = model._evaluate(grid[None])
        exact = bool(base["exact"][0])
        tiers.add(exact)
        costly += int(base["lane_factor"][0].max() > 1)
        np.testing.assert_allclose(model.screen(grid, batch, cells),
                                   held_split_objective(model, batch, base["counts"][0], exact=exact), rtol=1e-12)
    assert tiers == {False, True} and costly > 0, (tiers, costly)


def test_a_screened_swap_holds_the_grids_relays_as_the_full_evaluation_counts_them():
    """The screen keeps the base grid's relay load (as it keeps its sharing): against every lane and group of the
    swapped grid evaluated at that load, it is exact."""
    rng = np.random.default_rng(0)
    n = 12
    problem = Problem.from_topology(Topology.from_wire(synthetic.random_topology(n, 2, rng)), Workload(preset("tiny", 8), batch=64))
    behind = np.arange(n) >= 2  # ten devices behind NAT, at the relays of devices 0 and 1
    relays = route(problem.latency_s.copy(), problem.bandwidth_bytes_per_s.copy(), behind, np.where(behind, np.arange(n) % 2, -1),
                   np.zeros((n, n), dtype=bool), np.full(n, 2e6), problem.device_ids)
    problem = dataclasses.replace(problem, relays=relays)
    model = make_model(problem, PlannerConfig(sync="auto"), Shape(2, 4))
    for _ in range(3):
        grid = rng.permutation(n)[:8].reshape(2, 4)
        batch, cells = swaps(grid, n, 50, rng)
        base = model._evaluate(grid[None])
        assert (base["load"] > 1).any()  # the relays' share binds
        np.testing.assert_allclose(model.screen(grid, batch, cells),
                                   held_split_objective(model, batch, base["counts"][0], base["load"]), rtol=1e-12)


def test_a_negative_overhead_takes_at_most_half_of_any_step_off_and_the_plan_carries_what_it_took():
    """A coordinator learned -X on one plan; a plan predicted much faster must still come out positive, and the
    plan record (whose schema holds the overhead to half the step) must take it."""
    from hetpeer.coordinator.planner import to_plan

    rng = np.random.default_rng(0)
    problem = Problem.from_topology(Topology.from_wire(synthetic.random_topology(8, 2, rng)), Workload(preset("tiny", 4), batch=16))
    shape = Shape(2, 2)
    grid = np.arange(4).reshape(2, 2)
    step = make_model(problem, PlannerConfig(), shape).report(grid).cost["total_s"]
    for overhead, taken in ((-0.2 * step, -0.2 * step), (-0.9 * step, -0.5 * step)):
        model = make_model(dataclasses.replace(problem, step_overhead_s=overhead), PlannerConfig(), shape)
        report = model.report(grid)
        assert report.cost["total_s"] == pytest.approx(step + taken) and report.cost["overhead_s"] == pytest.approx(taken)
        assert model.batch_cost(grid[None])[0] == pytest.approx(report.objective)
        plan = to_plan(problem, "time", grid, report)
        assert Plan.from_wire(plan.to_wire()).cost["overhead_s"] == pytest.approx(taken)


def with_step_costs(problem: Problem, rng: np.random.Generator) -> Problem:
    """`problem` with every device's step costs (`StepCosts`) drawn at random, each about a block's time or less, and
    what recomputing a layer adds from a fifth to more than a whole layer."""
    n = problem.n
    return replace_costs(problem, np.column_stack([rng.uniform(0, 1e-3, n), rng.uniform(0, 2e-3, n), rng.uniform(0, 1e-7, n),
                                                   rng.uniform(0, 1e-3, n), rng.uniform(0.2, 1.2, n)]))


def test_a_stage_step_counts_what_its_devices_measured_beyond_their_blocks():
    """One lane of three stages: each device's micro-batch is its layers, its Python around them, the embedding on
    the first stage, the head (measured, not by FLOPs) and loss on the last; the slowest optimizer step follows."""
    raw = synthetic.random_topology(3, 1, np.random.default_rng(0))
    spec = preset("tiny", 6)
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(spec, batch=4, micro_batch=1))
    costs = np.array([[1e-3, 5e-4, 1e-6, 2e-4, 0.0], [3e-3, 2e-3, 2e-6, 1e-4, 0.5], [2e-3, 4e-3, 3e-7, 3e-4, 0.9]])
    plain, measured = (make_model(p, PlannerConfig(), Shape(3, 1)) for p in (problem, replace_costs(problem, costs)))
    grid = np.array([[0], [1], [2]])
    before, after = plain.report(grid), measured.report(grid)
    counts = np.array(after.layers)
    t = counts * measured.layer_s[[0, 1, 2]] + costs[[0, 1, 2], 3]
    t[0] += costs[0, 0]
    t[-1] += costs[2, 1]
    e = measured._evaluate(grid[None])
    np.testing.assert_allclose(e["t"][0, 0], t, rtol=1e-12)
    params = counts * spec.layer_params + np.array([spec.embedding_params, 0, spec.head_params])
    assert after.cost["update_s"] == pytest.approx((params * costs[[0, 1, 2], 2]).max())
    assert after.cost["total_s"] > before.cost["total_s"] and "update_s" not in before.cost


def replace_costs(problem: Problem, costs: np.ndarray) -> Problem:
    """The problem with `costs` as its step costs, the fields left out (codec rates) unmeasured."""
    return dataclasses.replace(problem, step_costs=np.pad(costs, ((0, 0), (0, len(STEP_COSTS) - costs.shape[1]))))


def test_the_screen_is_exact_when_every_stage_holds_one_layer():
    """With as many stages as layers the split cannot change: screen and exact cost agree."""
    rng = np.random.default_rng(7)
    raw = synthetic.random_topology(60, 5, rng)
    problem = Problem.from_topology(Topology.from_wire(raw), Workload(preset("tiny", 8), batch=64))
    model = make_model(problem, PlannerConfig(), Shape(8, 6))
    grid = rng.permutation(60)[:48].reshape(8, 6)
    batch, cells = swaps(grid, 60, 200, rng)
    np.testing.assert_allclose(model.screen(grid, batch, cells), model.batch_cost(batch), rtol=1e-12)


def exchanged(grid: np.ndarray, a: int, b: int, s1: int, s2: int) -> np.ndarray:
    out = grid.copy()
    out[s1:s2, a], out[s1:s2, b] = grid[s1:s2, b], grid[s1:s2, a]
    return out


@pytest.mark.parametrize("shape", [Shape(2, 2), Shape(3, 4), Shape(5, 3), Shape(8, 2)])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("per_lane", [1, 256])  # one micro-batch a step, and more than stages
@pytest.mark.parametrize("compress", [("raw", "raw"), ("int4", "bf16"), ("auto", "auto")])  # one pair, or per hop
def test_exchanged_lanes_are_the_full_evaluation_of_the_exchanged_grid(shape, tied, per_lane, compress, measured):
    """Every lane a with stages [s1, s2) of lane b: what the prefix sums and range maxima give is what
    evaluating the lanes of the grid with those stages exchanged gives, with the split held."""
    from hetpeer.coordinator.planner.screens import _segments
    from hetpeer.protocol.modelspec import ModelSpec

    rng = np.random.default_rng(shape.devices + tied + per_lane)
    spec = ModelSpec.from_config({"model_type": "gpt2", "n_embd": H, "n_head": 4, "n_layer": 8, "n_positions": SEQ,
                                  "vocab_size": VOCAB, "tie_word_embeddings": tied})
    problem = Problem.from_topology(Topology.from_wire(synthetic.random_topology(30, 4, rng)), Workload(spec, batch=per_lane * shape.group_size))
    model = make_model(with_step_costs(problem, rng) if tied else problem, PlannerConfig(compress=compress), shape)
    assert (model.micro_batches == 1 if per_lane == 1 else model.micro_batches > shape.stages) and bool(model.tied_bytes) == tied
    grid = rng.permutation(30)[: shape.devices].reshape(shape.stages, shape.group_size)
    counts = np.array(model.report(grid).layers)
    segments = _segments(shape.stages)
    a, b = np.array(list(itertools.permutations(range(shape.group_size), 2))).T
    new = model._exchanged_lanes(grid, counts, segments, a, b, model.micro_batches)
    for k in range(len(a)):
        grids = np.stack([exchanged(grid, a[k], b[k], s1, s2) for s1, s2 in segments])
        *parts, _, _ = model._lane_parts(grids.transpose(0, 2, 1), counts[None, None, :], 1.0)
        lanes = lane_times(*parts, model.micro_batches, shape.stages)
        np.testing.assert_allclose(new[k], lanes[:, a[k]], rtol=1e-12)


def test_segments_are_every_run_of_stages_but_the_whole_lane():
    from hetpeer.coordinator.planner.screens import _segments

    assert _segments(1).shape == (0, 2)
    assert _segments(3).tolist() == [[0, 1], [0, 2], [1, 2], [1, 3], [2, 3]]


@pytest.mark.parametrize("shape", [Shape(1, 4), Shape(4, 1), Shape(3, 4), Shape(6, 5)])
def test_exchanges_screen_better_and_keep_every_group(shape):
    """Every grid offered exchanges a run of stages between two lanes of `grid`, keeps each group's
    devices, is offered best first by the screen, and those that cost less exactly are most of them."""
    rng = np.random.default_rng(shape.devices)
    problem = Problem.from_topology(Topology.from_wire(synthetic.random_topology(40, 6, rng)),
                                    Workload(preset("tiny", 8), batch=64))
    model = make_model(problem, PlannerConfig(), shape)
    grid = rng.permutation(40)[: shape.devices].reshape(shape.stages, shape.group_size)
    offered = model.exchanges(grid, 10)
    if shape.stages == 1 or shape.group_size == 1:
        assert offered.shape == (0, *grid.shape)
        return
    assert 0 < len(offered) <= 10
    cost = model.batch_cost(grid[None])[0]
    for candidate in offered:
        assert all(set(row) == set(own) for row, own in zip(candidate, grid))
        changed = np.flatnonzero((candidate != grid).any(axis=0))
        assert len(changed) == 2
        rows = np.flatnonzero(candidate[:, changed[0]] != grid[:, changed[0]])
        assert rows.tolist() == list(range(rows[0], rows[-1] + 1)) and len(rows) < shape.stages
    assert (model.batch_cost(offered) < cost).mean() > 0.5


def test_beyond_32_lanes_exchanges_involve_one_of_the_32_slowest():
    from hetpeer.coordinator.planner.screens import EXCHANGED_LANES

    rng = np.random.default_rng(3)
    problem = Problem.from_topology(Topology.from_wire(synthetic.random_topology(120, 8, rng)),
                                    Workload(preset("tiny", 8), batch=256))
    model = make_model(problem, PlannerConfig(), Shape(2, 48))
    grid = rng.permutation(120)[:96].reshape(2, 48)
    lane = model._evaluate(grid[None])["lane"][0]
    slowest = set(np.argsort(-lane, kind="stable")[:EXCHANGED_LANES].tolist())
    offered = model.exchanges(grid, 5000)  # every exchange that screens better (among all pairs, some without)
    assert len(offered) > 500 and (model.batch_cost(offered) < model.batch_cost(grid[None])[0]).mean() > 0.5
    for candidate in offered:
        changed = set(np.flatnonzero((candidate != grid).any(axis=0)).tolist())
        assert len(changed) == 2 and changed & slowest
