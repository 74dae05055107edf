"""The communication cost model of Yuan et al., "Decentralized Training of Foundation Models in
Heterogeneous Environments" (NeurIPS 2022), Eqs. 1-4, as their scheduler computes it.

For groups C_1..C_S of m devices, with c_DP the bytes of one stage's gradients and c_PP the bytes of
one lane's activations per step:

    DP(C)   = max over d in C of sum over d' in C, d' != d of 2 (latency(d, d') + c_DP / (m bandwidth(d, d')))
    DP      = max over groups of DP(C)
    w(A, B) = min over perfect matchings M of A to B of max over (d, d') in M of latency + c_PP / bandwidth
    PP      = open-loop TSP over the groups with weights w
    total   = DP + 2 PP          (activations forward, their gradients backward)

On a grid (rows = groups in stage order, columns = lanes) the cost with the grid's own order and
pairing is the authors' random-scheduler cost, an upper bound of the exact cost of the grid's
partition; `canonical` grids (TSP order, lanes chained by bottleneck matchings) meet the bound.
"""

from __future__ import annotations

import numpy as np

from hetpeer.coordinator.planner.problem import Problem, Report, Shape

NAME = "dtfm"


class DtfmCost:
    """The paper's cost for one shape, evaluated on batches of grids."""

    name = NAME

    def __init__(self, problem: Problem, shape: Shape) -> None:
        self.problem, self.shape = problem, shape
        workload, m = problem.workload, shape.group_size
        layers_per_stage = -(-problem.layers // shape.stages)
        self.dp_bytes = problem.dp_bytes or float(
            layers_per_stage * workload.model.layer_params * workload.dtype_bytes
        )
        self.pp_bytes = problem.pp_bytes or problem.lanes_batch(m) * workload.boundary_bytes_per_seq
        latency, bandwidth = problem.latency_s, problem.bandwidth_bytes_per_s
        self.group_cost = 2 * (latency + self.dp_bytes / (m * bandwidth))
        np.fill_diagonal(self.group_cost, 0.0)
        self.link_cost = latency + self.pp_bytes / bandwidth

    def parts(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(DP, PP) of each grid in a (K, S, m) batch with the grids' own order and pairing."""
        within = self.group_cost[grids[:, :, :, None], grids[:, :, None, :]].sum(axis=3)
        dp = within.max(axis=(1, 2))
        if grids.shape[1] == 1:
            return dp, np.zeros_like(dp)
        hops = self.link_cost[grids[:, :-1, :], grids[:, 1:, :]].max(axis=2)
        return dp, hops.sum(axis=1)

    def batch_cost(self, grids: np.ndarray) -> np.ndarray:
        dp, pp = self.parts(grids)
        return dp + 2 * pp

    def seed_costs(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Objectives of seed grids, twice: they promise their objective (alignment sets both of its terms)."""
        costs = self.batch_cost(grids)
        return costs, costs

    def screen(self, grid: np.ndarray, batch: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Objectives of grids that differ from `grid` at a few cells: exact, as cheap as it gets
        at the sizes this model is used for."""
        return self.batch_cost(batch)

    def exchanges(self, grid: np.ndarray, count: int) -> np.ndarray:
        """None: here a lane's cost is no sum along it but each stage boundary's slowest link, which the
        search's alignment (bottleneck matchings between consecutive groups) already minimises, so
        no exchange of stages between lanes can improve an aligned grid."""
        return np.empty((0, *grid.shape), dtype=grid.dtype)

    def report(self, grid: np.ndarray) -> Report:
        dp, pp = self.parts(grid[None])
        return Report(
            layers=balanced_layers(self.problem.layers, self.shape.stages),
            sync=tuple("none" if self.shape.group_size == 1 else "allreduce" for _ in range(self.shape.stages)),
            cost={"dp_s": float(dp[0]), "pp_s": float(2 * pp[0]), "total_s": float(dp[0] + 2 * pp[0])},
            objective=float(dp[0] + 2 * pp[0]),
        )


def balanced_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Equal layer counts; the remainder goes to the middle stages, since the first and the last
    also hold the embeddings and the head."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2)))
    for s in middle[:extra]:
        counts[s] += 1
    return tuple(counts)
