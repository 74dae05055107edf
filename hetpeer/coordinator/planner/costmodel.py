"""What the search asks of a cost model, and when a cost counts as lower.

`dtfm.DtfmCost` (the paper's communication cost) and `timemodel.TimeCost` (a predicted step time)
implement `CostModel`; the search (`search.py`) and its moves (`moves.py`) use nothing else of them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hetpeer.coordinator.planner.problem import Report, Shape

IMPROVEMENT = 1e-9  # relative; smaller changes are rounding, not progress


class CostModel(Protocol):
    name: str
    shape: Shape
    link_cost: np.ndarray  # (n, n): what a lane pays between consecutive stages
    group_cost: np.ndarray  # (n, n): what sharing a group costs

    def batch_cost(self, grids: np.ndarray) -> np.ndarray: ...

    def seed_costs(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def screen(self, grid: np.ndarray, batch: np.ndarray, cells: np.ndarray) -> np.ndarray: ...

    def exchanges(self, grid: np.ndarray, count: int) -> np.ndarray: ...

    def report(self, grid: np.ndarray) -> Report: ...
