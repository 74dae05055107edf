"""Testbed benchmark: plans on a WAN of containers, the coordinator's against baselines, predicted against
measured, and recovery from a killed peer, all in one run of one testbed.

    python3 benchmarks/testbed.py [--per-region 2] [--scale 0.05] [--slowdown 16] [--window 60] [--compress auto] [--json]

The world-wide scenario of Yuan et al. (NeurIPS 2022; hetpeer/scenarios) cut to `--per-region` devices in
each of its 8 regions, as a `hetpeer testbed`: one container per device, each shaping what it sends to each
other device to the scenario's bandwidth times `--scale` (htb, per destination), the scenario's latency
added one way by the peers' transport (this kernel has no netem), compute slowed `--slowdown` times so
that 16 peers mostly wait on 2 cores as they would beside GPUs. The coordinator is held to `--stages`
(2): with the tiny model one stage fits every peer, and any assignment of peers to single-stage lanes is
the same plan, so only a pipeline gives placement something to decide. Once every peer has measured its
links and the coordinator has planned from those measurements:

1. throughput: the swarm's tokens/s (global batches completed in `--window` seconds, once the plan has run
   `SETTLE_STEPS`) under the coordinator's plan (its codecs chosen per hop, `--compress`), the plan the
   same planner makes from the same records with every hop raw ("uncompressed": what the coordinator
   published before it chose codecs), a random plan and the "blocks" plan (devices in the topology's
   order) of the coordinator's shape, published with the coordinator's key as the coordinator would,
   `--rounds` windows each, alternating (the machine is shared and its load drifts); medians compared, and the
   coordinator's over uncompressed in time to a loss too: its tokens/s ratio times uncompressed's steps factor
   over its own (a plan whose hops take int4 needs more steps to a loss: `planner/codecs.STEPS_FACTOR`);
2. prediction: each plan's predicted seconds per step beside the measured ones: the time model on what
   the peers announce as its window opens (measured links, achieved compute), alike for every kind (a
   plan whose hops are all raw predicted raw, the others with codecs chosen as the coordinator does),
   with the step's overhead the coordinator had learned before the plan was published (from the plan
   that ran before it; none for the first plan);
3. recovery: under each kind of plan, a peer of it is killed (`docker kill`); reported: seconds until a
   plan without it has run a step. The peer is then started again and the swarm waits for it.

Where hops cost (docs/compression.md, "On the testbed"): one device a region, so that every lane crosses
regions, on links 500 times slower than the scenario's (a 1 Gbit/s link between regions becomes 2 Mbit/s), outer
steps from the first step (during the recipe's warm start they all-reduce every step, which the windows would
measure instead):

    python3 benchmarks/testbed.py --per-region 1 --scale 0.002 --batch 32 --outer-warmup 0 --no-recovery --window 40

Time to loss (`--time-to-loss LOSS`), instead of the above: one fresh testbed for each of `--sync-modes` (auto,
gossip, allreduce by default), one after another, each coordinator held to that `--sync` with the same seed, the
peers from fresh weights, validation every `--eval-every` steps. Reported: seconds from each run's first step until
its validation loss reached LOSS (at most `--deadline`), and until it reached the lowest loss every mode reached;
`time_to_loss.json` in `--out` keeps the curves.

    python3 benchmarks/testbed.py --per-region 1 --batch 32 --time-to-loss 2.5 --deadline 720

`--json` prints one JSON object as the last line: per plan kind, tokens_per_s, predicted_s, measured_s,
recovery_s and the plan's codecs, each plan's steps_factor, and the goals' ratios (to_loss_over_uncompressed among them). `--out` keeps `plans.json` (the plans and the peers' records) and
`windows.json` (every window's measurement), which `benchmarks/timemodel_fit.py` fits the time model's
efficiency terms to.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from swarm import SETTLE_STEPS, announced, baseline, measure, poll, publish  # noqa: E402  (the sibling benchmark's windows)

from hetpeer import scenarios  # noqa: E402
from hetpeer.coordinator.api_client import ApiClient  # noqa: E402
from hetpeer.coordinator.config import CoordinatorConfig  # noqa: E402
from hetpeer.coordinator.planner import PlannerConfig, solve  # noqa: E402
from hetpeer.coordinator.policy import build_problem, running_report  # noqa: E402
from hetpeer.cli.common import compress_choice, compress_text  # noqa: E402
from hetpeer.peer.launch import free_port  # noqa: E402
from hetpeer.protocol.control import ControlPlane  # noqa: E402
from hetpeer.protocol.join import JoinInfo  # noqa: E402
from hetpeer.protocol.plan import Plan  # noqa: E402
from hetpeer.protocol.topology import Topology  # noqa: E402
from hetpeer.protocol.modelspec import preset  # noqa: E402
from hetpeer.protocol.workload import Workload  # noqa: E402
from hetpeer.testbed.compose import free_subnet  # noqa: E402
from hetpeer.testbed.project import COORDINATOR, TestbedConfig, peer_name, service_name  # noqa: E402
from hetpeer.testbed.run import Testbed  # noqa: E402

KINDS = ("coordinator", "uncompressed", "random", "blocks")
GOAL_SPEEDUP = 2.0  # the coordinator's tokens/s over the random plan's
GOAL_CODECS = 1.5  # the coordinator's tokens/s over the uncompressed plan's (docs/compression.md)
RAW = ("raw", "raw")
GOAL_PREDICTION = 0.25  # |measured / predicted - 1| for every plan kind


def world_wide(per_region: int) -> Topology:
    """The world-wide scenario with its first `per_region` devices of each region."""
    raw = scenarios.load("world-wide")
    kept, seen = [], {}
    for device in raw["devices"]:
        seen[device["region"]] = seen.get(device["region"], 0) + 1
        if seen[device["region"]] <= per_region:
            kept.append(device)
    return Topology.from_wire({**raw, "name": f"world-wide, {per_region} per region", "devices": kept})


def all_measured(client: ApiClient, devices: int):
    """The records once every peer announces a measurement of every other peer (either direction)."""
    records = announced(client)
    if len(records) < devices:
        return None
    pairs = {(a, b) for a, r in records.items() for b in r.links} | {(b, a) for a, r in records.items() for b in r.links}
    return records if all((a, b) in pairs for a in records for b in records if a != b) else None


def raw_hops(plan: Plan) -> bool:
    return all(not stage.hop_codecs for stage in plan.stages)


def coordinator_up(bed: Testbed, condition, every_s: float = 10.0):
    """`condition`, for `poll`, that ends the run with the coordinator's last lines if its container stopped
    (a bad option, say), instead of waiting out the poll's timeout."""
    checked = [time.monotonic()]

    def check():
        if time.monotonic() - checked[0] > every_s:
            checked[0] = time.monotonic()
            if COORDINATOR not in bed.compose.running():
                last = "\n".join(bed.compose.logs(COORDINATOR).splitlines()[-5:])
                raise SystemExit(f"the coordinator's container stopped; its log ends:\n{last}")
        return condition()

    return check


