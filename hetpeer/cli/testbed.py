"""`hetpeer testbed`: a swarm in containers whose links are shaped like a topology file's. Thin: parse, build
the config, call into `hetpeer/testbed`."""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from hetpeer import logline, scenarios
from hetpeer.cli.common import SWARM_DTYPES, UserError, positive_float, positive_int, read_json, stop_on_sigterm
from hetpeer.protocol.modelspec import PRESETS

PROJECT_RE = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")


def add_commands(commands) -> None:
    """Add `hetpeer testbed` to the subcommands."""
    testbed = commands.add_parser(
        "testbed", help="run a swarm in containers with links shaped like a topology file's",
        description="Write a Docker Compose project with one container per device of TOPOLOGY.json (or --scenario) and "
        "one for the coordinator, start it and follow the swarm until --steps (or Ctrl+C). Each container shapes what "
        "it sends to each other device to the topology's bandwidth times --scale (htb, per destination); the "
        "topology's latency is added by the peers' transport (emulated: this kernel has no netem); compute is slowed "
        "in proportion to each device's TFLOPS; a device's memory_gb limits its container, and its nat (cone or "
        "symmetric) puts it behind a router container of its own that masquerades it (cone keeps ports: peers behind two punch holes through them; docs/nat.md). Peers measure their links themselves and the coordinator plans from "
        "what they measured. At the end the containers' logs and a run report are kept in --out and the containers "
        "removed (--keep leaves them running). Needs Docker and the hetpeer image (docker/build.sh).",
    )
    source = testbed.add_mutually_exclusive_group(required=True)
    source.add_argument("topology", nargs="?", type=Path, metavar="TOPOLOGY.json", help="topology file (docs/topology.md)")
    source.add_argument("--scenario", choices=scenarios.NAMES, help="a built-in scenario of Yuan et al. (2022)")
    testbed.add_argument("--scale", type=positive_float, default=1.0, metavar="F",
                         help="every link's bandwidth times F, so the swarm fits this machine (default 1)")
    testbed.add_argument("--slowdown", type=positive_float, default=1.0, metavar="X",
                         help="the fastest device computes X times slower than this machine, slower devices in "
                         "proportion to their TFLOPS (>= 1; default 1)")
    testbed.add_argument("--no-latency", action="store_true", help="do not emulate the topology's latency")
    testbed.add_argument("--out", type=Path, metavar="DIR", help="the project folder: compose file, scripts, homes, logs, "
                         "report (default: a new temporary folder)")
    testbed.add_argument("--steps", type=positive_int, metavar="N", help="train N steps, then stop (default: until Ctrl+C)")
    testbed.add_argument("--stages", type=positive_int, metavar="S", help="hold the coordinator to S pipeline stages")
    testbed.add_argument("--group-size", type=positive_int, metavar="M", help="hold the coordinator to groups of M peers")
    testbed.add_argument("--keep", action="store_true", help="leave the containers running at the end")
    testbed.add_argument("--image", default="hetpeer:latest", metavar="IMAGE", help="the hetpeer image (default hetpeer:latest)")
    testbed.add_argument("--project", default="hetpeer-testbed", metavar="NAME",
                         help="compose project name (default hetpeer-testbed)")
    testbed.add_argument("--subnet", metavar="CIDR", help="the containers' network (default: a free /24 of 10.213.0.0/16)")
    testbed.add_argument("--api-port", type=positive_int, default=50051, metavar="PORT",
                         help="the coordinator's API on 127.0.0.1 (default 50051)")
    testbed.add_argument("--http-port", type=positive_int, default=8080, metavar="PORT",
                         help="the coordinator's dashboard on 127.0.0.1 (default 8080)")
    testbed.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="model preset (default tiny)")
    testbed.add_argument("--batch", type=positive_int, default=16, metavar="N", help="global batch in sequences (default 16)")
    testbed.add_argument("--micro-batch", type=positive_int, default=2, metavar="N", help="micro-batch (default 2)")
    testbed.add_argument("--dtype", choices=SWARM_DTYPES, default="fp32", help="training dtype (default fp32)")
    testbed.add_argument("--heartbeat", type=positive_float, default=2.0, metavar="SECONDS", help="heartbeat (default 2)")
    testbed.add_argument("--verbose", action="store_true", help="every plan's stages, not just the progress")
    testbed.set_defaults(run=run_testbed)


