"""NAT benchmark: the same swarm with none, half and all of its peers behind home routers, on the testbed.

    python3 benchmarks/nat.py [--peers 4] [--window 90] [--slowdown 8] [--json]

One `hetpeer testbed` per variant, each of `--peers` devices in one region (`--bandwidth` Mbit/s and `--latency`
ms one way between any two, shaped per destination and emulated as in every testbed), compute slowed
`--slowdown` times so that the containers mostly wait on 2 cores as beside GPUs, the coordinator held to
`--stages` x `--group-size` (2 x 2: every peer trains, each with two lane or group neighbours):

- public: every device on the shared network;
- half-cone: every other device behind a cone NAT (Linux SNAT keeping ports);
- all-cone: every device behind a cone NAT (no public peer: nobody can relay; the pairs punch holes);
- half-symmetric: every other device behind a symmetric NAT (`--random-fully`);
- relays: two more devices than `--peers` and one more lane, every third device public and the others behind
  symmetric NATs, so that pairs of them must talk through a relay, and there are two relays to spread them over;
- link-down: the half-cone swarm, and after its window the first NATed device's router drops everything for
  `--outage` seconds (iptables DROP in its FORWARD chain: no reset, no error, as a home link that goes down).

Peers behind NAT join with no address flag, learn from the coordinator's reach service that nobody can dial
them and whether their NAT keeps ports, punch holes to each other where both do, and register at a public
peer's relay where there is one; the coordinator plans with what they announce. Per variant:

- tokens/s: global batches the swarm completes in `--window` seconds once it has run `SETTLE_STEPS`, from the
  coordinator's progress (the same reading `benchmarks/swarm.py` takes), against the public variant's;
- join to training: per peer, from its process's first log line (past the testbed's wait for the join file)
  to its first step line (the largest);
- relayed bytes: what the public peers' relays carried (their last "relay: carried" line, written as they leave);
- relay load: per relay, the MiB a step the plan predicted it carries (`Plan.relay_load`, read at the window's end)
  against what it carried a step while it trained: between its first and last "relay: carried" lines from its
  first step to its last, over the steps it made between them (its own step lines; the lines come every 30 s), so
  keepalives and anything else through it count too;
- paths: the pairs of peers whose records, at the window's end, say they reach each other over a punched hole,
  and through a relay;
- longest stall: the largest gap between two consecutive steps of any peer, first step to the window's end;
- standby: the peers the plan left out, with the coordinator's reason.

For link-down also: the steps the swarm made while the link was down (it must step on), and, from the link's
return, the seconds until the coordinator lists the peer again ("seen"), until its links work ("linked": its
record is back, lists no peer it cannot reach, and no other peer's record lists it), polled from the
coordinator's API every `POLL_S`, and until a round of its probes is answered by every other peer (its log's
first "links measured" line that names them all; `--probe-targets` is 4, so each round probes all three).

`--json` prints one JSON object as the last line: per variant those figures, and the goals' ratios (half-cone
and all-cone >= 0.9 of public, half-symmetric >= 0.7 or its unserved peers on standby with a reason; training within 60 s of
joining; no stall over 60 s; relays: each relay's load within what the plan predicted; link-down: the swarm steps
on and the peer is linked again within 30 s of the link's return).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from swarm import SETTLE_STEPS, poll  # noqa: E402  (the sibling benchmark's reading of the coordinator)

from hetpeer import logline  # noqa: E402
from hetpeer.coordinator.api_client import ApiClient  # noqa: E402
from hetpeer.peer.launch import free_port  # noqa: E402
from hetpeer.protocol.modelspec import preset  # noqa: E402
from hetpeer.protocol.topology import Topology  # noqa: E402
from hetpeer.testbed.compose import free_subnet  # noqa: E402
from hetpeer.testbed.project import COORDINATOR, ROUTER_SUFFIX, TestbedConfig, peer_name, service_name  # noqa: E402
from hetpeer.testbed.run import Testbed  # noqa: E402

VARIANTS = {
    "public": lambda i: "none",
    "half-cone": lambda i: "cone" if i % 2 else "none",
    "all-cone": lambda i: "cone",
    "half-symmetric": lambda i: "symmetric" if i % 2 else "none",
    "relays": lambda i: "none" if i % 3 == 0 else "symmetric",
    "link-down": lambda i: "cone" if i % 2 else "none",  # the half-cone swarm, then one NATed peer's link goes down
}
WIDER = {"relays": 2}  # variants with more devices than --peers (and a lane more: every device trains)
STEP_RE = re.compile(r"  step (\d+)\b")
RELAY_RE = re.compile(r"relay: carried ([\d.]+) MiB")
STANDBY_RE = re.compile(r"(\S+) stays on standby: (.*)")
PLAN_LIMIT_S = 240.0  # a variant whose swarm has not trained by then is reported as not training
RECOVERY_LIMIT_S = 180.0  # link-down: how long to watch for the peer's return
POLL_S = 0.5


def topology(peers: int, kinds, bandwidth_mbit: float, latency_ms: float) -> Topology:
    return Topology.from_wire({
        "name": "home",
        "devices": [{"id": f"d{i}", "region": "net", "tflops": 1.0, "nat": kinds(i)} for i in range(peers)],
        "regions": {"net": {"latency_ms": latency_ms, "bandwidth_gbps": bandwidth_mbit / 1e3}},
    })


def stamped(path: Path):
    """(seconds since the epoch, text) of each time-stamped line of a log."""
    for line in path.read_text(errors="replace").splitlines():
        when, text = logline.split(line)
        if when is not None:
            yield logline.seconds(when), text


def relay_rates(logs: dict[str, Path]) -> dict[str, float]:
    """Per peer that relayed while it trained: the MiB it carried a step, between its first and last "relay:
    carried" lines from its first step to its last."""
    rates = {}
    for name, path in logs.items():
        lines = list(stamped(path))
        steps = [(t, int(m.group(1))) for t, text in lines if (m := STEP_RE.search(text))]
        if not steps:
            continue
        carried = [(t, float(m.group(1))) for t, text in lines
                   if (m := RELAY_RE.search(text)) and steps[0][0] <= t <= steps[-1][0]]  # not as it lingers, leaving
        if len(carried) < 2:
            continue
        (t1, mib1), (t2, mib2) = carried[0], carried[-1]
        step1, step2 = (max(step for t, step in steps if t <= when) for when in (t1, t2))
        if step2 > step1:
            rates[name] = (mib2 - mib1) / (step2 - step1)
    return rates


