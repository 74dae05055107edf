"""The swarm's commands: `hetpeer join --swarm`, `hetpeer coordinator`, `hetpeer status`, `hetpeer swarm`.

Thin like `cli.py` (which adds them to its parser): parse, build the config, call into the packages.
"""

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
from hetpeer.protocol.workload import PRESETS

SWARM_DTYPES = ("fp32", "bf16")  # what the stage worker computes in
JOIN_FILE_WAIT_S = 120.0


def _cli():
    import hetpeer.cli as cli

    return cli


def add_join_swarm_options(join: argparse.ArgumentParser) -> None:
    cli = _cli()
    swarm = join.add_argument_group("a swarm (--swarm)")
    swarm.add_argument("--swarm", metavar="NAME", help="the swarm to join (letters, digits, - and _)")
    swarm.add_argument("--join-file", type=Path, metavar="PATH",
                       help="the file `hetpeer coordinator --join-file` writes: the swarm, the coordinator's key, where to "
                       "join, the model and dtype, in place of those options (waits up to 2 minutes for it to appear)")
    swarm.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                       help="multiaddrs of peers (or the coordinator) already in the swarm's DHT")
    swarm.add_argument("--coordinator-key", metavar="HEX",
                       help="SHA-256 of the coordinator's public key (`hetpeer coordinator` prints it); "
                       "plans signed by any other key are ignored")
    swarm.add_argument("--token", metavar="TOKEN",
                       help="a join token from the swarm's organizer (`hetpeer invite`), for a coordinator run with "
                       "--admission token")
    swarm.add_argument("--name", default="peer", metavar="NAME",
                       help="readable part of this peer's id, NAME-<key fingerprint> (a-z, 0-9, _; default peer)")
    swarm.add_argument("--home", type=Path, metavar="DIR",
                       help="keeps this peer's key: restarting with the same DIR rejoins as the same peer "
                       "(default ~/.hetpeer/NAME)")
    swarm.add_argument("--announce-host", metavar="HOST", help="the host other peers should dial for tensors (default: the --listen host)")
    swarm.add_argument("--dht-listen", default="/ip4/127.0.0.1/tcp/0", metavar="MADDR",
                       help="where this peer's DHT node listens (default /ip4/127.0.0.1/tcp/0)")
    swarm.add_argument("--dht-announce", nargs="+", default=[], metavar="MADDR",
                       help="DHT multiaddrs others should dial, when they differ from --dht-listen (NAT, containers)")
    cli.add_model_options(swarm, default=None, default_text="default: the join file's, else tiny; with --plan: the folder "
                          "of a plan's model that is not a preset")
    swarm.add_argument("--dtype", choices=SWARM_DTYPES, help="training dtype (default fp32, or the join file's)")
    swarm.add_argument("--heartbeat", type=cli._positive_float, default=2.0, metavar="SECONDS",
                       help="seconds between announcements; a record expires after 3 (default 2)")
    swarm.add_argument("--slowdown", type=cli._positive_float, default=1.0, metavar="X",
                       help="emulate a slower accelerator: compute takes X times as long (>= 1; default 1)")
    swarm.add_argument("--probe-targets", type=cli._non_negative_int, default=4, metavar="K",
                       help="peers whose links are measured each round: lane and group neighbours first (default 4)")


