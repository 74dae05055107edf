"""Swarm benchmark: the coordinator's plan against baselines on the same unequal peers, fault recovery,
and the planner's predicted step time against the measured one, all in one run of one swarm.

    python3 benchmarks/swarm.py [--peers 8] [--window 20] [--out DIR]

A local swarm (`hetpeer swarm`'s launcher: a coordinator and N `hetpeer join` processes) with unequal
peers, slow and fast joining in turn as strangers would: compute 3x, 1x, 3x, 1x, 2x, 1x, 2x, 1x
(repeated for more peers), and the last two full-speed peers sending at most 40 Mbit/s per
destination. Every peer is slowed `--base-slowdown` times on top, so that the emulated compute is
mostly waiting: eight processes on two cores would otherwise compete for the cores, and placement
would hardly matter. The coordinator is held to `--stages` (2): with the tiny model one stage fits
every peer and any assignment of peers to single-stage lanes is the same plan, so only a pipeline
gives placement something to decide. Once the coordinator's plan runs:

1. throughput: the swarm's tokens/s (global batches completed in `--window` seconds, once the plan
   has run `SETTLE_STEPS`) under the coordinator's plan, a random plan and the "blocks" plan (devices
   in join order) of the same shape, and, where the coordinator's lanes take unlike shares of the batch
   by their speed, the same plan with every lane taking an even share ("even lanes"), published with the
   coordinator's key as the coordinator would; `--rounds` windows each, alternating (the machine is
   shared and its load drifts); the medians are compared;
2. a fault: a peer of the plan is killed; reported: seconds until the coordinator publishes a plan
   without it, and until that plan has run a step;
3. a rejoin: the peer restarts with the same key; seconds until a plan includes it again, and until it
   has trained a step under that plan (its state downloaded from the peers that hold its layers);
4. prediction: for each plan, the planner's predicted seconds per step beside the measured ones.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.coordinator.planner import PlannerConfig, Shape, make_model, to_plan
from hetpeer.coordinator.planner.baselines import blocks_grid, random_grids
from hetpeer.coordinator.planner.lanes import lane_times
from hetpeer.coordinator.policy import build_problem
from hetpeer.logline import unstamp
from hetpeer.peer.launch import free_port
from hetpeer.protocol.control import ControlPlane
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload
from hetpeer.swarm.launcher import DEMO_RECIPE, LocalSwarm, SwarmConfig

LEAD_S = 8.0  # a published plan takes effect this far ahead, so every peer has read it
SETTLE_STEPS = 10  # steps a plan runs before its window opens: switching, downloads and first steps excluded
SLOW = (3.0, 1.0, 3.0, 1.0, 2.0, 1.0, 2.0, 1.0)  # compute slowdown by join order, on top of the base


def poll(client: ApiClient, condition, what: str, timeout_s: float = 180.0, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
        except ApiError:
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}")


def measure(client: ApiClient, plan: Plan, window_s: float, tokens_per_step: int) -> dict:
    """Wait for `plan` to run `SETTLE_STEPS`, then count the global batches the swarm completes in
    `window_s` seconds. A step is one global batch: every lane's share of it, and lanes of a gossip group
    keep within a step or two of each other, so the swarm's step counter is its progress. Both ends of
    the window read the coordinator's view, equally stale. Measured seconds per step: window / steps."""
    poll(client, lambda: (g := client.call_get_progress()).epoch == plan.epoch and g.step >= plan.start_step + SETTLE_STEPS,
         f"plan epoch {plan.epoch} to run")
    first, started = client.call_get_progress(), time.monotonic()
    deadline = started + window_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        progress = client.call_get_progress()
        if progress.epoch != plan.epoch:
            raise SystemExit(f"plan epoch {plan.epoch} was replaced by epoch {progress.epoch} during its window")
    elapsed_s, steps = time.monotonic() - started, progress.step - first.step
    if steps < 1:
        raise SystemExit(f"plan epoch {plan.epoch} completed no step in {elapsed_s:.0f} s")
    return {
        "epoch": plan.epoch, "steps": steps, "tokens_per_s": steps * tokens_per_step / elapsed_s,
        "measured_s": elapsed_s / steps, "predicted_s": plan.total_s,
    }


def announced(client: ApiClient) -> dict[str, PeerRecord]:
    """The records of the peers that are not leaving, by device id."""
    return {s.record.device_id: s.record for s in client.call_list_peers() if s.record.state != "leaving"}


