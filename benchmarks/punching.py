"""Hole-punch success against home routers that drop what arrives unasked and routers that answer it with a reset.

    sudo python3 benchmarks/punching.py [--attempts 200] [--at-once 10] [--skew 1.0] [--json]

A lab of network namespaces (`tests/netns/lab.py`, root needed): two hosts, each behind a cone router (Linux
MASQUERADE keeping ports) one provider hop from the public bridge, for each router kind (`drop`, `reset`). Both
hosts punch (`peer/transport/punch.py`, the runtime's own function) to each other at the same moment plus a skew
drawn per attempt and side from 0 to `--skew` seconds, as two peers that saw each other's records at about the
same time; `--at-once` attempts run side by side, each from a port of its own, in rounds of one punch window.

Per router kind and rule, the share of attempts where both sides got a connection within one punch window
(`PUNCH_WINDOW_S`), its 95% interval (Wilson), the median seconds to connect, and the commonest failures. Rules:
`opening` (the runtime's: an opening SYN of `OPEN_TTL` hops before each dial) and `race` (every SYN with a full
TTL, as punching did before the opening SYN), measured in the same run. Beside them: libp2p's DCUtR, 70% +- 7%
over 4.4M attempts in the IPFS network (Trautwein et al., arXiv 2510.27500). The goal: >= 95% for cone routers of
both kinds. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = {"opening": None, "race": 64}  # rule -> the opening SYN's TTL (None: the runtime's OPEN_TTL)
BASE_PORT = 42000
DCUTR = (0.70, 0.07)


def side(args: argparse.Namespace) -> None:
    """One host's side: `attempts` punches to `far`, `at_once` at a time, each round starting at t0 + round x gap."""
    from hetpeer.peer.transport import punch as punching

    if args.open_ttl:
        punching.OPEN_TTL = args.open_ttl
    rng = random.Random(args.seed)

    async def one(i: int, at: float) -> dict:
        await asyncio.sleep(max(0.0, at - time.time()))
        started = time.monotonic()
        try:
            sock = await punching.punch((args.local, BASE_PORT + i), (args.far, BASE_PORT + i), punching.PUNCH_WINDOW_S)
        except (OSError, asyncio.TimeoutError) as error:
            return {"ok": False, "why": str(error).rsplit("(", 1)[-1].rstrip(")")}
        sock.close()
        return {"ok": True, "s": time.monotonic() - started}

    async def run() -> list[dict]:
        results = []
        for first in range(0, args.attempts, args.at_once):
            t = args.t0 + (first // args.at_once) * args.gap
            batch = range(first, min(args.attempts, first + args.at_once))
            results += await asyncio.gather(*(one(i, t + rng.random() * args.skew) for i in batch))
        return results

    print(json.dumps(asyncio.run(run())))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def measure(router: str, rule: str, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "netns"))
    from lab import Lab

    from hetpeer.peer.transport.punch import PUNCH_WINDOW_S

    gap = PUNCH_WINDOW_S + args.skew + 1.0
    with Lab() as lab:
        a, b = lab.behind_nat("a", "cone", router), lab.behind_nat("b", "cone", router)
        t0 = time.time() + 2.0
        common = ["--attempts", str(args.attempts), "--at-once", str(args.at_once), "--skew", str(args.skew),
                  "--t0", str(t0), "--gap", str(gap), "--open-ttl", str(RULES[rule] or 0)]
        procs = [host.popen([sys.executable, __file__, "--side", "--local", host.address, "--far", far.public_address,
                             "--seed", str(seed), *common], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for seed, (host, far) in enumerate(((a, b), (b, a)))]
        outs = [json.loads(proc.communicate()[0]) for proc in procs]
    both = [x["ok"] and y["ok"] for x, y in zip(*outs)]
    seconds = [max(x["s"], y["s"]) for x, y in zip(*outs) if x["ok"] and y["ok"]]
    failures = collections.Counter(r["why"] for out in outs for r in out if not r["ok"])
    low, high = wilson(sum(both), len(both))
    return {"router": router, "rule": rule, "attempts": len(both), "succeeded": sum(both),
            "success": sum(both) / len(both), "interval": [low, high],
            "median_s": statistics.median(seconds) if seconds else None, "failures": dict(failures.most_common(3))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=200, help="punches per router kind and rule (default 200)")
    parser.add_argument("--at-once", type=int, default=10, help="punches side by side, each on its own port (default 10)")
    parser.add_argument("--skew", type=float, default=1.0,
                        help="each side starts each punch 0 to this many seconds late, at random (default 1.0)")
    parser.add_argument("--routers", default="drop,reset", help="router kinds (default drop,reset)")
    parser.add_argument("--rules", default="opening,race", help="rules (default opening,race)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    for hidden in ("--local", "--far", "--t0", "--gap", "--seed", "--open-ttl"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        args.t0, args.gap, args.seed, args.open_ttl = float(args.t0), float(args.gap), int(args.seed), int(args.open_ttl)
        side(args)
        return
    routers, rules = args.routers.split(","), args.rules.split(",")
    for name, allowed in (("router", ("drop", "reset")), ("rule", tuple(RULES))):
        for given in (routers if name == "router" else rules):
            if given not in allowed:
                parser.error(f"unknown {name} {given!r}: one of {', '.join(allowed)}")
    if args.attempts < 1 or args.at_once < 1 or args.skew < 0:
        parser.error("--attempts and --at-once are at least 1, --skew at least 0")
    sys.path.insert(0, str(ROOT / "tests" / "netns"))
    from lab import netns_missing

    if (why := netns_missing()) is not None:
        sys.exit(f"the lab cannot run here: {why}")
    rows = []
    for router in routers:
        for rule in rules:
            print(f"{router} routers, {rule}: {args.attempts} punches, {args.at_once} at a time...", flush=True)
            row = measure(router, rule, args)
            rows.append(row)
            median = f"{row['median_s']:.2f} s" if row["median_s"] is not None else "-"
            print(f"  {row['succeeded']}/{row['attempts']} connected ({row['success']:.1%}, 95% {row['interval'][0]:.1%}"
                  f"-{row['interval'][1]:.1%}), median {median}; failures: {row['failures'] or 'none'}", flush=True)
    print(f"\ncone routers, skew up to {args.skew:g} s a side; libp2p DCUtR in IPFS: {DCUTR[0]:.0%} +- {DCUTR[1]:.0%}")
    print(f"{'router':7} {'rule':8} {'success':>8} {'95% interval':>14} {'vs DCUtR':>9} {'median':>7}")
    for row in rows:
        median = f"{row['median_s']:.2f}s" if row["median_s"] is not None else "-"
        print(f"{row['router']:7} {row['rule']:8} {row['success']:8.1%} {row['interval'][0]:6.1%}-{row['interval'][1]:6.1%}"
              f" {row['success'] / DCUTR[0]:8.2f}x {median:>7}")
    goal = all(row["success"] >= 0.95 for row in rows if row["rule"] == "opening")
    print(f"goal (opening rule >= 95% on every router kind): {'met' if goal else 'NOT met'}")
    if args.json:
        print(json.dumps({"rows": rows, "dcutr": DCUTR, "goal_met": goal}))


if __name__ == "__main__":
    main()
