"""The `hetpeer` command. Thin: parses arguments, calls into the packages, turns user errors into
one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from hetpeer import __version__, logline, scenarios
from hetpeer.peer.gossip.topology import TOPOLOGIES
from hetpeer.protocol.addresses import LINK_CHOICES
from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.plan import COST_MODELS, RECOMPUTE_CHOICES, SYNC_CHOICES, Plan
from hetpeer.protocol.wire import SchemaError
from hetpeer.protocol.workload import DTYPE_BYTES, PRESETS, ModelSpec, Workload, load_model

# What runs a command is imported when it runs: `hetpeer --version` and `hetpeer plan` never load torch or
# hivemind (the planner is pure), and building the parser loads nothing heavier than numpy.

EXIT_USAGE = 2
DEFAULT_STEPS = 20


class UserError(Exception):
    """Bad input from the person at the keyboard: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _efficiency(text: str):
    from hetpeer.coordinator.planner.efficiency import Efficiency

    try:
        return Efficiency.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
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
    parser = _Parser(prog="hetpeer", description="Train foundation models on volunteer GPUs over slow, uneven links.")
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
    add_model_options(work, default="gpt3-xl")
    work.add_argument("--layers", type=_positive_int, metavar="N", help="number of transformer layers (default: the model's)")
    work.add_argument("--batch", type=_positive_int, default=512, metavar="N", help="global batch in sequences (default 512)")
    work.add_argument("--micro-batch", type=_positive_int, default=1, metavar="N", help="micro-batch in sequences (default 1)")
    work.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="training dtype (default bf16)")
    model = plan.add_argument_group("cost model")
    model.add_argument("--cost-model", choices=COST_MODELS, default="time",
                       help="time: predicted seconds per step (default); dtfm: the paper's communication cost")
    model.add_argument("--stages", type=_positive_int, metavar="S", help="fix the number of pipeline stages")
    model.add_argument("--group-size", type=_positive_int, metavar="M", help="fix the data-parallel group size (lanes)")
    model.add_argument("--no-standby", action="store_true",
                       help="use every device (time model; dtfm always does)")
    model.add_argument("--no-prune", action="store_true",
                       help="search over every device, even those too small for a layer or too slow to matter "
                            "(by default they are left out first, with the reason in the plan)")
    model.add_argument("--sync", choices=SYNC_CHOICES, default="auto",
                       help="how groups average weights (time model; default auto: per group)")
    model.add_argument("--recompute", choices=RECOMPUTE_CHOICES, default="auto",
                       help="activation recomputation (time model): auto (default: a stage recomputes the fewest layers that "
                       "make it fit its devices' memory, each at the cost of one more forward pass), never, or always "
                       "(every layer)")
    model.add_argument("--dp-bytes", type=_positive_float, metavar="BYTES", help="dtfm: override c_DP, bytes of one stage's gradients")
    model.add_argument("--pp-bytes", type=_positive_float,
                       metavar="BYTES", help="dtfm: override c_PP, bytes of one lane's activations per step")
    model.add_argument("--efficiency", metavar="TERMS", type=_efficiency,
                       help="what training gets of the file's figures, e.g. compute=0.6,link=0.93,window_mb=4: achieved over "
                            "announced TFLOPS, one TCP stream's share of a link, the bytes a stream keeps in flight (it gets "
                            "at most that per round trip); default: the figures as they are (docs/planner.md, fitted on the testbed)")
    model.add_argument("--current", type=Path,
                       metavar="PLAN.json", help="the plan running now (JSON); the time model then counts the cost of moving weights")
    search = plan.add_argument_group("search")
    search.add_argument("--seed", type=_non_negative_int, default=0, metavar="N", help="random seed (default 0)")
    search.add_argument("--time-budget", type=_positive_float, default=2.0,
                        metavar="SECONDS", help="seconds to search (default 2)")
    search.add_argument("--random-samples", type=_positive_int, default=100,
                        metavar="N", help="random plans averaged for the baseline (default 100)")
    add_eval_options(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as the protocol's Plan object")
    plan.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    plan.set_defaults(run=run_plan)

    join = commands.add_parser(
        "join",
        help="join a swarm as a peer (or run one peer of a fixed plan)",
        description="Join a swarm (--swarm): reach it through --initial-peers, measure this machine and the links "
        "to a few peers, announce them, and train the stage the coordinator's plans give this peer, following "
        "new plans, until Ctrl+C (or --steps). Without --swarm, run one peer of a fixed plan (--plan, --as, "
        "--peers) for --steps steps: the address book (written by `hetpeer launch`, or by hand for a fixed "
        "set of machines) says where every peer of the plan can be reached.",
    )
    from hetpeer.cli_swarm import add_join_swarm_options

    add_join_swarm_options(join)
    static = join.add_argument_group("a fixed plan (without --swarm)")
    static.add_argument("--plan", type=Path, metavar="PLAN.json", help="the plan to run (from `hetpeer plan --json`)")
    static.add_argument("--as", dest="device_id", metavar="DEVICE", help="this peer's device id in the plan")
    static.add_argument("--peers", type=Path, metavar="ADDRESSES.json", help="the address book (see docs/pipeline.md)")
    static.add_argument("--identity", metavar="KEY", help="this peer's P2P private key file (needed when the book gives it a P2P address)")
    static.add_argument("--rejoin", action="store_true",
                        help="first download the stage's parameters and optimizer state from the rest of its group, "
                        "and enter at the group's step")
    static.add_argument("--resume", type=Path, metavar="DIR",
                        help="start from this peer's checkpoint DIR/DEVICE.safetensors (weights, Adam moments and step)")
    join.add_argument("--listen", metavar="HOST:PORT",
                      help="where to accept direct connections (default: this peer's address in the book; "
                      "with --swarm: 127.0.0.1 on a free port)")
    _add_link_option(join)
    _add_run_options(join)
    join.set_defaults(run=run_join)

    launch = commands.add_parser(
        "launch",
        help="run every peer of a plan on this machine",
        description="Start every peer of a plan on this machine as separate `hetpeer join` processes, with ports "
        "and P2P keys of their own, show their output, and stop them all when one fails or on Ctrl+C.",
    )
    launch.add_argument("plan", type=Path, nargs="?", metavar="PLAN.json",
                        help="the plan to run (from `hetpeer plan --json`); without one, a demo: the tiny model "
                        "on --local-peers equal peers, 2 stages deep")
    launch.add_argument("--local-peers", type=_positive_int, default=4, metavar="N",
                        help="peers of the demo plan when no PLAN.json is given (default 4)")
    launch.add_argument("--out", type=Path, metavar="DIR", help="folder for the address book, keys and logs (default: a new temporary folder)")
    launch.add_argument("--model", metavar="PATH", help="the model folder of a plan made with `hetpeer plan --model PATH` "
                        "(its config.json, and safetensors the peers load their stages from)")
    launch.add_argument("--seq-len", type=_positive_int, metavar="N", help="the sequence length that plan was made with, if not the model's context")
    _add_link_option(launch)
    _add_run_options(launch)
    launch.set_defaults(run=run_launch)

    export = commands.add_parser(
        "export",
        help="join stage checkpoints into one model folder",
        description="Join the stage checkpoints a run wrote (`--save DIR`: DIR/DEVICE.safetensors) into one model "
        "folder: config.json and model.safetensors, each part of the model from the checkpoint holding it at the "
        "highest step. A GPT-2 or Llama model loads with transformers' from_pretrained; hetpeer's GPT with --model.",
    )
    export.add_argument("checkpoints", type=Path, nargs="+", metavar="CHECKPOINT",
                        help="stage checkpoints (.safetensors), or folders of them")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="the model folder to write")
    export.set_defaults(run=run_export)

    from hetpeer.cli_swarm import add_commands
    from hetpeer.cli_testbed import add_command

    add_commands(commands)
    add_command(commands)
    return parser


