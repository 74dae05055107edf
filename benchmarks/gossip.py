"""Decentralized Adam benchmark: loss, hidden communication, and state download, each against its
reference from the same run.

    python3 benchmarks/gossip.py [--part loss|outer|overlap|download|all]

- loss: the tiny GPT trained by n peers in one group (in one process over the in-memory transport, so
  the figures do not depend on this machine's load) for a fixed number of steps: all-reduce Adam (the
  exact-average reference), decentralized Adam (one-peer exponential graph), decentralized Adam with exact
  mixing (the complete graph: what is left of the gap is not the topology's), AccumAdam as Wang et al.
  ran it (A = 8, beta2 0.98), and DAdam with int8 parameter frames; n = 4 and 8. Reported: the validation
  loss of the group's mean parameters on held-out sequences, its gap to all-reduce's, how many times
  all-reduce's steps the run needs to reach its loss (located on all-reduce's validation curve: what the
  planner's time to the same loss needs), the training loss of the last 10 steps, and the consensus
  distance (mean distance of a peer's parameters to the group mean, relative to the mean's norm).
- outer: outer steps every H steps (sync "outer", DiLoCo's outer Nesterov step, lr 0.7, momentum 0.9)
  against every-step all-reduce, the same tiny GPT, data, seed and steps (so equal tokens), n = 4: the
  validation loss of the group's mean parameters and its gap to every-step sync, for each H of `--outer`
  (default 1 10 50 200), from a fresh model and with a warm start (`--outer-warmup` steps of every-step
  all-reduce first: the plan's `outer_after`, default the coordinator's), and H = 50 with the exchange
  overlapping the next D steps (`--outer-delays`, the plan's `outer_delay`). Goal: H = 50 (warm) within 3%.
- overlap: the `small` preset, one stage of 2 peers as `hetpeer launch` processes, every link capped
  by the transport's rate limit so that exchanging the parameters takes less time than computing the
  gradient. Step times (median over steps 3+, slowest peer) with no averaging (compute only), gossip
  sending after the gradient (no overlap), gossip with overlap, and all-reduce. Hidden share =
  1 - (overlap - compute) / (no overlap - compute). Goal: at least 80% hidden.
- download: a peer downloads the `small` stage's state (parameters and Adam moments) from 1, 2 and 4
  donors over TCP on 127.0.0.1, each donor's uplink capped (as a volunteer's would be).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hetpeer.logline import unstamp
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.adam import AdamConfig
from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.group import GroupSync, SyncConfig
from hetpeer.peer.gossip.outer import OuterConfig
from hetpeer.peer.gossip.state import StateServer, fetch_state
from hetpeer.peer.launch import free_port
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.links import TcpLink
from hetpeer.peer.transport.network import Emulation, NetworkTransport
from hetpeer.protocol.addresses import AddressBook, PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.recipe import OUTER_AFTER, Recipe

HIDDEN_GOAL = 0.8
OUTER_GOAL_H, OUTER_GOAL = 50, 0.03  # H = 50 within 3% of every-step sync
VALIDATION_SEQUENCES, VALIDATION_SEED = 64, 12345
STEP_LINE = re.compile(r"^\[(\S+)\] step (\d+)/\d+ .* ([0-9.]+) s \(compute")


def one_group(model: str, peers: int, sync: str, batch_per_peer: int, micro_batch: int, outer_every: int = 0) -> Plan:
    layers = preset(model).layers
    stage = StagePlan(0, 0, layers, tuple(f"p{i}" for i in range(peers)), sync, outer_every=outer_every)
    return Plan("time", model, layers, batch_per_peer * peers, micro_batch, -(-batch_per_peer // micro_batch), "fp32", (stage,))


@dataclass(frozen=True)
class Run:
    curve: list[tuple[int, float]]  # (step, validation loss of the group's mean parameters)
    train: float  # mean training loss of the last 10 steps over the peers
    consensus: float  # mean |x_i - mean| / |mean| at the end

    @property
    def loss(self) -> float:
        return self.curve[-1][1]

    def steps_to(self, loss: float) -> float:
        """The step (interpolated between points of the curve) at which this run's loss first fell to `loss`;
        its last step when it never did."""
        previous = (0, math.inf)
        for step, value in self.curve:
            if value <= loss:
                if not math.isfinite(previous[1]):
                    return float(step)
                return previous[0] + (step - previous[0]) * (previous[1] - loss) / (previous[1] - value)
            previous = (step, value)
        return float(self.curve[-1][0])


def train_in_memory(peers: int, sync: str, steps: int, adam: AdamConfig, codec: str, corpus: Corpus, *,
                    topology: str = "one-peer-exp", batch_per_peer: int = 4, every: int = 50, outer_every: int = 0,
                    outer: OuterConfig = OuterConfig(), outer_after: int = 0, outer_delay: int = 0) -> Run:
    """n peers of one group in threads over the in-memory transport; every `every` steps, the validation loss
    of the group's mean parameters (what a final exact average would export)."""
    plan = one_group("tiny", peers, sync, batch_per_peer=batch_per_peer, micro_batch=batch_per_peer, outer_every=outer_every)
    # no gradient clipping: the figures in docs/gossip.md were measured without it
    recipe = Recipe(lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay, clip_norm=0.0,
                    warmup_steps=adam.warmup_steps, decay_steps=adam.decay_steps or 0, min_lr_ratio=adam.min_lr_ratio,
                    accumulate=adam.accumulate, topology=topology, sync_codec=codec, mix_deadline_s=60.0,
                    outer_lr=outer.lr, outer_momentum=outer.momentum, outer_after=outer_after)
    plan = replace(plan, recipe=recipe, stages=(replace(plan.stages[0], outer_delay=outer_delay),))
    hub = MemoryHub()
    config = WorkerConfig()
    workers = []
    for device in plan.devices:
        transport = MemoryTransport(device, hub)
        transport.start()
        workers.append(StageWorker(plan, device, transport, corpus, config))
    held_out = corpus.validation_batch(VALIDATION_SEQUENCES, preset("tiny").seq_len, seed=VALIDATION_SEED)
    tokens, labels = torch.from_numpy(held_out.tokens), torch.from_numpy(held_out.labels)
    losses: dict[str, list[float]] = {w.device_id: [] for w in workers}

    def run(worker: StageWorker, count: int) -> None:
        for _ in range(count):
            losses[worker.device_id].append(worker.train_step().loss)

    curve: list[tuple[int, float]] = []
    done = 0
    while done < steps:
        count = min(every, steps - done)
        threads = [threading.Thread(target=run, args=(w, count)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done += count
        model = workers[0]
        own = model.flat.data.clone()
        with torch.no_grad():
            model.flat.data.copy_(torch.stack([w.flat.data for w in workers]).mean(0))
            curve.append((done, float(model.model.loss(model.model(tokens), labels))))
            model.flat.data.copy_(own)
    params = torch.stack([w.flat.data for w in workers])
    mean = params.mean(0)
    consensus = float((params - mean).norm(dim=1).mean() / mean.norm())
    train = statistics.mean(statistics.mean(v[-10:]) for v in losses.values())
    return Run(curve, train, consensus)


def part_loss(args: argparse.Namespace) -> bool:
    corpus = Corpus.default()
    torch.set_num_threads(1)
    runs = [
        ("all-reduce Adam", "allreduce", AdamConfig(lr=args.lr), "one-peer-exp", "raw"),
        ("DAdam (one-peer-exp)", "gossip", AdamConfig(lr=args.lr), "one-peer-exp", "raw"),
        ("DAdam, exact mixing (complete)", "gossip", AdamConfig(lr=args.lr), "complete", "raw"),
        ("AccumAdam A=8, b2 0.98", "gossip", AdamConfig(lr=args.lr, betas=(0.9, 0.98), accumulate=8), "one-peer-exp", "raw"),
        ("DAdam, int8 parameters", "gossip", AdamConfig(lr=args.lr), "one-peer-exp", "int8"),
    ]
    runs = [run for run in runs if args.only is None or run[0] in args.only]
    print(f"\nloss: tiny GPT, {args.loss_steps} steps, lr {args.lr}, {args.batch_per_peer} sequences per peer per step; "
          f"validation loss of the group's mean parameters on {VALIDATION_SEQUENCES} held-out sequences; steps x = how many "
          "times all-reduce's steps the run takes to its loss (where all-reduce's curve reaches it); "
          "consensus = mean |x_i - mean| / |mean|")
    print(f"{'optimizer':32s} {'peers':>5s} {'val loss':>9s} {'vs all-reduce':>14s} {'steps x':>8s} {'train':>7s} {'consensus':>10s}")
    for peers in args.peers:
        reference = None
        for name, sync, adam, topology, codec in runs:
            run = train_in_memory(peers, sync, args.loss_steps, adam, codec, corpus, topology=topology,
                                  batch_per_peer=args.batch_per_peer, every=args.every)
            reference = reference or run
            factor = args.loss_steps / reference.steps_to(run.loss) if run.loss > reference.loss else 1.0
            print(f"{name:32s} {peers:5d} {run.loss:9.4f} {run.loss / reference.loss - 1:+14.1%} {factor:8.2f} "
                  f"{run.train:7.4f} {run.consensus:10.2e}", flush=True)
    return True


def part_outer(args: argparse.Namespace) -> bool:
    corpus = Corpus.default()
    torch.set_num_threads(1)
    peers, adam = 4, AdamConfig(lr=args.lr)
    print(f"\nouter: tiny GPT, {peers} peers, {args.loss_steps} steps (equal tokens), lr {args.lr}, {args.batch_per_peer} "
          f"sequences per peer per step; outer Nesterov lr {OuterConfig().lr}, momentum {OuterConfig().momentum}; validation "
          f"loss of the group's mean parameters on {VALIDATION_SEQUENCES} held-out sequences; warm start: all-reduce every "
          f"step before the first outer step")
    print(f"{'sync':36s} {'val loss':>9s} {'vs every step':>14s} {'exchanges':>10s} {'train':>7s}")
    reference = train_in_memory(peers, "allreduce", args.loss_steps, adam, "raw", corpus,
                                batch_per_peer=args.batch_per_peer, every=args.every)
    print(f"{'all-reduce every step':36s} {reference.loss:9.4f} {0:+14.1%} {args.loss_steps:10d} {reference.train:7.4f}", flush=True)
    gaps: dict[str, float] = {}
    for warm in sorted({0, args.outer_warmup}):
        for h in args.outer:
            if warm and h == 1:
                continue  # every step either way
            run = train_in_memory(peers, "outer", args.loss_steps, adam, "raw", corpus, batch_per_peer=args.batch_per_peer,
                                  every=args.every, outer_every=h, outer_after=warm)
            name = f"H = {h}" + (f", warm start {warm}" if warm else "")
            gaps[name] = run.loss / reference.loss - 1
            exchanges = warm + (args.loss_steps - warm) // h
            print(f"{'outer steps, ' + name:36s} {run.loss:9.4f} {gaps[name]:+14.1%} {exchanges:10d} {run.train:7.4f}", flush=True)
    for delay in args.outer_delays:  # the exchange overlapping the next D steps, landing after them
        run = train_in_memory(peers, "outer", args.loss_steps, adam, "raw", corpus, batch_per_peer=args.batch_per_peer,
                              every=args.every, outer_every=OUTER_GOAL_H, outer_after=args.outer_warmup, outer_delay=delay)
        name = f"H = {OUTER_GOAL_H}" + (f", warm start {args.outer_warmup}" if args.outer_warmup else "") + f", overlap {delay}"
        gaps[name] = run.loss / reference.loss - 1
        exchanges = args.outer_warmup + (args.loss_steps - args.outer_warmup) // OUTER_GOAL_H
        print(f"{'outer steps, ' + name:36s} {run.loss:9.4f} {gaps[name]:+14.1%} {exchanges:10d} {run.train:7.4f}", flush=True)
    goal = f"H = {OUTER_GOAL_H}" + (f", warm start {args.outer_warmup}" if args.outer_warmup else "")
    met = goal not in gaps or gaps[goal] <= OUTER_GOAL
    if goal in gaps:
        print(f"goal: {goal} within {OUTER_GOAL:.0%} of every-step sync: {gaps[goal]:+.1%} ({'met' if met else 'missed'})")
    print(json.dumps({"part": "outer", "steps": args.loss_steps, "every_step": reference.loss, "outer": gaps}))
    return met


def launch_steps(folder: Path, plan: Plan, steps: int, extra: list[str]) -> float:
    path = folder / f"plan-{len(list(folder.iterdir()))}.json"
    path.write_text(json.dumps(plan.to_wire()))
    out = subprocess.run(
        [sys.executable, "-m", "hetpeer", "launch", str(path), "--steps", str(steps), "--link", "tcp",
         "--out", str(folder / path.stem), "--mix-deadline", "60", *extra],
        capture_output=True, text=True, timeout=1800,
    )
    if out.returncode:
        raise SystemExit(f"hetpeer launch failed:\n{out.stdout[-3000:]}")
    times: dict[str, list[float]] = {}
    for line in map(unstamp, out.stdout.splitlines()):
        if (match := STEP_LINE.match(line)) and int(match[2]) > 2:
            times.setdefault(match[1], []).append(float(match[3]))
    return max(statistics.median(t) for t in times.values())


def part_overlap(args: argparse.Namespace) -> bool:
    folder = Path(tempfile.mkdtemp(prefix="hetpeer-bench-gossip-"))
    cap = ["--bandwidth-cap", str(args.cap_mbit)]
    flat_bytes = 4 * preset("small").params
    print(f"\noverlap: small preset ({flat_bytes / 1e6:.1f} MB of fp32 parameters), one stage x 2 peers, "
          f"{args.overlap_batch} sequences per peer per step, links capped at {args.cap_mbit:g} Mbit/s "
          f"(parameters take {flat_bytes * 8 / args.cap_mbit / 1e6:.2f} s to send)")
    rows = {}
    for name, sync, extra in [
        ("compute only (no averaging)", "none", []),
        ("gossip, sent after the gradient", "gossip", cap + ["--no-overlap"]),
        ("gossip, overlapped (DAdam)", "gossip", cap),
        ("all-reduce", "allreduce", cap),
    ]:
        plan = one_group("small", 2, sync, batch_per_peer=args.overlap_batch, micro_batch=args.overlap_batch)
        rows[name] = launch_steps(folder, plan, args.overlap_steps, extra)
        print(f"  {name:34s} {rows[name]:7.3f} s/step")
    compute = rows["compute only (no averaging)"]
    exposed = rows["gossip, sent after the gradient"] - compute
    left = rows["gossip, overlapped (DAdam)"] - compute
    hidden = 1 - left / exposed if exposed > 0 else float("nan")
    print(f"  communication exposed without overlap {exposed:.3f} s, with overlap {left:.3f} s: "
          f"{hidden:.0%} hidden; all-reduce / overlapped gossip = "
          f"{rows['all-reduce'] / rows['gossip, overlapped (DAdam)']:.2f}x")
    met = hidden >= HIDDEN_GOAL
    print(f"  goal: at least {HIDDEN_GOAL:.0%} of communication hidden when it is shorter than compute: "
          f"{'met' if met else 'NOT met'}")
    return met


def part_download(args: argparse.Namespace) -> bool:
    spec = preset("small")
    devices = [f"d{i}" for i in range(5)]
    book = AddressBook({d: PeerAddress(direct=("127.0.0.1", free_port())) for d in devices})
    plan = Plan("time", "small", spec.layers, 20, 4, 1, "fp32", (StagePlan(0, 0, spec.layers, tuple(devices), "gossip"),))
    rate = args.donor_mbit * 1e6 / 8
    syncs, servers, transports = [], [], []
    for i, device in enumerate(devices):
        transport = NetworkTransport(device, book, [TcpLink(*book.get(device).direct)],
                                     emulation=Emulation(rate_bytes_per_s=rate if i else None))
        server = StateServer(transport, device, known=lambda d: d in devices)
        transport.set_policy(lambda header, index=i: (servers[index].accept(header) if header.kind in ("state_request", "state")
                                                      else syncs[index].accept(header)))
        transport.start()
        flat = FlatParams(build_stage(spec, 0, spec.layers, seed=i))
        syncs.append(GroupSync(plan, device, transport, flat, AdamConfig(), SyncConfig(chunk_bytes=4 << 20)))
        server.hold(syncs[-1], *spec.param_range(0, spec.layers))  # the whole model: [0, size)
        servers.append(server)
        transports.append(transport)
    state_bytes = 4 * syncs[0].flat.size * len(syncs[0].state_tensors())
    print(f"\ndownload: the small stage's state ({state_bytes / 1e6:.0f} MB: parameters and Adam moments) over TCP, "
          f"in 4 MB chunks, each donor's uplink capped at {args.donor_mbit:g} Mbit/s")
    try:
        base = None
        for donors in (1, 2, 4):
            download = fetch_state(servers[0], syncs[0], 0, syncs[0].flat.size, devices[1 : 1 + donors], timeout_s=600)
            base = base or download.seconds
            print(f"  {donors} donor(s): {download.seconds:6.2f} s  {download.bytes * 8 / download.seconds / 1e6:7.0f} Mbit/s"
                  f"  speed-up {base / download.seconds:4.2f}x")
    finally:
        for transport in transports:
            transport.shutdown()
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["loss", "outer", "overlap", "download", "all"], default="all")
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8], help="group sizes for the loss part (default 4 8)")
    parser.add_argument("--loss-steps", type=int, default=600, help="steps of the loss part (default 600)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the loss part (default 1e-3)")
    parser.add_argument("--batch-per-peer", type=int, default=4, help="sequences per peer per step, loss part (default 4)")
    parser.add_argument("--every", type=int, default=50, help="steps between validations, loss part (default 50)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these optimizers of the loss part (by name)")
    parser.add_argument("--outer", type=int, nargs="+", default=[1, 10, 50, 200], metavar="H",
                        help="steps between outer steps, outer part (default 1 10 50 200)")
    parser.add_argument("--outer-warmup", type=int, default=OUTER_AFTER, metavar="STEPS",
                        help=f"outer part: also run each H with a warm start of this many steps (default {OUTER_AFTER}; 0: none)")
    parser.add_argument("--outer-delays", type=int, nargs="*", default=[1, 5, 10, OUTER_GOAL_H - 1], metavar="D",
                        help=f"outer part: also run H = {OUTER_GOAL_H} with its exchange overlapping D steps (default 1 5 10 "
                        f"{OUTER_GOAL_H - 1})")
    parser.add_argument("--cap-mbit", type=float, default=800.0, help="link cap of the overlap part (default 800)")
    parser.add_argument("--overlap-batch", type=int, default=4, help="sequences per peer per step (default 4)")
    parser.add_argument("--overlap-steps", type=int, default=10, help="steps per overlap run (default 10)")
    parser.add_argument("--donor-mbit", type=float, default=400.0, help="donor uplink cap of the download part (default 400)")
    args = parser.parse_args()
    parts = {"loss": part_loss, "outer": part_outer, "overlap": part_overlap, "download": part_download}
    chosen = list(parts) if args.part == "all" else [args.part]
    ok = all([parts[name](args) for name in chosen])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
