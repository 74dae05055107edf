"""Reference plans the search is measured against, under the same cost model.

- `random_grids`: the authors' random scheduler (shuffle the devices, cut them into groups in stage
  order, pair lanes by index, no matching or TSP);
- `blocks_grid`: Megatron's default rank order, group k = devices k m .. k m + m - 1 in file order;
- `exhaustive`: every grid of a shape, for tiny instances only.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hetpeer.coordinator.planner.costmodel import CostModel
from hetpeer.coordinator.planner.grid import layouts
from hetpeer.coordinator.planner.problem import PlanningError, Problem, Shape

EXHAUSTIVE_LIMIT = 2_000_000  # grids; 8 devices in every shape stay well below
_CHUNK = 20_000


def random_grids(problem: Problem, shape: Shape, count: int, rng: np.random.Generator) -> np.ndarray:
    """(count, S, m) random grids; with standby room the active devices are random too."""
    return np.stack(
        [rng.permutation(problem.n)[: shape.devices].reshape(shape.stages, shape.group_size) for _ in range(count)]
    )


def blocks_grid(shape: Shape) -> np.ndarray:
    return layouts(shape, np.arange(shape.devices))[0]


def strided_grid(shape: Shape) -> np.ndarray:
    """Group j = devices j, j + S, j + 2S, ...: lane l holds devices l S .. l S + S - 1."""
    return layouts(shape, np.arange(shape.devices))[1]


def exhaustive(problem: Problem, model: CostModel) -> tuple[np.ndarray, float]:
    """The best grid of the model's shape over every ordered choice of devices: n! / (n - S m)! grids."""
    shape = model.shape
    total = math.perm(problem.n, shape.devices)
    if total > EXHAUSTIVE_LIMIT:
        raise PlanningError(f"exhaustive search over {total} grids is too large (limit {EXHAUSTIVE_LIMIT})")
    best_grid, best_cost = None, math.inf
    orders = itertools.permutations(range(problem.n), shape.devices)
    while chunk := list(itertools.islice(orders, _CHUNK)):
        grids = np.array(chunk).reshape(len(chunk), shape.stages, shape.group_size)
        costs = model.batch_cost(grids)
        k = int(np.argmin(costs))
        if costs[k] < best_cost:
            best_grid, best_cost = grids[k], float(costs[k])
    return best_grid, best_cost


def baseline_costs(
    problem: Problem, model: CostModel, samples: int, rng: np.random.Generator
) -> dict[str, float | None]:
    """Predicted `total_s` of the baselines in the model's shape; None where they overflow memory.

    "random" is the mean over `samples` random grids of those that fit.
    """
    blocks = model.report(blocks_grid(model.shape))
    reports = [model.report(grid) for grid in random_grids(problem, model.shape, samples, rng)]
    fitting = [r.cost["total_s"] for r in reports if r.fits_memory]
    return {
        "blocks": blocks.cost["total_s"] if blocks.fits_memory else None,
        "random": float(np.mean(fitting)) if fitting else None,
    }