def add_model_options(parser, default: str | None, default_text: str | None = None) -> None:
    """--model (a preset or a model folder) and --seq-len, for every command that names the model."""
    parser.add_argument("--model", default=default, metavar="NAME|PATH",
                        help=f"a preset ({', '.join(PRESETS)}) or a model folder with a GPT-2 or Llama config.json "
                        "(and safetensors: peers load their stage's weights from it)"
                        f" ({default_text or f'default {default}'})")
    parser.add_argument("--seq-len", type=_positive_int, metavar="N",
                        help="tokens per training sequence, for a model folder (default: the model's context)")


def add_eval_options(parser) -> None:
    """--eval-every and --eval-batch: the validation the plans ask every lane for."""
    parser.add_argument("--eval-every", type=_non_negative_int, default=0, metavar="N",
                        help="every lane measures its loss on held-out data at every N-th step (default 0: never)")
    parser.add_argument("--eval-batch", type=_positive_int, default=8, metavar="N",
                        help="held-out sequences per lane for it (default 8)")


def model_spec(args: argparse.Namespace, layers: int | None = None) -> ModelSpec:
    """The model `--model` and `--seq-len` name; a bad one is a user error naming it."""
    try:
        return load_model(args.model, layers, args.seq_len)
    except ValueError as error:
        raise UserError(str(error)) from None


