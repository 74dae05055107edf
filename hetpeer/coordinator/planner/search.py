"""The hybrid genetic search of Yuan et al. (NeurIPS 2022), on grids, over shapes.

Per shape: a small population of grids, seeded by construction (clustered, strided, file order,
tiers of speed), at random, and, where devices may stand by, as tight clusters around random
centres; each seed is improved by local search, starting from the seeds best by objective and by
promise (the objective without sync, which a descent mends most) in turn, the best seed every other
time (descents of one seed along different random paths end far apart on large swarms, where a few
descents are all a budget affords). Nine generations in ten (`nudges`) take one member by tournament,
swap three random pairs of it and descend only around them (iterated local search); the child
replaces that member if better. The
others pick two parents by tournament and cross their partitions (balanced, see grid.crossover),
or kick one with many random swaps when the tournament picks the same member twice (so that a
population of one still searches); that child is aligned (TSP order over bottleneck matchings),
improved by local search, its lanes reordered, and aligned again, and replaces the member with
the same groups, or else the worst member, if better.

A descent (`moves.py`) swaps devices and exchanges runs of stages between lanes until neither
improves.

Across shapes: every shape is scored by its best constructed seed; the most promising few each
evolve in a trial, and the shape whose trial came out best evolves on from its population with
the rest of the budget. A population that has not improved for `patience` generations has
converged; while time is left, the best shape restarts from fresh seeds (random grids, clusters
around new centres, kicked copies of the best grid) with the best grids found so far among them,
so that new material is crossed with what earlier populations learnt. The search stops after
`restarts` restarts in a row that found nothing better, or at the deadline: it is deterministic for
a seed whenever the deadline is not hit, and anytime when it is.

Across searches: a search returns its `Memory` (each shape it evolved, its population by device id and
the seconds it had, and which shapes were scored); a search given one goes on from there instead of starting
again (`_resume`), as a coordinator's rounds do, and scores the shapes it may use that were not (peers joined);
when peers joined, every remembered shape gets a trial again. Over the same devices, a search that beats
nothing counts its patience and its restarts on from the last one's; once the searches settled, the next
returns the remembered best at once while the swarm is as it was (`_rested`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from hetpeer.coordinator.planner.costmodel import IMPROVEMENT, CostModel
from hetpeer.coordinator.planner.grid import Aligner, chain_order, crossover, layouts, tiers
from hetpeer.coordinator.planner.moves import descend, nudge, perturb, reorder_lanes
from hetpeer.coordinator.planner.problem import Problem, Shape

TRIAL_SHARE = 0.3  # of the budget, spent evolving the most promising shapes before the best goes on
CLUSTER_SEEDS = 8  # active sets grown around random centres, when some devices may stand by
POPULATION_CELLS = 4096  # large swarms get a smaller population: each member costs a local search
ELITES = 2  # best grids every restart's population starts with
FORGET_SHARE = 0.25  # a remembered grid that lost more of its devices than this is not worth going on from


@dataclass(frozen=True, slots=True)
class SearchConfig:
    population: int = 6
    patience: int = 25  # generations without improvement before a shape is done
    shapes_searched: int = 3  # shapes given a trial before one is evolved
    max_candidates: int = 64  # swaps screened per local-search move
    restarts: int = 3  # converged restarts in a row without a better grid before the search stops
    nudges: float = 0.9  # share of generations that nudge one member instead of crossing two

    def __post_init__(self) -> None:
        for name in ("population", "patience", "shapes_searched", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.restarts < 0:
            raise ValueError(f"restarts must be at least 0, got {self.restarts}")
        if not 0 <= self.nudges <= 1:
            raise ValueError(f"nudges must be a share in [0, 1], got {self.nudges}")


@dataclass(frozen=True, slots=True)
class Found:
    shape: Shape
    grid: np.ndarray
    objective: float
    generations: int
    converged: bool  # stopped for lack of progress, not at the deadline
    population: tuple[np.ndarray, ...]  # best first
    memory: "Memory | None" = None  # what the search learnt, to go on from (set by `search`)
    stale: int = 0  # restarts in a row that found nothing better, at the end (`_restart`)
    idle: int = 0  # generations in a row that found nothing better, at the end of the last population's evolution


@dataclass(frozen=True, slots=True)
class Remembered:
    """One shape a search evolved: its population as device ids (best first) and the seconds it was given."""

    shape: Shape
    population: tuple[tuple[tuple[str, ...], ...], ...]
    searched_s: float


@dataclass(frozen=True, slots=True)
class Memory:
    """What a search learnt, for the next search of the same swarm to go on from instead of starting again
    (`hetpeer coordinator` keeps it between its rounds): the shapes it evolved, the best first. Grids are
    kept as device ids, so that peers who joined, left or were renumbered since change only what they touch."""

    shapes: tuple[Remembered, ...]
    # the shapes scored by the searches since each was last allowed: one allowed again (peers joined) is scored
    # again, and given a trial when it is among the most promising, as in a fresh search
    considered: frozenset[Shape] = frozenset()
    devices: frozenset[str] = frozenset()  # the ids of the devices it searched over
    best: float = np.inf  # the best grid's objective
    # restarts in a row that found nothing better than `best`, counted on across searches of the same devices that
    # found nothing better either: at `SearchConfig.restarts` the search has settled, and the next rests (`_rested`)
    stale: int = 0
    idle: int = 0  # generations in a row without a better grid in the best shape's population, counted on likewise

    @property
    def searched_s(self) -> float:
        return sum(entry.searched_s for entry in self.shapes)


Progress = Callable[[str], None]


@dataclass(slots=True)
class _Shape:
    """A shape under search: its model, seeds, the population it reached and the seconds it has had."""

    shape: Shape
    model: CostModel
    seeds: list[np.ndarray]
    found: Found | None = None
    population: list[np.ndarray] = field(default_factory=list)
    searched_s: float = 0.0
    # generations without a better grid that an earlier search of the same devices left, and the objective they
    # failed to beat: the next evolution counts on from there if its population is no better (`_evolve`)
    idle: int = 0
    known: float = np.inf

    def evolve(self, problem, config, rng, deadline, clock) -> Found:
        started = clock()
        self.found = _evolve(problem, self.model, self.seeds, self.population, config, rng, deadline, clock,
                             idle=self.idle, known=self.known)
        self.idle, self.known = 0, np.inf
        self.population = list(self.found.population)
        self.searched_s += clock() - started
        return self.found


def search(
    problem: Problem,
    shapes: list[Shape],
    make_model: Callable[[Shape], CostModel],
    config: SearchConfig,
    rng: np.random.Generator,
    deadline: float,
    clock: Callable[[], float] = time.perf_counter,
    progress: Progress | None = None,
    memory: Memory | None = None,
) -> Found:
    """Best grid over the given shapes. `deadline` is a reading of `clock`. With `memory` (an earlier
    search's, `Found.memory`) the search goes on from where that one stopped (`_resume`); the result's
    `memory` is where this one stopped."""
    say = progress or (lambda line: None)
    recalled = _recall(memory, problem, shapes, rng) if memory is not None else []
    if recalled and (rested := _rested(memory, problem, shapes, recalled, make_model, config)) is not None:
        say(f"{rested.shape}: settled at {rested.objective:.4g} s on this swarm as it is: rests")
        return rested
    if recalled:
        orders = _device_orders(problem, make_model(recalled[0][0]), rng)
        book = [_Shape(shape, make_model(shape), _constructed(problem, shape, orders) + _sampled(problem, shape, rng),
                       population=population, searched_s=searched_s) for shape, population, searched_s in recalled]
        if memory.devices == frozenset(problem.device_ids) and recalled[0][0] == memory.shapes[0].shape:
            book[0].idle, book[0].known = memory.idle, memory.best  # a round shorter than patience converges on
        # shapes the last search could not use (the swarm grew) or whose remembered grids are forgotten: the most
        # promising join the trials, as in a fresh search
        forgotten = {entry.shape for entry in memory.shapes} - {shape for shape, _, _ in recalled}
        unscored = [shape for shape in shapes if shape not in memory.considered or shape in forgotten]
        scored = _score(unscored, make_model, problem, orders, deadline, clock)
        book += _book(scored, problem, orders, config, rng)
        considered = (memory.considered & set(shapes)) - forgotten | {shape for _, shape, _ in scored}
        # a device that joined since can make a remembered shape that lost out the best again (the peer whose
        # leaving made two lanes too slow comes back): every shape gets a trial this round, whatever it had
        joined = not memory.devices.issuperset(problem.device_ids)
        entry = _resume(problem, book, config, rng, deadline, clock, say, retry=joined)
    else:
        orders = _device_orders(problem, make_model(shapes[0]), rng)  # every shape's: their link costs differ only in scale
        scored = _score(shapes, make_model, problem, orders, deadline, clock)
        book = _book(scored, problem, orders, config, rng)
        considered = frozenset(shape for _, shape, _ in scored)
        # Trials: each promising shape evolves for an equal share of TRIAL_SHARE of the budget (a share
        # it leaves unused goes to the next); the best then evolves on from its population with the
        # rest, unless converged. A large swarm's trial affords about one local search, which tells the
        # shapes apart; the rest of the budget pays for more descents of the best one.
        trials_end = clock() + (TRIAL_SHARE if len(book) > 1 else 1.0) * (deadline - clock())
        for k, entry in enumerate(book):
            found = entry.evolve(problem, config, rng, clock() + (trials_end - clock()) / (len(book) - k), clock)
            say(f"{entry.shape}: trial {found.objective:.4g} s after {found.generations} generations")
        entry = min(book, key=lambda e: e.found.objective)
        if not entry.found.converged and clock() < deadline:
            found = entry.evolve(problem, config, rng, deadline, clock)
            say(f"{found.shape}: {found.objective:.4g} s after {found.generations} more generations")
    # a search that goes on from one of the same devices and has not beaten its best goes on counting its restarts:
    # a coordinator's rounds, each shorter than the restarts that settle a search, settle together
    unchanged = memory is not None and recalled and memory.devices == frozenset(problem.device_ids) and (
        abs(entry.found.objective - memory.best) <= IMPROVEMENT * memory.best)
    started = clock()
    found = _restart(problem, entry.model, entry.found, orders, config, rng, deadline, clock, say,
                     stale=memory.stale if unchanged else 0)
    entry.population, entry.searched_s = list(found.population), entry.searched_s + clock() - started
    return replace(found, memory=_remember(problem, book, entry, considered, found))


def _rested(memory: Memory, problem: Problem, shapes: list[Shape], recalled: list, make_model,
            config: SearchConfig) -> Found | None:
    """The remembered best as it is, where the searches that made `memory` settled (`config.restarts` restarts in a
    row found nothing better) and nothing they weighed has changed: the same devices, the same shapes allowed (all
    scored), and the best grid's objective on this problem within `IMPROVEMENT` of what it was (links measured again
    move it). A swarm's rounds then stop spending their budget once the search has converged, until peers come or
    go, a link changes or the remembered grid is lost."""
    if memory.stale < config.restarts or memory.devices != frozenset(problem.device_ids) or not memory.considered >= set(shapes):
        return None
    shape, population, _ = recalled[0]
    if shape != memory.shapes[0].shape:
        return None
    model = make_model(shape)
    costs = model.batch_cost(np.stack(population))
    if not abs(float(costs[0]) - memory.best) <= IMPROVEMENT * memory.best:
        return None
    ranked = tuple(population[int(k)] for k in np.argsort(costs, kind="stable"))
    return Found(shape, ranked[0], float(costs.min()), 0, True, ranked, memory=memory, stale=memory.stale)


def _score(shapes: list[Shape], make_model, problem: Problem, orders, deadline, clock) -> list:
    """(cost of the best constructed seed, shape, model) for each shape scored before the deadline, best first."""
    scored = []
    for shape in shapes:
        model = make_model(shape)
        costs = model.batch_cost(np.stack(_constructed(problem, shape, orders)))
        scored.append((float(costs.min()), shape, model))
        if clock() > deadline:
            break
    scored.sort(key=lambda entry: entry[0])
    return scored


def _book(scored: list, problem: Problem, orders, config: SearchConfig, rng) -> list[_Shape]:
    """The most promising scored shapes, to be given trials."""
    return [_Shape(shape, model, _constructed(problem, shape, orders) + _sampled(problem, shape, rng))
            for _, shape, model in scored[: config.shapes_searched]]


def _resume(problem, book: list[_Shape], config, rng, deadline, clock, say, retry: bool = False) -> _Shape:
    """Go on from remembered shapes as a search given their time and this budget together would: each shape
    but the best (new shapes too) gets its share of the trials first: TRIAL_SHARE of all the time, in equal shares,
    less what it has had, but no more than an equal share of TRIAL_SHARE of this round's (with `retry`, that share
    whatever it has had); then the best shape (re-evaluated on this swarm) evolves on with the rest."""
    budget = max(0.0, deadline - clock())
    total = sum(entry.searched_s for entry in book) + budget
    best = book[0]
    share = TRIAL_SHARE / max(1, len(book) - 1) * budget  # of this round's trials: the best goes on every round
    for entry in book[1:]:
        owed = share if retry else min(TRIAL_SHARE / len(book) * total - entry.searched_s, share)
        if owed > 0 and clock() < deadline:
            found = entry.evolve(problem, config, rng, min(deadline, clock() + owed), clock)
            say(f"{entry.shape}: trial goes on, {found.objective:.4g} s after {found.generations} generations")
    if clock() < deadline:
        found = best.evolve(problem, config, rng, deadline, clock)
        say(f"{found.shape}: goes on, {found.objective:.4g} s after {found.generations} generations")
    if best.found is None:  # no time left for it: the remembered best as it is, re-evaluated
        best.found = _evolve(problem, best.model, [], best.population, config, rng, deadline, clock)
    return min((entry for entry in book if entry.found is not None), key=lambda e: e.found.objective)


def _recall(memory: Memory, problem: Problem, shapes: list[Shape], rng: np.random.Generator) -> list:
    """The remembered shapes still searched, best first, as (shape, population as device indices of `problem`,
    seconds searched). A device no longer in the problem is replaced by a random unused one; a grid that lost
    more than `FORGET_SHARE` of its devices is forgotten, and so is a shape that lost every grid."""
    index = {device: i for i, device in enumerate(problem.device_ids)}
    recalled = []
    for entry in memory.shapes:
        if entry.shape not in shapes:
            continue
        population = []
        for ids in entry.population:
            grid = np.array([[index.get(d, -1) for d in row] for row in ids], dtype=np.int64)
            missing = grid < 0
            if missing.mean() > FORGET_SHARE:
                continue
            if missing.any():
                unused = rng.permutation(np.setdiff1d(np.arange(problem.n), grid[~missing]))
                grid[missing] = unused[: int(missing.sum())]
            population.append(grid)
        if population:
            recalled.append((entry.shape, population, entry.searched_s))
    return recalled


def _remember(problem: Problem, book: list[_Shape], best: _Shape, considered: frozenset[Shape], found: Found) -> Memory:
    ids = np.asarray(problem.device_ids, dtype=object)
    ordered = [best] + [entry for entry in book if entry is not best and entry.population]
    return Memory(tuple(
        Remembered(entry.shape, tuple(tuple(tuple(row) for row in ids[grid].tolist()) for grid in entry.population),
                   entry.searched_s)
        for entry in ordered
    ), considered, frozenset(problem.device_ids), found.objective, found.stale, found.idle)


def _restart(problem, model, found, orders, config, rng, deadline, clock, progress, stale: int = 0) -> Found:
    """Restarts of a converged population while time is left. A converged population has stopped
    learning, not the search: on small swarms patience runs out in a fraction of the budget (64
    devices: a 2 s budget converged after 1.5 s). Each restart grows a population from fresh seeds
    and the best grids found so far (the elites, which every restart shares), so crossovers take
    new material into what is known to be good. Stops after `config.restarts` restarts in a row
    without a better grid, or at the deadline; the best grid of all is returned, with a population of
    it, the elites and the last restart's population, which a later search goes on from: a restart cut
    short by the deadline is carried on, not begun again (a round of 60 s at 1024 devices affords about
    one restart's descents). `stale` counts on from an earlier search of the swarm that found nothing better."""
    best, generations = found, found.generations
    elites = list(found.population[:ELITES])
    while found.converged and stale < config.restarts and clock() < deadline:
        seeds = _fresh_seeds(problem, model, orders, best.grid, rng)
        # one fresh start at least: on the largest shapes the elites alone fill a population
        found = _evolve(problem, model, seeds, elites, config, rng, deadline, clock, min_seeds=1)
        generations += found.generations
        improved = found.objective < best.objective * (1 - IMPROVEMENT)
        stale = 0 if improved else stale + 1
        if improved:
            best = found
        elites = _merge_elites(elites, found.population)
        if progress is not None:
            progress(f"{found.shape}: restart {found.objective:.4g} s after {found.generations} generations"
                     f"{' (best)' if improved else ''}")
    population: list[np.ndarray] = []
    for grid in [best.grid, *elites, *found.population]:
        if not any(_same_partition(grid, other) for other in population):
            population.append(grid)
    return Found(best.shape, best.grid, best.objective, generations, found.converged,
                 tuple(population[: _population_size(config, model.shape)]), stale=stale, idle=found.idle)


def _population_size(config: SearchConfig, shape: Shape) -> int:
    return max(2, min(config.population, POPULATION_CELLS // shape.devices))


def _fresh_seeds(problem: Problem, model: CostModel, orders: dict[str, np.ndarray], elite: np.ndarray,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """Seeds for a restart: random grids, the devices around new random centres laid out along the
    chain (where some may stand by), and kicked copies of the best grid."""
    shape = model.shape
    seeds = _sampled(problem, shape, rng)
    if shape.devices < problem.n:
        chain = orders["chain"]
        for centre in rng.choice(problem.n, size=2, replace=False):
            active = np.argsort(model.group_cost[centre], kind="stable")[: shape.devices]
            seeds += layouts(shape, chain[np.isin(chain, active)])
    seeds += [perturb(elite, problem.n, model.group_cost, rng) for _ in range(2)]
    return seeds


def _merge_elites(elites: list[np.ndarray], population: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """The `ELITES` best distinct grids of both lists (population best first; elites are the older)."""
    merged: list[np.ndarray] = []
    for grid in list(population) + elites:
        if len(merged) < ELITES and not any(_same_partition(grid, other) for other in merged):
            merged.append(grid)
    return merged


def _device_orders(problem: Problem, model: CostModel, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Orders of all devices that seeds are cut from, computed once for every shape: a
    nearest-neighbour chain; fastest first; best connected (lowest median link cost) first; and
    around random centres, the devices a centre shares a group with most cheaply first."""
    orders = {
        "chain": chain_order(model.link_cost, np.arange(problem.n)),
        "connected": np.argsort(np.median(model.link_cost, axis=1), kind="stable"),
    }
    if problem.tflops is not None:
        orders["fastest"] = np.argsort(-problem.tflops, kind="stable")
    for k, centre in enumerate(rng.permutation(problem.n)[:CLUSTER_SEEDS]):
        orders[f"cluster{k}"] = np.argsort(model.group_cost[centre], kind="stable")
    return orders


def _constructed(problem: Problem, shape: Shape, orders: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Seed grids every shape is scored by: blocks and strided in file order, and the active devices
    (the first, or with room for standby, the first in each of `orders`) laid out along the chain."""
    k, chain = shape.devices, orders["chain"]
    seeds = layouts(shape, np.arange(k))
    actives = [np.arange(k)]
    if k < problem.n:
        actives += [np.sort(order[:k]) for key, order in orders.items() if key != "chain"]
    for active in actives:
        seeds += layouts(shape, chain[np.isin(chain, active)])
    if "fastest" in orders:
        seeds += tiers(shape, orders["fastest"], chain)
    return seeds


def _sampled(problem: Problem, shape: Shape, rng: np.random.Generator) -> list[np.ndarray]:
    """Random seed grids, for diversity."""
    return [rng.permutation(problem.n)[: shape.devices].reshape(shape.stages, shape.group_size) for _ in range(2)]


def _evolve(
    problem: Problem,
    model: CostModel,
    seeds: list[np.ndarray],
    improved: list[np.ndarray],
    config: SearchConfig,
    rng: np.random.Generator,
    deadline: float,
    clock: Callable[[], float],
    min_seeds: int = 0,
    idle: int = 0,
    known: float = np.inf,
) -> Found:
    """Evolve one shape's population, grown from `improved` grids (a trial's population, which local
    search resumes first: a trial may end before its local optima) and then the best raw seeds, at
    least `min_seeds` of them. Patience counts on from `idle` generations when the grown population's
    best is `known`'s (within `IMPROVEMENT`): an earlier search's, of which this one goes on."""
    aligner = Aligner(model.link_cost)
    size = _population_size(config, model.shape)
    starts = list(improved)
    count = max(size - len(starts), min_seeds) if seeds else 0
    if count > 0:
        costs, promised = model.seed_costs(np.stack(seeds))
        ranked = _interleaved(np.argsort(promised, kind="stable").tolist(), np.argsort(costs, kind="stable").tolist())
        starts += _start_order([seeds[i] for i in ranked], count)
    population: list[np.ndarray] = []
    costs: list[float] = []
    for start in starts:
        grid, cost = _improve(problem, model, aligner, start, config, rng, deadline, clock)
        if not any(_same_partition(grid, other) for other in population):
            population.append(grid)
            costs.append(cost)
        if clock() > deadline:
            break
    generations = 0
    stale = idle if idle and costs and abs(min(costs) - known) <= IMPROVEMENT * known else 0
    while stale < config.patience and clock() < deadline:
        generations += 1
        first, second = (_tournament(costs, rng) for _ in range(2))
        nudged = rng.random() < config.nudges
        if nudged:  # iterated local search: a light kick and a descent around it
            child, look = nudge(population[first], problem.n, rng)
            cost = float(model.batch_cost(child[None])[0])
            child, cost = descend(problem, model, child, cost, config.max_candidates, rng, deadline, clock, look)
        else:
            if first == second:  # nothing to cross: kick a member instead (iterated local search)
                child = perturb(population[first], problem.n, model.group_cost, rng)
            else:
                child = crossover(population[first], population[second], problem.n, model.group_cost, rng)
            child, cost = _improve(problem, model, aligner, child, config, rng, deadline, clock)
        best_before = min(costs)
        twins = [k for k, other in enumerate(population) if _same_partition(child, other)]
        # A child replaces its twin (same groups, maybe another order) if better, else its parent when
        # nudged (so that nudges do not fill the population with copies of one member), else the worst.
        replaced = twins[0] if twins else (first if nudged else int(np.argmax(costs)))
        if cost < costs[replaced]:
            population[replaced], costs[replaced] = child, cost
        stale = 0 if cost < best_before * (1 - IMPROVEMENT) else stale + 1
    ranked = np.argsort(costs, kind="stable")  # best first: a search that goes on resumes it in this order
    converged = stale >= config.patience
    best = int(ranked[0])
    ranked_population = tuple(population[int(k)] for k in ranked)
    return Found(model.shape, population[best], costs[best], generations, converged, ranked_population, idle=stale)


def _interleaved(first: list, second: list) -> list:
    """The items of two rankings of the same items, in turn from each, each item once where it first comes."""
    merged: list = []
    for pair in zip(first, second):
        for item in pair:
            if item not in merged:
                merged.append(item)
    return merged


def _start_order(ranked: list[np.ndarray], count: int) -> list[np.ndarray]:
    """`count` starts from seeds ranked best first: the best every other start, the next best in
    between. Where a local search ends depends on its random path as much as on its start (at
    1024 devices, four descents of one seed ended between 1.80 and 1.90 s per step, mostly below
    those of the next seeds), so the best seed is worth several descents. On small swarms its descents
    tend to agree, and one that ends in a partition already found is dropped."""
    runners_up = ranked[1:] or ranked
    return [ranked[0] if k % 2 == 0 else runners_up[min(k // 2, len(runners_up) - 1)] for k in range(count)]


def _improve(problem, model, aligner, grid, config, rng, deadline, clock) -> tuple[np.ndarray, float]:
    """Align, local search, reorder lanes, align again; keep whichever orientation is cheapest.
    A local search cut by the deadline is returned as it is: aligning a large grid takes long
    enough (a third of a second at 1024 devices) to overrun the budget."""
    grid, cost = _best_alignment(model, aligner, grid)
    grid, cost = descend(problem, model, grid, cost, config.max_candidates, rng, deadline, clock)
    if clock() > deadline:
        return grid, cost
    grid, cost = reorder_lanes(model, grid, cost, config.max_candidates, rng)
    return _best_alignment(model, aligner, grid, (grid, cost))


def _best_alignment(model, aligner, grid, incumbent=None) -> tuple[np.ndarray, float]:
    aligned = aligner.align(grid)
    options = [grid, aligned, aligned[::-1].copy()]
    costs = model.batch_cost(np.stack(options))
    best = int(np.argmin(costs))
    if incumbent is not None and incumbent[1] <= costs[best]:
        return incumbent
    return options[best], float(costs[best])


def _tournament(costs: list[float], rng: np.random.Generator) -> int:
    a, b = rng.integers(len(costs), size=2)
    return int(a if costs[a] <= costs[b] else b)


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return sorted(map(tuple, np.sort(a, axis=1))) == sorted(map(tuple, np.sort(b, axis=1)))
