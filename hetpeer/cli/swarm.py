"""The commands that run or watch a whole swarm: `hetpeer coordinator` (plans for the swarm's peers),
`hetpeer status` (what a coordinator's API says), `hetpeer invite` (join tokens) and `hetpeer swarm` (the demo:
a coordinator and peers on this machine, and a report). A swarm's peer is `hetpeer join --swarm` (`peer.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from hetpeer import logline
from hetpeer.protocol.plan import SYNC_CHOICES
from hetpeer.swarm import DEMO_RECIPE
from hetpeer.cli.common import (
    COMPRESS_HELP, OUTER_HELP, SWARM_DTYPES, WORKERS_HELP, UserError, default_workers, add_model_options, add_recipe_options, compress_choice, compress_text, home_dir, log_to_stdout, model_spec,
    interrupted_flag, non_negative_float, non_negative_int, outer_every_choice, outer_every_text, positive_float, positive_int, recipe_from, say, stop_on_sigterm,
)


def add_commands(commands) -> None:
    """Add `hetpeer coordinator`, `hetpeer status`, `hetpeer invite` and `hetpeer swarm` to the subcommands."""
    coordinator = commands.add_parser(
        "coordinator",
        help="run a swarm's coordinator",
        description="Read the peers' announcements from the swarm's DHT, plan with the `time` cost model, and "
        "publish signed plans: the first once --min-peers have settled, at once when a peer of the running plan "
        "disappears (the plan mended: the best peer outside it in its place, or its lane dropped; solved again "
        "when it cannot be mended), and otherwise every --replan-interval seconds if it predicts a step "
        "--gain faster (moving weights included). Serves the swarm's state over gRPC (--api) and, with --http, as a "
        "web dashboard with Prometheus metrics. Prints the key peers must trust and the DHT address they join through.",
    )
    coordinator.add_argument("--swarm", metavar="NAME", help="the swarm's name (needed but with --print-recipe)")
    coordinator.add_argument("--home", type=Path, metavar="DIR",
                             help="keeps the coordinator's key: a restart with the same DIR is the same coordinator "
                             "(default ~/.hetpeer/coordinator-NAME)")
    coordinator.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="DHT multiaddrs of peers already in the swarm")
    coordinator.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0", metavar="MADDR",
                             help="where the coordinator's DHT node listens (default /ip4/127.0.0.1/tcp/0)")
    coordinator.add_argument("--announce-maddr", nargs="+", default=[], metavar="MADDR",
                             help="DHT multiaddrs peers should dial, when they differ from --host-maddr (NAT, containers)")
    coordinator.add_argument("--api", default="127.0.0.1:0", metavar="HOST:PORT",
                             help="where to serve the read-only gRPC API (default 127.0.0.1 on a free port; 'off' for none)")
    coordinator.add_argument("--http", metavar="[HOST:]PORT",
                             help="serve the web dashboard (plan, charts, events, peers; JSON under /api/) and Prometheus "
                             "/metrics here (host default 127.0.0.1; port 0: a free one; default: no dashboard)")
    coordinator.add_argument("--data", type=Path, metavar="DIR",
                             help="a corpus prepared by hetpeer data prepare: plans name it, first-stage peers fetch the "
                             "shards they read next and the swarm reads it in one order without replacement (docs/data.md); "
                             "served under /data/ on --http unless --data-url says where it is")
    coordinator.add_argument("--data-url", metavar="URL",
                             help="where --data's folder is also served over HTTP(S) (its manifest.json at URL/manifest.json)")
    coordinator.add_argument("--tls-cert", type=Path, metavar="FILE",
                             help="serve the API (and the dashboard) over TLS with this PEM certificate (give --tls-key with it)")
    coordinator.add_argument("--tls-key", type=Path, metavar="FILE", help="the --tls-cert certificate's PEM private key, unencrypted")
    add_model_options(coordinator, default="tiny")
    coordinator.add_argument("--batch", type=positive_int, default=16, metavar="N", help="global batch in sequences (default 16)")
    coordinator.add_argument("--micro-batch", type=positive_int, default=2, metavar="N", help="micro-batch in sequences (default 2)")
    coordinator.add_argument("--dtype", choices=SWARM_DTYPES, default="fp32", help="training dtype (default fp32)")
    coordinator.add_argument("--heartbeat", type=positive_float, default=2.0, metavar="SECONDS",
                             help="seconds between rounds; use the peers' heartbeat (default 2)")
    coordinator.add_argument("--replan-interval", type=positive_float, default=300.0, metavar="SECONDS",
                             help="re-solve this often even when nothing broke (default 300; a plan a peer left is "
                                  "mended at once: docs/churn.md)")
    coordinator.add_argument("--min-peers", type=positive_int, default=2, metavar="N", help="peers to wait for before the first plan (default 2)")
    coordinator.add_argument("--gain", type=float, default=0.1, metavar="FRACTION",
                             help="a new plan must predict a step this much faster than the running one (default 0.1)")
    coordinator.add_argument("--time-budget", type=positive_float, default=2.0, metavar="SECONDS",
                             help="planner search time per solve (default 2); each solve goes on from the last one's search")
    coordinator.add_argument("--workers", type=positive_int, default=default_workers(), metavar="N", help=WORKERS_HELP)
    coordinator.add_argument("--stages", type=positive_int, metavar="S", help="fix the number of pipeline stages")
    coordinator.add_argument("--group-size", type=positive_int, metavar="M", help="fix the data-parallel group size")
    coordinator.add_argument("--compress", type=compress_choice, default=("auto", "auto"), metavar="auto|CODEC[/CODEC]",
                             help=COMPRESS_HELP)
    coordinator.add_argument("--sync", choices=SYNC_CHOICES, default="auto",
                             help="how groups average weights: auto (default: per group), allreduce, gossip, or outer "
                             "(every group takes outer steps, every --outer-every steps)")
    coordinator.add_argument("--outer-every", type=outer_every_choice, default=0, metavar="N|auto|never", help=OUTER_HELP)
    coordinator.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="planner seed (default 0)")
    coordinator.add_argument("--steps", type=positive_int, metavar="N",
                             help="the swarm's last step: once the running plan reaches it, publish no new plan "
                             "(peers leave there with their own --steps; default: train on)")
    add_recipe_options(coordinator, outer=True)
    coordinator.add_argument("--print-recipe", action="store_true",
                             help="print the recipe these options make (the defaults without any) as the JSON file --recipe "
                             "reads, and exit")
    coordinator.add_argument("--admission", nargs="+", default=["open"], metavar="MODE",
                             help="who may be planned: 'open' (every peer with a valid record; the default), "
                             "'allowlist FILE' (the device ids or key fingerprints FILE lists, one a line; read again when "
                             "it changes) or 'token' (peers that give a join token of this coordinator: `hetpeer invite`)")
    coordinator.add_argument("--ban-period", type=non_negative_float, default=300.0, metavar="SECONDS",
                             help="leave a peer that most of its group reports as misbehaving out of plans this long, "
                             "doubled on each repeat (default 300; 0: no bans)")
    coordinator.add_argument("--join-file", type=Path, metavar="PATH",
                             help="write what peers need to join (swarm, key digest, DHT address, model, dtype, reach "
                             "service) to PATH, for `hetpeer join --join-file PATH`")
    coordinator.add_argument("--reach-port", type=_reach_port, default=0, metavar="PORT",
                             help="port of the reach service on the DHT's host, which dials joining peers back to tell them "
                             "whether others can dial them (docs/nat.md; default: a free port; 'off' for none)")
    coordinator.set_defaults(run=run_coordinator)

    status = commands.add_parser(
        "status", help="show a swarm's plan, peers and progress, or its volunteers' credit",
        description="Ask a coordinator's gRPC API for the running plan, the peers with what they measured, and the "
        "swarm's progress, and show them as a table (--watch: redrawn until Ctrl+C) or JSON. With --credit: the "
        "leaderboard of the work each volunteer's neighbours confirm, and its teams'.",
    )
    status.add_argument("--api", required=True, metavar="HOST:PORT", help="the coordinator's API address (it prints it)")
    status.add_argument("--tls-ca", type=Path, metavar="FILE",
                        help="connect with TLS, trusting the PEM certificate(s) in FILE: the coordinator's own "
                        "(self-signed) certificate, or the CA that signed it")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--credit", action="store_true",
                        help="show the credit leaderboard instead: each volunteer's confirmed tokens, TFLOP, last hour's "
                        "tokens, hours training and online, suspects marked; and the teams'")
    # console.CREDIT_SORTS, spelled out: the console (rich) loads only when status runs
    status.add_argument("--sort", choices=("tokens", "flops", "last_hour_tokens", "training_s"), default="tokens",
                        help="rank the --credit leaderboard by this, most first (default tokens)")
    status.add_argument("--watch", type=positive_float, nargs="?", const=2.0, metavar="SECONDS",
                        help="redraw the table every SECONDS (default 2) until Ctrl+C; a coordinator that stops "
                        "answering is waited for")
    status.add_argument("--timeout", type=positive_float, default=5.0, metavar="SECONDS", help="give up after this long (default 5)")
    status.set_defaults(run=run_status)

    invite = commands.add_parser(
        "invite", help="mint a join token for a swarm whose coordinator runs with --admission token",
        description="Print a join token signed by the coordinator's key (kept in its --home). A peer joins with "
        "`hetpeer join --swarm ... --token TOKEN`; the coordinator plans it while the token has not expired. Anyone "
        "holding the token can use it: hand it out as you would a password, and bind it to a peer name with --name.",
    )
    invite.add_argument("--swarm", required=True, metavar="NAME", help="the swarm's name")
    invite.add_argument("--home", type=Path, metavar="DIR", help="the coordinator's --home (default ~/.hetpeer/coordinator-NAME)")
    invite.add_argument("--expires", default="7d", metavar="DURATION",
                        help="how long the token admits its holder: a number with s, m, h or d (default 7d)")
    invite.add_argument("--name", metavar="PEER", help="admit only a peer of this --name (default: any name)")
    invite.set_defaults(run=run_invite)

    swarm = commands.add_parser(
        "swarm", help="run a whole swarm on this machine (the demo)",
        description="Start a coordinator and --peers peers on this machine as separate processes, train the tiny "
        "GPT on the default corpus for --steps steps with live progress (open the coordinator's dashboard "
        "in a browser meanwhile), stop every process, and write a run report to --out: report.md, report.json, "
        "report.html (the dashboard's page, self-contained), dashboard.png (with Chromium) and loss.png (with "
        "matplotlib). Peers can be made unequal (--slowdowns, --bandwidth-caps), so the planner has something to solve.",
    )
    swarm.add_argument("--peers", type=positive_int, default=8, metavar="N", help="peers to start (default 8)")
    swarm.add_argument("--steps", type=positive_int, default=500, metavar="N", help="steps to train (default 500)")
    swarm.add_argument("--slowdowns", default="1,1,1,1,2,2,3,3", metavar="X,X,...",
                       help="compute slowdown of each peer, repeated to cover --peers (default 1,1,1,1,2,2,3,3), on top of "
                       "the emulation's")
    swarm.add_argument("--no-emulation", action="store_true",
                       help="let the peers share this machine's cores as they are; by default each is emulated as a device "
                       "of its own, its compute slowed by one more factor so that together they ask for at most a quarter "
                       "of the cores (the rest is left to the coordinator, the DHT and the peers' own threads), and (unless "
                       "--stages 1) with too little memory for the whole model")
    swarm.add_argument("--leave", type=leave_choice, default="auto", metavar="STEP,STEP|auto|none",
                       help="a peer of a group leaves at the first step and is started again at the second; auto (default): "
                       f"at {LEAVE_AT[0] * 100:g}%% and {LEAVE_AT[1] * 100:g}%% of --steps, where they are {LEAVE_MIN_STEPS} or more")
    swarm.add_argument("--bandwidth-caps", default="none,none,none,none,none,none,40,40", metavar="MBIT,...",
                       help="Mbit/s each peer sends at most to each other peer, 'none' for no cap, repeated to cover "
                       "--peers (default none x6, 40, 40)")
    swarm.add_argument("--latencies", default="5", metavar="MS,...",
                       help="one-way milliseconds each peer's frames to the other peers are held back before they leave "
                       "(emulated by the peers' transports: this machine's links take none), repeated to cover --peers "
                       "(default 5: peers a city or a region apart)")
    swarm.add_argument("--out", type=Path, metavar="DIR", help="logs, keys and the report (default: a new temporary folder)")
    swarm.add_argument("--heartbeat", type=positive_float, default=2.0, metavar="SECONDS", help="peers' and coordinator's heartbeat (default 2)")
    swarm.add_argument("--replan-interval", type=positive_float, default=30.0, metavar="SECONDS", help="coordinator re-solve interval (default 30)")
    swarm.add_argument("--data", type=Path, metavar="PATH",
                       help="text to train on (default: the Python standard library's sources), or a folder prepared by "
                       "hetpeer data prepare: then the coordinator serves it and the peers, which start without it, "
                       "download the shards their lanes read (docs/data.md)")
    swarm.add_argument("--batch", type=positive_int, default=16, metavar="N", help="global batch in sequences (default 16)")
    swarm.add_argument("--save", type=Path, metavar="DIR",
                       help="peers save their stage checkpoints to DIR when they leave; run again with the same --out and "
                       "--save to resume the swarm from them")
    swarm.add_argument("--compress", type=compress_choice, default=("auto", "auto"), metavar="auto|CODEC[/CODEC]",
                       help="the coordinator's --compress (default auto)")
    swarm.add_argument("--stages", type=positive_int, metavar="S", help="the coordinator's --stages (default: its planner's)")
    swarm.add_argument("--group-size", type=positive_int, metavar="M", help="the coordinator's --group-size (default: its planner's)")
    swarm.add_argument("--sync", choices=SYNC_CHOICES, default="auto", help="the coordinator's --sync (default auto)")
    swarm.add_argument("--outer-every", type=outer_every_choice, default=0, metavar="N|auto|never",
                       help="the coordinator's --outer-every (default auto)")
    add_recipe_options(swarm, outer=True, base=DEMO_RECIPE)
    swarm.add_argument("--verbose", action="store_true", help="show every process's output, not just the progress")
    swarm.set_defaults(run=run_swarm)


LEAVE_AT = (0.25, 0.4)  # --leave auto: of --steps, when a peer leaves and when it is started again
LEAVE_MIN_STEPS = 100  # shorter runs have no time for a re-plan, a return and the training after it


def leave_choice(text: str) -> tuple[int, int] | str | None:
    """--leave: STEP,STEP (leave, back), auto or none."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    at, comma, back = text.partition(",")
    try:
        steps = int(at), int(back)
    except ValueError:
        steps = (0, 0)
    if not comma or not 0 < steps[0] < steps[1]:
        raise argparse.ArgumentTypeError(f"must be auto, none or two steps LEAVE,BACK with 0 < LEAVE < BACK, got {text!r}")
    return steps


