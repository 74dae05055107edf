"""The quality table: what each way of syncing a group costs in validation loss, and in steps, against all-reduce
at equal tokens, from runs of benchmarks/gossip_scale.py.

    python3 benchmarks/gossip_table.py DIR [DIR ...] [--json]

Each DIR is a `gossip_scale.py --out DIR` folder (its runs.jsonl); runs of several folders that share a model, a
group size and a lane batch (tokens a peer-step) and step count form one cell of the table. In a cell, every method
is taken at its best learning rate (the lowest mean final validation loss over the seeds it ran; an lr run on more
seeds is preferred) and compared with all-reduce at its own best, seed by seed (paired: the same initial
weights and data):

- gap: the method's final validation loss over all-reduce's, minus 1; the mean over seeds and, with more than
  one, their range;
- steps factor: how many times all-reduce's steps the method needs to reach its loss (located on all-reduce's
  validation curve; where the method ends below all-reduce, its own steps to all-reduce's final loss over all
  the steps): what the planner multiplies a plan's step time by;
- parity: per method and group size, the smallest lane batch at which the gap is within 1%.
- noise scale: the gradient noise scale (B_simple, tokens) all-reduce measured over the second half of its
  runs (the median), where the runs recorded it: what places another model on this table.

With --json, the last line is the table as one JSON object (cells with their rows), which docs/gossip.md and
the planner's table (`planner/quality.py`) are written from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gossip import Run  # noqa: E402

PARITY = 0.01  # a gap within this is parity


def read(folders: list[Path]) -> list[dict]:
    runs = []
    for folder in folders:
        path = folder / "runs.jsonl"
        if not path.is_file():
            raise SystemExit(f"{folder}: no runs.jsonl (a gossip_scale.py --out folder holds one)")
        summary = folder / "summary.json"
        meta = json.loads(summary.read_text()) if summary.is_file() else {}
        for line in path.read_text().splitlines():
            run = json.loads(line)
            if run["status"] == "done" and run["curve"]:
                run["model"] = meta.get("model", "?")
                run.setdefault("seed", meta.get("seed", 0))
                run["tokens_per_peer"] = run["tokens_per_step"] // run["peers"]
                runs.append(run)
    return runs


def curve(run: dict) -> Run:
    return Run([tuple(point) for point in run["curve"]], run["train_loss"] or 0.0, run["consensus"] or 0.0)


def best(runs: list[dict]) -> float:
    """The learning rate of `runs` (one method) run on the most seeds, the lowest mean final loss among those."""
    by_lr: dict[float, list[float]] = defaultdict(list)
    for run in runs:
        by_lr[run["lr"]].append(run["val_loss"])
    most = max(len(v) for v in by_lr.values())
    return min((lr for lr, v in by_lr.items() if len(v) == most), key=lambda lr: statistics.mean(by_lr[lr]))


def cells(runs: list[dict]) -> list[dict]:
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        grouped[(run["model"], run["peers"], run["tokens_per_peer"], run["steps"])].append(run)
    table = []
    for (model, peers, tokens, steps), members in sorted(grouped.items()):
        methods: dict[str, list[dict]] = defaultdict(list)
        for run in members:
            methods[run["method"]].append(run)
        if "allreduce" not in methods:
            continue
        reference_lr = best(methods["allreduce"])
        reference = {r["seed"]: r for r in methods["allreduce"] if r["lr"] == reference_lr}
        rows = []
        for method, mine in methods.items():
            lr = best(mine)
            gaps, factors, losses = [], [], []
            for run in (r for r in mine if r["lr"] == lr and r["seed"] in reference):
                base, own = curve(reference[run["seed"]]), curve(run)
                gaps.append(own.loss / base.loss - 1)
                factors.append(steps / base.steps_to(own.loss) if own.loss > base.loss else own.steps_to(base.loss) / steps)
                losses.append(own.loss)
            if gaps:
                rows.append({"method": method, "lr": lr, "seeds": len(gaps), "val_loss": statistics.mean(losses),
                             "gap": statistics.mean(gaps), "gap_range": [min(gaps), max(gaps)],
                             "steps_factor": statistics.mean(factors)})
        noise = [v for run in reference.values() for step, v in run.get("noise_scale_curve", []) if v and step > steps / 2]
        table.append({"model": model, "peers": peers, "tokens_per_peer": tokens, "steps": steps, "rows": rows,
                      "noise_tokens": statistics.median(noise) if noise else None})
    return table


def parity(table: list[dict]) -> dict[str, dict[int, int | None]]:
    """Per method and group size: the smallest lane batch (tokens a peer-step) with the gap within PARITY (None: none)."""
    found: dict[str, dict[int, int | None]] = defaultdict(dict)
    for cell in sorted(table, key=lambda c: c["tokens_per_peer"]):
        for row in cell["rows"]:
            mine = found[row["method"]]
            if mine.get(cell["peers"]) is None:
                mine[cell["peers"]] = cell["tokens_per_peer"] if row["gap"] <= PARITY else None
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="gossip_scale.py --out folders")
    parser.add_argument("--json", action="store_true", help="print the table as one JSON object, the last line")
    args = parser.parse_args(argv)
    table = cells(read(args.folders))
    if not table:
        raise SystemExit("no cell has a finished all-reduce run to compare with")
    print(f"{'model':12s} {'peers':>5s} {'tokens':>7s} {'steps':>6s}  {'method':14s} {'lr':>7s} {'seeds':>5s} "
          f"{'val loss':>9s} {'gap':>8s} {'range':>17s} {'steps x':>8s}")
    for cell in table:
        if cell["noise_tokens"]:
            print(f"{cell['model']:12s} {cell['peers']:5d} {cell['tokens_per_peer']:7d} {cell['steps']:6d}  gradient noise scale "
                  f"{cell['noise_tokens']:,.0f} tokens (all-reduce, second half)")
        for row in cell["rows"]:
            spread = f"{row['gap_range'][0]:+.2%}..{row['gap_range'][1]:+.2%}" if row["seeds"] > 1 else ""
            print(f"{cell['model']:12s} {cell['peers']:5d} {cell['tokens_per_peer']:7d} {cell['steps']:6d}  "
                  f"{row['method']:14s} {row['lr']:7.1e} {row['seeds']:5d} {row['val_loss']:9.4f} {row['gap']:+8.2%} "
                  f"{spread:>17s} {row['steps_factor']:8.2f}")
    reached = parity(table)
    print(f"\nparity (gap within {PARITY:.0%}): the smallest lane batch, tokens a peer-step, by group size")
    for method, sizes in reached.items():
        print(f"  {method:14s} " + "  ".join(f"{peers} peers: {tokens or 'not reached'}" for peers, tokens in sorted(sizes.items())))
    if args.json:
        print(json.dumps({"cells": table, "parity": reached}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