def _add_link_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", choices=LINK_CHOICES, default="auto",
                        help="how peers reach each other: auto (direct TCP, falling back to hivemind P2P; default), tcp or p2p")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=_positive_int, metavar="N",
                     help="optimizer steps to run (default 20; with --swarm: until Ctrl+C, else leave at step N)")
    run.add_argument("--data", type=Path, metavar="PATH",
                     help="what to train on: a folder or file of text, .jsonl (a \"text\" string a line) or .parquet (a \"text\" "
                     "column) files (default: the Python standard library's sources)")
    run.add_argument("--tokenizer", type=Path, metavar="PATH",
                     help="a tokenizer.json (tokenizers) to turn text into tokens (default: the --model folder's "
                     "tokenizer.json if it has one, else bytes)")
    run.add_argument("--device", default="auto", metavar="DEVICE",
                     help="what to train on: auto (a CUDA GPU when there is one, else the CPU; the default), cpu, cuda or "
                     "cuda:N; the peer says what it took and why")
    run.add_argument("--recompute", action="store_true",
                     help="recompute every layer's activations in the backward pass (far less memory for a third more "
                     "compute), whatever the plan says; plans ask for it per stage where a device needs it")
    run.add_argument("--lr", type=_positive_float, default=3e-4, metavar="LR", help="AdamW learning rate (default 3e-4)")
    run.add_argument("--seed", type=_non_negative_int, default=0, metavar="N", help="seed of the initial weights and the data order (default 0)")
    run.add_argument("--timeout", type=_positive_float, default=60.0, metavar="SECONDS",
                     help="deadline for every tensor a peer waits for (default 60)")
    run.add_argument("--compress", choices=CODECS, default="raw",
                     help="how activations and gradients travel: raw (default), fp16, bf16 or int8")
    run.add_argument("--threads", type=_positive_int, metavar="N", help="torch threads per peer (default: torch's)")
    run.add_argument("--save", type=Path, metavar="DIR",
                     help="write each peer's stage checkpoint (weights, Adam moments, step, plan epoch) to DIR/DEVICE.safetensors "
                     "at the end (a swarm peer: when it leaves) and every --save-every steps, atomically; a swarm peer "
                     "started again offers it, and loads it when no live peer holds its layers; `hetpeer export` joins "
                     "them into one model")
    run.add_argument("--save-every", type=_positive_int, metavar="N", help="steps between checkpoints (default: only at the end)")
    run.add_argument("--bandwidth-cap", type=_positive_float, metavar="MBIT",
                     help="emulate slow links: each peer sends at most MBIT Mbit/s to each other peer")
    run.add_argument("--emulate-latency", type=_latency_map, default={}, metavar="HOST=MS,...",
                     help="emulate far links: hold each frame to HOST (or HOST:PORT; * for any other) back MS milliseconds "
                     "before it leaves (one way; the DHT's own traffic is not delayed)")
    group = parser.add_argument_group("averaging within groups (gossip mode)")
    group.add_argument("--topology", choices=TOPOLOGIES, default="one-peer-exp",
                       help="who mixes with whom each step (default one-peer-exp)")
    group.add_argument("--accumulate", type=_positive_int, default=1, metavar="A",
                       help="AccumAdam: update the Adam moments every A steps from the mean gradient (default 1: Adam)")
    group.add_argument("--mix-deadline", type=_positive_float, default=10.0, metavar="SECONDS",
                       help="how long to wait for a neighbour's parameters before leaving it out of the step (default 10)")
    group.add_argument("--sync-compress", choices=CODECS, default="raw",
                       help="how parameters travel: raw (default), fp16, bf16 or int8")
    group.add_argument("--robust", type=_positive_float, metavar="CLIP",
                       help="robust mixing: clip each neighbour's difference at CLIP x the typical distance, and leave "
                       "out (and report to the coordinator) a neighbour far past that round after round (2 is a start)")
    group.add_argument("--no-overlap", action="store_true",
                       help="send parameters after the gradient instead of during it (to measure what overlap hides)")


