"""Poisoning benchmark: one peer of a 4-peer group poisons what it sends; how much do the honest peers lose, in
every sync mode the planner may pick?

    python3 benchmarks/poison.py [--steps 200] [--modes auto,gossip,allreduce,outer,pipeline,...] [--attacks scale,flip,random]
                                 [--undefended] [--out DIR] [--json]

Local swarms (`hetpeer swarm`'s launcher: a coordinator and four `hetpeer join` processes, one stage, so the four
peers form one group; in `pipeline`, two stages of two lanes, where the poisoner lies about the activations or
gradients it hands its lane and stage checks are the defence). Per sync mode (`auto`: the coordinator's own choice, as a user gets it; `gossip`,
`allreduce`, `outer`: forced with `--sync`; `outer` from the first step, every 10 steps, so that the outer steps
and not the warm start's all-reduce meet the poison), these runs:

- `honest`: the defaults (the recipe's `robust` and the coordinator's bans on);
- `honest-off`: no defence (`robust=0`, `check=0`, `--ban-period 0`), the same seed: what the defences cost an
  honest group, in loss and in tokens/s, side by side;
- one per attack, on defaults: peer3 is `benchmarks/poison_peer.py`, which trains like the others but sends its
  group everything x100 (`scale`), sign-flipped (`flip`) or as noise of its RMS (`random`): its parameters in
  gossip, its gradient in all-reduce, its change at outer steps, and the results of the part it owns; all
  finite and well-formed, so no frame check catches them;
- with `--undefended`, each attack once more with no defence.

Reported: the loss of the honest peers (peer0-2) that trained the swarm's last 10 steps (a peer on standby trains
no more), against the same peers' in the honest run of that mode; when the poisoner was banned, from the swarm's
first step; tokens/s. Goal: on defaults, within 10% of honest and banned within 60 s, for every attack and mode.
"""

from __future__ import annotations

from dataclasses import replace

import argparse
import collections
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from hetpeer import logline
from hetpeer.peer.launch import free_port
from hetpeer.swarm.launcher import DEMO_RECIPE, LocalSwarm, SwarmConfig, SwarmError
from hetpeer.swarm.report import lane_step

GOAL, BAN_GOAL_S = 1.10, 60.0
POISONER = 3
HONEST = ("peer0", "peer1", "peer2")
LAST_STEPS = 10
BATCH = 64  # sequences a step: enough that every peer is worth a lane, so the poisoner is in the group
# one stage and a group of four, so the poisoner is in it whatever the planner would choose (it plans outer steps
# in a pair of lanes, and on a busy machine one lane alone); once it is banned only a repair plan (its lane
# dropped) follows, since no new plan of four exists
GROUP = ("--stages", "1", "--group-size", "4", "--min-peers", "4")
PIPELINE = ("--stages", "2", "--group-size", "2", "--min-peers", "4")
MODES = {
    "auto": GROUP,
    "gossip": GROUP + ("--sync", "gossip"),
    "allreduce": GROUP + ("--sync", "allreduce"),
    "outer": GROUP + ("--sync", "outer", "--outer-every", "10"),
    # two stages of two lanes (sync the coordinator's choice, or forced): the poisoner lies about its stage's work
    # instead, what it hands its lane (activations forward, gradients back); each group is a pair, so stage checks
    # decide by disputes
    "pipeline": PIPELINE,
    "pipeline-gossip": PIPELINE + ("--sync", "gossip"),
    "pipeline-outer": PIPELINE + ("--sync", "outer", "--outer-every", "10"),
}
LANE_POISON = "stage-"  # poison_peer.py's prefix for a poison of the lane's tensors
BANNED_RE = re.compile(r"banned (peer\d+-\S+) for")
SYNC_RE = re.compile(r"^\s+stage 1 layers \S+ \((\w+)")


class PoisonedSwarm(LocalSwarm):
    def __init__(self, config: SwarmConfig, poison: str | None, poisoner: int = POISONER) -> None:
        super().__init__(config, lambda line: None, free_port())
        self.poison, self.poisoner = poison, poisoner
        self.losses: dict[str, dict[int, float]] = collections.defaultdict(dict)  # peer -> step -> its lane's loss
        self.first_step_s: float | None = None
        self.banned_s: float | None = None
        self.sync: str | None = None  # the first plan's sync mode

    def peer_command(self, i: int) -> list[str]:
        command = super().peer_command(i)
        if self.poison is not None and i == self.poisoner:
            assert command[1:3] == ["-m", "hetpeer"]
            command[1:3] = [str(Path(__file__).with_name("poison_peer.py")), self.poison]
        return command

    def _on_line(self, name: str, stamped: str) -> None:
        super()._on_line(name, stamped)
        line = logline.unstamp(stamped)
        step = lane_step(line, self.elapsed())
        if step is not None:
            self.losses[name][step.step] = step.loss
            self.first_step_s = step.time_s if self.first_step_s is None else self.first_step_s
        if name == "coordinator":
            if self.banned_s is None and BANNED_RE.search(line):
                self.banned_s = self.elapsed()
            if self.sync is None and (found := SYNC_RE.match(line)):
                self.sync = found.group(1)


