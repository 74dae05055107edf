"""What the `hetpeer` commands share, below every command module: the argument types, the options several
commands take (and how `launch` passes the training options on to `join`), `UserError`, and small helpers
(reading JSON, SIGTERM, log lines). Imports nothing else of `hetpeer.cli`, and nothing heavier than the
protocol's constants: building the parser must stay cheap."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from hetpeer import logline
from hetpeer.protocol.addresses import LINK_CHOICES
from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.modelspec import PRESETS, ModelSpec, load_model
from hetpeer.protocol.plan import MAX_OUTER_EVERY
from hetpeer.protocol.recipe import FIELDS, OUTER_AFTER, Recipe, load as load_recipe
from hetpeer.protocol.wire import SchemaError

DEFAULT_STEPS = 20
SWARM_DTYPES = ("fp32", "bf16")  # what the stage worker computes in


class UserError(Exception):
    """Bad input from the person at the keyboard: reported in one line, exit code 2."""


def _number(text: str, within: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not within(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _number(text, lambda value: 0 < value < float("inf"), "a positive number")


def non_negative_float(text: str) -> float:
    return _number(text, lambda value: 0 <= value < float("inf"), "a non-negative number")


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def codec_pair(text: str) -> tuple[str, str]:
    """CODEC (both directions) or FORWARD/BACKWARD: how activations and their gradients travel."""
    names = text.split("/")
    if len(names) > 2 or any(name not in CODECS for name in names):
        raise argparse.ArgumentTypeError(f"must be a codec or FORWARD/BACKWARD, each one of {', '.join(CODECS)}; got {text!r}")
    return names[0], names[-1]


def compress_choice(text: str) -> tuple[str, str]:
    """`codec_pair`, or auto: the planner chooses each hop's pair."""
    return ("auto", "auto") if text == "auto" else codec_pair(text)


def compress_text(pair: tuple[str, str]) -> str:
    """A `compress_choice` as an option's value again (for another process's command line)."""
    return pair[0] if pair[0] == pair[1] else "/".join(pair)


def outer_every_choice(text: str) -> int | None:
    """Steps between outer steps, auto (0: the planner chooses per group) or never (None: outer steps forbidden)."""
    if text in ("auto", "never"):
        return 0 if text == "auto" else None
    try:
        every = int(text)
    except ValueError:
        every = -1
    if not 1 <= every <= MAX_OUTER_EVERY:
        raise argparse.ArgumentTypeError(f"must be auto, never or a whole number of steps from 1 to {MAX_OUTER_EVERY}, "
                                         f"got {text!r}")
    return every


def outer_every_text(every: int | None) -> str:
    return "never" if every is None else "auto" if every == 0 else str(every)


OUTER_HELP = ("where groups may sync every N steps with an outer step (DiLoCo) instead of every step: auto (default: "
              "the planner weighs them by time to loss, with H per group from its link, 10 to 50), N (every N steps), or "
              "never (docs/gossip.md, Outer steps)")


