"""Planner benchmark: how good and how fast `solve` is, against references measured in the same run.

    python3 benchmarks/planner.py [--part scenarios|tiny|scale|all] [options]

Parts:

- scenarios: the five networks of Yuan et al. (NeurIPS 2022) under their cost model (dtfm), 8 stages x
  8 lanes, against their GCMA figures and the blocks, strided and random baselines;
- tiny: random 8-device topologies, every shape, against exhaustive search (the true optimum);
- scale: synthetic swarms of 1024 devices from each generator of `planner/synthetic.py` (unlike GPUs, many
  small regions, a few big sites, home links, devices too small for any stage) under the time model: a
  budget T against the best of two searches of 10 T (seeded apart: one long search is itself noisy, and
  their spread is reported), and the coordinator's plan after 10 rounds of T (each search going on from the
  last) against the same reference; `--generators`, `--scale-seeds`, `--sizes` choose the cases;
- workers: the scale cases (`--generators`, default mixed here) solved in T on `--workers` N worker processes
  (islands, `planner/islands.py`) against one, at equal wall time, one solve at a time (N uses N cores).

The machine is shared and noisy, so every ratio is between figures taken in the same run. Defaults give
the full benchmark (scenarios and tiny about 8 minutes; scale 30 minutes of a core per case, 15 cases on
two cores about 4 hours; workers 6 minutes); the options shrink it for a quick run. Exit status 1 when a part misses its goal.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hetpeer import scenarios
from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, Shape, Solution, make_model, solve
from hetpeer.coordinator.planner import baselines, synthetic
from hetpeer.coordinator.planner.grid import Aligner
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

# The paper's c_DP and c_PP for GPT3-XL (bytes), as in their scheduler's configuration.
PAPER_DP_BYTES = 0.65e9
PAPER_PP_BYTES = 0.471248e9
# Their GCMA scheduler's best cost (s) per scenario; it needs 14-17 minutes for 5,000 candidates here.
GCMA_S = {"datacenter-on-demand": 3.440, "datacenter-spot": 49.504, "world-wide": 49.218}
GCMA_DECIMALS = 3  # the figures are rounded, so "reached" allows half a unit of the last digit
DEADLINE_SLACK_S = 0.1  # solve returns at its deadline plus the move under way; this much counts as on time
NEAR_OPTIMAL = 1e-9  # relative gap counted as equal to the optimum
WITHIN = 0.01
ROUNDS_WITHIN = 0.005  # the coordinator's plan after its rounds against the long solve
LONG_SEED_APART = 1000  # the second long solve's search seed, past the first's: one long search is itself noisy
DEFAULT_SCALE_BUDGET_S = {64: 2.0, 256: 6.0, 1024: 60.0}


def say(line: str = "") -> None:
    print(line, flush=True)


def code_state() -> str:
    """The commit, and a digest of uncommitted changes to hetpeer/, so that figures name the code they measured."""

    def git(*command: str) -> str:
        root = Path(__file__).resolve().parent.parent
        done = subprocess.run(["git", *command], cwd=root, capture_output=True, text=True, check=True, timeout=10)
        return done.stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        diff = git("diff", "HEAD", "--", "hetpeer")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    if not diff:
        return f"commit {commit}"
    digest = hashlib.sha1(diff.encode()).hexdigest()[:10]
    return f"commit {commit} + uncommitted changes to hetpeer/ (diff sha1 {digest})"


def header(title: str, measures: str, goal: str) -> None:
    say()
    say(f"== {title} ==")
    say(f"measures: {measures}")
    say(f"goal:     {goal}")
    say()


def timed_solve(
    problem: Problem, config: PlannerConfig, seed: int, progress: Callable[[str], None] | None = None
) -> tuple[Solution, float]:
    started = time.perf_counter()
    solution = solve(problem, config, np.random.default_rng(seed), progress=progress)
    return solution, time.perf_counter() - started


def percent(gap: float) -> str:
    """A relative gap; tiny nonzero ones (rounding-level misses) in scientific notation."""
    return f"{gap:.3%}" if gap == 0 or abs(gap) >= 1e-5 else f"{gap:.1e}"


def ratio(a: float, b: float | None) -> str:
    return "n/a" if b is None or b == 0 else f"{a / b:.3f}"


def table(rows: list[list[str]]) -> None:
    """Left-aligned first column, right-aligned figures."""
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        say("  " + "  ".join(cells))


# -- scenarios ---------------------------------------------------------------------------------------


def scenario_problem(name: str) -> Problem:
    topology = Topology.from_wire(scenarios.load(name))
    workload = Workload(preset("gpt3-xl"), batch=512)
    return Problem.from_topology(topology, workload, dp_bytes=PAPER_DP_BYTES, pp_bytes=PAPER_PP_BYTES)


def run_scenarios(args: argparse.Namespace) -> bool:
    header(
        "scenarios: the paper's five networks, dtfm cost, 8 stages x 8 lanes, GPT3-XL",
        f"our cost (s) and wall time of solve with a {args.budget:g} s budget (seed {args.seed}); GCMA's "
        "published cost; blocks and strided grids after TSP/matching alignment; mean of 100 random grids "
        f"in their own order and pairing (the authors' random scheduler); worst cost and time over "
        f"{args.seeds} seeds",
        f"reach GCMA's cost or better on every scenario within {args.budget:g} s",
    )
    config = PlannerConfig(cost_model="dtfm", stages=8, group_size=8, time_budget_s=args.budget)
    shape = Shape(8, 8)
    rows = [["scenario", "ours", "time s", "GCMA", "blocks", "strided", "random", "/GCMA", "/blocks", "/random",
             "worst", "worst s"]]  # fmt: skip
    reached, worst_time = [], 0.0
    for name in args.scenario_names:
        problem = scenario_problem(name)
        runs = []
        for k in range(args.seeds):
            solution, wall_s = timed_solve(problem, config, args.seed + k)
            runs.append((solution.report.objective, wall_s))
            say(f"  {name} seed {args.seed + k}: {solution.report.objective:.4f} s in {wall_s:.2f} s")
        ours, ours_s = runs[0]
        worst_cost = max(cost for cost, _ in runs)
        worst_s = max(wall_s for _, wall_s in runs)
        worst_time = max(worst_time, worst_s)
        model = make_model(problem, config, shape)
        aligner = Aligner(model.link_cost)
        blocks = float(model.batch_cost(aligner.align(baselines.blocks_grid(shape))[None])[0])
        strided = float(model.batch_cost(aligner.align(baselines.strided_grid(shape))[None])[0])
        grids = baselines.random_grids(problem, shape, args.random_samples, np.random.default_rng(args.seed))
        random_mean = float(model.batch_cost(grids).mean())
        gcma = GCMA_S.get(name)
        if gcma is not None:
            reached.append(worst_cost <= gcma + 0.5 * 10.0**-GCMA_DECIMALS)
        rows.append([
            name, f"{ours:.4f}", f"{ours_s:.2f}", "n/a" if gcma is None else f"{gcma:.3f}", f"{blocks:.4f}",
            f"{strided:.4f}", f"{random_mean:.4f}", ratio(ours, gcma), ratio(ours, blocks), ratio(ours, random_mean),
            f"{worst_cost:.4f}", f"{worst_s:.2f}" + ("*" if worst_s >= 0.98 * args.budget else ""),
        ])  # fmt: skip
    say()
    table(rows)
    ok = all(reached) and worst_time <= args.budget + DEADLINE_SLACK_S
    say()
    say("  ratios are ours / reference (below 1 is better); * the search ran to its deadline (did not converge)")
    say(f"result: GCMA reached on {sum(reached)}/{len(reached)} scenarios with a figure (worst of {args.seeds} "
        f"seeds; GCMA + {0.5 * 10.0**-GCMA_DECIMALS:g} allowed for its rounding); slowest solve {worst_time:.2f} s "
        f"(budget {args.budget:g} s + {DEADLINE_SLACK_S:g} s overshoot): "
        f"{'goal met' if ok else 'goal NOT met'}")  # fmt: skip
    return ok


# -- tiny --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    cost_model: str
    topology: int
    shape: Shape
    ours: float
    optimum: float
    solve_s: float
    exhaustive_s: float

    @property
    def gap(self) -> float:
        if self.optimum == 0:
            return 0.0 if self.ours == 0 else math.inf
        return (self.ours - self.optimum) / abs(self.optimum)


def tiny_shapes(cost_model: str, devices: int) -> list[Shape]:
    if cost_model == "dtfm":  # the paper's cost uses every device
        return [Shape(s, devices // s) for s in range(1, devices + 1) if devices % s == 0]
    return [Shape(s, m) for s in range(1, devices + 1) for m in range(1, devices // s + 1)]


def tiny_problem(cost_model: str, topology: Topology) -> Problem:
    if cost_model == "dtfm":
        workload = Workload(preset("gpt3-xl"), batch=512)
        return Problem.from_topology(topology, workload, dp_bytes=PAPER_DP_BYTES, pp_bytes=PAPER_PP_BYTES)
    return Problem.from_topology(topology, Workload(preset("tiny", layers=8), batch=64))


def run_tiny(args: argparse.Namespace) -> bool:
    devices = 8
    counts = {model: len(tiny_shapes(model, devices)) for model in args.cost_models}
    header(
        f"tiny: {args.topologies} random topologies of {devices} devices in 3 regions, every shape",
        "solve with the shape fixed and a "
        f"{args.tiny_budget:g} s budget against exhaustive search (every ordered choice of devices). "
        f"dtfm: GPT3-XL with the paper's c_DP/c_PP, stages x lanes = {devices} ({counts.get('dtfm', 0)} shapes); "
        f"time: tiny preset with 8 layers, batch 64, standby allowed, stages x lanes <= {devices} "
        f"({counts.get('time', 0)} shapes). Topology i is random_topology({devices}, 3, default_rng(i))",
        f"always within {WITHIN:.0%} of the optimum",
    )
    cases: dict[str, list[Case]] = {model: [] for model in args.cost_models}
    failures: list[str] = []
    started = time.perf_counter()
    for i in range(args.topologies):
        topology = Topology.from_wire(synthetic.random_topology(devices, 3, np.random.default_rng(i)))
        for cost_model in args.cost_models:
            problem = tiny_problem(cost_model, topology)
            for shape in tiny_shapes(cost_model, devices):
                config = PlannerConfig(
                    cost_model=cost_model, stages=shape.stages, group_size=shape.group_size,
                    time_budget_s=args.tiny_budget,
                )  # fmt: skip
                exhaustive_start = time.perf_counter()
                _, optimum = baselines.exhaustive(problem, make_model(problem, config, shape))
                exhaustive_s = time.perf_counter() - exhaustive_start
                try:
                    solution, solve_s = timed_solve(problem, config, args.seed)
                except PlanningError as error:
                    failures.append(f"topology {i}, {cost_model}, {shape}: {error}")
                    continue
                found = Case(cost_model, i, shape, solution.report.objective, optimum, solve_s, exhaustive_s)
                cases[cost_model].append(found)
        if (i + 1) % args.progress_every == 0 or i + 1 == args.topologies:
            far = sum(case.gap > WITHIN for group in cases.values() for case in group)
            say(f"  {i + 1}/{args.topologies} topologies, {time.perf_counter() - started:.0f} s, "
                f"{far} cases over {WITHIN:.0%} so far")  # fmt: skip

    say()
    rows = [["cost model", "shapes", "cases", "optimal", f"within {WITHIN:.0%}", "worst gap", "worst case",
             "solve mean s", "exhaustive mean s", "exhaustive s/topology"]]  # fmt: skip
    ok = not failures
    for cost_model, group in cases.items():
        if not group:
            continue
        worst = max(group, key=lambda case: case.gap)
        topologies = len({case.topology for case in group})
        ok &= worst.gap <= WITHIN
        rows.append([
            cost_model, str(counts[cost_model]), str(len(group)),
            str(sum(case.gap <= NEAR_OPTIMAL for case in group)), str(sum(case.gap <= WITHIN for case in group)),
            percent(worst.gap), f"t{worst.topology} {worst.shape.stages}x{worst.shape.group_size}",
            f"{np.mean([c.solve_s for c in group]):.3f}", f"{np.mean([c.exhaustive_s for c in group]):.3f}",
            f"{sum(c.exhaustive_s for c in group) / topologies:.2f}",
        ])  # fmt: skip
    table(rows)
    far = sorted((case for group in cases.values() for case in group if case.gap > NEAR_OPTIMAL),
                 key=lambda case: -case.gap)  # fmt: skip
    if far:
        say()
        say(f"cases not at the optimum ({len(far)}; worst {min(len(far), args.show_worst)} shown):")
        by_shape: dict[str, int] = {}
        for case in far:
            key = f"{case.cost_model} {case.shape.stages}x{case.shape.group_size}"
            by_shape[key] = by_shape.get(key, 0) + 1
        for case in far[: args.show_worst]:
            say(f"  {case.cost_model:<5} topology {case.topology:>3}  {case.shape.stages}x{case.shape.group_size}  "
                f"ours {case.ours:.6g}  optimum {case.optimum:.6g}  gap {percent(case.gap)}")  # fmt: skip
        say("  by shape: " + ", ".join(f"{key}: {count}" for key, count in sorted(by_shape.items())))
    for line in failures:
        say(f"  no plan: {line}")
    say()
    say(f"result: {'goal met' if ok else 'goal NOT met'} ({time.perf_counter() - started:.0f} s for this part)")
    return ok


# -- scale -------------------------------------------------------------------------------------------


def scale_problem(generator: str, devices: int, seed: int) -> Problem:
    topology = Topology.from_wire(synthetic.generate(generator, devices, seed))
    return Problem.from_topology(topology, Workload(preset("gpt3-xl"), batch=512))


def scale_case(kind: str, generator: str, devices: int, seed: int, budget_s: float, factor: float, rounds: int) -> dict:
    """One run of a scale case, in a process of its own (`--jobs`): `long` and `long2`, one solve of `factor` x the
    budget each, the second's search seeded apart (`LONG_SEED_APART`); or `rounds`, a coordinator's `rounds` solves of
    the budget, each going on from the last one's memory (the first is the plain budget's solve). Returns the
    objectives, shapes and wall seconds."""
    problem = scale_problem(generator, devices, seed)
    rng = np.random.default_rng(seed + (LONG_SEED_APART if kind == "long2" else 0))
    label = f"{generator} seed {seed}, {devices} devices"
    if kind in ("long", "long2"):
        started = time.perf_counter()
        solution = solve(problem, PlannerConfig(time_budget_s=factor * budget_s), rng)
        wall_s = time.perf_counter() - started
        say(f"  {label}: {factor * budget_s:g} s solve{' (seeded apart)' if kind == 'long2' else ''}: "
            f"{solution.report.objective:.4f} s per step, {solution.shape}, {wall_s:.1f} s")
        return {"cost": solution.report.objective, "shape": str(solution.shape), "wall_s": wall_s}
    memory, costs, shapes, walls = None, [], [], []
    for k in range(rounds):
        started = time.perf_counter()
        solution = solve(problem, PlannerConfig(time_budget_s=budget_s), rng, memory=memory)
        walls.append(time.perf_counter() - started)
        rested = memory is not None and solution.memory == memory  # a search that rests hands its memory back as it was
        memory = solution.memory
        costs.append(solution.report.objective)
        shapes.append(str(solution.shape))
        say(f"  {label}: round {k + 1} of {budget_s:g} s: {costs[-1]:.4f} s per step, {shapes[-1]}, {walls[-1]:.1f} s"
            f"{' (rests: the search has settled)' if rested else ''}")
    return {"costs": costs, "shapes": shapes, "walls": walls}


def run_workers(args: argparse.Namespace) -> bool:
    budgets = dict(zip(args.sizes, args.scale_budgets))
    seeds = list(range(args.seed, args.seed + args.scale_seeds))
    generators = args.generators if args.generators_given else ["mixed"]
    header(
        f"workers: the scale swarms solved on {args.workers} worker processes against 1, time cost model, GPT3-XL, batch 512",
        f"objective (s per step) of solve with budget T on 1 worker and on {args.workers} (the same seed, equal wall time, "
        f"one solve at a time); generators {', '.join(generators)}, seeds {seeds[0]}-{seeds[-1]}",
        f"{args.workers} workers below 1 worker on average (mean ratio under 1); every run ends within T + {DEADLINE_SLACK_S:g} s",
    )
    rows = [["generator", "seed", "devices", "T s", "cost(1)", "shape(1)", f"cost({args.workers})", f"shape({args.workers})",
             "ratio", f"wall({args.workers}) s"]]  # fmt: skip
    ratios, ok = [], True
    for n in args.sizes:
        for g in generators:
            for seed in seeds:
                problem = scale_problem(g, n, seed)
                results = []
                for workers in (1, args.workers):
                    started = time.perf_counter()
                    solution = solve(problem, PlannerConfig(time_budget_s=budgets[n], workers=workers),
                                     np.random.default_rng(seed))
                    wall_s = time.perf_counter() - started
                    ok &= wall_s <= budgets[n] + DEADLINE_SLACK_S
                    results.append((solution.report.objective, str(solution.shape), wall_s))
                    say(f"  {g} seed {seed}, {n} devices, {workers} worker(s): {results[-1][0]:.4f} s per step, "
                        f"{results[-1][1]}, {wall_s:.1f} s")
                (one, one_shape, _), (many, many_shape, many_wall) = results
                ratios.append(many / one)
                rows.append([g, str(seed), str(n), f"{budgets[n]:g}", f"{one:.4f}", one_shape, f"{many:.4f}", many_shape,
                             f"{many / one:.4f}", f"{many_wall:.1f}"])  # fmt: skip
    ok &= float(np.mean(ratios)) < 1
    say()
    say(f"  ratio: cost({args.workers}) over cost(1), below 1 is better; mean {np.mean(ratios):.4f}, range "
        f"{min(ratios):.4f}-{max(ratios):.4f}, {sum(r < 1 for r in ratios)} of {len(ratios)} better, "
        f"{sum(r > 1 for r in ratios)} worse")
    table(rows)
    say()
    say(f"result: {'goal met' if ok else 'goal NOT met'}")
    return ok


def run_scale(args: argparse.Namespace) -> bool:
    budgets = dict(zip(args.sizes, args.scale_budgets))
    seeds = list(range(args.seed, args.seed + args.scale_seeds))
    header(
        "scale: synthetic swarms of unlike kinds, time cost model, GPT3-XL, batch 512, shape searched, standby allowed",
        f"objective (s per step) of solve with a budget T against the best of two {args.factor:g} T solves (searches "
        f"seeded apart; their spread is how noisy the reference is), and of the coordinator's plan after {args.rounds} "
        f"rounds of T (each search going on from the last) against the same reference; generators {', '.join(args.generators)} (planner/synthetic.py), seeds {seeds[0]}-{seeds[-1]} (topology "
        f"and search), {args.jobs} run(s) at once, one core each",
        f"cost(T) within {WITHIN:.0%} of the best cost({args.factor:g} T), cost after {args.rounds} rounds within "
        f"{ROUNDS_WITHIN:.1%}; every T run ends within T + {DEADLINE_SLACK_S:g} s",
    )
    cases = [(g, n, seed) for n in args.sizes for g in args.generators for seed in seeds]
    kinds = ("long", "long2", "rounds")
    work = [(kind, g, n, seed, budgets[n], args.factor, args.rounds) for g, n, seed in cases for kind in kinds]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core a run: the runs at once share the machine evenly
    if args.jobs == 1:
        results = [scale_case(*job) for job in work]
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(scale_case, *zip(*work)))
    rows = [["generator", "seed", "devices", "T s", "cost(T)", "shape(T)", f"best cost({args.factor:g}T)",
             f"shape({args.factor:g}T)", "spread", "ratio", f"cost({args.rounds} rounds)", "ratio"]]  # fmt: skip
    ok = True
    for k, (g, n, seed) in enumerate(cases):
        one, two, rounds = results[len(kinds) * k: len(kinds) * (k + 1)]
        long = min(one, two, key=lambda r: r["cost"])
        spread = max(one["cost"], two["cost"]) / long["cost"] - 1
        first, last = rounds["costs"][0], rounds["costs"][-1]
        within, within_rounds = first / long["cost"], last / long["cost"]
        ok &= within <= 1 + WITHIN and within_rounds <= 1 + ROUNDS_WITHIN
        ok &= max(rounds["walls"]) <= budgets[n] + DEADLINE_SLACK_S
        rows.append([g, str(seed), str(n), f"{budgets[n]:g}", f"{first:.4f}", rounds["shapes"][0], f"{long['cost']:.4f}",
                     long["shape"], f"{spread:.2%}", f"{within:.4f}", f"{last:.4f}", f"{within_rounds:.4f}"])  # fmt: skip
    say()
    say(f"  ratio: against the better of the two {args.factor:g}T solves; 1 or below is as good as it; spread: the worse "
        "one over the better; shapes are stages x lanes")
    table(rows)
    say()
    say(f"result: {'goal met' if ok else 'goal NOT met'}")
    return ok


# -- command line ------------------------------------------------------------------------------------


def _positive_list(kind: type) -> Callable[[str], list]:
    """An argparse type: positive values of `kind` separated by commas, e.g. 64,256."""

    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}s separated by commas, got {text!r}") from None
        if not values or not all(v > 0 and math.isfinite(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected positive {kind.__name__}s, got {text!r}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("scenarios", "tiny", "scale", "workers", "all"), default="all")
    parser.add_argument("--seed", type=int, default=0, help="seed of solve (and of the scale topologies)")
    group = parser.add_argument_group("scenarios")
    group.add_argument("--scenario", dest="scenario_names", action="append", choices=scenarios.NAMES,
                       help="a scenario to run (repeatable; default all five)")
    group.add_argument("--budget", type=float, default=2.0, help="solve budget in seconds (default 2)")
    group.add_argument("--seeds", type=int, default=3, help="seeds per scenario, from --seed on (default 3)")
    group.add_argument("--random-samples", type=int, default=100, help="random grids averaged (default 100)")
    group = parser.add_argument_group("tiny")
    group.add_argument("--topologies", type=int, default=100, help="random 8-device topologies (default 100)")
    group.add_argument("--cost-models", type=lambda text: text.split(","), default=["dtfm", "time"],
                       help="comma-separated, from dtfm,time (default both)")
    group.add_argument("--tiny-budget", type=float, default=1.0, help="solve budget in seconds (default 1)")
    group.add_argument("--show-worst", type=int, default=15, help="non-optimal cases listed (default 15)")
    group.add_argument("--progress-every", type=int, default=10, help="topologies between progress lines")
    group = parser.add_argument_group("scale")
    group.add_argument("--generators", type=lambda text: text.split(","),
                       help=f"comma-separated, from {','.join(synthetic.GENERATORS)} (default all; workers: mixed)")
    group.add_argument("--sizes", type=_positive_list(int), default=[1024], help="devices, e.g. 64,256 (default 1024)")
    group.add_argument("--scale-budgets", type=_positive_list(float),
                       help="budget T in seconds per size, in --sizes order (default 64:2, 256:6, 1024:60)")
    group.add_argument("--scale-seeds", type=int, default=3, help="seeds per generator, from --seed on (default 3)")
    group.add_argument("--factor", type=float, default=10.0, help="the long solve's budget in T (default 10)")
    group.add_argument("--rounds", type=int, default=10, help="coordinator rounds of T (default 10)")
    group.add_argument("--jobs", type=int, default=2, help="runs at once, one core each (default 2)")
    group = parser.add_argument_group("workers")
    group.add_argument("--workers", type=int, default=2, help="worker processes against one (default 2)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.scenario_names = args.scenario_names or list(scenarios.NAMES)
    args.generators_given = args.generators is not None
    args.generators = args.generators or list(synthetic.GENERATORS)
    if unknown := set(args.cost_models) - {"dtfm", "time"}:
        parser.error(f"--cost-models: unknown {', '.join(sorted(unknown))} (known: dtfm, time)")
    if unknown := set(args.generators) - set(synthetic.GENERATORS):
        parser.error(f"--generators: unknown {', '.join(sorted(unknown))} (known: {', '.join(synthetic.GENERATORS)})")
    if min(args.budget, args.tiny_budget, args.factor) <= 0 or min(args.seeds, args.topologies, args.scale_seeds,
                                                                    args.rounds, args.jobs) < 1 or args.workers < 2:
        parser.error("budgets, --factor, --seeds, --topologies, --scale-seeds, --rounds and --jobs must be positive, "
                     "--workers at least 2")
    if args.scale_budgets is None:
        if missing := [n for n in args.sizes if n not in DEFAULT_SCALE_BUDGET_S]:
            parser.error(f"no default budget for {missing} devices: give --scale-budgets")
        args.scale_budgets = [DEFAULT_SCALE_BUDGET_S[n] for n in args.sizes]
    if len(args.scale_budgets) != len(args.sizes):
        parser.error(f"--scale-budgets has {len(args.scale_budgets)} values for {len(args.sizes)} sizes")
    say(f"hetpeer planner benchmark; code: {code_state()}")
    parts = {"scenarios": run_scenarios, "tiny": run_tiny, "scale": run_scale, "workers": run_workers}
    chosen = list(parts) if args.part == "all" else [args.part]
    results = {name: parts[name](args) for name in chosen}
    say()
    say("summary: " + ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
