"""The time cost model on random grids and devices, against its docstring's formulas written out here
one device and one link at a time, and against brute-force layer splits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model
from hetpeer.coordinator.planner.timemodel import TIE_BREAK
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload, preset

# tiny: hidden 64, seq 64, vocab 256.
H, SEQ, VOCAB = 64, 64, 256
LAYER_PARAMS = 12 * H * H + 13 * H
EMBEDDING_PARAMS = VOCAB * H + SEQ * H
HEAD_PARAMS = VOCAB * H + 2 * H



def docstring_step(problem: Problem, grid: np.ndarray, layers: tuple[int, ...], sync: str) -> tuple[float, float]:
    """(step seconds, search objective) of a grid with a given layer split, from the formulas in
    timemodel's docstring: the objective adds TIE_BREAK x (mean lane time + mean exposed sync)."""
    w = problem.workload
    S, m = grid.shape
    M = problem.micro_batches(m)
    lat, bw, flops = problem.latency_s, problem.bandwidth_bytes_per_s, problem.tflops * 1e12
    lanes = []
    for l in range(m):
        t = [layers[s] * 3 * w.micro_batch * w.layer_fwd_flops_per_seq / flops[grid[s, l]] for s in range(S)]
        t[-1] += 3 * w.micro_batch * w.head_fwd_flops_per_seq / flops[grid[-1, l]]
        h = [lat[grid[s, l], grid[s + 1, l]] + w.micro_batch * w.boundary_bytes_per_seq / bw[grid[s, l], grid[s + 1, l]]
             for s in range(S - 1)]  # fmt: skip
        lanes.append(sum(t) + 2 * sum(h) + (M - 1) * max(max(t), max(h, default=0.0)))
    lane_s = max(lanes)
    if m == 1:
        return lane_s, lane_s + TIE_BREAK * float(np.mean(lanes))
    model = w.model
    exposed = []
    for s in range(S):
        params = layers[s] * model.layer_params
        params += model.embedding_params if s == 0 else 0
        params += model.head_params if s == S - 1 else 0
        stage_bytes = params * w.dtype_bytes
        ring = [(grid[s, l], grid[s, (l + 1) % m]) for l in range(m)]
        allreduce = 2 * (m - 1) * (max(lat[a, b] for a, b in ring) + stage_bytes / (m * min(bw[a, b] for a, b in ring)))
        rounds = []
        for r in range(int(np.ceil(np.log2(m)))):
            pairs = [(grid[s, l], grid[s, (l + 2**r) % m]) for l in range(m)]
            rounds.append(max(lat[a, b] + stage_bytes / bw[a, b] for a, b in pairs))
        gossip = max(0.0, float(np.mean(rounds)) - lane_s)
        choice = sync if sync != "auto" else ("gossip" if allreduce > gossip + 0.02 * lane_s else "allreduce")
        exposed.append(gossip if choice == "gossip" else allreduce)
    step = lane_s + max(exposed)
    return step, step + TIE_BREAK * (float(np.mean(lanes)) + float(np.mean(exposed)))


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
    config = PlannerConfig(stages=S, group_size=m, sync=sync)
    model = make_model(problem, config, Shape(S, m))
    grids = np.stack([rng.permutation(n)[: S * m].reshape(S, m) for _ in range(4)])
    batch_costs = model.batch_cost(grids)
    for grid, cost in zip(grids, batch_costs):
        report = model.report(grid)
        assert sum(report.layers) == layers and min(report.layers) >= 1
        # The split is a min-max one (any tie will do)...
        assert stage_time(problem, grid, report.layers) == pytest.approx(min_max_stage_time(problem, grid), rel=1e-12)
        # ...and the step follows from it.
        expected, objective = docstring_step(problem, grid, report.layers, sync)
        assert report.cost["total_s"] == pytest.approx(expected, rel=1e-9)
        assert report.objective == pytest.approx(objective, rel=1e-9)
        assert cost == pytest.approx(objective, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_layer_split_respects_memory_caps(seed):
    """Devices whose memory holds only a few layers: the split is min-max among splits that fit."""
    rng = np.random.default_rng(2000 + seed)
    S, m, layers = int(rng.integers(2, 5)), 2, int(rng.integers(6, 13))
    base = random_problem(S * m, seed, layers, batch=4)
    config = PlannerConfig(stages=S, group_size=m, memory_reserve=0.0)
    grid = rng.permutation(S * m).reshape(S, m)
    # Per stage: bytes that do not depend on layers, and bytes per layer (test_timemodel.py works one out).
    M = base.micro_batches(m)
    inflight = [min(M, S - s) for s in range(S)]
    per_layer = [20 * LAYER_PARAMS + inflight[s] * 34 * SEQ * H for s in range(S)]
    fixed = [20 * EMBEDDING_PARAMS * (s == 0) + (20 * HEAD_PARAMS + 2 * 4 * SEQ * VOCAB) * (s == S - 1)
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