def baseline(client: ApiClient, running: Plan, kind: str, workload: Workload, rng: np.random.Generator,
             position: Callable[[str], int], compress: tuple[str, str] = ("auto", "auto")) -> Plan:
    """A random or blocks plan in the running plan's shape; blocks takes the peers in `position` order (join
    order, or a topology file's). Its hops' codecs are chosen as a coordinator with `compress` would."""
    problem, estimated = build_problem(announced(client), workload, current=None)
    order = sorted(problem.device_ids, key=position)
    join_order = np.array([problem.device_ids.index(d) for d in order])
    shape = Shape(len(running.stages), running.group_size)
    grid = random_grids(problem, shape, 1, rng)[0] if kind == "random" else join_order[blocks_grid(shape)]
    model = make_model(problem, PlannerConfig(cost_model="time", compress=compress), shape)
    return to_plan(problem, "time", grid, model.report(grid))


def even_lanes(client: ApiClient, running: Plan, workload: Workload) -> Plan:
    """`running` with every lane taking ceil(batch / lanes) sequences instead of its share by speed; its predicted
    step: the running plan's with the slowest lane's time at the even split in place of the slowest at the shares."""
    problem, _ = build_problem(announced(client), workload, current=None)
    shape = Shape(len(running.stages), running.group_size)
    grid = np.array([[problem.device_ids.index(d) for d in stage.devices] for stage in running.stages])
    model = make_model(problem, PlannerConfig(cost_model="time"), shape)
    e = model._evaluate(grid[None])
    even_s = lane_times(*e["parts"], model.micro_batches, shape.stages).max() - e["lane_s"][0]
    cost = {**running.cost, "total_s": running.total_s + float(even_s)}
    return replace(running, lane_batches=(), micro_batches=model.micro_batches, cost=cost)


def join_order(device: str) -> int:
    """`peerN-...` -> N: the launcher starts peers in that order."""
    return int(re.match(r"peer(\d+)-", device).group(1))


def publish(control: ControlPlane, client: ApiClient, plan: Plan, epoch: int, tokens_per_step: int) -> Plan:
    """Publish `plan` under the coordinator's key, taking effect about `LEAD_S` seconds from now, with what the
    coordinator gives every plan from the one it replaces: the organizer's recipe and dataset (a plan without them
    would be republished at once under the recipe), and the data position at its start step."""
    progress, (current, _) = client.call_get_progress(), client.call_get_plan()
    step_s = tokens_per_step / progress.tokens_per_s if progress.tokens_per_s else 1.0
    start = max(progress.step + max(5, round(LEAD_S / step_s)), current.start_step)
    plan = replace(plan, epoch=epoch, start_step=start, recipe=current.recipe, dataset=current.dataset,
                   data_position=current.data_position_at(start))
    if not control.publish_plan(plan, ttl_s=3600):
        raise SystemExit(f"could not publish plan epoch {epoch}")
    return plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8, help="peers in the swarm (default 8)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of each throughput window (default 20)")
    parser.add_argument("--out", type=Path, help="logs (default: a temporary folder)")
    parser.add_argument("--base-slowdown", type=float, default=8.0,
                        help="every peer's compute slowdown, times 3, 1, 3, 1, 2, 1, 2, 1 in join order (default 8: "
                        "eight processes on a small machine then mostly wait instead of competing for its cores)")
    parser.add_argument("--rounds", type=int, default=3, help="windows per plan, alternating between the plans (default 3)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages the coordinator must use (default 2)")
    parser.add_argument("--group-size", type=int, help="fix the coordinator's group size too (default: it chooses)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-bench-swarm-"))
    slowdowns = tuple(args.base_slowdown * SLOW[i % len(SLOW)] for i in range(args.peers))
    full_speed = [i for i in range(args.peers) if SLOW[i % len(SLOW)] == 1.0]
    caps = tuple(40.0 if i in full_speed[-2:] else None for i in range(args.peers))
    config = SwarmConfig(
        out=out, peers=args.peers, steps=10**6, slowdowns=slowdowns, bandwidth_caps=caps, heartbeat_s=2.0,
        replan_interval_s=10**6, timeout_s=10.0, recipe=replace(DEMO_RECIPE, seed=args.seed),
        coordinator_args=("--stages", str(args.stages)) + (("--group-size", str(args.group_size)) if args.group_size else ()),
    )
    workload = Workload(preset(config.model), batch=config.batch, micro_batch=config.micro_batch, dtype=config.dtype)
    tokens_per_step = config.batch * workload.model.seq_len
    print(f"swarm: {args.peers} peers, slowdowns {list(slowdowns)}, caps (Mbit/s) {list(caps)}; logs in {out}", flush=True)
    lines: list[str] = []
    swarm = LocalSwarm(config, lines.append, free_port())
    rng = np.random.default_rng(args.seed)
    rows = []
    try:
        swarm.start()
        with ApiClient(swarm.api_address) as client:
            planned = poll(client, lambda: client.call_get_plan()[0], "the coordinator's first plan")
            print(f"coordinator's plan: {len(planned.stages)} stage(s) x {planned.group_size} lane(s), standby "
                  f"{', '.join(planned.standby) or 'none'}" + (f"; lanes take {'/'.join(map(str, planned.lane_batches))} of "
                  f"the batch's {planned.batch} sequences" if planned.lane_batches else ""), flush=True)
            rows.append(("coordinator", measure(client, planned, args.window, tokens_per_step)))
            # the coordinator's key, from a copy: its home is locked by the running coordinator
            signer = out / "baselines" / "coordinator.key"
            signer.parent.mkdir(exist_ok=True)
            shutil.copyfile(out / "coordinator" / "coordinator.key", signer)
            control = ControlPlane(config.swarm, signer, swarm.dht_maddrs[:1]).start()
            try:
                epoch, plans = planned.epoch, {"coordinator": planned}
                if planned.lane_batches:
                    plans["even lanes"] = even_lanes(client, planned, workload)
                for kind in ("random", "blocks"):
                    plans[kind] = baseline(client, planned, kind, workload, rng, join_order)
                for round_ in range(args.rounds):  # alternate, so drifts in the machine's load hit every plan alike
                    for kind, plan in plans.items():
                        if round_ == 0 and kind == "coordinator":
                            continue  # measured above
                        epoch += 1
                        running = publish(control, client, plan, epoch, tokens_per_step)
                        rows.append((kind, measure(client, running, args.window, tokens_per_step)))
            finally:
                control.shutdown()
            print_throughput(rows)
            recovery(swarm, client, running)
    finally:
        swarm.shutdown()
    return 0


