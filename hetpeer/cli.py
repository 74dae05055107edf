"""The `hetpeer` command. Thin: parses arguments, calls into the packages, turns user errors into
one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hetpeer import __version__, scenarios
from hetpeer.coordinator.planner import PlannerConfig, PlanningError, Problem, make_model, solve
from hetpeer.coordinator.planner.baselines import baseline_costs
from hetpeer.coordinator.planner.render import format_plan
from hetpeer.coordinator.planner.timemodel import SYNC_CHOICES
from hetpeer.protocol.plan import COST_MODELS, Plan
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.wire import SchemaError
from hetpeer.protocol.workload import DTYPE_BYTES, PRESETS, Workload, preset

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input from the person at the keyboard: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetpeer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hetpeer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    work.add_argument("--model", choices=sorted(PRESETS), default="gpt3-xl", help="model preset (default gpt3-xl)")
    work.add_argument("--layers", type=_positive_int, metavar="N", help="number of transformer layers (default: the preset's)")
    work.add_argument("--batch", type=_positive_int, default=512, metavar="N", help="global batch in sequences (default 512)")
    work.add_argument("--micro-batch", type=_positive_int, default=1, metavar="N", help="micro-batch in sequences (default 1)")
    work.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp16", help="training dtype (default fp16)")
    model = plan.add_argument_group("cost model")
    model.add_argument("--cost-model", choices=COST_MODELS, default="time",
                       help="time: predicted seconds per step (default); dtfm: the paper's communication cost")
    model.add_argument("--stages", type=_positive_int, metavar="S", help="fix the number of pipeline stages")
    model.add_argument("--group-size", type=_positive_int, metavar="M", help="fix the data-parallel group size (lanes)")
    model.add_argument("--no-standby", action="store_true",
                       help="use every device (time model; dtfm always does)")
    model.add_argument("--sync", choices=SYNC_CHOICES, default="auto",
                       help="how groups average weights (time model; default auto: per group)")
    model.add_argument("--dp-bytes", type=_positive_float, metavar="BYTES", help="dtfm: override c_DP, bytes of one stage's gradients")
    model.add_argument("--pp-bytes", type=_positive_float,
                       metavar="BYTES", help="dtfm: override c_PP, bytes of one lane's activations per step")
    model.add_argument("--current", type=Path,
                       metavar="PLAN.json", help="the plan running now (JSON); the time model then counts the cost of moving weights")
    search = plan.add_argument_group("search")
    search.add_argument("--seed", type=_non_negative_int, default=0, metavar="N", help="random seed (default 0)")
    search.add_argument("--time-budget", type=_positive_float, default=2.0,
                        metavar="SECONDS", help="seconds to search (default 2)")
    search.add_argument("--random-samples", type=_positive_int, default=100,
                        metavar="N", help="random plans averaged for the baseline (default 100)")
    plan.add_argument("--json", action="store_true", help="print the plan as the protocol's Plan object")
    plan.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    plan.set_defaults(run=run_plan)
    return parser


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{what} {path} is not valid JSON: {error}") from None


def run_plan(args: argparse.Namespace) -> int:
    if args.cost_model != "dtfm" and (args.dp_bytes or args.pp_bytes):
        raise UserError("--dp-bytes and --pp-bytes apply to --cost-model dtfm only")
    raw = scenarios.load(args.scenario) if args.scenario else _read_json(args.topology, "topology file")
    topology = Topology.from_wire(raw)
    try:
        workload = Workload(
            preset(args.model, args.layers), batch=args.batch, micro_batch=args.micro_batch, dtype=args.dtype
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    current = Plan.from_wire(_read_json(args.current, "plan file")) if args.current else None
    problem = Problem.from_topology(topology, workload, dp_bytes=args.dp_bytes, pp_bytes=args.pp_bytes, current=current)
    config = PlannerConfig(
        cost_model=args.cost_model,
        stages=args.stages,
        group_size=args.group_size,
        allow_standby=not args.no_standby,
        sync=args.sync,
        time_budget_s=args.time_budget,
    )

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"  searched {line}", file=sys.stderr)

    name = args.scenario or str(args.topology)
    if not args.quiet:
        print(
            f"planning {name}: {problem.n} devices, {workload.model.name} with {workload.model.layers} layers, "
            f"batch {workload.batch}, {args.cost_model} cost model, up to {args.time_budget:g} s",
            file=sys.stderr,
        )
    started = time.perf_counter()
    solution = solve(problem, config, np.random.default_rng(args.seed), progress=progress)
    if not args.quiet:
        print(f"  done in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(solution.plan.to_wire(), indent=1))
        return 0
    model = make_model(problem, config, solution.shape)
    baselines = baseline_costs(problem, model, args.random_samples, np.random.default_rng(args.seed))
    print(format_plan(solution.plan, baselines, args.random_samples))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UserError, SchemaError, PlanningError) as error:
        print(f"hetpeer {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hetpeer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
