"""Soak benchmark: a swarm under churn and one poisoner for ten minutes; stalls, loss and leaks.

    python3 benchmarks/soak.py [--minutes 10] [--peers 6] [--seed 0] [--out DIR] [--json]

A local swarm (`hetpeer swarm`'s launcher: a coordinator and `--peers` `hetpeer join` processes, robust
mixing and bans on) in which the last peer poisons its gossip (`poison_peer.py scale`: parameters x100).
Every 20 to 40 s (seeded) one fault, chosen at random among those possible:

- kill: a peer, or now and then the coordinator, dies without a word (SIGKILL to its process group:
  the process, its DHT node and p2pd), as a crashed machine would;
- restart: a killed peer comes back with the same home (key), or the coordinator with the same key;
- partition: a peer is cut off for 10 to 20 s. On one machine this is emulated by stopping its whole
  process group (SIGSTOP, then SIGCONT): to the others it is silent, as a host behind a broken link is.
  The compose testbed cuts real links (tests/compose); this benchmark runs anywhere.

At least three honest peers stay up. Reported, against the goals:

- the longest stall: the longest time the swarm's furthest completed step did not move (goal: < 60 s);
- the honest peers' loss over the first and the last 10 steps;
- leaks: the swarm's processes (whose homes are in --out), p2pd processes, this process's threads and open files, p2pd's Unix sockets in the
  temp folder (a process killed with SIGKILL leaves its own: those are told apart) and torch's
  shared-memory files, before the swarm started and after it stopped; and for
  each peer that ran throughout, its threads and open files (sockets among them) a minute in and at the
  end (goal: nothing that grows with time).
"""

from __future__ import annotations

from dataclasses import replace

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from poison import PoisonedSwarm

from hetpeer.swarm.launcher import DEMO_RECIPE, SwarmConfig

STALL_GOAL_S = 60.0
SOCKETS = "p2pd sockets in the temp folder"
MIN_HONEST_UP = 3
LAST_STEPS = 10


def processes(marker: str) -> list[int]:
    """Pids of processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return found


def usage(pid: int) -> dict[str, int]:
    """A process's threads, open files, and the sockets among them."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(fd))
            except OSError:
                pass
        return {"threads": len(list(Path(f"/proc/{pid}/task").iterdir())), "files": len(fds),
                "sockets": sum(link.startswith("socket:") for link in links)}
    except OSError:
        return {}


def machine(out: Path) -> dict[str, int]:
    temp = Path(tempfile.gettempdir())
    shm = Path("/dev/shm")
    return {
        "swarm processes (homes in --out)": len(processes(f"{out}/")),
        "p2pd processes": len(processes("p2pd")),
        SOCKETS: len(list(temp.glob("hivemind-p2p*.sock"))),
        "torch shared-memory files": len(list(shm.glob("torch_*"))) if shm.exists() else 0,
        "this process's threads": len(list(Path("/proc/self/task").iterdir())),
        "this process's open files": len(list(Path("/proc/self/fd").iterdir())),
    }


