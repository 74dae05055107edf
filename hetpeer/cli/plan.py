"""`hetpeer plan`: plan, offline, how a set of machines should train a model. Loads the planner (numpy and
scipy) when it runs, never torch or hivemind."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from hetpeer import scenarios
from hetpeer.cli.common import (
    COMPRESS_HELP, OUTER_HELP, WORKERS_HELP, UserError, default_workers, add_model_options, add_recipe_options, compress_choice, model_spec, non_negative_int, outer_every_choice,
    positive_float, positive_int, read_json, recipe_from,
)
from hetpeer.protocol.plan import COST_MODELS, RECOMPUTE_CHOICES, SYNC_CHOICES, Plan
from hetpeer.protocol.modelspec import DTYPE_BYTES
from hetpeer.protocol.workload import Workload


def _efficiency(text: str):
    from hetpeer.coordinator.planner.efficiency import Efficiency

    try:
        return Efficiency.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_commands(commands) -> None:
    """Add `hetpeer plan` to the subcommands."""
    plan = commands.add_parser(
        "plan",
        help="plan how a set of machines should train a model (offline)",
        description="Decide which devices form each data-parallel group, which layers each group holds and "
        "how groups chain into pipelines (lanes), and print the plan with its predicted cost beside the "
        "blocks and random baselines.",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("topology", nargs="?", type=Path, metavar="TOPOLOGY.json", help="topology file (JSON, see docs/topology.md)")
    source.add_argument("--scenario", choices=scenarios.NAMES, help="a built-in scenario of Yuan et al. (2022)")
    work = plan.add_argument_group("workload")
    add_model_options(work, default="gpt3-xl")
    work.add_argument("--layers", type=positive_int, metavar="N", help="number of transformer layers (default: the model's)")
    work.add_argument("--batch", type=positive_int, default=512, metavar="N", help="global batch in sequences (default 512)")
    work.add_argument("--micro-batch", type=positive_int, default=1, metavar="N", help="micro-batch in sequences (default 1)")
    work.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="training dtype (default bf16)")
    model = plan.add_argument_group("cost model")
    model.add_argument("--cost-model", choices=COST_MODELS, default="time",
                       help="time: predicted seconds per step (default); dtfm: the paper's communication cost")
    model.add_argument("--stages", type=positive_int, metavar="S", help="fix the number of pipeline stages")
    model.add_argument("--group-size", type=positive_int, metavar="M", help="fix the data-parallel group size (lanes)")
    model.add_argument("--no-standby", action="store_true",
                       help="use every device (time model; dtfm always does)")
    model.add_argument("--no-prune", action="store_true",
                       help="search over every device, even those too small for a layer or too slow to matter "
                            "(by default they are left out first, with the reason in the plan)")
    model.add_argument("--sync", choices=SYNC_CHOICES, default="auto",
                       help="how groups average weights (time model; default auto: per group)")
    model.add_argument("--compress", type=compress_choice, default=("auto", "auto"), metavar="auto|CODEC[/CODEC]",
                       help=COMPRESS_HELP + "; time model only")
    model.add_argument("--outer-every", type=outer_every_choice, default=0, metavar="N|auto|never", help=OUTER_HELP + "; time model only")
    model.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                       help="activation recomputation (time model): auto (default: a stage recomputes the fewest layers that "
                       "make it fit its devices' memory, each at the cost of one more forward pass), never, or always "
                       "(every layer)")
    model.add_argument("--dp-bytes", type=positive_float, metavar="BYTES", help="dtfm: override c_DP, bytes of one stage's gradients")
    model.add_argument("--pp-bytes", type=positive_float,
                       metavar="BYTES", help="dtfm: override c_PP, bytes of one lane's activations per step")
    model.add_argument("--efficiency", metavar="TERMS", type=_efficiency,
                       help="what training gets of the file's figures, e.g. compute=0.6,link=0.93,window_mb=4: achieved over "
                            "announced TFLOPS, one TCP stream's share of a link, the bytes a stream keeps in flight (it gets "
                            "at most that per round trip); default: the figures as they are (docs/planner.md, fitted on the testbed)")
    model.add_argument("--current", type=Path,
                       metavar="PLAN.json", help="the plan running now (JSON); the time model then counts the cost of moving weights")
    search = plan.add_argument_group("search")
    search.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="random seed (default 0)")
    search.add_argument("--time-budget", type=positive_float, default=2.0,
                        metavar="SECONDS", help="seconds to search (default 2)")
    search.add_argument("--workers", type=positive_int, default=default_workers(), metavar="N",
                        help=WORKERS_HELP)
    search.add_argument("--random-samples", type=positive_int, default=100,
                        metavar="N", help="random plans averaged for the baseline (default 100)")
    add_recipe_options(plan, outer=True)
    plan.add_argument("--json", action="store_true", help="print the plan as the protocol's Plan object")
    plan.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from hetpeer.coordinator.planner import PlanningError

    try:
        return _run_plan(args)
    except PlanningError as error:
        raise UserError(str(error)) from None


def _run_plan(args: argparse.Namespace) -> int:
    import numpy as np

    from hetpeer.coordinator.planner import PlannerConfig, Problem, make_model, solve
    from hetpeer.coordinator.planner.baselines import baseline_costs
    from hetpeer.coordinator.planner.render import format_plan
    from hetpeer.protocol.topology import Topology

    if args.cost_model != "dtfm" and (args.dp_bytes or args.pp_bytes):
        raise UserError("--dp-bytes and --pp-bytes apply to --cost-model dtfm only")
    if args.cost_model == "dtfm":
        if args.compress not in (("auto", "auto"), ("raw", "raw")):
            raise UserError("--compress applies to --cost-model time only (dtfm counts the paper's bytes)")
        args.compress = ("raw", "raw")
        if args.outer_every or args.sync == "outer":
            raise UserError("--outer-every N and --sync outer apply to --cost-model time only (dtfm counts every-step all-reduce)")
        args.outer_every = None
    recipe = recipe_from(args)
    raw = scenarios.load(args.scenario) if args.scenario else read_json(args.topology, "topology file")
    topology = Topology.from_wire(raw)
    try:
        workload = Workload(model_spec(args, args.layers), batch=args.batch, micro_batch=args.micro_batch, dtype=args.dtype)
    except ValueError as error:
        raise UserError(str(error)) from None
    current = Plan.from_wire(read_json(args.current, "plan file")) if args.current else None
    problem = Problem.from_topology(topology, workload, dp_bytes=args.dp_bytes, pp_bytes=args.pp_bytes, current=current)
    if args.efficiency is not None:
        problem = args.efficiency.apply(problem)
    config = PlannerConfig(
        cost_model=args.cost_model,
        stages=args.stages,
        group_size=args.group_size,
        allow_standby=not args.no_standby,
        prune=not args.no_prune,
        sync=args.sync,
        recompute=args.recompute,
        compress=args.compress,
        outer_every=args.outer_every,
        robust=recipe.robust > 0,
        time_budget_s=args.time_budget,
        workers=args.workers,
    )

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  searched {line}", file=sys.stderr)

    name = args.scenario or str(args.topology)
    if not args.quiet:
        print(
            f"planning {name}: {problem.n} devices, {workload.model.name} with {workload.model.layers} layers, "
            f"batch {workload.batch}, {args.cost_model} cost model, up to {args.time_budget:g} s"
            f"{f' on {args.workers} workers' if args.workers > 1 else ''}",
            file=sys.stderr,
        )
    started = time.perf_counter()
    solution = solve(problem, config, np.random.default_rng(args.seed), progress=progress)
    if not args.quiet:
        print(f"  done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    plan = replace(solution.plan, recipe=recipe)
    if args.json:
        print(json.dumps(plan.to_wire(), indent=1))
        return 0
    model = make_model(problem, config, solution.shape)
    baselines = baseline_costs(problem, model, args.random_samples, np.random.default_rng(args.seed))
    print(format_plan(plan, baselines, args.random_samples))
    return 0
