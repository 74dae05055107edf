"""Coordinator at scale: 10,000 peer records through the real parsing path, validation and a first plan.

    python3 benchmarks/coordinator.py [--peers 10000] [--compare 1000] [--budget 60] [--links 8] [--seed 0] [--json]

Peer records are made by this script as DHT entries (signed subkeys and wire dicts) of a GPT-3 XL swarm in bf16
and parsed as the DHT's are (`ControlPlane.read_peers` -> `PeerRecord.from_wire`); only the DHT's network is
left out. The swarm is a volunteer mix: the GPU classes of `planner.synthetic` spread over regions, plus 5%
Raspberry Pi 4 boards (about 0.01 TFLOPS: four Cortex-A72 cores) and 3% devices with 1 GB of memory, neither of
which any plan should use. Each peer announces its links to `--links` others (half in its own region), with the
latency and bandwidth of `planner.synthetic`'s geography.

Measured for --peers and for --compare peers in the same run (the ratio shows what size costs):
- ingest: `read_peers`, parsing and checking every record (signature binding, types, ranges, freshness), beside
  pydantic's parse and round trip of the same records alone (what each record took before `_exact_check`);
- validation: admission and bans (`gate.plannable`) and the decision (`policy.decide`);
- problem: `policy.build_problem` (the link matrices from the measurements, estimates for the rest);
- planning: `solve` with a --budget search, pruning included: how many devices were pruned and why;
- the plan: its DHT record's size (at most `MAX_PLAN_BYTES`) and a peer's parse of it;
- a coordinator round that solves and publishes, end to end (`Coordinator.tick`, same budget).
Peak memory of the process is printed at the end. `--json` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hetpeer.coordinator import gate, policy
from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.planner import PlannerConfig, solve, synthetic
from hetpeer.coordinator.service import Coordinator
from hetpeer.protocol.records import MAX_PLAN_BYTES, PROTOCOL_VERSION, PeerSchema, peers_key, plan_from_wire, plan_to_wire
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import PRESETS
from hetpeer.protocol.workload import Workload
from synthetic_swarm import SyntheticControlPlane

MODEL = PRESETS["gpt3-xl"]
BATCH = 512
PI = (0.01, 4.0)  # Raspberry Pi 4: TFLOPS, GB
SMALL = (8.0, 1.0)  # a GPU with 1 GB: less than one GPT-3 XL layer's training state
SHARES = (0.05, 0.03)  # of the swarm: Pis, 1 GB devices
HEARTBEAT_S = 2.0


class VolunteerSwarm(SyntheticControlPlane):
    """`peers` volunteers of a GPT-3 XL swarm waiting for their first plan."""

    def __init__(self, peers: int, links: int, seed: int) -> None:
        super().__init__("scale", peers)
        rng = np.random.default_rng(seed)
        raw = synthetic.random_topology(peers, max(4, peers // 16), rng)
        self.topology = Topology.from_wire(raw)
        devices = self.topology.devices
        kind = rng.choice(3, size=peers, p=[1 - sum(SHARES), *SHARES])
        classes = [(d.tflops, d.memory_gb) for d in devices]
        self.compute = [classes[i] if kind[i] == 0 else (PI if kind[i] == 1 else SMALL) for i in range(peers)]
        self.names = ["NVIDIA GPU" if k == 0 else ("Raspberry Pi 4" if k == 1 else "small GPU") for k in kind]
        by_region: dict[str, list[int]] = {}
        for i, d in enumerate(devices):
            by_region.setdefault(d.region, []).append(i)
        self.links: list[dict[str, tuple[float, float]]] = []
        for i, d in enumerate(devices):
            near = rng.choice(by_region[d.region], size=min(links // 2, len(by_region[d.region])), replace=False)
            far = rng.choice(peers, size=links - len(near), replace=False)
            chosen = {int(j) for j in np.concatenate([near, far]) if j != i}
            self.links.append({self.ids[j]: self._link(i, j) for j in sorted(chosen)})

    def _entries(self, key: str):
        """The entries as the DHT returns them, made once per reading of the clock (ingest times the parsing only)."""
        if getattr(self, "_made", (None,))[0] != self.clock:
            self._made = (self.clock, super()._entries(key))
        return self._made[1]

    def _link(self, i: int, j: int) -> tuple[float, float]:
        found = self.topology.link(self.topology.devices[i], self.topology.devices[j])
        return found.latency_ms / 1e3, found.bandwidth_gbps * 1e9 / 8

    def record(self, i: int) -> dict:
        links = self.links[i]
        tflops, memory_gb = self.compute[i]
        return {
            "version": PROTOCOL_VERSION, "software": "hetpeer 0.1.0", "device_id": self.ids[i], "model": MODEL.name,
            "dtype": "bf16", "device_name": self.names[i], "tflops": float(tflops), "achieved_tflops": None,
            "memory_bytes": int(memory_gb * 1e9), "direct": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:7000",
            "p2p": [], "dht": [], "state": "waiting", "epoch": -1, "layers": None, "step": 0, "loss": None,
            "val_loss": None, "noise_scale": None, "checkpoint": None, "tokens_per_s": 0.0,
            "links": {"peers": list(links), "latency_s": [v[0] for v in links.values()],
                      "bandwidth_bytes_per_s": [v[1] for v in links.values()]},
            "time": self.clock - 0.5, "token": None, "suspects": [], "compute_key": None, "compute_share": 1.0, "compute_background": 0.0, "compute_own": 0.0, "timings": 2, "step_costs": [0.0, 0.0, 0.0, 0.0],
            "reachable": "direct", "unreachable": [], "unreachable_how": [], "punch": 0, "calling": [], "punched": [], "relayed": [], "team": None,
            "received": {"peers": [], "epochs": [], "kinds": [], "first": [], "last": [], "micro": [], "sequences": []},
            "trained": {"epochs": [], "first": [], "last": [], "micro": [], "sequences": []},
        }  # fmt: skip


def timed(work):
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


def measure(peers: int, links: int, budget_s: float, seed: int) -> tuple[VolunteerSwarm, dict]:
    """Each phase on its own, timed."""
    swarm, made_s = timed(lambda: VolunteerSwarm(peers, links, seed))
    print(f"  {peers} peers: records made in {made_s:.1f} s", flush=True)
    workload = Workload(MODEL, batch=BATCH, micro_batch=1, dtype="bf16")
    entries = swarm._entries(peers_key(swarm.swarm))
    (records, dropped), ingest_s = timed(lambda: swarm.read_peers(max_age_s=6 * HEARTBEAT_S))
    assert len(records) == peers and not dropped, (len(records), dropped[:3])
    # the same records through pydantic's parse and round trip alone, the check every record took before
    _, pydantic_s = timed(lambda: [PeerSchema.parse_obj(raw).dict() == raw for _, raw in entries])
    now = swarm.now()
    first_seen = {d: now - 60.0 for d in records}

    def validate():
        kept, refused = gate.plannable(records, gate.Admission(), {}, now)
        decision = policy.decide(None, kept, first_seen, now, 0.0, min_peers=2, settle_s=4.0, replan_interval_s=60.0,
                                 measure_wait_s=20.0)
        return kept, decision

    (kept, decision), validate_s = timed(validate)
    assert decision.solve, decision.reason
    (problem, estimated), problem_s = timed(lambda: policy.build_problem(kept, workload, None))
    solution, solve_s = timed(lambda: solve(problem, PlannerConfig(time_budget_s=budget_s), np.random.default_rng(seed)))
    plan = solution.plan
    record = plan_to_wire(plan, now)
    (parsed, _), parse_s = timed(lambda: plan_from_wire(record))
    assert parsed == plan
    pruned = {reason.split(":")[0]: len(ids) for reason, ids in plan.reasons.items()}
    print(f"  {peers} peers: ingest {ingest_s:.2f} s (pydantic's parse alone: {pydantic_s:.2f} s), validation {validate_s:.3f} s, problem {problem_s:.2f} s, "
          f"planning {solve_s:.1f} s: {solution.shape}, {plan.total_s:.3f} s/step predicted, standby {pruned}; "
          f"plan record {len(record['plan']) / 1e3:.0f} kB, parsed by a peer in {parse_s * 1e3:.0f} ms", flush=True)
    return swarm, {
        "peers": peers, "ingest_s": ingest_s, "pydantic_parse_s": pydantic_s, "validate_s": validate_s, "problem_s": problem_s, "solve_s": solve_s,
        "planned": len(plan.devices), "shape": str(solution.shape), "predicted_step_s": plan.total_s,
        "standby": pruned, "plan_bytes": len(record["plan"]), "plan_parse_s": parse_s,
        "estimated_links": len(policy.estimated_links(plan, problem.device_ids, estimated)),
    }  # fmt: skip


def measure_round(peers: int, links: int, budget_s: float, seed: int) -> dict:
    """`measure`, then (its problem and plan gone) a whole coordinator round."""
    swarm, figures = measure(peers, links, budget_s, seed)
    round_s, published = coordinator_round(swarm, budget_s)
    size = len(plan_to_wire(swarm.plan, swarm.now())["plan"]) if published else 0
    print(f"  {peers} peers: a coordinator round that solved and published: {round_s:.1f} s "
          f"({'published' if published else 'NOT published'}: {len(swarm.plan.estimated_links) if published else 0} "
          f"estimated links named, record {size / 1e3:.0f} kB)", flush=True)
    assert size <= MAX_PLAN_BYTES, f"the published plan's record is {size} bytes, over the DHT's {MAX_PLAN_BYTES}"
    return {**figures, "round_s": round_s, "published": published, "published_plan_bytes": size}


def coordinator_round(swarm: VolunteerSwarm, budget_s: float) -> tuple[float, bool]:
    """A real `Coordinator` over the synthetic control plane: one round to see the peers, then the round that
    plans once they have settled and the wait for links is over; (its wall seconds, whether it published)."""
    with tempfile.TemporaryDirectory(prefix="hetpeer-coordinator-scale-") as home:
        config = CoordinatorConfig(swarm="scale", home=Path(home), api_listen=None, model=MODEL, batch=BATCH,
                                   micro_batch=1, dtype="bf16", heartbeat_s=HEARTBEAT_S, time_budget_s=budget_s)
        coordinator = Coordinator(config, lambda line: None)
        coordinator.control = swarm
        coordinator.start()
        try:
            coordinator.tick()
            swarm.clock += 60.0
            (_, round_s) = timed(coordinator.tick)
        finally:
            coordinator.shutdown()
    return round_s, swarm.plan is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=10_000, help="records the coordinator reads (default 10000)")
    parser.add_argument("--compare", type=int, default=1000, help="the smaller swarm measured beside it (default 1000)")
    parser.add_argument("--budget", type=float, default=60.0, help="planner search budget in seconds (default 60)")
    parser.add_argument("--links", type=int, default=8, help="links each peer announces (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args()
    if min(args.peers, args.compare) < 10 or args.budget <= 0 or not 1 <= args.links <= 64:
        parser.error("--peers and --compare must be at least 10, --budget positive, --links 1 to 64")
    print(f"coordinator at scale: GPT-3 XL in bf16, batch {BATCH}, {args.links} links a peer, planner budget "
          f"{args.budget:g} s; {args.peers} against {args.compare} peers", flush=True)
    small = measure_round(args.compare, args.links, args.budget, args.seed)
    large = measure_round(args.peers, args.links, args.budget, args.seed)
    print()
    per_record = {key: (large[key] / large["peers"] * 1e6, small[key] / small["peers"] * 1e6) for key in ("ingest_s", "problem_s")}
    print(f"ingest: {per_record['ingest_s'][0]:.0f} us a record at {args.peers} against {per_record['ingest_s'][1]:.0f} us "
          f"at {args.compare} ({large['ingest_s'] / small['ingest_s']:.1f}x the time for {args.peers / args.compare:g}x the records); "
          f"pydantic's parse alone of the same records {large['pydantic_parse_s'] / large['ingest_s']:.1f}x the whole ingest")
    print(f"problem: {large['problem_s']:.2f} s against {small['problem_s']:.2f} s ({large['problem_s'] / small['problem_s']:.1f}x)")
    print(f"planning: {large['solve_s']:.1f} s against {small['solve_s']:.1f} s for a {args.budget:g} s budget; "
          f"plan record {large['plan_bytes'] / 1e3:.0f} kB of at most {MAX_PLAN_BYTES / 1e3:.0f} kB")
    print(f"a planning round: {large['round_s']:.1f} s against {small['round_s']:.1f} s; "
          f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    if args.json:
        print(json.dumps({"large": large, "small": small}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