def predicted_now(client: ApiClient, plan: Plan, workload: Workload, compress: tuple[str, str], overhead_s: float) -> float:
    """The time model's step for `plan` on what the peers announce now (their latest link measurements and
    achieved compute), as for any plan the coordinator would weigh: every kind is predicted alike, a plan
    whose hops are all raw as raw, the others with their codecs chosen as the coordinator's `compress` does,
    with the step's overhead (`overhead_s`) the coordinator had learned from the plans run before it."""
    problem, _ = build_problem(announced(client), workload, None, overhead_s)
    return running_report(problem, PlannerConfig(cost_model="time", compress=RAW if raw_hops(plan) else compress), plan).cost["total_s"]


def uncompressed(client: ApiClient, workload: Workload, stages: int, seed: int) -> Plan:
    """What the coordinator's planner makes of the same announcements with every hop raw."""
    problem, _ = build_problem(announced(client), workload, current=None)
    config = PlannerConfig(cost_model="time", stages=stages, compress=RAW, time_budget_s=CoordinatorConfig.__dataclass_fields__["time_budget_s"].default)
    return solve(problem, config, np.random.default_rng(seed)).plan


def recover(bed: Testbed, client: ApiClient, running: Plan) -> float:
    """Kill a member of `running`; seconds until a plan without it has run a step. Then start it again and
    wait until the coordinator has planned with it again (in or on standby), so that its re-plan for the
    newcomer does not replace the next plan measured."""
    victim = running.stages[-1].devices[0]
    service = service_name(next(d.id for d in bed.config.topology.devices if victim.startswith(peer_name(d.id) + "-")))
    killed = time.monotonic()
    bed.compose.kill(service)
    new = poll(client, lambda: (p := client.call_get_plan()[0]) and p.epoch > running.epoch and victim not in p.devices and p,
               "a plan without the killed peer", timeout_s=300)
    poll(client, lambda: (g := client.call_get_progress()).epoch >= new.epoch and g.step > new.start_step, "it to run", 300)
    seconds = time.monotonic() - killed
    bed.compose.start(service)
    poll(client, lambda: any(p.record.device_id == victim and p.record.state != "leaving" for p in client.call_list_peers()),
         "the killed peer to announce again", timeout_s=300)
    deadline = time.monotonic() + 8 * bed.config.heartbeat_s  # it settles, the coordinator solves: a new plan, or none
    while time.monotonic() < deadline:
        plan = client.call_get_plan()[0]
        if plan.epoch > new.epoch and victim in set(plan.devices) | set(plan.standby):
            break
        time.sleep(1.0)
    return seconds