# each worker is a process with its own copy of the swarm's matrices: 170 MB at 1,024 devices, growing with their square
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """The planner's default worker count: the cores this process may run on, at most `MAX_DEFAULT_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_DEFAULT_WORKERS)


WORKERS_HELP = (f"planner searches at once, one process each beyond the first, exchanging their best plans (default: "
                f"the cores this process may use, at most {MAX_DEFAULT_WORKERS}: {default_workers()} here; each a process "
                "of 170 MB at 1,024 devices); the plan is the same for a seed and a worker "
                "count wherever the search finishes within its budget")

COMPRESS_HELP = ("how activations travel between stages and their gradients back: auto (default: per hop, the pair that "
                 "makes it shortest among those whose measured loss effect is within budget, weighing the steps a pair "
                 "costs in time to loss), one codec for both, or "
                 f"FORWARD/BACKWARD, e.g. int4/int8; each one of {', '.join(CODECS)} (docs/compression.md)")


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


def add_model_options(parser, default: str | None, default_text: str | None = None,
                      seq_len_text: str = "the model's context") -> None:
    """--model (a preset or a model folder) and --seq-len, for every command that names the model."""
    parser.add_argument("--model", default=default, metavar="NAME|PATH",
                        help=f"a preset ({', '.join(PRESETS)}) or a model folder with a GPT-2 or Llama config.json "
                        "(and safetensors: peers load their stage's weights from it)"
                        f" ({default_text or f'default {default}'})")
    parser.add_argument("--seq-len", type=positive_int, metavar="N",
                        help=f"tokens per training sequence, for a model folder (default: {seq_len_text})")


def add_recipe_options(parser, outer: bool = False, base: Recipe = Recipe()) -> None:
    """--recipe, --set and their shorthands: the training recipe every peer of the plans trains by (the organizer's:
    `hetpeer coordinator`, or `hetpeer plan` and `launch` for a fixed plan); `base` is what `recipe_from` starts
    from, for the defaults the help names."""
    recipe = parser.add_argument_group("the training recipe (every peer trains by it: docs/swarm.md, The recipe)")
    recipe.add_argument("--recipe", type=Path, metavar="FILE",
                        help="the recipe as a JSON or TOML file: optimizer, schedule, averaging, seed, validation; fields "
                        "left out keep their defaults (`hetpeer coordinator --print-recipe` writes them all)")
    recipe.add_argument("--set", dest="recipe_settings", action="append", default=[], metavar="NAME=VALUE",
                        help=f"set one field of the recipe, after --recipe (repeatable; e.g. --set lr=1e-3 --set "
                        f"betas=0.9,0.95): {', '.join(FIELDS)}")
    recipe.add_argument("--eval-every", type=non_negative_int, metavar="N",
                        help="the recipe's eval_every: every lane measures its loss on held-out data at every N-th step "
                        f"(default {base.eval_every or '0: never'})")
    recipe.add_argument("--eval-batch", type=positive_int, metavar="N",
                        help=f"the recipe's eval_batch: held-out sequences per lane for it (default {base.eval_batch})")
    if outer:
        recipe.add_argument("--outer-warmup", type=non_negative_int, metavar="STEP",
                            help="the recipe's outer_after: groups with outer steps all-reduce every step until this step of "
                            f"the swarm (default {OUTER_AFTER}: a warm start, docs/gossip.md)")


def recipe_from(args: argparse.Namespace, base: Recipe | None = None) -> Recipe:
    """The recipe `add_recipe_options`' options make: `base` (the defaults when None), the --recipe file's fields,
    the shorthands, then each --set in order. A bad one is a user error naming the field."""
    try:
        recipe = load_recipe(args.recipe, base) if args.recipe is not None else base or Recipe()
        shorthands = {"eval_every": args.eval_every, "eval_batch": args.eval_batch,
                      "outer_after": getattr(args, "outer_warmup", None)}
        recipe = Recipe.from_wire({k: v for k, v in shorthands.items() if v is not None}, base=recipe)
        for setting in args.recipe_settings:
            recipe = recipe.with_setting(setting)
    except SchemaError as error:
        raise UserError(str(error)) from None
    return recipe


# the training options a peer took before the recipe was the organizer's: each names the recipe's field instead
ORGANIZER_FLAGS = {"--lr": "lr", "--warmup-steps": "warmup_steps", "--decay-steps": "decay_steps", "--seed": "seed",
                   "--topology": "topology", "--accumulate": "accumulate", "--mix-deadline": "mix_deadline_s",
                   "--sync-compress": "sync_codec", "--outer-lr": "outer_lr", "--outer-momentum": "outer_momentum",
                   "--robust": "robust"}


class _OrganizerFlag(argparse.Action):
    """Keeps a training option a peer no longer takes, for `refuse_organizer_flags` to name in one line."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.organizer_flags = [*namespace.organizer_flags, option_string]


def refuse_organizer_flags(args: argparse.Namespace, where: str) -> None:
    """A UserError naming the recipe field of the first training option given to a peer; `where` says who sets it."""
    if args.organizer_flags:
        flag = args.organizer_flags[0]
        raise UserError(f"{flag} is the organizer's, not a peer's: the plan's recipe sets {ORGANIZER_FLAGS[flag]} for every "
                        f"peer ({where} --set {ORGANIZER_FLAGS[flag]}=VALUE, or --recipe FILE)")


