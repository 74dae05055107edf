"""Relay benchmark: what counting the relays' shared links is worth to the planner.

    python3 benchmarks/relays.py [--devices 64] [--seeds 5] [--budget 2] [--public 0.25] [--cone 0.4] [--json]

Swarms of `planner/synthetic.py`'s `home` generator (consumer GPUs behind home links), their devices behind NATs
(`planner/relays.behind_nat`): a share `--public` public, `--cone` behind cone NATs (they punch holes to each
other) and the rest behind symmetric NATs (they reach other NATed devices through a relay: a public device each
picks as peers do). GPT-3 XL's first 8 layers at sequence 1024, batch 64 (activations of 4 MiB a micro-batch a
hop, which a relay carries twice). Per seed, two solves of `--budget` seconds:

- counted: the planner with `Problem.relays`, as the coordinator builds it: the pairs a plan routes through one
  relay share the relay's link;
- blind: the same links (each relayed pair's two hops), with no relays: every relayed pair as if it were alone
  on its relay.

Both plans are then judged by the counted model (the shared link is what the swarm would meet): the blind plan's
step over the counted plan's is what counting is worth; also each plan's busiest relay (pairs through it) and how
far the blind plan's own prediction was off. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import numpy as np

from hetpeer.coordinator.planner import PlannerConfig, Problem, make_model, solve, synthetic
from hetpeer.coordinator.planner.relays import CONE, PUBLIC, SYMMETRIC, behind_nat
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.workload import Workload


def workload() -> Workload:
    model = dataclasses.replace(preset("gpt3-xl"), layers=8, seq_len=1024)
    return Workload(model, batch=64, micro_batch=1, dtype="fp16")


def case(devices: int, seed: int, public: float, cone: float) -> Problem:
    rng = np.random.default_rng(seed)
    plain = Problem.from_topology(Topology.from_wire(synthetic.home(devices, rng)), workload())
    kinds = rng.choice([PUBLIC, CONE, SYMMETRIC], size=devices, p=[public, cone, 1 - public - cone])
    return behind_nat(plain, kinds)


def busiest(problem: Problem, grid: np.ndarray) -> int:
    """The most relayed pairs the grid routes through one relay."""
    return int(problem.relays.load(grid[None]).max()) if problem.relays is not None else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds a solve (default 2: the coordinator's)")
    parser.add_argument("--public", type=float, default=0.25, help="share of public devices (default 0.25)")
    parser.add_argument("--cone", type=float, default=0.4, help="share behind cone NATs (default 0.4; the rest symmetric)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (0 < args.public <= 1 and 0 <= args.cone <= 1 - args.public):
        parser.error("--public must be in (0, 1] and --cone in [0, 1 - public]")
    config = PlannerConfig(time_budget_s=args.budget)
    print(f"{args.devices} home devices, {args.public:.0%} public, {args.cone:.0%} cone, "
          f"{1 - args.public - args.cone:.0%} symmetric; {args.budget:g} s solves", flush=True)
    rows = []
    for seed in range(args.seeds):
        counted = case(args.devices, seed, args.public, args.cone)
        blind = dataclasses.replace(counted, relays=None)
        a = solve(counted, config, np.random.default_rng(seed))
        b = solve(blind, config, np.random.default_rng(seed))
        judged = make_model(counted, config, b.shape).report(b.grid).cost["total_s"]
        row = {
            "seed": seed, "relays": len(counted.relays.names) if counted.relays is not None else 0,
            "counted_s": a.report.cost["total_s"], "blind_judged_s": judged, "blind_predicted_s": b.report.cost["total_s"],
            "counted_busiest": busiest(counted, a.grid), "blind_busiest": busiest(counted, b.grid),
            "counted_shape": str(a.shape), "blind_shape": str(b.shape),
        }
        row["blind_over_counted"] = judged / row["counted_s"]
        rows.append(row)
        print(f"  seed {seed}: {row['relays']} relays; counted {row['counted_s']:.3f} s/step ({a.shape}, busiest relay "
              f"{row['counted_busiest']} pair(s)); blind {judged:.3f} s/step judged, {row['blind_predicted_s']:.3f} "
              f"predicted ({b.shape}, busiest {row['blind_busiest']}): blind / counted {row['blind_over_counted']:.3f}",
              flush=True)
    ratios = [r["blind_over_counted"] for r in rows]
    result = {"rows": rows, "blind_over_counted_mean": statistics.mean(ratios),
              "blind_over_counted_min": min(ratios), "blind_over_counted_max": max(ratios)}
    print(f"blind / counted step: mean {result['blind_over_counted_mean']:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} "
          f"over {len(rows)} seeds (above 1: counting the relays' shared links gave the faster plan)", flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