def from_logs(logs: dict[str, Path], window_end: float) -> dict:
    """Join to training (per peer, the largest), the longest stall, relayed bytes, standby reasons."""
    joined, stalls, relayed, standby = {}, [], 0.0, {}
    for name, path in logs.items():
        lines = list(stamped(path))
        if name == COORDINATOR:
            standby.update({m.group(1): m.group(2) for _, text in lines if (m := STANDBY_RE.search(text))})
            continue
        steps = [t for t, text in lines if STEP_RE.search(text) and t <= window_end]
        started = [t for t, text in lines if not text.startswith("waiting for the join file")]  # the testbed's own wait
        if started and steps:
            joined[name] = steps[0] - started[0]
            stalls.append(max([b - a for a, b in zip(steps, steps[1:])] + [window_end - steps[-1]]))
        carried = [float(m.group(1)) for _, text in lines if (m := RELAY_RE.search(text))]
        relayed += carried[-1] if carried else 0.0
    return {
        "join_to_training_s": max(joined.values()) if joined else None, "peers_training": len(joined),
        "longest_stall_s": max(stalls) if stalls else None, "relayed_mib": relayed, "standby": standby,
    }


def run_variant(name: str, args, out: Path) -> dict:
    kinds, more = VARIANTS[name], WIDER.get(name, 0)
    group_size = args.group_size + (1 if more else 0)
    config = TestbedConfig(
        topology=topology(args.peers + more, kinds, args.bandwidth, args.latency), out=out / name, slowdown=args.slowdown,
        image=args.image, project=f"hetpeer-bench-nat-{time.time_ns() % 10**8}", subnet=free_subnet(),
        lan_subnets=free_subnet("10.214.0.0/16", prefix=20), api_port=free_port(), http_port=free_port(), swarm="nat",
        batch=args.batch, heartbeat_s=args.heartbeat,
        coordinator_args=("--replan-interval", "1000000", "--stages", str(args.stages), "--group-size", str(group_size)),
    )
    tokens_per_step = config.batch * preset(config.model).seq_len
    bed = Testbed(config, lambda line: None)
    row: dict = {"variant": name, "nat": [kinds(i) for i in range(args.peers + more)]}
    try:
        bed.start()
        with ApiClient(bed.api_address, timeout_s=5.0) as client:
            try:
                poll(client, lambda: client.call_get_progress().step >= SETTLE_STEPS, "the swarm to train", PLAN_LIMIT_S)
            except SystemExit as stopped:
                row.update(tokens_per_s=0.0, note=str(stopped))
            else:
                first, started = client.call_get_progress(), time.monotonic()
                time.sleep(args.window)
                last = client.call_get_progress()
                row["tokens_per_s"] = (last.step - first.step) * tokens_per_step / (time.monotonic() - started)
                plan, _ = client.call_get_plan()
                row["plan"] = f"{len(plan.stages)} stage(s) x {plan.group_size} lane(s), standby {len(plan.standby)}"
                row["relay_predicted_mib_per_step"] = {relay: carried / 2**20 for relay, _, carried in plan.relay_load}
                row.update(paths([status.record for status in client.call_list_peers()]))
            window_end = time.time()  # the stall figure is the window's: link-down's outage comes after it
            if name == "link-down" and "plan" in row:
                victim = next(d.id for d in config.topology.devices if d.nat != "none")
                row.update(link_down(bed, client, victim, args.outage))
        for service in [service_name(d.id) for d in config.topology.devices]:
            bed.compose.stop(service)  # as they leave, relays say what they carried in all
        logs = bed.logs()
        row.update(from_logs(logs, window_end))
        by_service = {service_name(d.id): relay for d in config.topology.devices
                      for relay in row.get("relay_predicted_mib_per_step", {}) if relay.startswith(f"{peer_name(d.id)}-")}
        row["relay_measured_mib_per_step"] = {by_service.get(service, service): rate
                                              for service, rate in relay_rates(logs).items()}
    finally:
        bed.shutdown()
    return row


