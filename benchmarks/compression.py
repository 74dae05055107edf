"""Codecs between pipeline stages: what each costs in loss and how fast it encodes, against raw from the same run.

    python3 benchmarks/compression.py [--part quality|speed|all] [--json]

- quality: a 2-stage x 2-lane plan of the `small` preset (default), trained in one process over the in-memory
  transport (so the figures do not depend on this machine's load) for 600 steps, with the same data, seed and
  initial weights for every pair of codecs (activations forward / their gradients back), for each of
  `--seeds`: a paired design, each pair's gap taken against raw of its own seed. The stages' groups average
  by all-reduce, so both lanes hold the same weights and nothing but the codecs differs between the runs of a
  seed. Every --every steps, the validation loss of those weights on held-out sequences, computed on the
  stages directly (no codec in the measurement). Reported per pair: the final validation loss's gap to raw's
  at equal tokens and its steps factor (raw's steps over the pair's to the same loss: above 1, the pair needs
  more steps; curves interpolated between validations), each as the mean over seeds with a 95% confidence
  interval (Student's t; one seed: none). Goals: int8 within 0.5% of raw, int4 forward within 2%, at the
  interval's upper end.
- speed: encode and decode rates (MB/s of fp32 input, median of rounds) of every codec at 1 and 2 torch threads
  on activation-shaped tensors, against a plain copy of the same tensor (raw's encode), and the link speed at
  which the encoder just keeps up with what it puts on the wire.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import torch
from scipy import stats

from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.codec import checksum, decode, encode
from hetpeer.protocol.frame import CODECS, FrameHeader, bytes_per_value
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe

PAIRS = [("raw", "raw"), ("bf16", "bf16"), ("int8", "int8"), ("int4", "int8"), ("int4", "int6"), ("int4", "int4")]
GOALS = {"int8": 0.005, "int4": 0.02}  # the forward codec's allowed gap to raw, at equal tokens
VALIDATION_SEQUENCES, VALIDATION_SEED = 256, 12345


def two_by_two(model: str, lane_batch: int, micro_batch: int) -> Plan:
    layers = preset(model).layers
    half = layers // 2
    stages = (StagePlan(0, 0, half, ("a0", "a1"), "allreduce"), StagePlan(1, half, layers, ("b0", "b1"), "allreduce"))
    return Plan("time", model, layers, 2 * lane_batch, micro_batch, -(-lane_batch // micro_batch), "fp32", stages)


def train(plan: Plan, steps: int, every: int, lr: float, clip: float, corpus: Corpus, seed: int) -> list[tuple[int, float]]:
    """(step, validation loss) every `every` steps of `plan` (its codecs on the hops) trained from `seed`."""
    hub = MemoryHub()
    plan = replace(plan, recipe=Recipe(lr=lr, seed=seed, clip_norm=clip))
    config = WorkerConfig()
    workers = {}
    for device in plan.devices:
        transport = MemoryTransport(device, hub)
        transport.start()
        workers[device] = StageWorker(plan, device, transport, corpus, config)
    spec = preset(plan.model)
    held_out = corpus.validation_batch(VALIDATION_SEQUENCES, spec.seq_len, seed=VALIDATION_SEED)
    tokens, labels = torch.from_numpy(held_out.tokens), torch.from_numpy(held_out.labels)
    failures: list[BaseException] = []

    def run(worker: StageWorker, count: int) -> None:
        try:
            for _ in range(count):
                worker.train_step()
        except BaseException as error:  # noqa: BLE001 - reported below, the other threads time out
            failures.append(error)

    curve, done = [], 0
    while done < steps:
        count = min(every, steps - done)
        threads = [threading.Thread(target=run, args=(w, count)) for w in workers.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        done += count
        first, last = workers["a0"].model, workers["b0"].model
        with torch.no_grad():
            curve.append((done, float(last.loss(last(first(tokens)), labels))))
    for worker in workers.values():
        worker.transport.shutdown()
    return curve


def steps_to(curve: list[tuple[int, float]], loss: float) -> float | None:
    """The step at which `curve` first reaches `loss`, linear between its validations (from its start at step 0
    and its first validation); None where it never does."""
    previous_step, previous_loss = curve[0]
    if previous_loss <= loss:
        return float(previous_step)
    for step, value in curve[1:]:
        if value <= loss:
            return previous_step + (step - previous_step) * (previous_loss - loss) / (previous_loss - value)
        previous_step, previous_loss = step, value
    return None


def steps_factor(curve: list[tuple[int, float]], raw: list[tuple[int, float]]) -> float:
    """Raw's steps over the pair's to the loss the later of the two reached: above 1 where the pair needs more
    steps than raw to a loss. Where the pair ends above raw, the steps raw took to the pair's final loss; where
    it ends below, the steps the pair took to raw's."""
    steps = curve[-1][0]
    if curve[-1][1] >= raw[-1][1]:
        return steps / (steps_to(raw, curve[-1][1]) or steps)
    return (steps_to(curve, raw[-1][1]) or steps) / steps