def auto_leave(steps: int) -> tuple[int, int] | None:
    """--leave auto's two steps for a run of `steps`, None for a short run."""
    return (round(LEAVE_AT[0] * steps), round(LEAVE_AT[1] * steps)) if steps >= LEAVE_MIN_STEPS else None


def run_coordinator(args: argparse.Namespace) -> int:
    from hetpeer.coordinator.api_errors import ApiError
    from hetpeer.coordinator.config import CoordinatorConfig
    from hetpeer.coordinator.service import Coordinator
    from hetpeer.coordinator.web import DashboardError
    from hetpeer.protocol.admission import AdmissionError
    from hetpeer.coordinator.ledger import LedgerError
    from hetpeer.protocol.control import ControlError

    recipe = recipe_from(args)
    if args.print_recipe:
        print(recipe.to_text())
        return 0
    if not args.swarm:
        raise UserError("hetpeer coordinator needs --swarm NAME")
    log_to_stdout()
    api_tls = _api_tls(args)
    http = _http_listen(args.http, api_tls is not None)
    try:
        config = CoordinatorConfig(
            swarm=args.swarm, home=home_dir(args.home, f"coordinator-{args.swarm}"), initial_peers=tuple(args.initial_peers),
            dht_maddrs=(args.host_maddr,), dht_announce=tuple(args.announce_maddr), api_listen=None if args.api == "off" else args.api,
            api_tls=api_tls, http_listen=http, model=model_spec(args),
            batch=args.batch, micro_batch=args.micro_batch, dtype=args.dtype, heartbeat_s=args.heartbeat,
            replan_interval_s=args.replan_interval, min_peers=args.min_peers, gain=args.gain,
            time_budget_s=args.time_budget, workers=args.workers, stages=args.stages, group_size=args.group_size, compress=args.compress,
            sync=args.sync, outer_every=args.outer_every, recipe=recipe, seed=args.seed,
            steps=args.steps, join_file=args.join_file, reach_port=args.reach_port,
            **_admission(args.admission), ban_period_s=args.ban_period, **_dataset(args),
        )
        coordinator = Coordinator(config, say)  # checks the swarm name
    except ValueError as error:
        raise UserError(str(error)) from None
    stop_on_sigterm()
    try:
        coordinator.start()
        coordinator.run()
    except (ControlError, ApiError, AdmissionError, DashboardError, LedgerError) as error:
        raise UserError(str(error)) from None
    except KeyboardInterrupt:
        say("interrupted: the peers go on with the plan they have")
    finally:
        coordinator.shutdown()
    return 0


DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def run_invite(args: argparse.Namespace) -> int:
    from hetpeer.protocol.admission import mint_token
    from hetpeer.protocol.control import ControlError, load_or_create_key

    text = args.expires.strip()
    try:
        seconds = float(text[:-1]) * DURATION_UNITS_S[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise UserError(f"--expires must be a number with s, m, h or d (like 12h), got {args.expires!r}") from None
    if not 0 < seconds < 10 * 365 * 86400:
        raise UserError(f"--expires must be more than nothing and under ten years, got {args.expires!r}")
    key_path = home_dir(args.home, f"coordinator-{args.swarm}") / "coordinator.key"
    if not key_path.exists():  # never make a key here: a token signed by a new key admits no one
        raise UserError(f"no coordinator key at {key_path}: give the coordinator's --home (it is made when "
                        "`hetpeer coordinator` first starts)")
    try:
        token = mint_token(load_or_create_key(key_path), args.swarm, time.time() + seconds, args.name)
    except (ControlError, ValueError) as error:
        raise UserError(str(error)) from None
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + seconds))
    print(f"join token for swarm {args.swarm}" + (f", peer name {args.name}" if args.name else "") + f", until {expires}:",
          file=sys.stderr)
    print(token)
    return 0


def _admission(words: list[str]) -> dict:
    """CoordinatorConfig's admission fields from `--admission MODE [FILE]`."""
    mode, rest = words[0], words[1:]
    if mode == "allowlist" and len(rest) == 1:
        return {"admission": mode, "allowlist": Path(rest[0])}
    if mode in ("open", "token") and not rest:
        return {"admission": mode}
    raise UserError(f"--admission takes 'open', 'allowlist FILE' or 'token', got {' '.join(words)!r}")