def paths(records) -> dict:
    """The pairs of peers whose records say they reach each other over a punched hole, and through a relay."""
    def pairs(field: str) -> list[list[str]]:
        return sorted({tuple(sorted((r.device_id, other))) for r in records for other in getattr(r, field)})

    return {"punched_pairs": pairs("punched"), "relayed_pairs": pairs("relayed")}


def link_down(bed: Testbed, client: ApiClient, victim: str, outage_s: float) -> dict:
    """`victim`'s router drops everything for `outage_s` seconds: the steps the swarm made meanwhile, and the
    seconds from the link's return until the coordinator lists the peer again, until its links work (its record
    and the others' list no failed path to or from it) and until a round of its probes is answered by every other
    peer (a "links measured" line of its log naming them all)."""
    router = ["docker", "exec", bed.compose.container(service_name(victim) + ROUTER_SUFFIX), "iptables"]
    prefix = f"{peer_name(victim)}-"
    others = [f"{peer_name(d.id)}-" for d in bed.config.topology.devices if d.id != victim]
    before = client.call_get_progress().step
    subprocess.run([*router, "-I", "FORWARD", "1", "-j", "DROP"], check=True)
    time.sleep(outage_s)
    during = client.call_get_progress().step - before
    subprocess.run([*router, "-D", "FORWARD", "-j", "DROP"], check=True)
    up, up_wall = time.monotonic(), time.time()
    seen = linked = probed = None
    while (linked is None or probed is None) and time.monotonic() - up < RECOVERY_LIMIT_S:
        records = [status.record for status in client.call_list_peers()]
        mine = next((r for r in records if r.device_id.startswith(prefix)), None)
        if mine is not None:
            seen = seen if seen is not None else time.monotonic() - up
            if linked is None and not mine.unreachable and not any(mine.device_id in r.unreachable for r in records):
                linked = time.monotonic() - up
        if probed is None:
            lines = map(logline.split, bed.compose.logs(service_name(victim)).splitlines())
            measured = [logline.seconds(when) for when, text in lines
                        if when is not None and text.startswith("links measured") and logline.seconds(when) > up_wall
                        and all(f" {other}" in text for other in others)]
            probed = min(measured) - up_wall if measured else None
        time.sleep(POLL_S)
    return {"outage_s": outage_s, "steps_during_outage": during, "seen_after_s": seen, "linked_after_s": linked,
            "probes_answered_after_s": probed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4, help="devices in the swarm (default 4)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s between any two devices (default 100)")
    parser.add_argument("--latency", type=float, default=10.0, help="one-way ms between any two devices (default 10)")
    parser.add_argument("--slowdown", type=float, default=8.0, help="compute slowdown of every peer (default 8)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages the coordinator must use (default 2)")
    parser.add_argument("--group-size", type=int, default=2, help="lanes the coordinator must use (default 2)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat (default 2)")
    parser.add_argument("--window", type=float, default=90.0, help="seconds of the throughput window (default 90)")
    parser.add_argument("--outage", type=float, default=60.0, help="link-down: seconds the link is down (default 60)")
    parser.add_argument("--image", default="hetpeer:latest")
    parser.add_argument("--out", type=Path, help="where the testbeds' folders go (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="hetpeer-bench-nat-"))).resolve()
    wider = "".join(f" ({name}: {args.peers + more})" for name, more in WIDER.items() if name in args.variants)
    print(f"{args.peers} peers{wider}, {args.bandwidth:g} Mbit/s and {args.latency:g} ms between any two, compute "
          f"{args.slowdown:g}x slower; testbeds in {out}", flush=True)
    rows = {}
    for name in args.variants:
        rows[name] = run_variant(name, args, out)
        r = rows[name]
        print(f"  {name:<15} {r['tokens_per_s']:>8.0f} tokens/s  join->training {fmt(r.get('join_to_training_s'))} s  "
              f"stall {fmt(r.get('longest_stall_s'), 1)} s  relayed {r.get('relayed_mib', 0):.1f} MiB  "
              f"pairs punched {len(r.get('punched_pairs', ()))} relayed {len(r.get('relayed_pairs', ()))}  "
              f"{r.get('plan', r.get('note', ''))}" + (f"  standby: {r['standby']}" if r.get("standby") else ""), flush=True)
        for relay in sorted(set(r.get("relay_predicted_mib_per_step", {})) | set(r.get("relay_measured_mib_per_step", {}))):
            print(f"  {'':<15} relay {relay}: predicted {fmt(r.get('relay_predicted_mib_per_step', {}).get(relay), 3)} "
                  f"MiB a step, carried {fmt(r.get('relay_measured_mib_per_step', {}).get(relay), 3)}", flush=True)
        if "outage_s" in r:
            print(f"  {'':<15} link down {r['outage_s']:g} s: the swarm made {r['steps_during_outage']} step(s) meanwhile; "
                  f"after it returned the coordinator saw the peer in {fmt(r['seen_after_s'], 1)} s, its links worked in "
                  f"{fmt(r['linked_after_s'], 1)} s, every peer answered its probes in {fmt(r['probes_answered_after_s'], 1)} s",
                  flush=True)
    result = {"variants": rows}
    base = rows.get("public", {}).get("tokens_per_s")
    for name in ("half-cone", "all-cone", "half-symmetric"):
        if base and name in rows:
            result[f"{name}_vs_public"] = rows[name]["tokens_per_s"] / base
    joins = [r["join_to_training_s"] for r in rows.values() if r.get("join_to_training_s") is not None]
    stalls = [r["longest_stall_s"] for r in rows.values() if r.get("longest_stall_s") is not None]
    if "relays" in rows:  # each relay's measured load over its predicted one (a relay the plan gave nothing: None)
        predicted, measured = (rows["relays"].get(f"relay_{kind}_mib_per_step", {}) for kind in ("predicted", "measured"))
        result["relay_measured_vs_predicted"] = {relay: measured.get(relay, 0.0) / mib if mib else None
                                                 for relay, mib in predicted.items()}
    result["slowest_join_to_training_s"] = max(joins) if joins else None
    result["longest_stall_s"] = max(stalls) if stalls else None
    print("goals: half-cone >= 0.90 of public: " + fmt(result.get("half-cone_vs_public"), 3)
          + "; all-cone >= 0.90 of public, nothing relayed: " + fmt(result.get("all-cone_vs_public"), 3)
          + "; half-symmetric >= 0.70: " + fmt(result.get("half-symmetric_vs_public"), 3)
          + f"; training within 60 s of joining: {fmt(result['slowest_join_to_training_s'])} s"
          + f"; no stall over 60 s: {fmt(result['longest_stall_s'], 1)} s"
          + (f"; relays carry <= 1.0 of the predicted load: {result['relay_measured_vs_predicted']}"
             if "relay_measured_vs_predicted" in result else "")
          + (f"; link-down: stepped on ({rows['link-down']['steps_during_outage']} steps), links and probes again within "
             f"30 s: {fmt(rows['link-down']['linked_after_s'], 1)} and {fmt(rows['link-down']['probes_answered_after_s'], 1)} s"
             if "link-down" in rows else ""), flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


def fmt(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