def add_commands(commands) -> None:
    cli = _cli()
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
    coordinator.add_argument("--swarm", required=True, metavar="NAME", help="the swarm's name")
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
    coordinator.add_argument("--tls-cert", type=Path, metavar="FILE",
                             help="serve the API (and the dashboard) over TLS with this PEM certificate (give --tls-key with it)")
    coordinator.add_argument("--tls-key", type=Path, metavar="FILE", help="the --tls-cert certificate's PEM private key, unencrypted")
    cli.add_model_options(coordinator, default="tiny")
    coordinator.add_argument("--batch", type=cli._positive_int, default=16, metavar="N", help="global batch in sequences (default 16)")
    coordinator.add_argument("--micro-batch", type=cli._positive_int, default=2, metavar="N", help="micro-batch in sequences (default 2)")
    coordinator.add_argument("--dtype", choices=SWARM_DTYPES, default="fp32", help="training dtype (default fp32)")
    coordinator.add_argument("--heartbeat", type=cli._positive_float, default=2.0, metavar="SECONDS",
                             help="seconds between rounds; use the peers' heartbeat (default 2)")
    coordinator.add_argument("--replan-interval", type=cli._positive_float, default=300.0, metavar="SECONDS",
                             help="re-solve this often even when nothing broke (default 300; a plan a peer left is "
                                  "mended at once: docs/churn.md)")
    coordinator.add_argument("--min-peers", type=cli._positive_int, default=2, metavar="N", help="peers to wait for before the first plan (default 2)")
    coordinator.add_argument("--gain", type=float, default=0.1, metavar="FRACTION",
                             help="a new plan must predict a step this much faster than the running one (default 0.1)")
    coordinator.add_argument("--time-budget", type=cli._positive_float, default=2.0, metavar="SECONDS", help="planner search time (default 2)")
    coordinator.add_argument("--stages", type=cli._positive_int, metavar="S", help="fix the number of pipeline stages")
    coordinator.add_argument("--group-size", type=cli._positive_int, metavar="M", help="fix the data-parallel group size")
    coordinator.add_argument("--seed", type=cli._non_negative_int, default=0, metavar="N", help="planner seed (default 0)")
    coordinator.add_argument("--steps", type=cli._positive_int, metavar="N",
                             help="the swarm's last step: once the running plan reaches it, publish no new plan "
                             "(peers leave there with their own --steps; default: train on)")
    cli.add_eval_options(coordinator)
    coordinator.add_argument("--admission", nargs="+", default=["open"], metavar="MODE",
                             help="who may be planned: 'open' (every peer with a valid record; the default), "
                             "'allowlist FILE' (the device ids or key fingerprints FILE lists, one a line; read again when "
                             "it changes) or 'token' (peers that give a join token of this coordinator: `hetpeer invite`)")
    coordinator.add_argument("--ban-period", type=cli._non_negative_float, default=300.0, metavar="SECONDS",
                             help="leave a peer that most of its group reports as misbehaving out of plans this long, "
                             "doubled on each repeat (default 300; 0: no bans)")
    coordinator.add_argument("--join-file", type=Path, metavar="PATH",
                             help="write what peers need to join (swarm, key digest, DHT address, model, dtype) to PATH, "
                             "for `hetpeer join --join-file PATH`")
    coordinator.set_defaults(run=run_coordinator)

    status = commands.add_parser(
        "status", help="show a swarm's plan, peers and progress",
        description="Ask a coordinator's gRPC API for the running plan, the peers with what they measured, and the "
        "swarm's progress, and show them as a table (--watch: redrawn until Ctrl+C) or JSON.",
    )
    status.add_argument("--api", required=True, metavar="HOST:PORT", help="the coordinator's API address (it prints it)")
    status.add_argument("--tls-ca", type=Path, metavar="FILE",
                        help="connect with TLS, trusting the PEM certificate(s) in FILE: the coordinator's own "
                        "(self-signed) certificate, or the CA that signed it")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--watch", type=cli._positive_float, nargs="?", const=2.0, metavar="SECONDS",
                        help="redraw the table every SECONDS (default 2) until Ctrl+C; a coordinator that stops "
                        "answering is waited for")
    status.add_argument("--timeout", type=cli._positive_float, default=5.0, metavar="SECONDS", help="give up after this long (default 5)")
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
    swarm.add_argument("--peers", type=cli._positive_int, default=8, metavar="N", help="peers to start (default 8)")
    swarm.add_argument("--steps", type=cli._positive_int, default=200, metavar="N", help="steps to train (default 200)")
    swarm.add_argument("--slowdowns", default="1,1,1,1,2,2,3,3", metavar="X,X,...",
                       help="compute slowdown of each peer, repeated to cover --peers (default 1,1,1,1,2,2,3,3)")
    swarm.add_argument("--bandwidth-caps", default="none,none,none,none,none,none,40,40", metavar="MBIT,...",
                       help="Mbit/s each peer sends at most to each other peer, 'none' for no cap, repeated to cover "
                       "--peers (default none x6, 40, 40)")
    swarm.add_argument("--out", type=Path, metavar="DIR", help="logs, keys and the report (default: a new temporary folder)")
    swarm.add_argument("--heartbeat", type=cli._positive_float, default=2.0, metavar="SECONDS", help="peers' and coordinator's heartbeat (default 2)")
    swarm.add_argument("--replan-interval", type=cli._positive_float, default=30.0, metavar="SECONDS", help="coordinator re-solve interval (default 30)")
    swarm.add_argument("--lr", type=cli._positive_float, default=3e-3, metavar="LR", help="learning rate (default 3e-3)")
    swarm.add_argument("--seed", type=cli._non_negative_int, default=0, metavar="N", help="seed (default 0)")
    swarm.add_argument("--data", type=Path, metavar="PATH", help="text to train on (default: the Python standard library's sources)")
    swarm.add_argument("--save", type=Path, metavar="DIR",
                       help="peers save their stage checkpoints to DIR when they leave; run again with the same --out and "
                       "--save to resume the swarm from them")
    swarm.add_argument("--eval-every", type=cli._non_negative_int, default=25, metavar="N",
                       help="every lane measures its loss on held-out data at every N-th step (default 25; 0: never)")
    swarm.add_argument("--eval-batch", type=cli._positive_int, default=8, metavar="N", help="held-out sequences per lane for it (default 8)")
    swarm.add_argument("--verbose", action="store_true", help="show every process's output, not just the progress")
    swarm.set_defaults(run=run_swarm)