def add_link_option(parser: argparse.ArgumentParser) -> None:
    """--link, for `hetpeer join` and `hetpeer launch`."""
    parser.add_argument("--link", choices=LINK_CHOICES, default="auto",
                        help="how peers reach each other: auto (direct TCP, falling back to hivemind P2P; default), tcp or p2p")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """How a peer trains and averages, for `hetpeer join` and `hetpeer launch` (which passes them on to each
    `hetpeer join`: keep `run_options_argv` in step with this one)."""
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=positive_int, metavar="N",
                     help="optimizer steps to run (default 20; with --swarm: until Ctrl+C, else leave at step N)")
    run.add_argument("--data", type=Path, metavar="PATH",
                     help="what to train on: a folder prepared by hetpeer data prepare, or a folder or file of text, .jsonl "
                     "(a \"text\" string a line) or .parquet (a \"text\" column) files (default: the Python standard "
                     "library's sources); a plan that names a dataset takes it from here when it holds it, else downloads it")
    run.add_argument("--data-cache", type=Path, metavar="DIR",
                     help="where shards of the plan's dataset are downloaded to and large local text is prepared "
                     "(default: ~/.cache/hetpeer/data)")
    run.add_argument("--data-cache-gb", type=positive_float, default=20.0, metavar="GB",
                     help="downloaded shards kept at most, least recently used deleted first (default 20)")
    run.add_argument("--tokenizer", type=Path, metavar="PATH",
                     help="a tokenizer.json (tokenizers) to turn text into tokens (default: the --model folder's "
                     "tokenizer.json if it has one, else bytes)")
    run.add_argument("--device", default="auto", metavar="DEVICE",
                     help="what to train on: auto (a CUDA GPU when there is one, else the CPU; the default), cpu, cuda or "
                     "cuda:N; the peer says what it took and why")
    run.add_argument("--recompute", action="store_true",
                     help="recompute every layer's activations in the backward pass (far less memory for a third more "
                     "compute), whatever the plan says; plans ask for it per stage where a device needs it")
    run.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                     help="deadline for every tensor a peer waits for (default 60)")
    run.add_argument("--threads", type=positive_int, metavar="N", help="torch threads per peer (default: torch's)")
    run.add_argument("--save", type=Path, metavar="DIR",
                     help="write each peer's stage checkpoint (weights, Adam moments, step, plan epoch) to DIR/DEVICE.safetensors "
                     "at the end (a swarm peer: when it leaves) and every --save-every steps, atomically; a swarm peer "
                     "started again offers it, and loads it when no live peer holds its layers; `hetpeer export` joins "
                     "them into one model")
    run.add_argument("--save-every", type=positive_int, metavar="N", help="steps between checkpoints (default: only at the end)")
    run.add_argument("--bandwidth-cap", type=positive_float, metavar="MBIT",
                     help="emulate slow links: each peer sends at most MBIT Mbit/s to each other peer")
    run.add_argument("--emulate-latency", type=_latency_map, default={}, metavar="HOST=MS,...",
                     help="emulate far links: hold each frame to HOST (or HOST:PORT; * for any other) back MS milliseconds "
                     "before it leaves (one way; the DHT's own traffic is not delayed)")
    run.add_argument("--no-overlap", action="store_true",
                     help="send a gossip group's parameters after the gradient instead of during it (to measure what "
                     "overlap hides)")
    for flag in ORGANIZER_FLAGS:  # the recipe's now: given, they are refused in one line naming the recipe
        parser.add_argument(flag, action=_OrganizerFlag, help=argparse.SUPPRESS)
    parser.set_defaults(organizer_flags=[])


def data_cache(args: argparse.Namespace):
    """The `DataCache` of `--data-cache` and `--data-cache-gb`."""
    from hetpeer.peer.data.source import DataCache

    given = {"folder": args.data_cache} if args.data_cache is not None else {}
    return DataCache(max_bytes=int(args.data_cache_gb * 2**30), **given)


def run_options_argv(args: argparse.Namespace) -> list[str]:
    """The training options (`add_run_options`'s, and the model), as `hetpeer launch` passes them on to each
    `hetpeer join`."""
    passed = ["--steps", str(args.steps or DEFAULT_STEPS), "--device", args.device, "--timeout", repr(args.timeout)]
    if args.data is not None:
        passed += ["--data", str(args.data.resolve())]
    if args.data_cache is not None:
        passed += ["--data-cache", str(args.data_cache.resolve())]
    passed += ["--data-cache-gb", repr(args.data_cache_gb)]
    if args.tokenizer is not None:
        passed += ["--tokenizer", str(args.tokenizer.resolve())]
    if args.model is not None:
        model = args.model if args.model in PRESETS else str(Path(args.model).resolve())  # the peers' own working folder
        passed += ["--model", model] + (["--seq-len", str(args.seq_len)] if args.seq_len else [])
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


def model_spec(args: argparse.Namespace, layers: int | None = None) -> ModelSpec:
    """The model `--model` and `--seq-len` name; a bad one is a user error naming it."""
    try:
        return load_model(args.model, layers, args.seq_len)
    except ValueError as error:
        raise UserError(str(error)) from None


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{what} {path} is not valid JSON: {error}") from None


def home_dir(path: Path | None, default_name: str) -> Path:
    """`--home`, or ~/.hetpeer/`default_name`: where a peer or a coordinator keeps its key."""
    return path if path is not None else Path.home() / ".hetpeer" / default_name


def interrupted_flag() -> threading.Event:
    """Ctrl+C raises KeyboardInterrupt as ever, and also sets the returned flag: a loop that reads over the network
    checks it too, since an interrupt that lands inside an API call can come out of it as a failed call."""
    flag = threading.Event()

    def interrupt(signum, frame) -> None:
        flag.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    return flag


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


def log_to_stdout() -> None:
    """Log records to stdout, stamped like the lines `say` prints (`hetpeer.logline`)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logline.Formatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("hivemind").setLevel(logging.WARNING)


def say(line: str) -> None:
    """Print one stamped line to stdout."""
    # one write per line: the transport's log lines share stdout and must not land inside it
    sys.stdout.write(logline.stamp(line) + "\n")
    sys.stdout.flush()
