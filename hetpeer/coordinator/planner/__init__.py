"""The planner: a pure library. Devices, links and a workload in; a plan out.

No torch, hivemind, grpc or asyncio here (a test proves it): the coordinator calls `solve` from an
executor, and `hetpeer plan` calls it directly.
"""

from hetpeer.coordinator.planner.problem import PlanningError, Problem, Report, Shape
from hetpeer.coordinator.planner.search import Memory, SearchConfig
from hetpeer.coordinator.planner.solve import PlannerConfig, Solution, make_model, solve, to_plan

__all__ = [
    "Memory",
    "PlannerConfig",
    "PlanningError",
    "Problem",
    "Report",
    "SearchConfig",
    "Shape",
    "Solution",
    "make_model",
    "solve",
    "to_plan",
]