def _run_options(args: argparse.Namespace) -> list[str]:
    """The training options of `hetpeer launch`, passed on to each `hetpeer join`."""
    passed = ["--steps", str(args.steps or DEFAULT_STEPS), "--device", args.device, "--lr", repr(args.lr), "--seed", str(args.seed),
              "--timeout", repr(args.timeout), "--compress", args.compress, "--topology", args.topology,
              "--accumulate", str(args.accumulate), "--mix-deadline", repr(args.mix_deadline),
              "--sync-compress", args.sync_compress]
    if args.data is not None:
        passed += ["--data", str(args.data.resolve())]
    if args.tokenizer is not None:
        passed += ["--tokenizer", str(args.tokenizer.resolve())]
    if args.model is not None:
        model = args.model if args.model in PRESETS else str(Path(args.model).resolve())  # the peers' own working folder
        passed += ["--model", model] + (["--seq-len", str(args.seq_len)] if args.seq_len else [])
    if args.robust is not None:
        passed += ["--robust", repr(args.robust)]
    if args.save is not None:
        passed += ["--save", str(args.save.resolve())] + (["--save-every", str(args.save_every)] if args.save_every else [])
    if args.bandwidth_cap is not None:
        passed += ["--bandwidth-cap", repr(args.bandwidth_cap)]
    if args.emulate_latency:
        passed += ["--emulate-latency", ",".join(f"{host}={s * 1e3:g}" for host, s in args.emulate_latency.items())]
    if args.no_overlap:
        passed.append("--no-overlap")
    if args.recompute:
        passed.append("--recompute")
    return passed


def _worker_config(args: argparse.Namespace, model: ModelSpec | None = None):
    """The worker's settings; `model` is the model `--model` gave this peer (a folder's weights are read from it)."""
    from hetpeer.peer.gossip.adam import AdamConfig
    from hetpeer.peer.gossip.group import SyncConfig
    from hetpeer.peer.pipeline.worker import WorkerConfig

    folder = model is not None and args.model not in PRESETS  # a path: the model's weights may be there too
    return WorkerConfig(
        model=model,
        weights=str(args.model) if folder else None,
        device=args.device,
        seed=args.seed,
        adam=AdamConfig(lr=args.lr, accumulate=args.accumulate),
        sync=SyncConfig(
            topology=args.topology, deadline_s=args.mix_deadline, codec=args.sync_compress, clip=args.robust,
            overlap=not args.no_overlap, allreduce_timeout_s=args.timeout,
        ),
        timeout_s=args.timeout,
        codec=args.compress,
        recompute=args.recompute,
    )


def take_device(args: argparse.Namespace, dtype: str) -> None:
    """Resolve `--device` (auto: a CUDA GPU when there is one) for training in `dtype`, and say what and why."""
    from hetpeer.peer.device import choose_device

    choice = choose_device(args.device, dtype)
    _say(f"device: {choice}")
    args.device = choice.device