def interval(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and the half-width of its 95% confidence interval (Student's t; inf for one value)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, float("inf")
    return mean, float(stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values)))


def part_quality(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    corpus = Corpus.default()
    plan = two_by_two(args.model, args.lane_batch, args.micro_batch)
    spec = preset(args.model)
    print(f"quality: {args.model} ({spec.params / 1e6:.1f} M parameters), 2 stages x 2 lanes, {args.steps} steps of "
          f"{plan.batch} sequences of {spec.seq_len} tokens, lr {args.lr:g}, "
          f"{f'clip {args.clip:g}' if args.clip else 'no clipping'}, seeds {' '.join(map(str, args.seeds))}, "
          f"validation on {VALIDATION_SEQUENCES} held-out sequences", flush=True)
    pairs = [tuple(pair.split("/")) for pair in args.pairs]
    runs: dict[str, list[list[tuple[int, float]]]] = {f"{f}/{b}": [] for f, b in pairs}
    for seed in args.seeds:
        for forward, backward in pairs:
            started = time.perf_counter()
            curve = train(plan.with_codecs(forward, backward), args.steps, args.every, args.lr, args.clip, corpus, seed)
            runs[f"{forward}/{backward}"].append(curve)
            print(f"  seed {seed} {forward}/{backward}: validation loss {curve[-1][1]:.4f} after {args.steps} steps "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    raws = runs["raw/raw"]
    rows, ok = [], True
    print(f"\n{'activations/gradients':<22}{'bits a value':>13}{'val loss':>10}{'gap to raw (95% CI)':>22}"
          f"{'steps factor (95% CI)':>24}  goal")
    for name, curves in runs.items():
        forward, backward = name.split("/")
        gaps = [curve[-1][1] / raw[-1][1] - 1 for curve, raw in zip(curves, raws)]
        factors = [steps_factor(curve, raw) for curve, raw in zip(curves, raws)]
        (gap, gap_half), (factor, factor_half) = interval(gaps), interval(factors)
        goal = GOALS.get(forward)
        met = goal is None or gap + gap_half <= goal
        ok &= met
        bits = "/".join(f"{8 * bytes_per_value('fp32', c):g}" for c in (forward, backward))
        goal_text = f"<= {100 * goal:.1f}%: {'met' if met else 'MISSED'}" if goal is not None else ""
        loss = float(np.mean([curve[-1][1] for curve in curves]))
        print(f"{name:<22}{bits:>13}{loss:>10.4f}{f'{100 * gap:+.2f}% +- {100 * gap_half:.2f}':>22}"
              f"{f'{factor:.3f} +- {factor_half:.3f}':>24}  {goal_text}")
        rows.append({"codecs": name, "val_loss": loss, "gap": gap, "gap_half_width": gap_half, "gaps": gaps,
                     "steps_factor": factor, "steps_factor_half_width": factor_half, "steps_factors": factors,
                     "curves": curves, "goal": goal, "met": met})
    print(f"\nresolution: the widest 95% interval on a gap is +-{100 * max(r['gap_half_width'] for r in rows[1:] or rows):.2f}% "
          f"({len(args.seeds)} seed(s))")
    return {"model": args.model, "steps": args.steps, "batch": plan.batch, "lr": args.lr, "clip": args.clip,
            "seeds": args.seeds, "rows": rows, "ok": ok}


def rate(work, size_bytes: int, rounds: int) -> float:
    """MB/s of `size_bytes` through `work`, the median of `rounds` timed calls after one warm-up."""
    work()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return size_bytes / statistics.median(times) / 1e6


def part_speed(args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(0)
    shapes = {"small micro-batch (2 x 128 x 256)": (2, 128, 256), "GPT-2 XL micro-batch (1 x 1024 x 1600)": (1, 1024, 1600)}
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, shape in shapes.items():
            tensor = torch.randn(shape, generator=generator)
            size = tensor.numel() * 4
            copy = rate(lambda: tensor.clone(), size, args.rounds)
            print(f"\n{threads} thread(s), {label}: a plain copy runs at {copy:.0f} MB/s")
            print(f"  {'codec':<6}{'encode MB/s':>13}{'vs copy':>9}{'decode MB/s':>13}{'keeps up with':>16}")
            for codec in CODECS:
                _, payload = encode(tensor, codec)
                header = FrameHeader("activation", "fp32", tuple(shape), "a", 0, codec=codec, checksum=checksum(payload))
                buffer = bytearray(payload)
                encoding = rate(lambda: encode(tensor, codec), size, args.rounds)
                decoding = rate(lambda: decode(header, buffer), size, args.rounds)
                link_gbit = encoding * bytes_per_value("fp32", codec) / 4 * 8 / 1e3  # wire bytes it makes a second
                print(f"  {codec:<6}{encoding:>13.0f}{encoding / copy:>9.2f}{decoding:>13.0f}{link_gbit:>11.2f} Gbit/s")
                rows.append({"threads": threads, "tensor": label, "codec": codec, "encode_mb_s": encoding,
                             "decode_mb_s": decoding, "copy_mb_s": copy, "keeps_up_gbit_s": link_gbit})
    # raw is sent as a view of the tensor and received in place: no work for the planner to count
    work = {row["codec"]: 0.0 if row["codec"] == "raw" else float(f"{4 / row['encode_mb_s'] / 1e6 + 4 / row['decode_mb_s'] / 1e6:.3g}")
            for row in rows if row["threads"] == 1 and row["tensor"] == list(shapes)[-1]}
    print(f"\nthe planner's WORK_S_PER_VALUE (seconds a value to encode and decode, one thread, the larger tensor): {work}")
    return {"rows": rows, "work_s_per_value": work}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["quality", "speed", "all"], default="all")
    parser.add_argument("--model", default="small", help="preset of the quality part (default small)")
    parser.add_argument("--steps", type=int, default=600, help="training steps of the quality part (default 600)")
    parser.add_argument("--every", type=int, default=100, help="steps between validations (default 100)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--lane-batch", type=int, default=8, help="sequences per lane per step (default 8)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm, 0 for none (default 1, the recipe's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the quality part (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], metavar="SEED",
                        help="initial weights and data order of the quality part, each a paired set of runs (default 0 1 2)")
    parser.add_argument("--pairs", nargs="+", default=[f"{f}/{b}" for f, b in PAIRS], metavar="FORWARD/BACKWARD",
                        help="codec pairs of the quality part, raw/raw first (default: all six)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per figure of the speed part (default 15)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = parser.parse_args()
    if args.pairs[0] != "raw/raw":
        parser.error("--pairs must start with raw/raw, the reference")
    results, ok = {}, True
    if args.part in ("speed", "all"):
        results["speed"] = part_speed(args)
    if args.part in ("quality", "all"):
        results["quality"] = part_quality(args)
        ok = results["quality"]["ok"]
    if args.json:
        print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