def print_throughput(rows: list[tuple[str, dict]]) -> None:
    print("\nthroughput, same peers, one run, windows in the order run (tokens/s: global batches completed per second)")
    print(f"{'plan':<12} {'epoch':>5} {'steps':>6} {'tokens/s':>9} {'predicted s/step':>17} {'measured s/step':>16} {'meas/pred':>9}")
    for name, r in rows:
        print(f"{name:<12} {r['epoch']:>5} {r['steps']:>6} {r['tokens_per_s']:>9.0f} {r['predicted_s']:>17.3f} "
              f"{r['measured_s']:>16.3f} {r['measured_s'] / r['predicted_s']:>9.2f}")
    medians = {name: statistics.median(r["tokens_per_s"] for n, r in rows if n == name) for name, _ in rows}
    print("\nmedian over the windows, and ratio to the coordinator's plan:")
    for name, value in medians.items():
        print(f"  {name:<12} {value:>9.0f} tokens/s  {value / medians['coordinator']:.2f}x")
    sys.stdout.flush()


def recovery(swarm: LocalSwarm, client: ApiClient, running: Plan) -> None:
    # a full-speed peer: the swarm is worse off without it, so the coordinator takes it back when it returns
    config = swarm.config
    fastest = min(config.slowdown(i) for i, d in swarm.device_ids.items() if d in running.devices)
    index = next(i for i, d in sorted(swarm.device_ids.items())
                 if d in running.devices and config.slowdown(i) == fastest and config.cap(i) is None)
    victim = swarm.device_ids[index]
    killed = time.monotonic()
    swarm.kill_peer(index)
    new = poll(client, lambda: (p := client.call_get_plan()[0]) and p.epoch > running.epoch and p, "a plan without the dead peer")
    published_s = time.monotonic() - killed
    poll(client, lambda: (g := client.call_get_progress()).epoch == new.epoch and g.step > new.start_step, "the new plan to run")
    running_s = time.monotonic() - killed
    print(f"\npeer {victim} killed: new plan (epoch {new.epoch}) published after {published_s:.1f} s, running after "
          f"{running_s:.1f} s (records expire after 5 heartbeats of {swarm.config.heartbeat_s:g} s)")
    restarted = time.monotonic()
    swarm.start_peer(index)
    back = poll(client, lambda: (p := client.call_get_plan()[0]) and victim in p.devices and p, "a plan with the peer back", timeout_s=300)
    included_s = time.monotonic() - restarted
    log = swarm.config.out / f"peer{index}.log"

    def text() -> str:
        return "\n".join(map(unstamp, log.read_text().splitlines()))

    poll(client, lambda: any(int(e) >= back.epoch for e in re.findall(r"^e(\d+) stage", text(), re.M)),
         "the peer to train again", timeout_s=300)
    training_s = time.monotonic() - restarted
    download = re.findall(r"downloaded ([\d.]+) MiB of state in (\d+) chunk\(s\) from (.+) in ([\d.]+) s", text())
    print(f"peer {victim} restarted: in plan epoch {back.epoch} after {included_s:.1f} s, training after {training_s:.1f} s"
          + (f"; state download {download[-1][0]} MiB from {download[-1][2]} in {download[-1][3]} s" if download else
             "; kept no state to download (its layers were fresh)"))


if __name__ == "__main__":
    sys.exit(main())