def tokenizer_path(args: argparse.Namespace, spec: ModelSpec) -> str | None:
    """`--tokenizer`, or the model folder's tokenizer.json; checked against the model's vocabulary now, before
    a peer starts, so that a mismatch is one line rather than a peer that fails at its first batch."""
    from hetpeer.peer.data.corpus import CorpusError, load_tokenizer

    path = args.tokenizer
    if path is None and args.model is not None and args.model not in PRESETS and (Path(args.model) / "tokenizer.json").is_file():
        path = Path(args.model) / "tokenizer.json"
    if path is None:
        if spec.vocab < 256:
            raise UserError(f"model {spec.name} has a vocabulary of {spec.vocab}, too small for bytes: give --tokenizer")
        return None
    try:
        size = load_tokenizer(path).get_vocab_size()
    except CorpusError as error:
        raise UserError(str(error)) from None
    if size > spec.vocab:
        raise UserError(f"tokenizer {path} has {size} tokens, more than the vocabulary of model {spec.name} ({spec.vocab})")
    return str(path)


def _latency_map(text: str) -> dict[str, float]:
    """`HOST=MS,HOST:PORT=MS,*=MS` -> one-way seconds by host."""
    found = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        host, sep, ms = part.rpartition("=")
        try:
            seconds = float(ms) / 1e3
        except ValueError:
            seconds = float("nan")
        if not sep or not host or not 0 <= seconds <= 10:
            raise argparse.ArgumentTypeError(f"expected HOST=MS with MS from 0 to 10000, got {part!r}")
        found[host] = seconds
    return found


def emulation(args: argparse.Namespace):
    """The links `--bandwidth-cap` and `--emulate-latency` ask a peer to emulate."""
    from hetpeer.peer.transport.network import Emulation

    rate = args.bandwidth_cap * 1e6 / 8 if args.bandwidth_cap is not None else None
    return Emulation(rate_bytes_per_s=rate, latency_s=args.emulate_latency)


def stop_on_sigterm() -> None:
    """SIGTERM (docker stop, the launcher) leaves the way Ctrl+C does: announcing it. Processes forked
    later (hivemind's DHT node, which its owner stops with SIGTERM) inherit the handler: they just exit."""
    main = os.getpid()

    def stop(signum, frame):
        if os.getpid() != main:
            os._exit(0)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def _load_plan(path: Path) -> Plan:
    return Plan.from_wire(_read_json(path, "plan file"))


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{what} {path} is not valid JSON: {error}") from None


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
    raw = scenarios.load(args.scenario) if args.scenario else _read_json(args.topology, "topology file")
    topology = Topology.from_wire(raw)
    try:
        workload = Workload(model_spec(args, args.layers), batch=args.batch, micro_batch=args.micro_batch, dtype=args.dtype)
    except ValueError as error:
        raise UserError(str(error)) from None
    current = Plan.from_wire(_read_json(args.current, "plan file")) if args.current else None
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
        plan = replace(solution.plan, eval_every=args.eval_every, eval_batch=args.eval_batch if args.eval_every else 0)
        print(json.dumps(plan.to_wire(), indent=1))
        return 0
    model = make_model(problem, config, solution.shape)
    baselines = baseline_costs(problem, model, args.random_samples, np.random.default_rng(args.seed))
    print(format_plan(solution.plan, baselines, args.random_samples))
    return 0


def run_join(args: argparse.Namespace) -> int:
    from hetpeer.peer import node
    from hetpeer.peer.checkpoint import CheckpointError
    from hetpeer.peer.data.corpus import CorpusError
    from hetpeer.peer.transport import TransportError
    from hetpeer.protocol.addresses import AddressBook

    if args.swarm is not None or args.join_file is not None:
        from hetpeer.cli_swarm import run_swarm_join

        return run_swarm_join(args)
    missing = [flag for flag, value in (("--plan", args.plan), ("--as", args.device_id), ("--peers", args.peers)) if value is None]
    if missing:
        raise UserError(f"give --swarm NAME to join a swarm, or {', '.join(missing)} to run a peer of a fixed plan")
    log_to_stdout()
    try:
        plan = _load_plan(args.plan)
        take_device(args, plan.dtype)
        given = model_spec(args) if args.model is not None else None
        tokenizer = tokenizer_path(args, node.model_for(plan, given))
        setup = node.PeerSetup(
            device_id=args.device_id,
            plan=plan,
            book=AddressBook.load(args.peers),
            worker=_worker_config(args, given),
            steps=args.steps or DEFAULT_STEPS,
            links=args.link,
            listen=_host_port(args.listen) if args.listen else None,
            identity_path=args.identity,
            data=str(args.data) if args.data else None,
            tokenizer=tokenizer,
            threads=args.threads,
            rejoin=args.rejoin,
            save=args.save,
            save_every=args.save_every,
            resume=args.resume,
            emulation=emulation(args),
        )
        node.run(setup, _say)
    except (node.PeerSetupError, CorpusError, CheckpointError) as error:
        raise UserError(str(error)) from None
    except ValueError as error:  # the worker refuses a plan it cannot run (dtype, device)
        raise UserError(str(error)) from None
    except TransportError as error:
        print(f"hetpeer join: stopped: {error}", file=sys.stderr)
        return 1
    return 0