def _reach_port(text: str) -> int | None:
    if text == "off":
        return None
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port (0 for any free one) or 'off', got {text!r}")
    return int(text)


def _dataset(args: argparse.Namespace) -> dict:
    """CoordinatorConfig's dataset and data folder from --data and --data-url."""
    from hetpeer.protocol.dataset import ManifestError, read_folder
    from hetpeer.protocol.plan import Dataset
    from hetpeer.protocol.wire import SchemaError

    if args.data is None:
        if args.data_url is not None:
            raise UserError("--data-url says where --data's folder is served: give --data DIR (the prepared folder) too")
        return {}
    try:
        manifest, name = read_folder(args.data)
        dataset = Dataset(name, args.data_url or "")
    except (ManifestError, SchemaError) as error:
        raise UserError(str(error)) from None
    model = model_spec(args)
    if manifest.vocab > model.vocab:
        raise UserError(f"{args.data} holds ids up to {manifest.vocab - 1}, past model {model.name}'s vocabulary of {model.vocab}: "
                        "prepare it with the model's tokenizer")
    return {"dataset": dataset, "data_folder": args.data.resolve()}


def _http_listen(text: str | None, tls: bool) -> str | None:
    """`--http [HOST:]PORT` as HOST:PORT (host 127.0.0.1 when left out); a warning when served beyond this host
    without TLS."""
    if text is None:
        return None
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"--http takes [HOST:]PORT with a port from 0 to 65535, got {text!r}")
    listen = f"{host or '127.0.0.1'}:{int(port)}"
    if not tls:
        _warn_unencrypted("dashboard", listen)
    return listen


