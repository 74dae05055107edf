"""Pipeline benchmark: measured step time of a real pipeline against the planner's `time` prediction.

    python3 benchmarks/pipeline.py [--stages 2 4] [--steps 8] [--batch 16] [--micro-batch 2]

For each pipeline depth S (one lane, the `small` preset, fp32, on this machine's CPU):

1. probe: S processes at once (as the peers will run) time forward + backward through one block at
   the plan's micro-batch (`hetpeer.peer.probe.block_tflops`) and plain matrix multiplies
   (`matmul_tflops`), one thread each; the direct transport's latency and bandwidth are measured
   between two processes;
2. plan: `hetpeer plan` on a topology of S devices with those figures, shape fixed to S x 1, gives the
   predicted step time;
3. run: `hetpeer launch` runs that plan in S processes; the step time is the median over steps after
   the first two (warm-up), taken on the slowest peer; each peer also reports its peak memory.

Goal: the prediction within 20% of the measured step. The matmul-probe prediction is printed beside it
to show what a datasheet-style probe would predict. Exit status 1 when the goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from transport import framed  # noqa: E402  (the sibling benchmark's timed transfer)

import torch  # noqa: E402

from hetpeer.logline import unstamp  # noqa: E402

GOAL = 0.20
MODEL = "small"
PROBE = """
import json, sys, torch
torch.set_num_threads(1)
from hetpeer.peer.probe import block_tflops, matmul_tflops
from hetpeer.protocol.modelspec import preset
print(json.dumps({"block": block_tflops(preset(sys.argv[1]), int(sys.argv[2]), seconds=3.0),
                  "matmul": matmul_tflops(seconds=3.0)}))
"""
STEP_LINE = re.compile(r"^\[(\S+)\] step (\d+)/\d+ .* ([0-9.]+) s \(compute")
MEMORY_LINE = re.compile(r"^\[(\S+)\] memory: (.*)$")


def probe(peers: int, micro_batch: int) -> dict[str, float]:
    """Mean achieved TFLOPS per peer while `peers` processes probe at once."""
    children = [
        subprocess.Popen([sys.executable, "-c", PROBE, MODEL, str(micro_batch)], stdout=subprocess.PIPE, text=True)
        for _ in range(peers)
    ]
    results = [json.loads(child.communicate(timeout=300)[0]) for child in children]
    return {key: statistics.mean(r[key] for r in results) for key in ("block", "matmul")}


def link() -> dict[str, float]:
    """Latency (half a small round trip) and bandwidth (64 MB) of the direct path between two processes."""
    small = statistics.median(framed("direct", torch.zeros(16), 9))
    large = statistics.median(framed("direct", torch.randn(16 * 10**6), 3))
    return {"latency_ms": 1e3 * small / 2, "bandwidth_gbps": 8 * 64e6 / max(large - small, 1e-9) / 1e9}


def plan(folder: Path, stages: int, tflops: float, net: dict[str, float], args: argparse.Namespace) -> dict:
    topology = {
        "name": f"this machine, {stages} peers",
        "regions": {"loopback": {"latency_ms": net["latency_ms"], "bandwidth_gbps": net["bandwidth_gbps"]}},
        "devices": [{"id": f"p{i}", "region": "loopback", "tflops": tflops} for i in range(stages)],
    }
    path = folder / f"topology-{stages}-{tflops:.4f}.json"
    path.write_text(json.dumps(topology))
    out = subprocess.run(
        [sys.executable, "-m", "hetpeer", "plan", str(path), "--model", MODEL, "--batch", str(args.batch),
         "--micro-batch", str(args.micro_batch), "--dtype", "fp32", "--stages", str(stages), "--group-size", "1",
         "--json", "--quiet"],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return json.loads(out.stdout)


def run(folder: Path, plan_wire: dict, steps: int) -> tuple[float, dict[str, str]]:
    path = folder / f"plan-{len(plan_wire['stages'])}.json"
    path.write_text(json.dumps(plan_wire))
    out = subprocess.run(
        [sys.executable, "-m", "hetpeer", "launch", str(path), "--steps", str(steps), "--out", str(folder / path.stem)],
        capture_output=True, text=True, timeout=1800,
    )
    if out.returncode:
        raise SystemExit(f"hetpeer launch failed:\n{out.stdout[-3000:]}")
    times: dict[str, list[float]] = {}
    memory = {}
    for line in map(unstamp, out.stdout.splitlines()):
        if match := STEP_LINE.match(line):
            if int(match[2]) > 2:
                times.setdefault(match[1], []).append(float(match[3]))
        elif match := MEMORY_LINE.match(line):
            memory[match[1]] = match[2]
    return max(statistics.median(t) for t in times.values()), memory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline depths (default 2 4)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first two are warm-up (default 8)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (two warm-up steps are not counted)")
    folder = Path(tempfile.mkdtemp(prefix="hetpeer-bench-pipeline-"))
    net = link()
    print(f"direct path between two processes: latency {net['latency_ms']:.3f} ms, "
          f"bandwidth {net['bandwidth_gbps']:.1f} Gbit/s")
    rows, missed = [], False
    for stages in args.stages:
        tflops = probe(stages, args.micro_batch)
        predicted = plan(folder, stages, tflops["block"], net, args)
        by_matmul = plan(folder, stages, tflops["matmul"], net, args)["cost"]["total_s"]
        measured, memory = run(folder, predicted, args.steps)
        error = predicted["cost"]["total_s"] / measured - 1
        missed |= abs(error) > GOAL
        rows.append((stages, tflops, predicted, by_matmul, measured, error))
        for device, line in sorted(memory.items()):
            print(f"  {stages} stages, {device}: {line}")
    print(f"\n{MODEL} preset, fp32, batch {args.batch}, micro-batch {args.micro_batch}, one lane, "
          f"{os.cpu_count()} cores here, one thread per peer")
    print(f"{'stages':>6s} {'M':>3s} {'block TFLOPS':>13s} {'matmul TFLOPS':>14s} {'predicted s':>12s} "
          f"{'measured s':>11s} {'error':>7s} {'matmul-probe s':>15s} {'its error':>10s}")
    for stages, tflops, predicted, by_matmul, measured, error in rows:
        print(f"{stages:6d} {predicted['micro_batches']:3d} {tflops['block']:13.4f} {tflops['matmul']:14.4f} "
              f"{predicted['cost']['total_s']:12.3f} {measured:11.3f} {error:+7.1%} {by_matmul:15.3f} "
              f"{by_matmul / measured - 1:+10.1%}")
    print(f"goal: predicted step time within {GOAL:.0%} of measured: {'NOT met' if missed else 'met'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
