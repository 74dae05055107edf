"""The planner's entry point: `solve(problem, config, rng) -> Solution`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from hetpeer.coordinator.planner import dtfm, timemodel
from hetpeer.coordinator.planner.codecs import candidates
from hetpeer.coordinator.planner.outer import OUTER_AUTO
from hetpeer.coordinator.planner.costmodel import CostModel
from hetpeer.coordinator.planner.islands import Archipelago, Islands, memories, search_islands
from hetpeer.coordinator.planner.problem import PlanningError, Problem, Report, Shape
from hetpeer.coordinator.planner.prune import Pruned, prune
from hetpeer.coordinator.planner.search import Memory, Progress, SearchConfig, search
from hetpeer.protocol.plan import COST_MODELS, MAX_OUTER_EVERY, RECOMPUTE_CHOICES, Plan, StagePlan, standby_runs
from hetpeer.protocol.workload import STATE_BYTES_PER_PARAM

MAX_RELAY_LOADS = 256  # a plan names the relays carrying most, at most this many (`Plan.relay_load`)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """What to optimise and how long to look. `stages`/`group_size` fix the shape; otherwise it is
    searched. Standby (leaving devices out) is a `time` model option: the paper's `dtfm` cost has
    no notion of compute, so it always uses every device."""

    cost_model: str = "time"
    stages: int | None = None
    group_size: int | None = None
    allow_standby: bool = True
    prune: bool = True  # leave out devices no plan should use before the search (`prune.py`), saying why
    sync: str = "auto"
    recompute: str = "auto"  # activation recomputation: auto (where a stage fits no other way), never, always
    compress: tuple[str, str] = ("raw", "raw")  # codecs of activations between stages and of their gradients back
    # outer steps: OUTER_AUTO = allowed with H chosen per group, N = allowed every N steps (`outer.py`), None =
    # forbidden (only where `sync` is "outer", H chosen per group)
    outer_every: int | None = OUTER_AUTO
    # groups that average exactly do it robustly (the recipe's `robust`, on by default): m / 2 times the bytes of a
    # plain all-reduce (`peer/gossip/exact.py`)
    robust: bool = True
    time_budget_s: float = 2.0
    workers: int = 1  # searches at once, one process each beyond the first (`islands.py`)
    memory_reserve: float = 0.1
    horizon_steps: int = 100
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self) -> None:
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
        if not self.time_budget_s > 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory reserve must be in [0, 1), got {self.memory_reserve}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {self.recompute!r}")
        if self.horizon_steps < 1:
            raise ValueError(f"horizon must be at least 1 step, got {self.horizon_steps}")
        candidates(self.compress)  # a ValueError naming what is wrong
        if self.cost_model == dtfm.NAME and self.compress != ("raw", "raw"):
            raise ValueError("codecs between stages are counted by the time cost model only, not dtfm's")
        if self.outer_every is not None and not 0 <= self.outer_every <= MAX_OUTER_EVERY:
            raise ValueError(f"outer steps must be 1 to {MAX_OUTER_EVERY} steps apart (or {OUTER_AUTO}: chosen per group), "
                             f"got {self.outer_every}")
        if self.cost_model == dtfm.NAME and (self.outer_every not in (None, OUTER_AUTO) or self.sync == "outer"):
            raise ValueError("outer steps are counted by the time cost model only, not dtfm's")


@dataclass(frozen=True, slots=True)
class Solution:
    plan: Plan
    report: Report
    shape: Shape
    grid: np.ndarray  # indices into the problem's devices
    generations: int
    pruned: Pruned | None = None
    # where the search stopped (each island's, with several workers): give it to the next `solve` of this swarm
    memory: Memory | Archipelago | None = None


def make_model(problem: Problem, config: PlannerConfig, shape: Shape,
               hop_codecs: dict[tuple[int, int], tuple[str, str]] | None = None) -> CostModel:
    """The configured cost model for one shape; with `hop_codecs` ((sender, receiver) device indices -> (forward,
    backward) codecs: a running plan's) the time model counts those hops in those codecs."""
    if config.cost_model == dtfm.NAME:
        return dtfm.DtfmCost(problem, shape)
    return timemodel.TimeCost(
        problem, shape, sync=config.sync, memory_reserve=config.memory_reserve, horizon_steps=config.horizon_steps,
        recompute=config.recompute, compress=config.compress, outer_every=config.outer_every, hop_codecs=hop_codecs,
        robust=config.robust,
    )


def solve(
    problem: Problem,
    config: PlannerConfig,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
    progress: Progress | None = None,
    memory: Memory | Archipelago | None = None,
    islands: Islands | None = None,
) -> Solution:
    """The best plan found within the time budget (deterministic for a seed and a worker count when the search
    converges before the deadline). With `memory` (an earlier solution's, for the same workload and
    configuration) the search goes on from where that one stopped: a swarm solved every round gets, after
    k rounds, about the plan of one search k budgets long. With `config.workers` > 1 the search runs on that
    many islands (`islands.py`), in the worker processes of `islands` (a caller that solves again keeps them),
    or else of processes started for this solve; `clock` then is the system's."""
    if problem.current is not None and problem.current.layers != problem.layers:
        raise PlanningError(
            f"the current plan splits {problem.current.layers} layers but the workload has {problem.layers}"
        )
    allow_standby = config.allow_standby and config.cost_model == timemodel.NAME
    pruned = None
    searched = problem
    if allow_standby and config.prune:
        pruned = _prune(problem, config)
        if len(pruned.kept) == 0:
            raise PlanningError("no device can hold a stage: " + "; ".join(
                f"{len(ids)} {reason}" for reason, ids in pruned.reasons(problem.device_ids).items() if ids))
        if len(pruned.kept) < problem.n:
            searched = problem.subset(pruned.kept)
    shapes = searched.shapes(config.stages, config.group_size, allow_standby)
    models: dict[Shape, CostModel] = {}

    def model_for(shape: Shape) -> CostModel:
        if shape not in models:
            models[shape] = make_model(searched, config, shape)
        return models[shape]

    if config.workers > 1:
        own = islands is None or islands.workers != config.workers
        pool = Islands(config.workers) if own else islands
        try:
            found, memory = search_islands(searched, shapes, model_for, functools.partial(make_model, searched, config),
                                           config.search, rng, config.time_budget_s, pool, progress, memory)
        finally:
            if own:
                pool.close(wait=False)
    else:
        found = search(searched, shapes, model_for, config.search, rng, clock() + config.time_budget_s, clock, progress,
                       memories(memory, 1)[0])
        memory = found.memory
    report = model_for(found.shape).report(found.grid)
    if not report.fits_memory:
        raise PlanningError(_memory_message(searched, found.shape, config))
    grid = pruned.kept[found.grid] if searched is not problem else found.grid
    plan = to_plan(problem, config.cost_model, grid, report)
    if pruned is not None:
        plan = with_reasons(plan, pruned.reasons(problem.device_ids))
    return Solution(plan=plan, report=report, shape=found.shape, grid=grid, generations=found.generations, pruned=pruned,
                    memory=memory)


def _prune(problem: Problem, config: PlannerConfig) -> Pruned:
    """`prune.prune`; with a fixed shape only the too-small rule holds (its proof of too slow compares against
    plans of any shape)."""
    found = prune(problem, config.memory_reserve, lambda p, shape, grid: make_model(p, config, shape).report(grid))
    if config.stages is None and config.group_size is None:
        return found
    return Pruned(np.union1d(found.kept, found.too_slow), found.too_small, np.zeros(0, dtype=np.int64),
                  found.layer_gb, found.reference_s)


SPARE = "spare: the plan is predicted no faster with it"


def with_reasons(plan: Plan, pruned: dict[str, list[str]]) -> Plan:
    """The plan with its standby devices ordered by reason: each pruned one under its reason, the rest spare."""
    named = {d for ids in pruned.values() for d in ids}
    standby, runs = standby_runs({**pruned, SPARE: [d for d in plan.standby if d not in named]})
    return replace(plan, standby=standby, standby_reasons=runs)


def to_plan(problem: Problem, cost_model: str, grid: np.ndarray, report: Report) -> Plan:
    ids = problem.device_ids
    starts = np.concatenate([[0], np.cumsum(report.layers)])
    stages = tuple(
        StagePlan(
            index=s,
            layer_start=int(starts[s]),
            layer_end=int(starts[s + 1]),
            devices=tuple(ids[d] for d in grid[s]),
            sync=report.sync[s],
            outer_every=report.outer_every[s] if report.sync[s] == "outer" else 0,
            outer_delay=report.outer_delay[s] if report.sync[s] == "outer" else 0,
            recompute=report.recompute[s] if report.recompute else 0,
            **_stage_codecs(report, s),
        )
        for s in range(grid.shape[0])
    )
    used = set(int(d) for d in grid.ravel())
    w = problem.workload
    return Plan(
        cost_model=cost_model,
        model=w.model.name,
        layers=w.model.layers,
        batch=w.batch,
        micro_batch=problem.lane_micro_batch(grid.shape[1]),
        micro_batches=max(-(-b // problem.lane_micro_batch(grid.shape[1])) for b in report.lane_batches)
        if report.lane_batches else problem.micro_batches(grid.shape[1]),
        lane_batches=report.lane_batches,
        dtype=w.dtype,
        seq_len=w.model.seq_len,
        stages=stages,
        standby=tuple(ids[d] for d in range(problem.n) if d not in used),
        cost=dict(report.cost),
        steps_factor=report.steps_factor,
        relay_load=tuple(sorted(report.relay_load, key=lambda load: -load[2])[:MAX_RELAY_LOADS]),
    )


def _stage_codecs(report: Report, stage: int) -> dict[str, tuple[str, ...]]:
    """A stage's `forward` and `backward` codecs per lane, as the report counted its hop (none named: all raw)."""
    pairs = report.codecs[stage] if stage < len(report.codecs) else ()
    return {
        direction: codecs if any(codec != "raw" for codec in codecs) else ()
        for direction, codecs in (("forward", tuple(f for f, _ in pairs)), ("backward", tuple(b for _, b in pairs)))
    }


def _memory_message(problem: Problem, shape: Shape, config: PlannerConfig) -> str:
    model = problem.workload.model
    state_gb = model.params * STATE_BYTES_PER_PARAM / 1e9
    limited = problem.memory_bytes[np.isfinite(problem.memory_bytes)]
    usable_gb = float(limited.sum()) * (1 - config.memory_reserve) / 1e9
    largest_gb = float(limited.max()) / 1e9
    return (
        f"nothing fits in memory: {model.name} with {model.layers} layers needs {state_gb:.1f} GB of training "
        f"state alone plus activations; the best plan found ({shape}) still overflows. The devices that state their memory have "
        f"{usable_gb:.1f} GB usable together, {largest_gb:.1f} GB at most each. Use fewer layers, a smaller "
        f"micro-batch, or more devices" + (", or let stages recompute activations (--recompute auto)"
                                           if config.recompute == "never" else "")
    )