def run(out: Path, steps: int, mode: str, poison: str | None, defended: bool) -> dict:
    recipe = DEMO_RECIPE if defended else replace(DEMO_RECIPE, robust=0.0, check=0.0)
    if mode.endswith("outer"):
        recipe = replace(recipe, outer_after=0)
    config = SwarmConfig(
        out=out, peers=4, steps=steps, swarm="poison", replan_interval_s=600.0, stall_s=180.0, batch=BATCH,
        coordinator_args=MODES[mode] + (() if defended else ("--ban-period", "0")), recipe=recipe,
    )
    if poison is not None and mode.startswith("pipeline"):
        poison = LANE_POISON + poison
    swarm = PoisonedSwarm(config, poison)
    try:
        swarm.start()
        report = swarm.run()
    finally:
        swarm.shutdown()
    # the honest lanes that trained the swarm's last steps (a peer the plan put on standby trains no more)
    trained = {step for peer in HONEST for step in swarm.losses.get(peer, {})}
    last = sorted(trained)[-LAST_STEPS:]
    finals = {peer: statistics.fmean(swarm.losses[peer][s] for s in last if s in swarm.losses[peer])
              for peer in HONEST if any(s in swarm.losses.get(peer, {}) for s in last)}
    banned = swarm.banned_s - swarm.first_step_s if swarm.banned_s is not None and swarm.first_step_s is not None else None
    return {"mode": mode, "sync": swarm.sync, "poison": poison, "defended": defended, "loss": statistics.fmean(finals.values()),
            "per_peer": finals, "banned_after_s": banned, "tokens_per_s": report.tokens_per_s, "wall_s": report.wall_s,
            "steps": report.steps}


def runs_of(mode: str, attacks: list[str], undefended: bool) -> list[tuple[str, str | None, bool]]:
    return [("honest", None, True), ("honest-off", None, False)] + [(a, a, True) for a in attacks] + \
        ([(f"{a}-off", a, False) for a in attacks] if undefended else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"sync modes to run (default {','.join(MODES)})")
    parser.add_argument("--attacks", default="scale,flip,random", help="poisons to try (default scale,flip,random)")
    parser.add_argument("--undefended", action="store_true", help="also run each attack with no defence")
    parser.add_argument("--out", type=Path, help="keep the runs' logs here (default: a temporary folder, removed)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    attacks = [a for a in args.attacks.split(",") if a]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    out = args.out or Path(tempfile.mkdtemp(prefix="hetpeer-poison-"))
    results = []
    try:
        for mode in modes:
            for name, poison, defended in runs_of(mode, attacks, args.undefended):
                print(f"running {mode} {name} ({args.steps} steps)...", flush=True)
                try:
                    results.append(run(out / mode / name, args.steps, mode, poison, defended) | {"run": name})
                except SwarmError as error:
                    results.append({"run": name, "mode": mode, "poison": poison, "defended": defended, "loss": float("nan"),
                                    "error": str(error)})
                    print(f"  {mode} {name} failed: {error}", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\nhonest peers' loss over their last {LAST_STEPS} of {args.steps} steps (peer0-2; peer3 poisons); "
          "defaults: the recipe's robust averaging and bans; -off: neither")
    print(f"{'mode':9s} {'sync':9s} {'run':14s} {'loss':>8s} {'vs honest':>10s} {'banned after':>13s} {'tokens/s':>9s} {'vs honest':>10s}")
    met = True
    for mode in modes:
        of_mode = [r for r in results if r["mode"] == mode]
        honest = next(r for r in of_mode if r["run"] == "honest")
        for r in of_mode:
            r["vs_honest"] = r["loss"] / honest["loss"]
            speed = (r.get("tokens_per_s") or float("nan")) / (honest.get("tokens_per_s") or float("nan"))
            banned = f"{r['banned_after_s']:.0f} s" if r.get("banned_after_s") is not None else "-"
            print(f"{mode:9s} {str(r.get('sync')):9s} {r['run']:14s} {r['loss']:8.3f} {r['vs_honest']:9.3f}x {banned:>13s} "
                  f"{r.get('tokens_per_s') or float('nan'):9.0f} {speed:9.3f}x")
            if r["defended"] and r["poison"] is not None and not (
                    r["vs_honest"] <= GOAL and r.get("banned_after_s") is not None and r["banned_after_s"] <= BAN_GOAL_S):
                met = False
    print(f"goal: on defaults, every attack within {GOAL - 1:.0%} of the honest run's loss and the poisoner banned within "
          f"{BAN_GOAL_S:g} s of the first step: {'met' if met else 'NOT met'}")
    if args.json:
        print(json.dumps({"goal": GOAL, "ban_goal_s": BAN_GOAL_S, "met": met, "runs": results}))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