def run_testbed(args: argparse.Namespace) -> int:
    from hetpeer.protocol.topology import Topology
    from hetpeer.swarm.report import write_report
    from hetpeer.swarm.watch import StalledError
    from hetpeer.testbed.compose import ComposeError, free_subnet
    from hetpeer.testbed.project import TestbedConfig, TestbedError
    from hetpeer.testbed.run import Testbed

    if not PROJECT_RE.match(args.project):
        raise UserError(f"--project must be lower-case letters, digits, - and _, got {args.project!r}")
    if args.slowdown < 1:
        raise UserError(f"--slowdown must be at least 1, got {args.slowdown:g}")
    raw = scenarios.load(args.scenario) if args.scenario else read_json(args.topology, "topology file")
    topology = Topology.from_wire(raw)
    out = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-testbed-"))).resolve()
    try:
        config = TestbedConfig(
            topology=topology, out=out, scale=args.scale, slowdown=args.slowdown, emulate_latency=not args.no_latency,
            image=args.image, project=args.project, api_port=args.api_port, http_port=args.http_port, model=args.model, batch=args.batch,
            micro_batch=args.micro_batch, dtype=args.dtype, heartbeat_s=args.heartbeat, steps=args.steps,
            coordinator_args=tuple(a for flag, value in (("--stages", args.stages), ("--group-size", args.group_size))
                                   if value is not None for a in (flag, str(value))),
        )
        config = replace(config, subnet=args.subnet or free_subnet())
        nated = sum(d.nat != "none" for d in topology.devices)
        if nated:  # one private /24 per device behind NAT, in a block no other Docker network uses
            config = replace(config, lan_subnets=free_subnet("10.214.0.0/16", prefix=max(16, 24 - (nated - 1).bit_length())))
    except (TestbedError, ComposeError) as error:
        raise UserError(str(error)) from None
    lock = threading.Lock()

    def echo(line: str) -> None:
        if args.verbose or "  stage " not in line:
            with lock:
                print(line, flush=True)

    print(f"a testbed of {len(topology.devices)} devices ({topology.name or args.topology}), bandwidth x{args.scale:g}, "
          f"compute {args.slowdown:g}x slower at the fastest, latency {'not ' if args.no_latency else ''}emulated; "
          f"project in {out}", flush=True)
    bed = Testbed(config, echo)
    ended = 1
    stop_on_sigterm()  # `kill`, a CI's timeout: the containers are removed as after Ctrl+C
    try:
        bed.start()
        print(f"watch it: hetpeer status --api {bed.api_address}, or http://127.0.0.1:{config.http_port}/", flush=True)
        bed.run(status=lambda line: echo(logline.relabel(line, "testbed")))
        ended = 0
    except ComposeError as error:
        print(f"hetpeer testbed: {error}", file=sys.stderr)
    except StalledError as error:
        print(f"hetpeer testbed: {error}; logs in {out / 'logs'}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        ended = 0
    finally:
        for stop in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl+C must not leave the containers behind
            signal.signal(stop, signal.SIG_IGN)
        if (out / "compose.yaml").exists():
            print("collecting the logs" + ("" if args.keep else " and removing the containers") + "...", flush=True)
        logs = bed.logs() if (out / "compose.yaml").exists() else {}
        if logs:
            files = write_report(bed.report(logs), out)
            print(f"report: {files['md']}; logs in {out / 'logs'}", flush=True)
        if args.keep:
            print(f"the containers keep running: docker-compose -f {out / 'compose.yaml'} -p {args.project} down -v "
                  f"removes them", flush=True)
        else:
            bed.shutdown()
    return ended