class Soak:
    def __init__(self, swarm: PoisonedSwarm, rng: random.Random, say) -> None:
        self.swarm, self.rng, self.say = swarm, rng, say
        self.dead: set[int] = set()  # peers killed and not restarted
        self.coordinator_dead = False
        self.touched: set[int] = set()  # peers killed, restarted or cut off at some point
        self.events: list[tuple[float, str]] = []

    def honest_up(self) -> list[int]:
        return [i for i in range(len(self.swarm.peers)) if i != self.swarm.poisoner and i not in self.dead]

    def act(self) -> None:
        swarm, rng = self.swarm, self.rng
        choices = []
        if len(self.honest_up()) > MIN_HONEST_UP:
            choices += ["kill", "kill", "partition"]
        if self.dead:
            choices += ["restart", "restart"]
        if len(self.honest_up()) >= MIN_HONEST_UP:
            choices.append("partition")
        choices.append("coordinator")
        action = rng.choice(choices)
        if action == "coordinator":
            if self.coordinator_dead:
                swarm.start_coordinator()
                self.log("coordinator restarted")
            else:
                swarm.kill_coordinator()
                self.log("coordinator killed")
            self.coordinator_dead = not self.coordinator_dead
        elif action == "kill":
            i = rng.choice(self.honest_up())
            swarm.kill_peer(i)
            self.dead.add(i)
            self.touched.add(i)
            self.log(f"peer{i} killed")
        elif action == "restart":
            i = rng.choice(sorted(self.dead))
            swarm.start_peer(i)
            self.dead.discard(i)
            self.log(f"peer{i} restarted")
        else:
            i = rng.choice(self.honest_up())
            seconds = rng.uniform(10, 20)
            group = swarm.peers[i].popen.pid
            self.touched.add(i)
            self.log(f"peer{i} cut off for {seconds:.0f} s")
            os.killpg(group, signal.SIGSTOP)
            time.sleep(seconds)
            try:
                os.killpg(group, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def log(self, text: str) -> None:
        self.events.append((self.swarm.elapsed(), text))
        self.say(f"{self.swarm.elapsed():6.0f} s  {text}")


def longest_stall(done: list[tuple[float, str, int]], start_s: float, end_s: float) -> tuple[float, float]:
    """The longest time (and when it began) the furthest completed step did not move, between start and end."""
    furthest, since, worst, at = -1, start_s, 0.0, start_s
    for time_s, _, step in sorted(done):
        if time_s < start_s or time_s > end_s:
            continue
        if step > furthest:
            if time_s - since > worst:
                worst, at = time_s - since, since
            furthest, since = step, time_s
    if end_s - since > worst:
        worst, at = end_s - since, since
    return worst, at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the swarm runs under faults (default 10)")
    parser.add_argument("--peers", type=int, default=6, help="peers, the last of them the poisoner (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    parser.add_argument("--clip", type=float, default=2.0, help="the honest peers' --robust (default 2)")
    parser.add_argument("--out", type=Path, help="keep the logs here (default: a temporary folder, removed)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-soak-"))
    before = machine(out)
    config = SwarmConfig(out=out, peers=args.peers, steps=10**6, swarm="soak", stall_s=3600.0,
                         recipe=replace(DEMO_RECIPE, robust=args.clip))
    swarm = PoisonedSwarm(config, "scale", poisoner=args.peers - 1)
    soak = Soak(swarm, random.Random(args.seed), lambda line: print(line, flush=True))
    early: dict[int, dict[str, int]] = {}
    try:
        swarm.start()
        while not swarm.done:
            if swarm.elapsed() > 300:
                raise SystemExit(f"the swarm did not train within 300 s; logs in {out}")
            time.sleep(0.5)
        start_s = swarm.elapsed()
        soak.log("training: faults begin")
        end_s = start_s + args.minutes * 60
        next_s = start_s + soak.rng.uniform(20, 40)
        while swarm.elapsed() < end_s:
            if not early and swarm.elapsed() > start_s + 60:
                early = {i: usage(p.popen.pid) for i, p in enumerate(swarm.peers) if p.alive and i not in soak.touched}
            if swarm.elapsed() >= next_s:
                soak.act()
                next_s = swarm.elapsed() + soak.rng.uniform(20, 40)
            time.sleep(0.2)
        end_s = swarm.elapsed()
        late = {i: usage(swarm.peers[i].popen.pid) for i in early if i not in soak.touched and swarm.peers[i].alive}
    finally:
        swarm.shutdown()
    time.sleep(3)  # the last children reaped, their files closed
    after = machine(out)
    stall_s, stall_at = longest_stall(swarm.done, start_s, end_s)
    honest = [f"peer{i}" for i in range(args.peers - 1)]
    points = sorted((step, loss) for name in honest for step, loss in swarm.losses.get(name, {}).items())
    steps = sorted({s for s, _ in points})
    first = statistics.fmean(loss for s, loss in points if s in steps[:LAST_STEPS])
    last = statistics.fmean(loss for s, loss in points if s in steps[-LAST_STEPS:])
    bans = [line for line in (out / "coordinator.log").read_text().splitlines() if " banned " in f" {line}"]

    print(f"\nsoak: {args.peers} peers (peer{args.peers - 1} poisons), {len(soak.events) - 1} faults in "
          f"{(end_s - start_s) / 60:.1f} min of training, steps {steps[0] + 1} to {steps[-1] + 1}")
    print(f"longest stall: {stall_s:.1f} s (from {stall_at:.0f} s; goal < {STALL_GOAL_S:g} s): "
          f"{'met' if stall_s < STALL_GOAL_S else 'NOT met'}")
    print(f"honest peers' loss: {first:.3f} over the first {LAST_STEPS} steps, {last:.3f} over the last {LAST_STEPS}")
    print(f"bans: {len(bans)}" + "".join(f"\n  {line}" for line in bans))
    print(f"{'machine':34s} {'before':>7s} {'after':>7s}")
    for key in before:
        print(f"{key:34s} {before[key]:7d} {after[key]:7d}")
    print(f"{'peer that ran throughout':26s} {'threads':>15s} {'open files':>15s} {'sockets':>15s}")
    for i in late:
        row = "".join(f" {early[i].get(k, 0):6d} -> {late[i].get(k, 0):5d}" for k in ("threads", "files", "sockets"))
        print(f"peer{i:<22d}{row}")
    leaked = {k: after[k] - before[k] for k in before if after[k] > before[k]}
    kills = sum(text.endswith("killed") for _, text in soak.events)
    if 0 < leaked.get(SOCKETS, 0) <= kills:  # p2pd's socket files of processes SIGKILLed: they had no chance to clean up
        print(f"{SOCKETS}: {leaked.pop(SOCKETS)} left by the {kills} processes killed (SIGKILL), none by processes that stopped")
    grew = {f"peer{i} {k}": late[i][k] - early[i][k] for i in late for k in late[i] if late[i][k] > early[i].get(k, 0)}
    print(f"leaks: {leaked or 'none'}; growth in peers that ran throughout: {grew or 'none'}")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    if args.json:
        print(json.dumps({"longest_stall_s": stall_s, "stall_goal_s": STALL_GOAL_S, "loss_first": first, "loss_last": last,
                          "faults": soak.events, "bans": bans, "machine_before": before, "machine_after": after,
                          "peers_early": early, "peers_late": late, "leaked": leaked, "grew": grew}))
    return 0 if stall_s < STALL_GOAL_S and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
