"""What robust averaging costs an honest group: validation loss (paired by seed) and time a step, with the recipe's
`robust` at its default against 0, in each sync mode.

    python3 benchmarks/robust.py [--modes allreduce,outer,gossip] [--seeds 3] [--steps 300] [--lanes 4] [--json]

One stage of the `tiny` preset, its lanes' workers (`StageWorker`, the runtime's own) in threads of one process over
`MemoryTransport`, so what differs between the two runs of a pair is the averaging alone: the same initial weights,
the same data, the same steps. The pair steps in lockstep (a step of one, then the same step of the other), so
the machine's load falls on both alike. Per mode and seed: each run's validation loss on the same held-out
sequences after the last step, and their ratio; per mode: the mean ratio with its range over seeds, the time a step
of each (all lanes, averaging included) and its ratio, and how many contributions or owners' results robust
averaging clipped over the honest run (`SyncReport.clipped`, summed over the members: a step not the group's plain
mean), and who reported whom (an honest run's false accusations: goal none).

Modes: `allreduce` (the butterfly every step), `outer` (outer steps every 10 steps after a warm start of 20 steps of
all-reduce), `gossip` (robust mixing, the one-peer exponential graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import ROBUST, Recipe
from hetpeer.swarm import DEMO_RECIPE

MODES = ("allreduce", "outer", "gossip")
OUTER_EVERY, OUTER_AFTER = 10, 20
MICRO_BATCH = 2  # sequences, as the demo's


class Run:
    """One group of `lanes` workers training one stage of the tiny model under `recipe`."""

    def __init__(self, mode: str, lanes: int, batch: int, steps: int, recipe: Recipe, corpus: Corpus) -> None:
        devices = tuple(f"p{i}" for i in range(lanes))
        stage = StagePlan(0, 0, 4, devices, mode, outer_every=OUTER_EVERY if mode == "outer" else 0)
        # validation at step 0 and after the last step: the plan evaluates at the steps divisible by eval_every
        micro_batches = max(1, batch // lanes // MICRO_BATCH)
        plan = Plan("time", "tiny", 4, batch, MICRO_BATCH, micro_batches, "fp32", (stage,),
                    recipe=replace(recipe, eval_every=steps))
        hub = MemoryHub()
        self.workers = []
        for device in devices:
            transport = MemoryTransport(device, hub)
            transport.start()
            self.workers.append(StageWorker(plan, device, transport, corpus, WorkerConfig(timeout_s=120)))
        self.pool = ThreadPoolExecutor(lanes)
        self.seconds = 0.0
        self.clipped = 0
        self.reported: set[tuple[str, str]] = set()  # (reporter, reported): false accusations, in an honest run
        self.val_loss: float | None = None

    def step(self, last: bool) -> None:
        started = time.perf_counter()
        results = list(self.pool.map(lambda w: w.train_step(last), self.workers))
        self.seconds += time.perf_counter() - started
        self.clipped += sum(r.sync.clipped for r in results)
        self.reported |= {(w.device_id, d) for w in self.workers for d in w.sync.outliers()}
        losses = [r.val_loss for r in results if r.val_loss is not None]
        if losses:
            self.val_loss = statistics.fmean(losses)

    def close(self) -> None:
        self.pool.shutdown()
        for worker in self.workers:
            worker.transport.shutdown()


def pair(mode: str, seed: int, args: argparse.Namespace, corpus: Corpus) -> dict:
    recipe = replace(DEMO_RECIPE, seed=seed, outer_after=OUTER_AFTER)
    runs = {name: Run(mode, args.lanes, args.batch, args.steps, replace(recipe, robust=robust), corpus)
            for name, robust in (("robust", ROBUST), ("plain", 0.0))}
    try:
        for t in range(args.steps + 1):  # the last step only validates what the steps before trained
            for run in runs.values():
                run.step(last=t == args.steps)
    finally:
        for run in runs.values():
            run.close()
    robust, plain = runs["robust"], runs["plain"]
    return {"mode": mode, "seed": seed, "robust_val": robust.val_loss, "plain_val": plain.val_loss,
            "ratio": robust.val_loss / plain.val_loss, "robust_s": robust.seconds / (args.steps + 1),
            "plain_s": plain.seconds / (args.steps + 1), "clipped": robust.clipped,
            "reported": sorted(f"{a} reported {b}" for a, b in robust.reported)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"sync modes (default {','.join(MODES)})")
    parser.add_argument("--seeds", type=int, default=3, help="seeds, each a pair of runs (default 3)")
    parser.add_argument("--steps", type=int, default=300, help="steps a run (default 300)")
    parser.add_argument("--lanes", type=int, default=4, help="the group's lanes (default 4)")
    parser.add_argument("--batch", type=int, default=16, help="sequences a step, over all lanes (default 16)")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    corpus = Corpus.default()
    rows = []
    for mode in modes:
        for seed in range(args.seeds):
            print(f"{mode} seed {seed}: {args.steps} steps, robust {ROBUST:g} and 0 in lockstep...", flush=True)
            rows.append(pair(mode, seed, args, corpus))
            r = rows[-1]
            print(f"  validation loss {r['robust_val']:.4f} robust, {r['plain_val']:.4f} plain ({r['ratio']:.4f}x); "
                  f"{r['robust_s'] * 1e3:.1f} against {r['plain_s'] * 1e3:.1f} ms a step; {r['clipped']} clipped; "
                  f"reported: {', '.join(r['reported']) or 'nobody'}", flush=True)
    print(f"\n{args.lanes} lanes of the tiny model, batch {args.batch}, {args.steps} steps, {args.seeds} seed(s); "
          f"robust {ROBUST:g} against 0, paired by seed")
    print(f"{'mode':10s} {'val loss ratio':>15s} {'range':>17s} {'ms a step':>16s} {'time ratio':>11s} {'clipped':>8s} "
          f"{'reported':>9s}")
    summary = {}
    for mode in modes:
        of = [r for r in rows if r["mode"] == mode]
        ratios = [r["ratio"] for r in of]
        robust_s, plain_s = sum(r["robust_s"] for r in of) / len(of), sum(r["plain_s"] for r in of) / len(of)
        summary[mode] = {"ratio": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios),
                         "robust_s": robust_s, "plain_s": plain_s, "time_ratio": robust_s / plain_s,
                         "clipped": sum(r["clipped"] for r in of), "reported": sum(len(r["reported"]) for r in of)}
        s = summary[mode]
        print(f"{mode:10s} {s['ratio']:14.4f}x {s['min']:8.4f}-{s['max']:.4f}x {robust_s * 1e3:6.1f} / {plain_s * 1e3:5.1f} "
              f"{s['time_ratio']:10.3f}x {s['clipped']:8d} {s['reported']:9d}")
    if args.json:
        print(json.dumps({"runs": rows, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