def bench_config(args, topology: Topology, out: Path, subnet: str, *coordinator_args: str) -> TestbedConfig:
    """The benchmark's testbed: its coordinator held to `--stages`, never re-solving on its own, with
    `coordinator_args` more."""
    return TestbedConfig(
        topology=topology, out=out, scale=args.scale, slowdown=args.slowdown, image=args.image,
        project=f"hetpeer-bench-{time.time_ns() % 10**8}", subnet=subnet, api_port=free_port(), swarm="bench",
        batch=args.batch, heartbeat_s=args.heartbeat, model=args.model,
        coordinator_args=("--stages", str(args.stages), "--replan-interval", "1000000", "--seed", str(args.seed),
                          "--compress", compress_text(args.compress),
                          *(("--outer-warmup", str(args.outer_warmup)) if args.outer_warmup is not None else ()),
                          *coordinator_args),
        peer_args=("--probe-targets", "8", "--timeout", "30"),
    )


def time_to_loss(args, topology: Topology) -> int:
    """For each of `args.sync_modes`, a fresh testbed whose coordinator is held to that `--sync` (fresh weights,
    the same seed): its validation loss every `--eval-every` steps against the seconds since its first step,
    until `--time-to-loss` or `--deadline`. Reported: each mode's time to the target, and to the lowest loss every
    mode reached (the target may be out of some mode's reach within the deadline)."""
    base = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-bench-ttl-"))).resolve()
    print(f"time to loss: {len(topology.devices)} devices ({topology.name}), bandwidth x{args.scale:g}, compute "
          f"{args.slowdown:g}x slower, {args.stages} stages, batch {args.batch}, validation every {args.eval_every} steps, "
          f"target {args.time_to_loss:g}, at most {args.deadline:g} s a mode; projects in {base}", flush=True)
    runs: dict[str, dict] = {}
    for mode in args.sync_modes:
        config = bench_config(args, topology, base / mode, free_subnet(), "--sync", mode, "--eval-every", str(args.eval_every))
        bed = Testbed(config, lambda line: None)
        try:
            bed.start()
            with ApiClient(bed.api_address, timeout_s=5.0) as client:
                first = poll(client, coordinator_up(bed, lambda: (g := client.call_get_progress()).step > 0 and g),
                             "the first step", timeout_s=900)
                started, curve, plans = time.monotonic(), [], {}
                while time.monotonic() - started < args.deadline:
                    plan = client.call_get_plan()[0]
                    if plan is not None and plan.epoch not in plans:
                        plans[plan.epoch] = {"start_step": plan.start_step, "shape": f"{len(plan.stages)} x {plan.group_size}",
                                             "sync": sorted({stage.sync_words for stage in plan.stages}), "steps_factor": plan.steps_factor}
                    progress = client.call_get_progress()
                    if progress.val_loss is not None and (not curve or curve[-1][2] != progress.val_loss):
                        curve.append((time.monotonic() - started, progress.step, progress.val_loss))
                        if progress.val_loss <= args.time_to_loss:
                            break
                    time.sleep(1.0)
        finally:
            bed.logs()
            bed.shutdown()
        reached = next((t for t, _, loss in curve if loss <= args.time_to_loss), None)
        runs[mode] = {"first_step": first.step, "curve": curve, "plans": plans, "time_to_target_s": reached}
        last = curve[-1] if curve else (float("nan"), 0, float("nan"))
        shapes = "; ".join(f"{p['shape']} {'/'.join(p['sync'])} x{p['steps_factor']:.2f}" for p in plans.values())
        print(f"  {mode:<10} plans {shapes}: "
              f"validation {last[2]:.3f} at step {last[1]} after {last[0]:.0f} s, target "
              f"{'reached after %.0f s' % reached if reached is not None else 'not reached'}", flush=True)
    common = max(min((loss for *_, loss in run["curve"]), default=float("inf")) for run in runs.values())
    for run in runs.values():
        run["time_to_common_s"] = next((t for t, _, loss in run["curve"] if loss <= common), None)
    result = {"target": args.time_to_loss, "common_loss": common, "runs": runs}
    (base / "time_to_loss.json").write_text(json.dumps(result, indent=1))
    print(f"\ntime to validation loss, one testbed per mode, one after another (s from each run's first step; "
          f"target {args.time_to_loss:g}, and {common:.3f}, the lowest loss every mode reached):")
    print(f"{'sync':<10} {'to target':>10} {'to common':>10} {'steps':>6} {'s/step':>7}")
    for mode, run in runs.items():
        steps = run["curve"][-1][1] - run["first_step"] if run["curve"] else 0
        per_step = run["curve"][-1][0] / steps if steps else float("nan")
        cells = [f"{run[k]:.0f}" if run[k] is not None else "-" for k in ("time_to_target_s", "time_to_common_s")]
        print(f"{mode:<10} {cells[0]:>10} {cells[1]:>10} {steps:>6} {per_step:>7.3f}")
    if args.json:
        print(json.dumps(result))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-region", type=int, default=2, help="devices per region of the world-wide scenario (default 2)")
    parser.add_argument("--scale", type=float, default=0.05, help="bandwidth scale (default 0.05: 2 Gbit/s becomes 100 Mbit/s)")
    parser.add_argument("--slowdown", type=float, default=16.0, help="compute slowdown of every peer (default 16)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages the coordinator must use (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--heartbeat", type=float, default=4.0,
                        help="peers' and coordinator's heartbeat (default 4: sixteen DHT nodes at 2 s would take most of 2 cores)")
    parser.add_argument("--window", type=float, default=60.0, help="seconds of each throughput window (default 60)")
    parser.add_argument("--rounds", type=int, default=2, help="windows per plan kind, alternating (default 2)")
    parser.add_argument("--compress", type=compress_choice, default=("auto", "auto"), metavar="auto|CODEC[/CODEC]",
                        help="the coordinator's --compress (default auto: it chooses each hop's codecs)")
    parser.add_argument("--model", default="tiny", help="the model preset every peer trains (default tiny)")
    parser.add_argument("--outer-warmup", type=int, metavar="STEP",
                        help="the coordinator's --outer-warmup (default the recipe's, 100): groups with outer steps "
                             "all-reduce every step until then, which the windows would measure on slow links")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-recovery", dest="recovery", action="store_false",
                        help="measure the windows only, no peer killed (about 10 minutes shorter)")
    parser.add_argument("--image", default="hetpeer:latest")
    parser.add_argument("--out", type=Path, help="the testbed's folder: compose project, logs (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--time-to-loss", type=float, metavar="LOSS",
                        help="instead: one testbed per --sync-modes mode, each trained from fresh weights until its "
                             "validation loss reaches LOSS (or --deadline); time to loss compared")
    parser.add_argument("--sync-modes", nargs="+", choices=("auto", "gossip", "allreduce", "outer"),
                        default=["auto", "gossip", "allreduce"], help="with --time-to-loss: the coordinators' --sync, in order")
    parser.add_argument("--eval-every", type=int, default=20, help="with --time-to-loss: validation every N steps (default 20)")
    parser.add_argument("--deadline", type=float, default=900.0,
                        help="with --time-to-loss: seconds a mode trains at most, from its first step (default 900)")
    args = parser.parse_args()
    if args.time_to_loss is not None and not (math.isfinite(args.time_to_loss) and args.time_to_loss > 0):
        parser.error(f"--time-to-loss must be a positive loss, got {args.time_to_loss:g}")
    if args.eval_every < 1 or not args.deadline > 0:
        parser.error(f"--eval-every must be at least 1 and --deadline positive, got {args.eval_every} and {args.deadline:g}")
    topology = world_wide(args.per_region)
    if args.time_to_loss is not None:
        return time_to_loss(args, topology)
    out = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-bench-testbed-"))).resolve()
    subnet = free_subnet()
    config = bench_config(args, topology, out, subnet)
    workload = Workload(preset(config.model), batch=config.batch, micro_batch=config.micro_batch, dtype=config.dtype)
    tokens_per_step = config.batch * workload.model.seq_len
    print(f"testbed: {len(topology.devices)} devices ({topology.name}), bandwidth x{args.scale:g}, compute {args.slowdown:g}x "
          f"slower, coordinator held to {args.stages} stages; project in {out}", flush=True)
    order = {peer_name(d.id): i for i, d in enumerate(topology.devices)}
    rng = np.random.default_rng(args.seed)
    bed = Testbed(config, lambda line: None)
    rows: list[tuple[str, dict]] = []
    plans: dict[str, Plan] = {}
    recovery: dict[str, float] = {}
    started = time.monotonic()
    try:
        bed.start()
        with ApiClient(bed.api_address, timeout_s=5.0) as client:
            poll(client, coordinator_up(bed, lambda: all_measured(client, len(topology.devices))), "every peer to measure every link",
                 timeout_s=900)
            print(f"every link measured after {time.monotonic() - started:.0f} s", flush=True)
            # a plan whose estimated links are all measured now: made on measured links, or solved again on them and kept
            planned = poll(client, lambda: (p := client.call_get_plan()[0]) and (m := all_measured(client, len(topology.devices)))
                           and all(b in m[a].links or a in m[b].links for a, b in p.estimated_links) and p,
                           "a plan made on measured links", timeout_s=300)
            print(f"coordinator's plan: {len(planned.stages)} stage(s) x {planned.group_size} lane(s), standby "
                  f"{', '.join(planned.standby) or 'none'}", flush=True)
            # the coordinator's key, from a copy (the running coordinator holds its home's lock), and a DHT node
            # on the testbed's bridge, where the containers can reach it
            signer = out / "baselines" / "coordinator.key"
            signer.parent.mkdir(exist_ok=True)
            shutil.copyfile(out / "homes" / "coordinator" / "coordinator.key", signer)
            gateway = subnet.rsplit(".", 1)[0] + ".1"
            join = JoinInfo.load(out / "swarm" / "join.json")
            control = ControlPlane(config.swarm, signer, join.initial_peers, [f"/ip4/{gateway}/tcp/0"]).start()
            try:
                plans.update(coordinator=planned, uncompressed=uncompressed(client, workload, args.stages, args.seed))
                for kind in ("random", "blocks"):
                    plans[kind] = baseline(client, planned, kind, workload, rng, lambda d: order[d.rsplit("-", 1)[0]], args.compress)
                for kind, plan in plans.items():
                    print(f"  {kind:<12} plan: {len(plan.stages)} stage(s) x {plan.group_size} lane(s), hops "
                          f"{'; '.join(s.hop_codecs or 'raw' for s in plan.stages[:-1]) or 'none'}", flush=True)
                # what the plans were made from, for a later look at the time model's terms
                (out / "plans.json").write_text(json.dumps({
                    "plans": {kind: plan.to_wire() for kind, plan in plans.items()},
                    "records": [p.record.to_wire() for p in client.call_list_peers()],
                }, indent=1))
                epoch = planned.epoch
                for round_ in range(args.rounds):
                    for kind, plan in plans.items():
                        epoch = max(epoch, client.call_get_plan()[0].epoch) + 1
                        first = round_ == 0 and kind == "coordinator"  # the plan the swarm started with: nothing ran before it
                        overhead_s = 0.0 if first else client.call_get_progress().step_overhead_s
                        running = planned if first else publish(control, client, plan, epoch, tokens_per_step)
                        predicted_s = predicted_now(client, running, workload, args.compress, overhead_s)
                        rows.append((kind, {**measure(client, running, args.window, tokens_per_step), "predicted_s": predicted_s}))
                        print(f"  {kind:<12} {rows[-1][1]['tokens_per_s']:>8.0f} tokens/s, {rows[-1][1]['measured_s']:.3f} s/step "
                              f"measured, {rows[-1][1]['predicted_s']:.3f} predicted", flush=True)
                # after every kind has run: what each peer's training achieved and its latest link probes, kept with
                # the windows for benchmarks/timemodel_fit.py (before the kills, which a slow machine may time out)
                (out / "windows.json").write_text(json.dumps({
                    "per_region": args.per_region, "scale": args.scale, "slowdown": args.slowdown, "batch": args.batch,
                    "windows": [{"kind": kind, **row} for kind, row in rows],
                    "records": [p.record.to_wire() for p in client.call_list_peers()],
                }, indent=1))
                for kind, plan in plans.items() if args.recovery else ():
                    epoch = max(epoch, client.call_get_plan()[0].epoch) + 1
                    running = publish(control, client, plan, epoch, tokens_per_step)
                    poll(client, lambda: (g := client.call_get_progress()).epoch == running.epoch
                         and g.step >= running.start_step + SETTLE_STEPS, f"the {kind} plan to run")
                    recovery[kind] = recover(bed, client, running)
                    print(f"  {kind:<12} a killed peer's plan replaced and running after {recovery[kind]:.1f} s", flush=True)
            finally:
                control.shutdown()
    finally:
        bed.logs()
        bed.shutdown()
    result = summarize(rows, recovery, plans)
    print_table(rows, result)
    if args.json:
        print(json.dumps(result))
    return 0


