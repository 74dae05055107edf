"""The commands that run peers: `hetpeer join` (one peer of a fixed plan, or with --swarm a swarm peer that
follows the coordinator's plans), `hetpeer launch` (every peer of a plan on this machine) and `hetpeer export`
(stage checkpoints into one model folder)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from hetpeer.cli.common import (
    DEFAULT_STEPS, SWARM_DTYPES, UserError, add_link_option, add_model_options, add_recipe_options, add_run_options, codec_pair,
    data_cache, home_dir, log_to_stdout, model_spec, non_negative_int, positive_float, positive_int, read_json, recipe_from,
    refuse_organizer_flags, run_options_argv, say, stop_on_sigterm,
)
from hetpeer.protocol.addresses import maddr_host
from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.modelspec import PRESETS, ModelSpec
from hetpeer.protocol.workload import Workload

JOIN_FILE_WAIT_S = 120.0
CREDIT_WAIT_HEARTBEATS = 3  # a leaving peer waits at most this long for its last steps to be confirmed
TENSOR_PORT, DHT_PORT = 7000, 7001  # a swarm peer's default ports off this machine: the ones to forward on a home router
DEFAULT_LINK_KEY_SHOWN = "~/.hetpeer/link.key"  # a fixed plan peer's, as `hetpeer key` and `join --plan` take it
DEFAULT_LINK_KEY = str(Path(DEFAULT_LINK_KEY_SHOWN).expanduser())


def add_commands(commands) -> None:
    """Add `hetpeer join`, `hetpeer launch` and `hetpeer export` to the subcommands."""
    join = commands.add_parser(
        "join",
        help="join a swarm as a peer (or run one peer of a fixed plan)",
        description="Join a swarm (--swarm, or --join-file): reach it through --initial-peers, learn from the "
        "coordinator's reach service whether others can dial this peer (behind NAT it needs no address option: "
        "docs/nat.md), measure this machine and the links to a few peers, announce them, and train the stage the coordinator's plans give this peer, following "
        "new plans, until Ctrl+C (or --steps). Without --swarm, run one peer of a fixed plan (--plan, --as, "
        "--peers) for --steps steps: the address book (written by `hetpeer launch`, or by hand for a fixed "
        "set of machines) says where every peer of the plan can be reached and which key proves it (`hetpeer key`).",
    )
    _add_swarm_options(join)
    static = join.add_argument_group("a fixed plan (without --swarm)")
    static.add_argument("--plan", type=Path, metavar="PLAN.json", help="the plan to run (from `hetpeer plan --json`)")
    static.add_argument("--as", dest="device_id", metavar="DEVICE", help="this peer's device id in the plan")
    static.add_argument("--peers", type=Path, metavar="ADDRESSES.json", help="the address book (see docs/pipeline.md)")
    static.add_argument("--identity", metavar="KEY", help="this peer's P2P private key file (needed when the book gives it a P2P address)")
    static.add_argument("--link-key", type=Path, metavar="FILE",
                        help="this peer's link key, whose SHA-256 the book gives it as \"key\": its direct links prove "
                        f"it and are sealed with it (default {DEFAULT_LINK_KEY_SHOWN}; "
                        "`hetpeer key` makes one)")
    static.add_argument("--rejoin", action="store_true",
                        help="first download the stage's parameters and optimizer state from the rest of its group, "
                        "and enter at the group's step")
    static.add_argument("--resume", type=Path, metavar="DIR",
                        help="start from this peer's checkpoint DIR/DEVICE.safetensors (weights, Adam moments and step)")
    join.add_argument("--listen", metavar="HOST:PORT",
                      help="where to accept direct connections (default: this peer's address in the book; with --swarm: "
                      f"127.0.0.1 on a free port for a swarm on this machine, else 0.0.0.0:{TENSOR_PORT})")
    add_link_option(join)
    add_run_options(join)
    join.set_defaults(run=run_join)

    launch = commands.add_parser(
        "launch",
        help="run every peer of a plan on this machine",
        description="Start every peer of a plan on this machine as separate `hetpeer join` processes, with ports, "
        "link keys (their direct links are sealed) and P2P keys of their own, show their output, and stop them all "
        "when one fails or on Ctrl+C.",
    )
    launch.add_argument("plan", type=Path, nargs="?", metavar="PLAN.json",
                        help="the plan to run (from `hetpeer plan --json`); without one, a demo: the tiny model "
                        "on --local-peers equal peers, 2 stages deep")
    launch.add_argument("--local-peers", type=positive_int, default=4, metavar="N",
                        help="peers of the demo plan when no PLAN.json is given (default 4)")
    launch.add_argument("--out", type=Path, metavar="DIR", help="folder for the address book, keys and logs (default: a new temporary folder)")
    launch.add_argument("--model", metavar="PATH", help="the model folder of a plan made with `hetpeer plan --model PATH` "
                        "(its config.json, and safetensors the peers load their stages from)")
    launch.add_argument("--seq-len", type=positive_int, metavar="N",
                        help="tokens per training sequence (default: the plan's; plans older than that field: the model's context)")
    launch.add_argument("--compress", type=codec_pair, metavar="CODEC[/CODEC]",
                        help="how activations travel to the next stage and their gradients back, for every lane's hops: "
                        f"one codec for both, or FORWARD/BACKWARD (e.g. int4/int8), each one of {', '.join(CODECS)} "
                        "(default: the plan's own, raw where it names none)")
    add_link_option(launch)
    add_run_options(launch)
    add_recipe_options(launch)
    launch.set_defaults(run=run_launch)

    key = commands.add_parser(
        "key",
        help="make a fixed plan peer's link key and print its SHA-256",
        description="Print the SHA-256 of the link key in FILE, making the key there first when the file does not "
        "exist. The SHA-256 is what a fixed plan's address book gives the peer as \"key\": `hetpeer join --plan` proves "
        "itself with the key on every direct link and seals the link, and refuses peers whose key is not the book's.",
    )
    key.add_argument("file", type=Path, nargs="?", metavar="FILE",
                     help=f"the key file (default {DEFAULT_LINK_KEY_SHOWN})")
    key.set_defaults(run=run_key)

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


def _add_swarm_options(join: argparse.ArgumentParser) -> None:
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
    swarm.add_argument("--team", metavar="TEAM",
                       help="the team this volunteer's credit counts for on the leaderboard (1-32 of A-Z, a-z, 0-9, _, . "
                       "and -; default none)")
    swarm.add_argument("--coordinator-api", metavar="HOST:PORT",
                       help="the coordinator's gRPC API, asked for this peer's confirmed credit as it leaves (default: the "
                       "join file's; none: no credit is said)")
    swarm.add_argument("--home", type=Path, metavar="DIR",
                       help="keeps this peer's key: restarting with the same DIR rejoins as the same peer "
                       "(default ~/.hetpeer/NAME)")
    swarm.add_argument("--announce-host", metavar="HOST",
                       help="the host other peers should dial for tensors (default: the address the reach service saw when "
                       "listening on all interfaces, else the --listen host)")
    swarm.add_argument("--reach", metavar="HOST:PORT",
                       help="the coordinator's reach service, which tells this peer whether others can dial it (default: "
                       "the join file's)")
    swarm.add_argument("--dht-listen", metavar="MADDR",
                       help="where this peer's DHT node listens (default /ip4/127.0.0.1/tcp/0 for a swarm on this machine, "
                       f"else /ip4/0.0.0.0/tcp/{DHT_PORT})")
    swarm.add_argument("--dht-announce", nargs="+", default=[], metavar="MADDR",
                       help="DHT multiaddrs others should dial, when they differ from --dht-listen (NAT, containers)")
    add_model_options(swarm, default=None, default_text="default: the join file's, else tiny; with --plan: the folder "
                      "of a plan's model that is not a preset", seq_len_text="with --plan the plan's, else the model's context")
    swarm.add_argument("--dtype", choices=SWARM_DTYPES, help="training dtype (default fp32, or the join file's)")
    swarm.add_argument("--heartbeat", type=positive_float, default=2.0, metavar="SECONDS",
                       help="seconds between announcements; a record expires after 3 (default 2)")
    swarm.add_argument("--slowdown", type=positive_float, default=1.0, metavar="X",
                       help="emulate a slower accelerator: compute takes X times as long (>= 1; default 1)")
    swarm.add_argument("--emulate-memory", type=positive_float, metavar="MIB",
                       help="emulate an accelerator with this much memory: announce at most MIB MiB free, so plans give "
                       "this peer no more than fits (for demos and tests of models split across small devices)")
    swarm.add_argument("--emulate-clock-skew", type=float, default=0.0, metavar="SECONDS",
                       help="emulate a machine whose clock is off: every time this peer reads for the swarm is SECONDS "
                       "ahead (negative: behind); for tests and demos of the clock correction (docs/nat.md)")
    swarm.add_argument("--probe-targets", type=non_negative_int, default=4, metavar="K",
                       help="peers whose links are measured each round: lane and group neighbours first (default 4)")


def _worker_config(args: argparse.Namespace, model: ModelSpec | None = None):
    """How this peer's machine takes part (how it trains is the plan's recipe); `model` is the model `--model` gave
    this peer (a folder's weights are read from it)."""
    from hetpeer.peer.pipeline.worker import WorkerConfig

    folder = model is not None and args.model not in PRESETS  # a path: the model's weights may be there too
    return WorkerConfig(
        model=model,
        weights=str(args.model) if folder else None,
        device=args.device,
        timeout_s=args.timeout,
        recompute=args.recompute,
        overlap=not args.no_overlap,
    )


def _take_device(args: argparse.Namespace, dtype: str) -> None:
    """Resolve `--device` (auto: a CUDA GPU when there is one) for training in `dtype`, and say what and why."""
    from hetpeer.peer.device import choose_device

    choice = choose_device(args.device, dtype)
    say(f"device: {choice}")
    args.device = choice.device


def _tokenizer_path(args: argparse.Namespace, spec: ModelSpec) -> str | None:
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


def _emulation(args: argparse.Namespace):
    """The links `--bandwidth-cap` and `--emulate-latency` ask a peer to emulate."""
    from hetpeer.peer.transport.network import Emulation

    rate = args.bandwidth_cap * 1e6 / 8 if args.bandwidth_cap is not None else None
    return Emulation(rate_bytes_per_s=rate, latency_s=args.emulate_latency)


def _load_plan(path: Path, args: argparse.Namespace) -> Plan:
    """The plan in `path`; its sequence length becomes --seq-len (the model a plan trains is its peers' only
    if they cut sequences alike), and a --seq-len that disagrees with it is a user error."""
    plan = Plan.from_wire(read_json(path, "plan file"))
    if plan.seq_len:
        if args.seq_len is not None and args.seq_len != plan.seq_len:
            raise UserError(f"plan {path} was made for sequences of {plan.seq_len} tokens, not --seq-len {args.seq_len} "
                            "(leave --seq-len out: the plan's is used)")
        args.seq_len = plan.seq_len
    return plan


def _host_port(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"{flag} must be HOST:PORT, got {text!r}")
    return host or "0.0.0.0", int(port)


def run_join(args: argparse.Namespace) -> int:
    from hetpeer.peer import node
    from hetpeer.peer.checkpoint import CheckpointError
    from hetpeer.peer.data.corpus import CorpusError
    from hetpeer.peer.transport import TransportError
    from hetpeer.protocol.addresses import AddressBook

    if args.swarm is not None or args.join_file is not None:
        return run_swarm_join(args)
    refuse_organizer_flags(args, "a fixed plan carries it: hetpeer plan or hetpeer launch")
    missing = [flag for flag, value in (("--plan", args.plan), ("--as", args.device_id), ("--peers", args.peers)) if value is None]
    if missing:
        raise UserError(f"give --swarm NAME to join a swarm, or {', '.join(missing)} to run a peer of a fixed plan")
    log_to_stdout()
    try:
        plan = _load_plan(args.plan, args)
        _take_device(args, plan.dtype)
        given = model_spec(args) if args.model is not None else None
        tokenizer = _tokenizer_path(args, node.model_for(plan, given))
        setup = node.PeerSetup(
            device_id=args.device_id,
            plan=plan,
            book=AddressBook.load(args.peers),
            worker=_worker_config(args, given),
            steps=args.steps or DEFAULT_STEPS,
            links=args.link,
            listen=_host_port(args.listen) if args.listen else None,
            identity_path=args.identity,
            link_key=args.link_key or Path(DEFAULT_LINK_KEY),
            data=str(args.data) if args.data else None,
            data_cache=data_cache(args),
            tokenizer=tokenizer,
            threads=args.threads,
            rejoin=args.rejoin,
            save=args.save,
            save_every=args.save_every,
            resume=args.resume,
            emulation=_emulation(args),
        )
        node.run(setup, say)
    except (node.PeerSetupError, CorpusError, CheckpointError) as error:
        raise UserError(str(error)) from None
    except ValueError as error:  # the worker refuses a plan it cannot run (dtype, device)
        raise UserError(str(error)) from None
    except TransportError as error:
        print(f"hetpeer join: stopped: {error}", file=sys.stderr)
        return 1
    return 0


def run_swarm_join(args: argparse.Namespace) -> int:
    """`hetpeer join --swarm` (or --join-file): a swarm peer, until Ctrl+C or --steps."""
    from hetpeer.peer.checkpoint import CheckpointError
    from hetpeer.peer.daemon import SwarmPeer, SwarmPeerConfig
    from hetpeer.peer.data.corpus import CorpusError
    from hetpeer.peer.reach import ReachError
    from hetpeer.protocol.modelspec import ModelConfigError
    from hetpeer.protocol.control import ControlError

    fixed = [flag for flag, value in (("--plan", args.plan), ("--as", args.device_id), ("--peers", args.peers)) if value is not None]
    if fixed:
        raise UserError(f"{', '.join(fixed)} run a fixed plan; a swarm peer follows the coordinator's plans (drop them or --swarm)")
    refuse_organizer_flags(args, "the coordinator's: hetpeer coordinator")
    if args.join_file is not None:
        _take_join_file(args)
    if args.coordinator_key is None:
        raise UserError("--swarm needs --coordinator-key (the coordinator prints it) or --join-file")
    args.model, args.dtype = args.model or "tiny", args.dtype or "fp32"
    model = model_spec(args)
    here = on_this_machine(args.initial_peers)
    if not args.slowdown >= 1:
        raise UserError(f"--slowdown must be at least 1, got {args.slowdown:g}")
    log_to_stdout()
    try:
        _take_device(args, args.dtype)
        config = SwarmPeerConfig(
            swarm=args.swarm, name=args.name, home=home_dir(args.home, args.name), coordinator_key=args.coordinator_key.lower(),
            worker=replace(_worker_config(args, model), slowdown=args.slowdown), initial_peers=tuple(args.initial_peers),
            model=model, dtype=args.dtype,
            listen=_host_port(args.listen) if args.listen else (("127.0.0.1", 0) if here else ("0.0.0.0", TENSOR_PORT)),
            announce_host=args.announce_host, reach=_host_port(args.reach, "--reach") if args.reach else None,
            dht_maddrs=(args.dht_listen or ("/ip4/127.0.0.1/tcp/0" if here else f"/ip4/0.0.0.0/tcp/{DHT_PORT}"),), dht_announce=tuple(args.dht_announce), heartbeat_s=args.heartbeat, probe_targets=args.probe_targets, steps=args.steps,
            data=str(args.data) if args.data else None, data_cache=data_cache(args), tokenizer=_tokenizer_path(args, model),
            threads=args.threads,
            emulation=_emulation(args), save=args.save, save_every=args.save_every, token=args.token,
            clock_skew_s=args.emulate_clock_skew,
            memory_cap_bytes=round(args.emulate_memory * 2**20) if args.emulate_memory is not None else None,
            team=args.team,
        )
        from hetpeer.protocol.identity import NAME_RE

        if not NAME_RE.match(args.name):
            raise ValueError(f"--name must be 1-24 of a-z, 0-9 and _, got {args.name!r}")
        peer = SwarmPeer(config, say)  # checks the swarm name
    except ValueError as error:
        raise UserError(str(error)) from None
    stop_on_sigterm()
    try:
        peer.start()
        peer.run()
    except (ControlError, CorpusError, ModelConfigError, CheckpointError, ReachError) as error:  # its data, model folder, ports
        raise UserError(str(error)) from None
    except KeyboardInterrupt:
        say("interrupted: leaving the swarm")
    finally:
        peer.shutdown()
    if args.coordinator_api and peer.device_id:
        _say_credit(args.coordinator_api, peer, args.heartbeat)
    return 0


def _say_credit(address: str, peer, heartbeat_s: float) -> None:
    """Ask the coordinator what this peer is credited, once its ledger has this peer's last record and the
    neighbours' receipts stop moving (a few heartbeats at most), and say it."""
    from hetpeer.coordinator.api_client import ApiClient
    from hetpeer.coordinator.api_errors import ApiError
    from hetpeer.coordinator.ledger import describe

    claimed = sum(c.sequences for c in peer.tally.claims())
    if not claimed:
        say("credit: none earned in this session: it trained no step")
        return
    deadline, last = time.monotonic() + CREDIT_WAIT_HEARTBEATS * heartbeat_s, None
    try:
        with ApiClient(address, timeout_s=2.0) as client:
            while True:
                credit = client.call_get_credit().of(peer.device_id)
                if credit is not None and credit.claimed_sequences >= claimed and credit == last or time.monotonic() > deadline:
                    break
                last = credit
                time.sleep(heartbeat_s)
    except (ApiError, KeyboardInterrupt) as error:
        say(f"credit: could not ask the coordinator at {address} ({error or 'interrupted'}); `hetpeer status --credit` shows it")
        return
    say(f"credit: {describe(credit)}")


def _take_join_file(args: argparse.Namespace) -> None:
    """Fill the swarm's options from the join file, waiting for it to appear (a coordinator starting beside
    this peer writes it once its DHT node runs); an option also given on the command line must agree."""
    from hetpeer.protocol.join import JoinInfo
    from hetpeer.protocol.wire import SchemaError

    path, waited = args.join_file, 0.0
    while not path.exists():
        if waited >= JOIN_FILE_WAIT_S:
            raise UserError(f"no join file at {path} after {JOIN_FILE_WAIT_S:g} s (`hetpeer coordinator --join-file` writes it)")
        if waited % 10 == 0:
            say(f"waiting for the join file {path} (`hetpeer coordinator --join-file` writes it)")
        time.sleep(1.0)
        waited += 1.0
    try:
        info = JoinInfo.load(path)
    except SchemaError as error:
        raise UserError(f"bad join file: {error}") from None
    model = model_spec(args).name if args.model is not None else None
    for flag, given, wanted in (("--swarm", args.swarm, info.swarm), ("--coordinator-key", args.coordinator_key, info.coordinator_key),
                                ("--model", model, info.model), ("--dtype", args.dtype, info.dtype)):
        if given is not None and given.lower() != wanted:
            raise UserError(f"{flag} {given} disagrees with the join file {path}, which says {wanted}")
    if args.model is None and info.model not in PRESETS:
        raise UserError(f"the swarm of {path} trains model {info.model} from a model folder: give --model with that "
                        "folder (and --seq-len if the coordinator was given one)")
    args.swarm, args.coordinator_key, args.dtype = info.swarm, info.coordinator_key, info.dtype
    args.model = args.model or info.model
    args.initial_peers = list(dict.fromkeys([*args.initial_peers, *info.initial_peers]))
    if args.reach is None and info.reach is not None:
        args.reach = f"{info.reach[0]}:{info.reach[1]}"
    if args.coordinator_api is None and info.api is not None:
        args.coordinator_api = f"{info.api[0]}:{info.api[1]}"


def on_this_machine(maddrs: list[str]) -> bool:
    """Whether a swarm reached through `maddrs` runs on this machine alone (every address a loopback one)."""
    hosts = [maddr_host(m) for m in maddrs]
    return all(h is not None and (h == "localhost" or h.startswith("127.") or h == "::1") for h in hosts)


def run_key(args: argparse.Namespace) -> int:
    from hetpeer.protocol.identity import KeyFileError, load_or_create_link_key

    path = args.file or Path(DEFAULT_LINK_KEY)
    made = not path.exists()
    try:
        digest = load_or_create_link_key(path).digest
    except (KeyFileError, OSError) as error:
        raise UserError(str(error)) from None
    if made:
        print(f"made a new link key in {path}", file=sys.stderr)
    print(f"{digest}  {path}")
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


def run_launch(args: argparse.Namespace) -> int:
    from hetpeer.peer.launch import launch

    refuse_organizer_flags(args, "hetpeer launch takes it as")
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.plan is None:
        plan = demo_plan(args.local_peers)
        print(f"demo: the tiny model on {args.local_peers} local peers, {len(plan.stages)} stage(s) x "
              f"{plan.group_size} lane(s), plan in {out / 'plan.json'}", flush=True)
    else:
        plan, path = _load_plan(args.plan, args), args.plan.resolve()
    if args.compress is not None:
        plan = plan.with_codecs(*args.compress)
        print(f"activations travel in {args.compress[0]}, their gradients in {args.compress[1]}", flush=True)
    recipe = recipe_from(args, plan.recipe)
    changed = recipe != plan.recipe
    if changed:
        print(f"recipe: {'; '.join(plan.recipe.changes(recipe))}", flush=True)
        plan = replace(plan, recipe=recipe)
    if args.plan is None or args.compress is not None or changed:  # the peers read the plan they run from a file
        path = out / "plan.json"
        path.write_text(json.dumps(plan.to_wire(), indent=1))
    if args.model is not None or plan.model not in PRESETS:  # the peers would each refuse it: say so once, here
        if args.model is None:
            raise UserError(f"plan {args.plan} trains model {plan.model} from a model folder: give --model with that folder")
        given = model_spec(args, plan.layers)
        if given.name != plan.model:
            raise UserError(f"plan {args.plan} trains model {plan.model}; --model {args.model} is {given.name} (another "
                            "config, sequence length or depth)")
    return launch(path, plan, out, args.steps or DEFAULT_STEPS, args.link, run_options_argv(args), lambda line: print(line, flush=True))


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