def _home(path: Path | None, default_name: str) -> Path:
    return path if path is not None else Path.home() / ".hetpeer" / default_name


def run_swarm_join(args: argparse.Namespace) -> int:
    cli = _cli()
    from hetpeer.peer.checkpoint import CheckpointError
    from hetpeer.peer.daemon import SwarmPeer, SwarmPeerConfig
    from hetpeer.peer.data.corpus import CorpusError
    from hetpeer.protocol.workload import ModelConfigError
    from hetpeer.protocol.control import ControlError

    fixed = [flag for flag, value in (("--plan", args.plan), ("--as", args.device_id), ("--peers", args.peers)) if value is not None]
    if fixed:
        raise cli.UserError(f"{', '.join(fixed)} run a fixed plan; a swarm peer follows the coordinator's plans (drop them or --swarm)")
    if args.join_file is not None:
        _take_join_file(args, cli)
    if args.coordinator_key is None:
        raise cli.UserError("--swarm needs --coordinator-key (the coordinator prints it) or --join-file")
    args.model, args.dtype = args.model or "tiny", args.dtype or "fp32"
    model = cli.model_spec(args)
    if not args.slowdown >= 1:
        raise cli.UserError(f"--slowdown must be at least 1, got {args.slowdown:g}")
    cli.log_to_stdout()
    try:
        cli.take_device(args, args.dtype)
        config = SwarmPeerConfig(
            swarm=args.swarm, name=args.name, home=_home(args.home, args.name), coordinator_key=args.coordinator_key.lower(),
            worker=_replace_slowdown(cli._worker_config(args, model), args.slowdown), initial_peers=tuple(args.initial_peers),
            model=model, dtype=args.dtype,
            listen=cli._host_port(args.listen) if args.listen else ("127.0.0.1", 0), announce_host=args.announce_host,
            dht_maddrs=(args.dht_listen,), dht_announce=tuple(args.dht_announce), heartbeat_s=args.heartbeat, probe_targets=args.probe_targets, steps=args.steps,
            data=str(args.data) if args.data else None, tokenizer=cli.tokenizer_path(args, model), threads=args.threads,
            emulation=cli.emulation(args), save=args.save, save_every=args.save_every, token=args.token,
        )
        from hetpeer.protocol.identity import NAME_RE

        if not NAME_RE.match(args.name):
            raise ValueError(f"--name must be 1-24 of a-z, 0-9 and _, got {args.name!r}")
        peer = SwarmPeer(config, cli._say)  # checks the swarm name
    except ValueError as error:
        raise cli.UserError(str(error)) from None
    cli.stop_on_sigterm()
    try:
        peer.start()
        peer.run()
    except (ControlError, CorpusError, ModelConfigError, CheckpointError) as error:  # its data, its model folder
        raise cli.UserError(str(error)) from None
    except KeyboardInterrupt:
        cli._say("interrupted: leaving the swarm")
    finally:
        peer.shutdown()
    return 0


