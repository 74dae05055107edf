"""A swarm of volunteers who are all at home, behind routers that reset, against the same swarm on public addresses.

    sudo python3 benchmarks/home_swarm.py [--steps 300] [--settle 30] [--variants public,reset,drop] [--sync allreduce] [--json]

A lab of network namespaces (`tests/netns/lab.py`, root needed). In each variant a coordinator on the public
bridge and four peers, each started with the README's volunteer line alone (`hetpeer join --join-file ...`), the
coordinator held to 2 stages x 2 lanes so that every plan needs every peer (and to `--sync`, all-reduce by default,
so that the variants' plans differ in their layer split at most; the table shows each variant's plan):

- public: the four on public addresses;
- reset: two behind each of two cone routers (Linux MASQUERADE keeping ports, two peers sharing each public
  address) that answer what arrives unasked with a reset of their own (OpenWrt's default REJECT does too), no
  public peer, so no relay: every pair that works together must punch a hole through both routers;
- drop: the same behind routers that drop what arrives unasked.

Per variant: seconds from the last peer's start to the step where all four train in one plan (each peer's first
step line of that plan's epoch), steps a second over the steps after `--settle` to the last (from the last stage's
step lines), that as a share of the public variant's, the bytes relayed (the peers' "relay: carried" lines), and
the pairs punched. Goals (issue 65): all four train within 120 s of the last start, the reset swarm steps at >= 90%
of the public one, 0 bytes relayed. The variants run one after another on this machine: the ratio compares runs
minutes apart, so run it on a quiet machine. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "netns"))

from lab import Lab, netns_missing  # noqa: E402  (the lab lives with the tests that use it)
from runs import start_coordinator, starter, stop, wait_for_line  # noqa: E402

VARIANTS = ("public", "reset", "drop")
STEP = re.compile(r"^(\S+) e(\d+) stage (\d+) lane \d+\s+step (\d+)/", re.MULTILINE)
DEADLINE_S = 900.0


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run_variant(variant: str, args: argparse.Namespace, folder: Path) -> dict:
    started: list[subprocess.Popen] = []
    run = starter(folder, started)
    deadline = time.monotonic() + DEADLINE_S
    try:
        with Lab() as lab:
            coordinator_host = lab.public("coord")
            if variant == "public":
                hosts = {f"peer{i}": lab.public(f"peer{i}") for i in range(4)}
            else:
                a, b = lab.behind_nat("peer0", "cone", variant), lab.behind_nat("peer1", "cone", variant)
                hosts = {"peer0": a, "peer1": b, "peer2": lab.beside(a, "peer2"), "peer3": lab.beside(b, "peer3")}
            coordinator, join = start_coordinator(run, coordinator_host, folder, "home", deadline, "--min-peers", "4",
                                                  "--stages", "2", "--group-size", "2", "--heartbeat", "1",
                                                  "--steps", str(args.steps), "--sync", args.sync)
            peers = {}
            for name, host in hosts.items():
                peers[name] = run(host, name, "join", "--join-file", str(join), "--name", name, "--home",
                                  str(folder / name), "--heartbeat", "1", "--steps", str(args.steps))
            last_start = time.time()
            for name, proc in peers.items():
                wait_for_line(folder / f"{name}.log", rf"step {args.steps}/", proc, deadline)
    finally:
        stop(started)
    logs = {name: (folder / f"{name}.log").read_text(errors="replace") for name in hosts}
    steps = {name: [(stamp(t), int(e), int(s), int(k)) for t, e, s, k in STEP.findall(log)] for name, log in logs.items()}
    final_epoch = max(e for rows in steps.values() for _, e, _, _ in rows)
    first = [min(t for t, e, _, _ in rows if e == final_epoch) for rows in steps.values()]
    last_stage = max(s for rows in steps.values() for _, _, s, _ in rows)
    times = sorted({k: t for rows in steps.values() for t, e, s, k in rows if s == last_stage and e == final_epoch}.items())
    window = [(k, t) for k, t in times if k >= args.settle]
    rate = (window[-1][0] - window[0][0]) / (window[-1][1] - window[0][1]) if len(window) > 1 else 0.0
    relayed = sum(float(m) for log in logs.values() for m in re.findall(r"relay: carried ([\d.]+) MiB", log))
    punched = sorted({tuple(sorted((name, other.split("-")[0]))) for name, log in logs.items()
                      for other in re.findall(r"reaches (\S+) over a connection punched", log)})
    coordinator_log = (folder / "coordinator.log").read_text(errors="replace")
    stages = re.findall(r"^\S+   stage \d+ layers (\S+) \((\w+)", coordinator_log, re.MULTILINE)[-2:]  # the last plan's
    plan = " | ".join(f"{layers} {sync}" for layers, sync in stages) or "-"
    return {"variant": variant, "training_after_s": max(first) - last_start, "epochs": final_epoch, "plan": plan,
            "steps_per_s": rate, "relayed_mib": relayed, "punched_pairs": [list(p) for p in punched]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps the swarm trains (default 300)")
    parser.add_argument("--settle", type=int, default=30, help="steps left out of the rate at the start (default 30)")
    parser.add_argument("--sync", default="allreduce", choices=("auto", "allreduce", "gossip", "outer"),
                        help="the coordinator's --sync (default allreduce)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"which of {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--out", type=Path, default=None, help="keep the logs here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    if not 0 <= args.settle < args.steps - 1:
        parser.error("--settle must leave at least two steps before --steps")
    if (why := netns_missing()) is not None:
        sys.exit(f"the lab cannot run here: {why}")
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-home-swarm-"))
    rows = []
    for variant in variants:
        folder = out / variant
        folder.mkdir(parents=True, exist_ok=True)
        print(f"{variant}: 4 peers, 2 stages x 2 lanes, {args.steps} steps (logs in {folder})...", flush=True)
        row = run_variant(variant, args, folder)
        rows.append(row)
        print(f"  all four training {row['training_after_s']:.0f} s after the last start (plan epoch {row['epochs']}), "
              f"{row['steps_per_s']:.3f} steps/s, relayed {row['relayed_mib']:.1f} MiB, "
              f"{len(row['punched_pairs'])} pair(s) punched", flush=True)
    public = next((r["steps_per_s"] for r in rows if r["variant"] == "public"), None)
    print(f"\n{'variant':8} {'training after':>15} {'steps/s':>8} {'of public':>10} {'relayed':>9} {'punched':>8}  layers")
    for row in rows:
        row["of_public"] = row["steps_per_s"] / public if public else None
        share = f"{row['of_public']:.2f}x" if row["of_public"] is not None else "-"
        print(f"{row['variant']:8} {row['training_after_s']:14.0f}s {row['steps_per_s']:8.3f} {share:>10} "
              f"{row['relayed_mib']:8.1f}M {len(row['punched_pairs']):8}  {row['plan']}")
    goals = {row["variant"]: row["training_after_s"] <= 120 and row["relayed_mib"] == 0
             and (row["of_public"] is None or row["of_public"] >= 0.9) for row in rows if row["variant"] != "public"}
    print("goals (training within 120 s, >= 0.9x public, nothing relayed): "
          + (", ".join(f"{v} {'met' if ok else 'NOT met'}" for v, ok in goals.items()) or "no NAT variant run"))
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals}))


if __name__ == "__main__":
    main()
