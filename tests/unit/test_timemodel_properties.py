"""The time cost model on random grids and devices, against its docstring's formulas written out here
one device and one link at a time, and against brute-force layer splits."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model
from hetpeer.coordinator.planner.codecs import WORK_S_PER_VALUE, steps_factor
from hetpeer.coordinator.planner.quality import TABLE
from hetpeer.coordinator.planner.timemodel import TIE_BREAK
from hetpeer.protocol.frame import bytes_per_value
from hetpeer.peer.pipeline.schedule import FORWARD, one_f_one_b
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

# tiny: hidden 64, seq 64, vocab 256.
H, SEQ, VOCAB = 64, 64, 256
LAYER_PARAMS = 12 * H * H + 13 * H
EMBEDDING_PARAMS = VOCAB * H + SEQ * H
HEAD_PARAMS = VOCAB * H + 2 * H


def docstring_step(
    problem: Problem, grid: np.ndarray, layers: tuple[int, ...], sync: str, compress: tuple[str, str] = ("raw", "raw"),
) -> tuple[float, float]:
    """(step seconds, search objective) of a grid with a given layer split, from the formulas in
    timemodel's docstring: the objective adds TIE_BREAK x (mean lane time + mean exposed sync) and is multiplied by
    the steps factor (`quality.TABLE`, tested on its own) and the codecs' (`codecs.STEPS_FACTOR`)."""
    w = problem.workload
    S, m = grid.shape
    M = problem.micro_batches(m)  # each lane's in the even split
    lat, bw, flops = problem.latency_s, problem.bandwidth_bytes_per_s, problem.tflops * 1e12
    parts = []  # per lane: (round trip, period)
    for l in range(m):
        t = [layers[s] * 3 * w.micro_batch * w.layer_fwd_flops_per_seq / flops[grid[s, l]] for s in range(S)]
        t[-1] += 3 * w.micro_batch * w.head_fwd_flops_per_seq / flops[grid[-1, l]]
        values = w.micro_batch * w.model.seq_len * w.model.hidden  # an activation's values, each way
        x_each = [[values * bytes_per_value(w.dtype, codec) / bw[grid[s, l], grid[s + 1, l]] for codec in compress]
                  for s in range(S - 1)]  # fmt: skip
        work = values * sum(WORK_S_PER_VALUE[codec] for codec in compress) / 2  # encoding and decoding, each way
        round_trip = sum(t) + sum(2 * lat[grid[s, l], grid[s + 1, l]] + sum(x_each[s]) + 2 * work for s in range(S - 1))
        parts.append((round_trip, max(max(t), max((max(x) + work for x in x_each), default=0.0))))

    def lane_time(l: int, k: int) -> float:  # lane l with k micro-batches: past S, a round trip per S of them too
        round_trip, period = parts[l]
        return round_trip + (k - 1) * max(period, round_trip / S if k > S else 0.0)

    # the step's micro-batches, each lane one and then each in turn to the lane that would finish it soonest (at
    # most the even split's where that is fewer than the stages); the even split where there are fewer than lanes
    total = -(-w.batch // problem.lane_micro_batch(m))
    counts = [M] * m
    if total >= m and m > 1:
        counts, cap = [1] * m, (M if M < S else total)
        for _ in range(total - m):
            counts[min((l for l in range(m) if counts[l] < cap), key=lambda l: lane_time(l, counts[l] + 1))] += 1
    lanes = [lane_time(l, counts[l]) for l in range(m)]
    lane_s = max(lanes)
    codecs_factor = steps_factor(compress) if S > 1 else 1.0  # a fixed pair on every hop, where there are hops
    if m == 1:
        return lane_s, (lane_s + TIE_BREAK * float(np.mean(lanes))) * codecs_factor
    model = w.model
    lane_tokens = problem.lanes_batch(m) * model.seq_len
    options = []  # per stage: mode -> (exposed seconds, steps factor)
    for s in range(S):
        params = layers[s] * model.layer_params
        params += model.embedding_params if s == 0 else 0
        params += model.head_params if s == S - 1 else 0
        stage_bytes = params * w.dtype_bytes
        ring = [(grid[s, l], grid[s, (l + 1) % m]) for l in range(m)]
        allreduce = max(lat[a, b] for a, b in ring) + (m - 1) * stage_bytes / min(bw[a, b] for a, b in ring)  # robust
        rounds = []
        for r in range(int(np.ceil(np.log2(m)))):
            pairs = [(grid[s, l], grid[s, (l + 2**r) % m]) for l in range(m)]
            rounds.append(max(lat[a, b] + stage_bytes / bw[a, b] for a, b in pairs))
        gossip = float(np.mean([max(0.0, r - lane_s) for r in rounds]))
        change = allreduce * 2 / w.dtype_bytes  # outer steps: the all-reduce with the change in fp16
        h = min(50, max(10, math.ceil(change / (0.02 * lane_s))))
        d = min(max(1, h // 10), math.ceil(change / lane_s))
        options.append({"allreduce": (allreduce, 1.0), "gossip": (gossip, TABLE.factor("gossip", m, lane_tokens)),
                        "outer": (max(0.0, change - d * lane_s) / h, TABLE.factor("outer", m, lane_tokens, h))})
    # auto: each set of modes with all-reduce in it, each group its fastest; the least (step x factor) wins
    sets = [[sync]] if sync != "auto" else [["allreduce"], ["allreduce", "gossip"], ["allreduce", "outer"],
                                            ["allreduce", "gossip", "outer"]]
    best = None
    for modes in sets:
        picks = [min(modes, key=lambda mode, o=o: o[mode][0]) for o in options]  # a tie goes to the earlier mode
        exposed = [o[mode][0] for o, mode in zip(options, picks)]
        factor = max(o[mode][1] for o, mode in zip(options, picks))
        step = lane_s + max(exposed)
        if best is None or step * factor < best[0] * best[2]:
            best = (step, (step + TIE_BREAK * (float(np.mean(lanes)) + float(np.mean(exposed)))) * factor, factor)
    # a fixed pair on every hop: its steps factor (codecs.STEPS_FACTOR) too, where there are hops
    return best[0], best[1] * codecs_factor


def min_max_stage_time(problem: Problem, grid: np.ndarray, caps: list[float] | None = None) -> float:
    """The least possible time of the slowest stage over every split of the layers (within caps)."""
    w = problem.workload
    S = grid.shape[0]
    per_layer = [max(3 * w.micro_batch * w.layer_fwd_flops_per_seq / (problem.tflops[d] * 1e12) for d in row)
                 for row in grid]  # fmt: skip
    extra = [0.0] * S
    extra[-1] = max(3 * w.micro_batch * w.head_fwd_flops_per_seq / (problem.tflops[d] * 1e12) for d in grid[-1])
    best = np.inf
    for split in itertools.product(range(1, problem.layers + 1), repeat=S):
        if sum(split) == problem.layers and (caps is None or all(c <= cap for c, cap in zip(split, caps))):
            best = min(best, max(c * p + e for c, p, e in zip(split, per_layer, extra)))
    return best


def stage_time(problem: Problem, grid: np.ndarray, layers: tuple[int, ...]) -> float:
    w = problem.workload
    times = []
    for s, row in enumerate(grid):
        t = max(layers[s] * 3 * w.micro_batch * w.layer_fwd_flops_per_seq / (problem.tflops[d] * 1e12) for d in row)
        if s == len(grid) - 1:
            t = max(
                layers[s] * 3 * w.micro_batch * w.layer_fwd_flops_per_seq / (problem.tflops[d] * 1e12)
                + 3 * w.micro_batch * w.head_fwd_flops_per_seq / (problem.tflops[d] * 1e12)
                for d in row
            )
        times.append(t)
    return max(times)


def random_problem(n: int, seed: int, layers: int, batch: int, micro_batch: int = 1) -> Problem:
    rng = np.random.default_rng(seed)
    raw = {
        "devices": [
            {"id": f"d{i}", "region": f"r{i % 3}", "tflops": float(10 ** rng.uniform(-4, 1)), "memory_gb": 100.0}
            for i in range(n)
        ],
        "regions": {f"r{k}": {"latency_ms": float(rng.uniform(0, 5)), "bandwidth_gbps": float(rng.uniform(0.05, 10))}
                    for k in range(3)},  # fmt: skip
        "region_links": [
            {"a": f"r{a}", "b": f"r{b}", "latency_ms": float(rng.uniform(5, 100)),
             "bandwidth_gbps": float(rng.uniform(0.01, 1))}
            for a, b in ((0, 1), (0, 2), (1, 2))
        ],  # fmt: skip
    }
    return Problem.from_topology(
        Topology.from_wire(raw), Workload(preset("tiny", layers), batch=batch, micro_batch=micro_batch)
    )


@pytest.mark.parametrize("seed", range(12))
def test_random_grids_follow_the_docstring(seed):
    rng = np.random.default_rng(1000 + seed)
    S, m = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    layers = int(rng.integers(S, 13))
    n = S * m + int(rng.integers(0, 3))
    problem = random_problem(n, seed, layers, batch=int(rng.integers(m, 4 * m + 1)), micro_batch=1)
    sync = ("allreduce", "gossip", "auto")[seed % 3]
    compress = (("raw", "raw"), ("int4", "int8"), ("bf16", "raw"), ("int8", "int4"))[seed % 4]
    config = PlannerConfig(stages=S, group_size=m, sync=sync, compress=compress)
    model = make_model(problem, config, Shape(S, m))
    grids = np.stack([rng.permutation(n)[: S * m].reshape(S, m) for _ in range(4)])
    batch_costs = model.batch_cost(grids)
    for grid, cost in zip(grids, batch_costs):
        report = model.report(grid)
        assert sum(report.layers) == layers and min(report.layers) >= 1
        # The split is a min-max one (any tie will do)...
        assert stage_time(problem, grid, report.layers) == pytest.approx(min_max_stage_time(problem, grid), rel=1e-12)
        # ...and the step follows from it.
        expected, objective = docstring_step(problem, grid, report.layers, sync, compress)
        assert {pair for hop in report.codecs for pair in hop} <= {compress} and len(report.codecs) == S - 1
        assert report.cost["total_s"] == pytest.approx(expected, rel=1e-9)
        assert report.objective == pytest.approx(objective, rel=1e-9)
        assert cost == pytest.approx(objective, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_layer_split_respects_memory_caps(seed):
    """Devices whose memory holds only a few layers: the split is min-max among splits that fit."""
    rng = np.random.default_rng(2000 + seed)
    S, m, layers = int(rng.integers(2, 5)), 2, int(rng.integers(6, 13))
    base = random_problem(S * m, seed, layers, batch=4)
    config = PlannerConfig(stages=S, group_size=m, memory_reserve=0.0, recompute="never")
    grid = rng.permutation(S * m).reshape(S, m)
    # Per stage: bytes that do not depend on layers, and bytes per layer (test_timemodel.py works one out): state
    # and a neighbour's parameters (20 a parameter), and per micro-batch in flight activations and fp16 weights.
    M = base.micro_batches(m)
    inflight = [min(M, S - s) for s in range(S)]
    per_layer = [20 * LAYER_PARAMS + inflight[s] * (38 * SEQ * H + 2 * LAYER_PARAMS) for s in range(S)]
    fixed = [20 * EMBEDDING_PARAMS * (s == 0) + (20 * HEAD_PARAMS + 12 * SEQ * VOCAB + 2 * VOCAB * H) * (s == S - 1)
             for s in range(S)]  # fmt: skip
    caps = [int(c) for c in rng.integers(1, layers, size=S)]
    while sum(caps) < layers:
        caps[int(rng.integers(S))] += 1
    memory = np.empty(S * m)
    for s in range(S):
        for d in grid[s]:
            memory[d] = fixed[s] + (caps[s] + 0.5) * per_layer[s]
    problem = Problem(base.device_ids, base.latency_s, base.bandwidth_bytes_per_s, base.workload,
                      tflops=base.tflops, memory_bytes=memory)  # fmt: skip
    report = make_model(problem, config, Shape(S, m)).report(grid)
    assert report.fits_memory
    assert all(c <= cap for c, cap in zip(report.layers, caps))
    assert sum(report.layers) == layers
    best = min_max_stage_time(problem, grid, caps)
    assert stage_time(problem, grid, report.layers) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_layer_split_with_recomputation_is_min_max_over_every_split_that_fits(seed):
    """Devices too small for their layers' activations: each stage recomputes the fewest layers that make it fit
    (`Workload.stage_memory`, counted here layer by layer), and the split is min-max among all splits, a stage's
    time growing by a third of a layer for each layer it recomputes."""
    rng = np.random.default_rng(3000 + seed)
    S, m, layers = int(rng.integers(2, 4)), 2, int(rng.integers(5, 10))
    base = random_problem(S * m, seed, layers, batch=8, micro_batch=2)
    w, M = base.workload, base.micro_batches(m)
    grid = rng.permutation(S * m).reshape(S, m)

    def need(s: int, c: int, k: int) -> float:
        parts = w.stage_memory(c, first=s == 0, last=s == S - 1, in_flight=min(M, S - s), micro_batch=w.micro_batch,
                               group_size=m, recompute=k)
        return sum(parts.values())

    memory = np.empty(S * m)
    for s in range(S):  # room for a few layers with their activations, more when recomputed
        room = need(s, int(rng.integers(1, layers)), 0) * float(rng.uniform(1.0, 1.6))
        memory[grid[s]] = room * np.array([1.0, 1.3])[rng.permutation(2)]
    problem = Problem(base.device_ids, base.latency_s, base.bandwidth_bytes_per_s, w, tflops=base.tflops,
                      memory_bytes=memory)
    per_layer = [max(3 * w.micro_batch * w.layer_fwd_flops_per_seq / (problem.tflops[d] * 1e12) for d in row) for row in grid]
    extra = [0.0] * (S - 1) + [max(3 * w.micro_batch * w.head_fwd_flops_per_seq / (problem.tflops[d] * 1e12) for d in grid[-1])]

    def fewest(s: int, c: int) -> int | None:
        smallest = memory[grid[s]].min()
        return next((k for k in range(c + 1) if need(s, c, k) <= smallest), None)

    best = np.inf
    for split in itertools.product(range(1, layers + 1), repeat=S):
        ks = [fewest(s, c) for s, c in enumerate(split)]
        if sum(split) == layers and None not in ks:
            best = min(best, max((c + k / 3) * p + e for c, k, p, e in zip(split, ks, per_layer, extra)))
    report = make_model(problem, PlannerConfig(stages=S, group_size=m, memory_reserve=0.0), Shape(S, m)).report(grid)
    if not np.isfinite(best):
        assert not report.fits_memory
        return
    assert report.fits_memory
    assert list(report.recompute) == [fewest(s, c) for s, c in enumerate(report.layers)]
    time = max((c + k / 3) * p + e for c, k, p, e in zip(report.layers, report.recompute, per_layer, extra))
    assert time == pytest.approx(best, rel=1e-12)


def simulate_lane(fwd: list[float], bwd: list[float], latency: list[float], occupancy: list[float], M: int) -> float:
    """The runtime's 1F1B schedule (hetpeer.peer.pipeline.schedule) played out event by event: each stage
    runs its operations in order, each waits for its input, and each link carries one micro-batch at a
    time per direction (occupancy), delivered a latency later."""
    S = len(fwd)
    ops = [one_f_one_b(s, S, M) for s in range(S)]
    clock, position = [0.0] * S, [0] * S
    arrived: dict[tuple[str, int, int], float] = {}
    link_free = {("f", s): 0.0 for s in range(S - 1)} | {("b", s): 0.0 for s in range(S - 1)}
    while any(position[s] < len(ops[s]) for s in range(S)):
        for s in range(S):
            while position[s] < len(ops[s]):
                op, i = ops[s][position[s]]
                forward = op == FORWARD
                ready = 0.0 if (forward and s == 0) or (not forward and s == S - 1) else arrived.get((op, s, i))
                if ready is None:
                    break
                clock[s] = max(clock[s], ready) + (fwd[s] if forward else bwd[s])
                to, link = (s + 1, ("f", s)) if forward else (s - 1, ("b", s - 1))
                if 0 <= to < S:
                    sent = max(clock[s], link_free[link]) + occupancy[link[1]]
                    link_free[link] = sent
                    arrived[(op, to, i)] = sent + latency[link[1]]
                position[s] += 1
    return max(clock)


def test_the_lane_formula_against_the_runtimes_schedule_played_out():
    rng = np.random.default_rng(7)
    errors, exact = [], []
    for _ in range(300):
        S, M = int(rng.integers(2, 6)), int(rng.integers(1, 13))
        t = rng.uniform(0.01, 0.3, S)
        latency = rng.choice([0.001, 0.02, 0.1, 0.25], S - 1)
        occupancy = rng.uniform(0.0, 0.1, S - 1)
        played = simulate_lane(list(t / 3), list(2 * t / 3), list(latency), list(occupancy), M)
        round_trip = t.sum() + 2 * (latency + occupancy).sum()
        period = max(t.max(), occupancy.max(), round_trip / S if M > S else 0.0)
        formula = round_trip + (M - 1) * period  # timemodel's docstring, which `_lanes` follows (tests above)
        (exact if M == 1 else errors).append(formula / played - 1)
    assert max(abs(e) for e in exact) < 1e-9
    assert float(np.mean(np.abs(errors))) < 0.05, float(np.mean(np.abs(errors)))
    assert max(abs(e) for e in errors) < 0.35