def summarize(rows: list[tuple[str, dict]], recovery: dict[str, float], plans: dict[str, Plan]) -> dict:
    result: dict = {}
    for kind in KINDS:
        mine = [r for k, r in rows if k == kind]
        result[kind] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "predicted_s": statistics.median(r["predicted_s"] for r in mine),
            "measured_s": statistics.median(r["measured_s"] for r in mine),
            "recovery_s": recovery.get(kind),
            "codecs": [stage.hop_codecs or "raw" for stage in plans[kind].stages[:-1]],
        }
    result["speedup_over_random"] = result["coordinator"]["tokens_per_s"] / result["random"]["tokens_per_s"]
    result["speedup_over_uncompressed"] = result["coordinator"]["tokens_per_s"] / result["uncompressed"]["tokens_per_s"]
    # in time to a loss: tokens/s over the steps each plan's step is worth (its sync's and its codecs' factor)
    result["steps_factor"] = {kind: plans[kind].steps_factor for kind in KINDS}
    result["to_loss_over_uncompressed"] = (result["speedup_over_uncompressed"] * plans["uncompressed"].steps_factor
                                           / plans["coordinator"].steps_factor)
    result["prediction_error"] = {k: result[k]["measured_s"] / result[k]["predicted_s"] - 1 for k in KINDS}
    result["goals"] = {"speedup_over_random": GOAL_SPEEDUP, "speedup_over_uncompressed": GOAL_CODECS,
                       "prediction_error": GOAL_PREDICTION}
    return result