def _take_join_file(args: argparse.Namespace, cli) -> None:
    """Fill the swarm's options from the join file, waiting for it to appear (a coordinator starting beside
    this peer writes it once its DHT node runs); an option also given on the command line must agree."""
    from hetpeer.protocol.join import JoinInfo
    from hetpeer.protocol.wire import SchemaError

    path, waited = args.join_file, 0.0
    while not path.exists():
        if waited >= JOIN_FILE_WAIT_S:
            raise cli.UserError(f"no join file at {path} after {JOIN_FILE_WAIT_S:g} s (`hetpeer coordinator --join-file` writes it)")
        if waited % 10 == 0:
            cli._say(f"waiting for the join file {path} (`hetpeer coordinator --join-file` writes it)")
        time.sleep(1.0)
        waited += 1.0
    try:
        info = JoinInfo.load(path)
    except SchemaError as error:
        raise cli.UserError(f"bad join file: {error}") from None
    model = cli.model_spec(args).name if args.model is not None else None
    for flag, given, wanted in (("--swarm", args.swarm, info.swarm), ("--coordinator-key", args.coordinator_key, info.coordinator_key),
                                ("--model", model, info.model), ("--dtype", args.dtype, info.dtype)):
        if given is not None and given.lower() != wanted:
            raise cli.UserError(f"{flag} {given} disagrees with the join file {path}, which says {wanted}")
    if args.model is None and info.model not in PRESETS:
        raise cli.UserError(f"the swarm of {path} trains model {info.model} from a model folder: give --model with that "
                            "folder (and --seq-len if the coordinator was given one)")
    args.swarm, args.coordinator_key, args.dtype = info.swarm, info.coordinator_key, info.dtype
    args.model = args.model or info.model
    args.initial_peers = list(dict.fromkeys([*args.initial_peers, *info.initial_peers]))


def _replace_slowdown(worker, slowdown: float):
    return replace(worker, slowdown=slowdown)


def run_coordinator(args: argparse.Namespace) -> int:
    cli = _cli()
    from hetpeer.coordinator.api import ApiError
    from hetpeer.coordinator.service import Coordinator, CoordinatorConfig
    from hetpeer.coordinator.web import DashboardError
    from hetpeer.protocol.admission import AdmissionError
    from hetpeer.protocol.control import ControlError

    cli.log_to_stdout()
    api_tls = _api_tls(args)
    http = _http_listen(args.http, api_tls is not None)
    try:
        config = CoordinatorConfig(
            swarm=args.swarm, home=_home(args.home, f"coordinator-{args.swarm}"), initial_peers=tuple(args.initial_peers),
            dht_maddrs=(args.host_maddr,), dht_announce=tuple(args.announce_maddr), api_listen=None if args.api == "off" else args.api,
            api_tls=api_tls, http_listen=http, model=cli.model_spec(args),
            batch=args.batch, micro_batch=args.micro_batch, dtype=args.dtype, heartbeat_s=args.heartbeat,
            replan_interval_s=args.replan_interval, min_peers=args.min_peers, gain=args.gain,
            time_budget_s=args.time_budget, stages=args.stages, group_size=args.group_size, seed=args.seed,
            steps=args.steps, join_file=args.join_file, eval_every=args.eval_every, eval_batch=args.eval_batch,
            **_admission(args.admission), ban_period_s=args.ban_period,
        )
        coordinator = Coordinator(config, cli._say)  # checks the swarm name
    except ValueError as error:
        raise cli.UserError(str(error)) from None
    cli.stop_on_sigterm()
    try:
        coordinator.start()
        coordinator.run()
    except (ControlError, ApiError, AdmissionError, DashboardError) as error:
        raise cli.UserError(str(error)) from None
    except KeyboardInterrupt:
        cli._say("interrupted: the peers go on with the plan they have")
    finally:
        coordinator.shutdown()
    return 0


DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def run_invite(args: argparse.Namespace) -> int:
    cli = _cli()
    from hetpeer.protocol.admission import mint_token
    from hetpeer.protocol.control import ControlError, load_or_create_key

    text = args.expires.strip()
    try:
        seconds = float(text[:-1]) * DURATION_UNITS_S[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise cli.UserError(f"--expires must be a number with s, m, h or d (like 12h), got {args.expires!r}") from None
    if not 0 < seconds < 10 * 365 * 86400:
        raise cli.UserError(f"--expires must be more than nothing and under ten years, got {args.expires!r}")
    key_path = _home(args.home, f"coordinator-{args.swarm}") / "coordinator.key"
    if not key_path.exists():  # never make a key here: a token signed by a new key admits no one
        raise cli.UserError(f"no coordinator key at {key_path}: give the coordinator's --home (it is made when "
                            "`hetpeer coordinator` first starts)")
    try:
        token = mint_token(load_or_create_key(key_path), args.swarm, time.time() + seconds, args.name)
    except (ControlError, ValueError) as error:
        raise cli.UserError(str(error)) from None
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
    raise _cli().UserError(f"--admission takes 'open', 'allowlist FILE' or 'token', got {' '.join(words)!r}")


def _http_listen(text: str | None, tls: bool) -> str | None:
    """`--http [HOST:]PORT` as HOST:PORT (host 127.0.0.1 when left out); a warning when served beyond this host
    without TLS."""
    if text is None:
        return None
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise _cli().UserError(f"--http takes [HOST:]PORT with a port from 0 to 65535, got {text!r}")
    listen = f"{host or '127.0.0.1'}:{int(port)}"
    if not tls:
        _warn_unencrypted("dashboard", listen)
    return listen


def _warn_unencrypted(what: str, listen: str) -> None:
    if listen.rsplit(":", 1)[0].strip("[]") not in ("localhost", "127.0.0.1", "::1"):
        _cli()._say(f"warning: the {what} on {listen} is served without TLS: anyone who reaches it reads the swarm's "
                    "plan and peers, unencrypted (give --tls-cert and --tls-key)")


def _api_tls(args: argparse.Namespace):
    """The coordinator API's `ServerTls` from --tls-cert and --tls-key (both or neither), checked; a warning
    when the API is served beyond this host without it."""
    cli = _cli()
    from hetpeer.coordinator.api import ApiTlsError, ServerTls

    if (args.tls_cert is None) != (args.tls_key is None):
        raise cli.UserError("give --tls-cert and --tls-key together (the API's certificate and its key), or neither")
    if args.tls_cert is None:
        if args.api != "off":
            _warn_unencrypted("API", args.api)
        return None
    if args.api == "off" and args.http is None:
        raise cli.UserError("--tls-cert and --tls-key secure the API and the dashboard: leave them out with --api off "
                            "and no --http")
    try:
        return ServerTls.load(args.tls_cert, args.tls_key)
    except ApiTlsError as error:
        raise cli.UserError(str(error)) from None


def run_status(args: argparse.Namespace) -> int:
    cli = _cli()
    # before grpc loads: its own log lines (a failed TLS handshake, say) would follow the one line of error
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from hetpeer.coordinator.api import ApiClient, ApiError, ApiTlsError, ClientTls
    from hetpeer.coordinator.console import status_json, status_view

    if args.watch is not None and args.json:
        raise cli.UserError("--watch redraws the table: leave out --json (or --watch, for one JSON document)")
    try:
        tls = ClientTls.load(args.tls_ca) if args.tls_ca is not None else None
        with ApiClient(args.api, timeout_s=args.timeout, tls=tls) as client:
            def read():  # in `status_view`'s order
                plan, plan_time = client.call_get_plan()
                return plan, client.call_list_peers(), client.call_get_progress(), plan_time

            plan, peers, progress, plan_time = read()
            if args.watch is not None:
                return _watch(read, (plan, peers, progress, plan_time), args.watch)
    except ApiTlsError as error:  # the flags do not fit the server or the files: the user's to fix
        raise cli.UserError(str(error)) from None
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

    from hetpeer.coordinator.api import ApiError, ApiTlsError
    from hetpeer.coordinator.console import status_view

    console = _console()
    last, read_at, problem = first, time.strftime("%H:%M:%S"), None

    def refresh() -> None:
        nonlocal last, read_at, problem
        time.sleep(every_s)
        try:
            last, read_at, problem = read(), time.strftime("%H:%M:%S"), None
        except ApiTlsError:
            raise
        except ApiError as error:
            problem = f"{error}: showing what it said at {read_at}; retrying"

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
    cli = _cli()
    from hetpeer.peer.launch import free_port
    from hetpeer.swarm.launcher import LocalSwarm, SwarmConfig, SwarmError, parse_per_peer
    from hetpeer.swarm.report import write_report

    try:
        config = SwarmConfig(
            out=args.out or Path("."), peers=args.peers, steps=args.steps,
            slowdowns=parse_per_peer(args.slowdowns, args.peers, "--slowdowns"),
            bandwidth_caps=parse_per_peer(args.bandwidth_caps, args.peers, "--bandwidth-caps", none_value="none"),
            heartbeat_s=args.heartbeat, replan_interval_s=args.replan_interval, lr=args.lr, seed=args.seed, data=args.data,
            save=args.save.resolve() if args.save else None, coordinator_args=("--eval-every", str(args.eval_every), "--eval-batch", str(args.eval_batch)),
        )
    except ValueError as error:
        raise cli.UserError(str(error)) from None
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-swarm-"))
    config = replace(config, out=out)
    lock = threading.Lock()

    def echo(line: str) -> None:
        text = logline.unstamp(line)
        if args.verbose or text.startswith(("[swarm]", "[coordinator] published")) or "  stage " in text:
            with lock:
                print(line, flush=True)

    print(f"a swarm of {config.peers} peers and a coordinator on this machine; logs and report in {out}", flush=True)
    swarm = LocalSwarm(config, echo, free_port(), http_port=free_port())
    cli.stop_on_sigterm()
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