def _warn_unencrypted(what: str, listen: str) -> None:
    if listen.rsplit(":", 1)[0].strip("[]") not in ("localhost", "127.0.0.1", "::1"):
        say(f"warning: the {what} on {listen} is served without TLS: anyone who reaches it reads the swarm's "
            "plan and peers, unencrypted (give --tls-cert and --tls-key)")


def _api_tls(args: argparse.Namespace):
    """The coordinator API's `ServerTls` from --tls-cert and --tls-key (both or neither), checked; a warning
    when the API is served beyond this host without it."""
    from hetpeer.coordinator.api_errors import ApiTlsError
    from hetpeer.coordinator.tls import ServerTls

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("give --tls-cert and --tls-key together (the API's certificate and its key), or neither")
    if args.tls_cert is None:
        if args.api != "off":
            _warn_unencrypted("API", args.api)
        return None
    if args.api == "off" and args.http is None:
        raise UserError("--tls-cert and --tls-key secure the API and the dashboard: leave them out with --api off "
                        "and no --http")
    try:
        return ServerTls.load(args.tls_cert, args.tls_key)
    except ApiTlsError as error:
        raise UserError(str(error)) from None


def run_status(args: argparse.Namespace) -> int:
    # before grpc loads: its own log lines (a failed TLS handshake, say) would follow the one line of error
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from hetpeer.coordinator.api_client import ApiClient
    from hetpeer.coordinator.api_errors import ApiError, ApiTlsError
    from hetpeer.coordinator.tls import ClientTls
    from hetpeer.coordinator.console import credit_view, status_json, status_view

    if args.watch is not None and args.json:
        raise UserError("--watch redraws the table: leave out --json (or --watch, for one JSON document)")
    if args.watch is not None and args.credit:
        raise UserError("--watch redraws the swarm's table, not the credit: leave out --watch (or --credit)")
    if args.sort != "tokens" and not args.credit:
        raise UserError("--sort ranks the --credit leaderboard: give --credit too")
    try:
        tls = ClientTls.load(args.tls_ca) if args.tls_ca is not None else None
        with ApiClient(args.api, timeout_s=args.timeout, tls=tls) as client:
            if args.credit:
                board = client.call_get_credit()
                if args.json:
                    print(json.dumps(board.to_wire(), indent=1))
                else:
                    _console().print(credit_view(board, args.sort))
                return 0

            def read():  # in `status_view`'s order
                plan, plan_time = client.call_get_plan()
                return plan, client.call_list_peers(), client.call_get_progress(), plan_time

            plan, peers, progress, plan_time = read()
            if args.watch is not None:
                return _watch(read, (plan, peers, progress, plan_time), args.watch)
    except ApiTlsError as error:  # the flags do not fit the server or the files: the user's to fix
        raise UserError(str(error)) from None
    except ApiError as error:
        print(f"hetpeer status: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_json(plan, peers, progress, plan_time), indent=1))
    else:
        _console().print(status_view(plan, peers, progress, plan_time))
    return 0


def _console():
    """A terminal's own width; a pipe's lines whole (wide), without colour."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200, color_system=None)


def _watch(read, first, every_s: float) -> int:
    """Redraw the status every `every_s` seconds until Ctrl+C; a failed read keeps the last one, marked. A
    terminal's table is redrawn in place; a pipe gets each one after the last, a blank line between."""
    from rich.live import Live

    from hetpeer.coordinator.api_errors import ApiError, ApiTlsError
    from hetpeer.coordinator.console import status_view

    console = _console()
    last, read_at, problem = first, time.strftime("%H:%M:%S"), None
    interrupted = interrupted_flag()

    def refresh() -> None:
        nonlocal last, read_at, problem
        time.sleep(every_s)
        try:
            last, read_at, problem = read(), time.strftime("%H:%M:%S"), None
        except ApiTlsError:
            raise
        except ApiError as error:
            problem = f"{error}: showing what it said at {read_at}; retrying"
        if interrupted.is_set():
            raise KeyboardInterrupt

    try:
        if not console.is_terminal:
            while True:
                console.print(status_view(*last, problem=problem), "")
                sys.stdout.flush()
                refresh()
        with Live(status_view(*last), console=console, auto_refresh=False) as live:
            while True:
                refresh()
                live.update(status_view(*last, problem=problem), refresh=True)
    except KeyboardInterrupt:
        return 0


def run_swarm(args: argparse.Namespace) -> int:
    from hetpeer.peer.reach import free_port
    from hetpeer.swarm.launcher import EMULATION_SHARE, LocalSwarm, SwarmConfig, SwarmError, parse_per_peer
    from hetpeer.swarm.report import write_report

    try:
        config = SwarmConfig(
            out=args.out or Path("."), peers=args.peers, steps=args.steps,
            slowdowns=parse_per_peer(args.slowdowns, args.peers, "--slowdowns"),
            bandwidth_caps=parse_per_peer(args.bandwidth_caps, args.peers, "--bandwidth-caps", none_value="none"),
            latencies_ms=parse_per_peer(args.latencies, args.peers, "--latencies"),
            emulate=not args.no_emulation, small_devices=args.stages != 1,  # one stage must hold the whole model
            leave=auto_leave(args.steps) if args.leave == "auto" else args.leave,
            heartbeat_s=args.heartbeat, replan_interval_s=args.replan_interval, recipe=recipe_from(args, DEMO_RECIPE),
            data=args.data.resolve() if args.data else None, batch=args.batch,
            save=args.save.resolve() if args.save else None, coordinator_args=(
                "--compress", compress_text(args.compress), "--sync", args.sync,
                "--outer-every", outer_every_text(args.outer_every),
                *(("--stages", str(args.stages)) if args.stages else ()),
                *(("--group-size", str(args.group_size)) if args.group_size else ()),
            ),
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-swarm-"))
    config = replace(config, out=out)
    lock = threading.Lock()

    def echo(line: str) -> None:
        text = logline.unstamp(line)
        if args.verbose or text.startswith(("[swarm]", "[coordinator] published")) or "  stage " in text:
            with lock:
                print(line, flush=True)

    print(f"a swarm of {config.peers} peers and a coordinator on this machine; logs and report in {out}", flush=True)
    if config.emulation > 1:
        memory = f", and holds {config.memory_mib:.1f} MiB, too little for the whole model" if config.memory_mib else ""
        print(f"emulation: each peer computes as on a device of its own, its compute slowed {config.emulation:.1f}x more so "
              f"that together they ask for at most {EMULATION_SHARE:.0%} of this machine's {config.cores_shared} core(s){memory} "
              f"(--no-emulation: they share the cores as they are)", flush=True)
    if any(config.latencies_ms):
        held = sorted(set(config.latencies_ms))
        print(f"links: each peer's frames to the others are held back {', '.join(f'{ms:g}' for ms in held)} ms one way before "
              "they leave, as over a network (--latencies 0: no delay)", flush=True)
    swarm = LocalSwarm(config, echo, free_port(), http_port=free_port(), interrupted=interrupted_flag())
    stop_on_sigterm()
    try:
        swarm.start()
        print(f"dashboard: {swarm.dashboard_url} (open it while the swarm trains)", flush=True)
        report = swarm.run(status=lambda line: echo(logline.relabel(line, "swarm")))
        _screenshot(swarm.dashboard_url, out / "dashboard.png")
    except SwarmError as error:
        print(f"hetpeer swarm: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopping every process", flush=True)
        report = swarm.report()
    finally:
        swarm.shutdown()
    files = write_report(report, out)
    extra = ", ".join(str(files[kind]) for kind in ("html", "png") if kind in files)
    print(f"report: {files['md']} ({extra})", flush=True)
    if "png" not in files:
        print("  (pip install -e '.[plots]' for loss.png, drawn with matplotlib)", flush=True)
    return 0


def _screenshot(url: str, path: Path) -> None:
    """A picture of the dashboard at the end of the run, where Chromium is installed."""
    from hetpeer.swarm.browser import BrowserError, find_chromium, screenshot

    if find_chromium() is None:
        print("no Chromium on this machine: no dashboard screenshot (the report has the same charts)", flush=True)
        return
    try:
        screenshot(url + "?once", path)
    except BrowserError as error:
        print(f"no dashboard screenshot: {error}", flush=True)
        return
    print(f"dashboard screenshot: {path}", flush=True)