def run_export(args: argparse.Namespace) -> int:
    from hetpeer.peer.checkpoint import CheckpointError, export

    paths = []
    for given in args.checkpoints:
        found = sorted(given.glob("*.safetensors")) if given.is_dir() else [given]
        if not found:
            raise UserError(f"{given} holds no .safetensors checkpoints")
        paths += found
    try:
        done = export(paths, args.out)
    except CheckpointError as error:
        raise UserError(str(error)) from None
    print(f"exported {done['model']}: {done['tensors']} tensors from {len(set(done['parts'].values()))} checkpoint(s) "
          f"(steps {', '.join(map(str, done['steps']))}) to {args.out}")
    return 0


def log_to_stdout() -> None:
    """Log records to stdout, stamped like the lines `_say` prints (`hetpeer.logline`)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logline.Formatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("hivemind").setLevel(logging.WARNING)


def _say(line: str) -> None:
    # one write per line: the transport's log lines share stdout and must not land inside it
    sys.stdout.write(logline.stamp(line) + "\n")
    sys.stdout.flush()


def run_launch(args: argparse.Namespace) -> int:
    from hetpeer.peer.launch import launch

    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.plan is None:
        plan = demo_plan(args.local_peers)
        path = out / "plan.json"
        path.write_text(json.dumps(plan.to_wire(), indent=1))
        print(f"demo: the tiny model on {args.local_peers} local peers, {len(plan.stages)} stage(s) x "
              f"{plan.group_size} lane(s), plan in {path}", flush=True)
    else:
        plan, path = _load_plan(args.plan), args.plan.resolve()
    if args.model is not None or plan.model not in PRESETS:  # the peers would each refuse it: say so once, here
        if args.model is None:
            raise UserError(f"plan {args.plan} trains model {plan.model} from a model folder: give --model with that folder")
        given = model_spec(args, plan.layers)
        if given.name != plan.model:
            raise UserError(f"plan {args.plan} trains model {plan.model}; --model {args.model} is {given.name} (another "
                            "config, sequence length or depth)")
    return launch(path, plan, out, args.steps or DEFAULT_STEPS, args.link, _run_options(args), lambda line: print(line, flush=True))


def demo_plan(peers: int) -> Plan:
    """The tiny model over `peers` equal local peers: two stages (one if alone), as many lanes as fit."""
    import numpy as np

    from hetpeer.coordinator.planner import PlannerConfig, Problem, solve
    from hetpeer.protocol.topology import Topology

    stages = min(2, peers)
    devices = [{"id": f"peer{i}", "region": "local", "tflops": 0.05} for i in range(peers)]
    topology = Topology.from_wire(
        {"name": "demo", "regions": {"local": {"latency_ms": 0.1, "bandwidth_gbps": 10}}, "devices": devices}
    )
    workload = Workload(PRESETS["tiny"], batch=16, micro_batch=2, dtype="fp32")
    config = PlannerConfig(cost_model="time", stages=stages, group_size=peers // stages, time_budget_s=1.0)
    return solve(Problem.from_topology(topology, workload), config, np.random.default_rng(0)).plan


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"--listen must be HOST:PORT, got {text!r}")
    return host or "0.0.0.0", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UserError, SchemaError) as error:
        print(f"hetpeer {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hetpeer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