def print_table(rows: list[tuple[str, dict]], result: dict) -> None:
    print("\nthroughput, same testbed, one run, windows in the order run (tokens/s: global batches completed per second)")
    print(f"{'plan':<12} {'epoch':>5} {'steps':>6} {'tokens/s':>9} {'predicted s/step':>17} {'measured s/step':>16} {'meas/pred':>9}")
    for name, r in rows:
        print(f"{name:<12} {r['epoch']:>5} {r['steps']:>6} {r['tokens_per_s']:>9.0f} {r['predicted_s']:>17.3f} "
              f"{r['measured_s']:>16.3f} {r['measured_s'] / r['predicted_s']:>9.2f}")
    print("\nmedians, against the goals (coordinator >= 2x random and >= 1.5x uncompressed; every |measured/predicted - 1| <= 25%):")
    for kind in KINDS:
        r = result[kind]
        recovery = f"{r['recovery_s']:.1f} s" if r["recovery_s"] is not None else "-"
        print(f"  {kind:<12} {r['tokens_per_s']:>8.0f} tokens/s ({r['tokens_per_s'] / result['coordinator']['tokens_per_s']:.2f}x), "
              f"measured/predicted {r['measured_s'] / r['predicted_s']:.2f}, recovery {recovery}")
    print(f"  coordinator over random: {result['speedup_over_random']:.2f}x, over uncompressed: "
          f"{result['speedup_over_uncompressed']:.2f}x; in time to loss over uncompressed (tokens/s over steps factors "
          f"{result['steps_factor']['coordinator']:.3f} and {result['steps_factor']['uncompressed']:.3f}): "
          f"{result['to_loss_over_uncompressed']:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
