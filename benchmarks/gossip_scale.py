"""Decentralized Adam against all-reduce Adam at GPT-2-small scale, with large lane batches, on one accelerator.

    python3 benchmarks/gossip_scale.py [--peers 8 16] [--tokens-per-peer 16384] [--seq-len 1024]
        [--methods allreduce dadam ...] [--lr 6e-4 ...] [--lr-for METHOD LR ...] [--topology one-peer-exp]
        [--time-budget S | --steps N] [--eval-every N] [--seed 0] [--out DIR] [--json] [--small]

The question: at GPT-2-small scale, with 16K tokens or more a peer-step, how far is decentralized Adam
(gossip; Wang et al., ICLR 2025) from all-reduce Adam in validation loss at equal tokens? benchmarks/gossip.py
(part loss) answers it for the `tiny` preset at 256 tokens a peer-step; the planner prices gossip by it.

What runs: the n peers of one group, simulated in ONE process (n = 8 and 16 by default). Mixing is exact
arithmetic on tensors: no network, no deadline, no peer left out, so what is measured is the optimizer alone.
Each peer holds its parameters and Adam moments as flat fp32 vectors on the device (the `flat.FlatParams`
layout); one module (`model.build_stage`: GPT-2 small's shape, 12 blocks of width 768 with 12 heads and learned
positions, with the corpus's 256-byte vocabulary, so 86M parameters where GPT-2's BPE makes 124M) is the
compute shell each peer's vector is loaded into for its forward and backward (bf16 autocast on CUDA, fp32 on a
CPU). Every run of a group size reads the same data (peer i of step t the corpus's positions
[(t n + i) B, (t n + i + 1) B): disjoint across peers), from the same initial point, for the same steps:

- allreduce: all-reduce Adam, run as one model stepping AdamW (`adam.adam_update`) on the mean of the n peers'
  gradients, which is what `group.py`'s ring all-reduce hands every peer;
- dadam: decentralized Adam as `group.py` runs it: at step t peer i's gradient g_i is taken at x_i(t), then
  x_half_i = x_i + sum_j W_ij(t) (x_j - x_i) over round t of the topology (`topology.mixing_matrix`, the
  one-peer exponential graph by default), then the peer's own `adam_update` from x_half_i with g_i;
- dadam-group, dadam-window: the same with the recipe's `second_moment` group (each peer's Adam second moment
  scaled to the group's mean gradient) and window (from the mean of its last n gradients): `adam.py`;
- accumadam: the same with AccumAdam's window A = n and beta2 0.98 (Wang et al. ran A = 4 to 8);
- outer-10, outer-50: outer steps every H steps (DiLoCo, `outer.py`, lr 0.7 and Nesterov momentum 0.9) after
  `--outer-after` steps of every-step all-reduce (the recipe's warm start), the exchange landing at once.

The learning rate rises linearly over the first 10% of the steps, then falls on a cosine to 0.1x at the last
(`AdamConfig`); betas (0.9, 0.95), weight decay 0.1 on matrices. No gradient clipping: the project had none
when this was written (`--clip-norm` turns on `adam_update`'s where the checkout's AdamConfig has
`clip_norm`: each peer clips its own gradient, all-reduce the mean one). The runs of one group size step in
lockstep (step t of each, then step t + 1), so runs cut short still compare at equal steps.

Reported, with the definitions of benchmarks/gossip.py's loss part: the validation loss of the group's MEAN
parameters on held-out sequences (the same for every run) every `--eval-every` steps; its gap to the best
all-reduce run of the group size; the steps factor (how many times all-reduce's steps the run needs to reach
its final loss, located on all-reduce's validation curve; where the run ends below all-reduce, its own steps to
all-reduce's final loss over all-reduce's steps, under 1); the training loss of the last 10 steps; the
consensus distance (mean |x_i - mean| / |mean|: 0 for all-reduce, one model); for all-reduce runs, the gradient
noise scale B_simple in tokens between evaluations (McCandlish et al. 2018, appendix A: each lane's squared gradient
norm against the mean gradient's), which places a model on the steps factor table (`planner/quality.py`).

Cost: a step of a run is n forward and backward passes of B sequences plus n Adam updates (and for gossip
O(n P) mixing, P parameters); device memory is 16 P bytes a gossiping peer (parameters, mixing buffer, two
moments; AccumAdam 20 P), 12 P for an all-reduce run, and the shell's 8 P and one peer-batch's activations.

Budget: with `--time-budget S` (wall seconds for the whole script, counted from its first line) it first times
a warm-up, a few steps and an evaluation of every group size, then takes the most steps at which every
requested run (group size x method x learning rate) fits in S, says what it chose, and runs them. Where a step
would pass S after all, every run stops there (a last evaluation, then the report). Each evaluation is
printed as it happens, each run's JSON line (`{"run": ...}`) as it ends (and with `--out DIR` into
DIR/runs.jsonl, every evaluation into DIR/evals.jsonl); with `--json` the summary object is the last line.
SIGTERM (what `timeout` sends) and Ctrl-C stop it the same way, with the report of what it measured.

Data: the project's embedded corpus (`Corpus.default`: this interpreter's standard library sources, as bytes;
nothing is downloaded), or a folder of text with `--corpus DIR`. The standard library holds only about 12 MB,
so at n = 16 a few hundred steps read it several times over: the header says how many epochs each group reads.

On one H200 with a hard limit of 420 s for the whole script (n = 8 and 16, allreduce and dadam, 16K tokens a
peer-step; about 250 steps fit, not 1000):

    timeout -s TERM 420 python3 benchmarks/gossip_scale.py --time-budget 400 --json --out gossip-scale

The CPU smoke run that tests/unit/test_gossip_scale_benchmark.py checks (`tiny` preset, 2 and 4 peers, 30
steps; seconds):

    python3 benchmarks/gossip_scale.py --small --json
"""
from __future__ import annotations

import time

STARTED_S = time.monotonic()  # the time budget counts from here: imports and the accelerator's start-up spend it too

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field, fields, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the loss part's definitions
from gossip import VALIDATION_SEED, Run  # noqa: E402

from hetpeer.peer.data.corpus import DEFAULT_MAX_BYTES, Corpus  # noqa: E402
from hetpeer.peer.gossip.adam import AdamConfig, AdamState, adam_update  # noqa: E402
from hetpeer.peer.gossip.flat import FlatParams  # noqa: E402
from hetpeer.peer.gossip.noise import noise_scale  # noqa: E402
from hetpeer.peer.gossip.outer import OuterConfig, OuterState, outer_step  # noqa: E402
from hetpeer.peer.gossip.topology import TOPOLOGIES, mixing_matrix  # noqa: E402
from hetpeer.peer.model import build_stage  # noqa: E402
from hetpeer.protocol.modelspec import PRESETS, ModelSpec, preset  # noqa: E402
from hetpeer.protocol.recipe import OUTER_AFTER  # noqa: E402

METHODS = ("allreduce", "dadam", "dadam-group", "dadam-window", "accumadam", "outer-10", "outer-50")
LABELS = {"allreduce": "all-reduce Adam", "dadam": "DAdam", "dadam-group": "DAdam, v scaled to group",
          "dadam-window": "DAdam, v from n-step mean", "accumadam": "AccumAdam A=n, b2 0.98",
          "outer-10": "outer steps H=10", "outer-50": "outer steps H=50"}
SECOND_MOMENT = {"dadam": "lane", "dadam-group": "group", "dadam-window": "window", "accumadam": "lane"}
WARMUP_SHARE, MIN_LR_RATIO = 0.1, 0.1
SAFETY = 0.93  # share of the time left that the sized runs may take: timings drift a little from the probe's
RESERVE_S = 5.0  # kept back at the end for the report
MEMORY_SHARE = 0.8  # of the accelerator's free memory, what one group's lockstep runs may hold (activations need the rest)
LOG_EVERY_S = 30.0  # a progress line at least this often between evaluations
# The real question's sizes, and the CPU smoke run's.
FULL = dict(model="gpt2-small", peers=[8, 16], tokens_per_peer=16384, seq_len=1024, lr=[6e-4], steps=None,
            eval_every=None, val_sequences=128, corpus_bytes=DEFAULT_MAX_BYTES)
SMALL = dict(model="tiny", peers=[2, 4], tokens_per_peer=256, seq_len=64, lr=[3e-3], steps=30, eval_every=10,
             val_sequences=32, corpus_bytes=4 << 20)
EVALUATIONS = 20  # evaluations a run, when --eval-every is not given


class Stopped(Exception):
    """A signal asked the benchmark to stop: report what has been measured."""


def say(line: str) -> None:
    print(line, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_s() -> float:
    return time.monotonic() - STARTED_S


def gpt2_small(seq_len: int, vocab: int) -> ModelSpec:
    """GPT-2 small's shape (Radford et al., 2019) in hetpeer's own GPT: 12 blocks of width 768 and 12 heads, learned
    positions, an untied head; the vocabulary is the corpus's."""
    return ModelSpec(f"gpt2-small-v{vocab}", hidden=768, heads=12, seq_len=seq_len, vocab=vocab, layers=12)


@dataclass(frozen=True, slots=True)
class RunConfig:
    peers: int
    method: str
    lr: float

    @property
    def name(self) -> str:
        return f"{self.method} lr {self.lr:g}"


@dataclass(frozen=True, slots=True)
class Cost:
    """What the probe measured of one lockstep group of runs: seconds to build it, a step of all its runs, an
    evaluation of all its runs."""

    setup_s: float
    step_s: float
    eval_s: float


@dataclass
class Record:
    """What one run has measured so far, filled in as it goes, so that a run cut short still reports."""

    config: RunConfig
    steps: int
    tokens_per_step: int
    status: str = "pending"  # then running, and done, stopped (deadline or signal), failed or skipped
    initial_loss: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss of the mean parameters)
    consensus: list[tuple[int, float]] = field(default_factory=list)
    noise: list[tuple[int, float | None]] = field(default_factory=list)  # all-reduce: the gradient noise scale, tokens
    train: list[float] = field(default_factory=list)  # each step's training loss, mean over the peers
    probe_s_per_step: float | None = None
    peak_bytes: int | None = None
    error: str | None = None
    seed: int = 0  # model initialisation and data order

    @property
    def steps_done(self) -> int:
        return self.curve[-1][0] if self.curve else 0

    def run(self, upto: int | None = None) -> Run:
        """As benchmarks/gossip.py's `Run`, its curve cut at step `upto` (equal steps with a shorter run)."""
        curve = [point for point in self.curve if upto is None or point[0] <= upto]
        done = curve[-1][0]
        consensus = [c for s, c in self.consensus if s <= done][-1]
        train = self.train[:done][-10:]
        return Run(curve, sum(train) / len(train), consensus)

    def to_json(self) -> dict:
        return {"peers": self.config.peers, "method": self.config.method, "lr": self.config.lr, "seed": self.seed,
                "status": self.status,
                "steps": self.steps, "steps_done": self.steps_done, "tokens_per_step": self.tokens_per_step,
                "tokens": self.tokens_per_step * self.steps_done, "initial_loss": self.initial_loss,
                "val_loss": self.curve[-1][1] if self.curve else None, "curve": self.curve,
                "consensus": self.consensus[-1][1] if self.consensus else None, "consensus_curve": self.consensus,
                "noise_scale_curve": self.noise,
                "train_loss": mean_of_last(self.train), "probe_s_per_step": self.probe_s_per_step,
                "peak_bytes": self.peak_bytes, "error": self.error}


def mean_of_last(values: list[float], count: int = 10) -> float | None:
    tail = values[-count:]
    return sum(tail) / len(tail) if tail else None


CAN_CLIP = "clip_norm" in {f.name for f in fields(AdamConfig)}  # gradient clipping, where this checkout's Adam has it


def adam_config(method: str, lr: float, steps: int, clip_norm: float = 0.0, peers: int = 1) -> AdamConfig:
    warmup = max(1, round(WARMUP_SHARE * steps)) if steps > 1 else 0
    betas, window = ((0.9, 0.98), peers) if method == "accumadam" else ((0.9, 0.95), 1)
    clip = {"clip_norm": clip_norm} if clip_norm else {}
    return AdamConfig(lr=lr, betas=betas, accumulate=window, warmup_steps=warmup, second_moment=SECOND_MOMENT.get(method, "lane"),
                      decay_steps=steps if steps > warmup else None, min_lr_ratio=MIN_LR_RATIO, **clip)


def outer_every(method: str) -> int:
    """H of an outer-step method ("outer-H"), 0 for the others."""
    return int(method.removeprefix("outer-")) if method.startswith("outer-") else 0


class Shell:
    """The one module every peer's parameters pass through: a flat vector goes in, a loss and its gradient
    (in `flat.grad`) come out."""

    def __init__(self, spec: ModelSpec, seed: int, device: torch.device) -> None:
        self.model = build_stage(spec, 0, spec.layers, seed=seed, device=device)
        self.flat = FlatParams(self.model)
        self.init = self.flat.data.clone()  # where every peer of every run starts
        self.cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def load(self, x: torch.Tensor) -> None:
        self.flat.data.copy_(x)
        self.flat.zero_grad()

    def backward(self, tokens: torch.Tensor, labels: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Adds scale x the gradient of the loss on (tokens, labels) to `flat.grad`; the loss (unscaled, detached)."""
        with self.cast:
            loss = self.model.loss(self.model(tokens), labels)
        (loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    @torch.no_grad()
    def validate(self, x: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, rows: int) -> float:
        """The mean token loss of parameters x over the held-out sequences, `rows` sequences a forward pass."""
        self.flat.data.copy_(x)
        total = torch.zeros((), device=x.device)
        for part, part_labels in zip(tokens.split(rows), labels.split(rows)):
            with self.cast:
                total += self.model.loss(self.model(part), part_labels).float() * len(part)
        return float(total) / len(tokens)


class AllReduce:
    """All-reduce Adam: one model stepping on the mean of the n peers' gradients, exactly. It also estimates the
    gradient noise scale from each lane's gradient against the mean's (`noise_scale`)."""

    def __init__(self, shell: Shell, peers: int, adam: AdamConfig) -> None:
        self.peers, self.adam = peers, adam
        self.x = shell.init.clone()
        self.state = AdamState(self.x.numel(), self.x.device)
        self.total = torch.empty_like(self.x)  # the lanes' gradients summed, while each lane's is taken alone
        self.squares = torch.zeros(2, device=self.x.device)  # since the last estimate: sum of mean |g_lane|^2, of |g_mean|^2
        self.steps = 0

    def step(self, shell: Shell, tokens: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
        shell.load(self.x)
        self.total.zero_()
        losses = []
        for i in range(self.peers):
            shell.flat.zero_grad()
            losses.append(shell.backward(tokens[i], labels[i]))
            self.squares[0] += shell.flat.grad.square().sum() / self.peers
            self.total.add_(shell.flat.grad)
        shell.flat.grad.copy_(self.total.div_(self.peers))
        self.squares[1] += shell.flat.grad.square().sum()
        self.steps += 1
        adam_update(self.x, shell.flat.grad, self.state, self.adam, shell.flat.decay_ranges)
        return torch.stack(losses).mean()

    def noise_scale(self, lane_tokens: int) -> float | None:
        """The gradient noise scale B_simple in tokens over the steps since the last call (McCandlish et al. 2018,
        appendix A: from |G|^2 at a lane's batch b and at the group's n b), None where the estimate is not positive."""
        small, big = (self.squares / max(self.steps, 1)).tolist()
        self.squares.zero_()
        self.steps = 0
        return noise_scale(small, big, lane_tokens, self.peers)

    def mean(self) -> torch.Tensor:
        return self.x

    def consensus(self) -> float:
        return 0.0


class Decentralized:
    """Decentralized Adam (or AccumAdam) of n peers, each with its own parameters and moments."""

    def __init__(self, shell: Shell, peers: int, adam: AdamConfig, topology: str) -> None:
        self.peers, self.adam, self.topology = peers, adam, topology
        size, device = shell.init.numel(), shell.init.device
        self.x = shell.init.repeat(peers, 1)  # row i: peer i's parameters
        self.mixed = torch.empty_like(self.x)  # x_half, then (after Adam) the next step's x
        self.difference = torch.empty(size, device=device)
        self.states = [AdamState(size, device, windowed=adam.windowed) for _ in range(peers)]

    def step(self, shell: Shell, tokens: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
        self._mix(mixing_matrix(self.topology, self.peers, step))
        losses = []
        for i in range(self.peers):
            shell.load(self.x[i])  # the gradient is taken at x_i(t), the step made from x_half_i
            losses.append(shell.backward(tokens[i], labels[i]))
            adam_update(self.mixed[i], shell.flat.grad, self.states[i], self.adam, shell.flat.decay_ranges,
                        peers=self.peers)
        self.x, self.mixed = self.mixed, self.x
        return torch.stack(losses).mean()

    @torch.no_grad()
    def _mix(self, w: np.ndarray) -> None:
        # x_i + sum_j w_ij (x_j - x_i): group.py's form (rows of W sum to 1, so it is sum_j w_ij x_j)
        for i in range(self.peers):
            out = self.mixed[i]
            out.copy_(self.x[i])
            for j in np.flatnonzero(w[i]):
                if j != i:
                    torch.sub(self.x[j], self.x[i], out=self.difference)
                    out.add_(self.difference, alpha=float(w[i, j]))

    def mean(self) -> torch.Tensor:
        return self.x.mean(0)

    @torch.no_grad()
    def consensus(self) -> float:
        mean = self.x.mean(0)
        distances = torch.stack([torch.linalg.vector_norm(row - mean) for row in self.x])
        return float(distances.mean() / torch.linalg.vector_norm(mean))


class Outer:
    """Outer steps (DiLoCo; `outer.py`): every step's mean gradient for the first `after` steps (the recipe's warm
    start, `outer_after`), then each peer trains alone and every H steps the group takes one Nesterov step with
    the mean of its changes since the last, as `group.py` runs a group without overlap."""

    def __init__(self, shell: Shell, peers: int, adam: AdamConfig, every: int, after: int) -> None:
        self.peers, self.adam, self.every, self.after = peers, adam, every, after
        size, device = shell.init.numel(), shell.init.device
        self.x = shell.init.repeat(peers, 1)
        self.states = [AdamState(size, device) for _ in range(peers)]
        self.outer, self.config = OuterState(shell.init), OuterConfig()

    def step(self, shell: Shell, tokens: torch.Tensor, labels: torch.Tensor, step: int) -> torch.Tensor:
        if step < self.after:  # all-reduce: every peer steps from the same point with the mean gradient
            shell.load(self.x[0])
            losses = [shell.backward(tokens[i], labels[i], 1.0 / self.peers) for i in range(self.peers)]
            for i in range(self.peers):
                adam_update(self.x[i], shell.flat.grad, self.states[i], self.adam, shell.flat.decay_ranges)
            self.outer.anchor.copy_(self.x[0])
            return torch.stack(losses).mean()
        losses = []
        for i in range(self.peers):
            shell.load(self.x[i])
            losses.append(shell.backward(tokens[i], labels[i]))
            adam_update(self.x[i], shell.flat.grad, self.states[i], self.adam, shell.flat.decay_ranges)
        if (step + 1) % self.every == 0:
            with torch.no_grad():
                change = self.outer.anchor - self.x.mean(0)
                outer_step(self.x[0], change, self.outer, self.config)
                self.x[1:] = self.x[0]
        return torch.stack(losses).mean()

    def mean(self) -> torch.Tensor:
        return self.x.mean(0)

    consensus = Decentralized.consensus


def state_bytes(config: RunConfig, size: int) -> int:
    """Device bytes a run holds beyond the shared shell: fp32 parameters, mixing buffer and moments."""
    if config.method == "allreduce":
        return 4 * size * 3
    if outer_every(config.method):
        return 4 * size * (config.peers * 3 + 3)  # x, m, v a peer; anchor, momentum, the mean change
    per_peer = 5 if config.method in ("accumadam", "dadam-window") else 4  # x, x_half, m, v (and a window)
    return 4 * size * (config.peers * per_peer + 1)


class Bench:
    """The shared parts (device, corpus, shell, held-out sequences) and the running of lockstep groups of runs."""

    def __init__(self, args: argparse.Namespace, spec: ModelSpec, corpus: Corpus, device: torch.device) -> None:
        self.args, self.spec, self.corpus, self.device = args, spec, corpus, device
        self.sequences = args.tokens_per_peer // args.seq_len
        self.shell = Shell(spec, args.seed, device)
        held_out = corpus.validation_batch(args.val_sequences, args.seq_len, seed=VALIDATION_SEED)
        self.val_tokens = torch.from_numpy(held_out.tokens).to(device)
        self.val_labels = torch.from_numpy(held_out.labels).to(device)
        self.deadline_s: float | None = None  # seconds since STARTED_S at which every run stops

    def build(self, config: RunConfig, steps: int) -> AllReduce | Decentralized | Outer:
        adam = adam_config(config.method, config.lr, steps, self.args.clip_norm, config.peers)
        if config.method == "allreduce":
            return AllReduce(self.shell, config.peers, adam)
        if outer_every(config.method):
            return Outer(self.shell, config.peers, adam, outer_every(config.method), self.args.outer_after)
        return Decentralized(self.shell, config.peers, adam, self.args.topology)

    def batch(self, step: int, peers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s sequences of every peer, shaped (peers, sequences, seq_len): peer i's are the corpus's
        positions [(step peers + i) B, (step peers + i + 1) B), so the peers' data are disjoint."""
        rows, seq_len = peers * self.sequences, self.args.seq_len
        data = self.corpus.batch(step * rows, rows, seq_len, seed=self.args.seed)
        out = []
        for array in (data.tokens, data.labels):
            tensor = torch.from_numpy(array).view(peers, self.sequences, seq_len)
            if self.device.type == "cuda":  # pinned, so that the copy does not wait for the queued compute
                tensor = tensor.pin_memory().to(self.device, non_blocking=True)
            out.append(tensor)
        return out[0], out[1]

    def validate(self, run: AllReduce | Decentralized | Outer) -> float:
        return self.shell.validate(run.mean(), self.val_tokens, self.val_labels, self.sequences)

    def probe(self, configs: list[RunConfig], steps: int) -> tuple[Cost, list[float], int]:
        """Build the group, one warm-up step, `--probe-steps` timed steps, one timed evaluation: its Cost, each run's
        seconds a step, and its peak device bytes."""
        self._reset_peak()
        started = time.perf_counter()
        runs = [self.build(c, steps) for c in configs]
        sync(self.device)
        setup_s = time.perf_counter() - started
        peers = configs[0].peers
        per_run = [0.0] * len(runs)
        for step in range(1 + self.args.probe_steps):
            tokens, labels = self.batch(step, peers)
            for k, run in enumerate(runs):
                sync(self.device)
                started = time.perf_counter()
                run.step(self.shell, tokens, labels, step)
                sync(self.device)
                per_run[k] += (time.perf_counter() - started) * (step > 0)
        per_run = [s / self.args.probe_steps for s in per_run]
        started = time.perf_counter()
        for run in runs:
            self.validate(run)
            run.consensus()
        eval_s = time.perf_counter() - started
        peak = self._peak()
        runs.clear()  # the state goes before the next group is built
        self.release()
        return Cost(setup_s, sum(per_run), eval_s), per_run, peak

    def run_group(self, records: list[Record], eval_every: int, on_eval, estimate: Cost | None) -> None:
        """Every run of `records` (one group size) in lockstep for their steps; evaluations at step 0, every
        `eval_every` steps and at the end. Stops early, after a last evaluation, where the next step and an
        evaluation would pass the deadline."""
        steps, peers = records[0].steps, records[0].config.peers
        self._reset_peak()
        runs = [self.build(r.config, steps) for r in records]
        for record in records:
            record.status = "running"
        pending: list[list[torch.Tensor]] = [[] for _ in runs]
        step_s = estimate.step_s if estimate else 0.0
        eval_s = estimate.eval_s if estimate else 0.0
        train_s, logged_s = 0.0, time.monotonic()

        def evaluate(step: int) -> None:
            nonlocal eval_s
            started = time.perf_counter()
            for k, (record, run) in enumerate(zip(records, runs)):
                record.train += [float(v) for v in pending[k]]
                pending[k].clear()
                loss = self.validate(run)
                if step == 0:
                    record.initial_loss = loss
                else:
                    record.curve.append((step, loss))
                    record.consensus.append((step, run.consensus()))
                    if isinstance(run, AllReduce):
                        record.noise.append((step, run.noise_scale(self.args.tokens_per_peer)))
            eval_s = time.perf_counter() - started
            on_eval(records, step, steps, train_s / step if step else None)

        evaluate(0)
        done = 0
        for step in range(steps):
            if self.late(step_s + eval_s):
                break
            sync(self.device)
            started = time.perf_counter()
            tokens, labels = self.batch(step, peers)
            for k, run in enumerate(runs):
                pending[k].append(run.step(self.shell, tokens, labels, step))
            done = step + 1
            if done % eval_every == 0 or done == steps or time.monotonic() - logged_s > LOG_EVERY_S:
                sync(self.device)
            train_s += time.perf_counter() - started
            step_s = train_s / done
            if done % eval_every == 0 or done == steps:
                evaluate(done)
                logged_s = time.monotonic()
            elif time.monotonic() - logged_s > LOG_EVERY_S:
                last = [float(p[-1]) for p in pending]
                say(f"  [{peers} peers] step {done}/{steps}  {step_s:.3f} s/step  train "
                    + "  ".join(f"{r.config.name}: {v:.4f}" for r, v in zip(records, last)))
                logged_s = time.monotonic()
        if done and (not records[0].curve or records[0].curve[-1][0] != done):
            evaluate(done)  # cut short: a last evaluation where it stopped
        for record in records:
            record.status = "done" if done == steps else "stopped"
            record.peak_bytes = self._peak()
        runs.clear()  # the state goes before the next group is built
        self.release()

    def late(self, next_s: float) -> bool:
        return self.deadline_s is not None and elapsed_s() + next_s + RESERVE_S > self.deadline_s

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def groups_of(configs: list[RunConfig], size: int, limit_bytes: int | None) -> list[list[RunConfig]]:
    """The runs, by group size, in lockstep groups whose state fits `limit_bytes` (all of a size at once if None)."""
    groups: list[list[RunConfig]] = []
    for peers in dict.fromkeys(c.peers for c in configs):
        current: list[RunConfig] = []
        for config in (c for c in configs if c.peers == peers):
            if current and limit_bytes is not None and sum(state_bytes(c, size) for c in [*current, config]) > limit_bytes:
                groups.append(current)
                current = []
            current.append(config)
        groups.append(current)
    return groups


def evaluations(steps: int, every: int) -> int:
    return steps // every + 1 + (steps % every != 0)  # step 0, every `every`, the last


def eval_every_for(args: argparse.Namespace, steps: int) -> int:
    return args.eval_every or max(1, steps // EVALUATIONS)


def choose_steps(costs: list[Cost], available_s: float, args: argparse.Namespace) -> int:
    """The most steps at which every group's build, steps and evaluations take at most `available_s` x SAFETY
    (0 when not even one fits): a binary search over a cost that grows with the steps."""
    def total_s(steps: int) -> float:
        points = evaluations(steps, eval_every_for(args, steps))
        return sum(c.setup_s + steps * c.step_s + points * c.eval_s for c in costs)

    low, high = 0, 1
    while total_s(high) <= available_s * SAFETY and high < 10**7:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if total_s(middle) <= available_s * SAFETY else (low, middle)
    return low


def compare(records: list[Record]) -> dict[int, dict]:
    """Per group size: every run with a curve against the best all-reduce run, at the steps all of them reached."""
    result: dict[int, dict] = {}
    for peers in dict.fromkeys(r.config.peers for r in records):
        group = [r for r in records if r.config.peers == peers and r.curve]
        references = [r for r in group if r.config.method == "allreduce"]
        if not references:
            continue
        upto = min(r.curve[-1][0] for r in group)
        runs = {id(r): r.run(upto) for r in group}
        reference = min(references, key=lambda r: runs[id(r)].loss)
        base = runs[id(reference)]
        rows = {}
        for record in group:
            run = runs[id(record)]
            # all-reduce's steps to this run's loss; where the run beat all-reduce, its own steps to all-reduce's
            factor = upto / base.steps_to(run.loss) if run.loss > base.loss else run.steps_to(base.loss) / upto
            rows[record.config.name] = {"val_loss": run.loss, "gap": run.loss / base.loss - 1, "steps_factor": factor,
                                        "train_loss": run.train, "consensus": run.consensus, "at_step": run.curve[-1][0]}
        result[peers] = {"reference": reference.config.name, "at_step": upto, "runs": rows}
    return result


def print_table(comparison: dict[int, dict]) -> None:
    say(f"\n{'optimizer':40s} {'peers':>5s} {'step':>6s} {'val loss':>9s} {'vs all-reduce':>14s} {'steps x':>8s} "
        f"{'train':>7s} {'consensus':>10s}")
    for peers, found in comparison.items():
        for name, row in found["runs"].items():
            method, _, lr = name.partition(" lr ")
            say(f"{LABELS[method] + ', lr ' + lr:40s} {peers:5d} {row['at_step']:6d} {row['val_loss']:9.4f} "
                f"{row['gap']:+14.2%} {row['steps_factor']:8.2f} {row['train_loss']:7.4f} {row['consensus']:10.2e}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke sizes: the tiny preset, 2 and 4 peers, 30 steps")
    parser.add_argument("--model", help=f"gpt2-small or a preset ({', '.join(PRESETS)}); default gpt2-small "
                        "(--small: tiny)")
    parser.add_argument("--peers", type=int, nargs="+", help="group sizes (default 8 16; --small: 2 4)")
    parser.add_argument("--tokens-per-peer", type=int, help="tokens a peer-step, a multiple of --seq-len (default 16384)")
    parser.add_argument("--seq-len", type=int, help="tokens a sequence (default 1024; --small: 64)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["allreduce", "dadam"],
                        help="optimizers to compare (default allreduce dadam)")
    parser.add_argument("--lr", type=float, nargs="+",
                        help="peak learning rates of every method (default 6e-4; --small: 3e-3)")
    parser.add_argument("--lr-for", nargs="+", action="append", default=[], metavar=("METHOD", "LR"),
                        help="this method's own learning rates, in place of --lr (repeatable): --lr-for dadam 6e-4 1e-3")
    parser.add_argument("--clip-norm", type=float, default=0.0, metavar="NORM",
                        help="clip each peer's gradient (all-reduce: the mean gradient) to this L2 norm, where this "
                        "checkout's AdamConfig has clip_norm (default 0: no clipping)")
    parser.add_argument("--outer-after", type=int, default=OUTER_AFTER, metavar="STEPS",
                        help=f"outer-H methods: steps of every-step all-reduce before the first outer step, the recipe's "
                        f"outer_after (default {OUTER_AFTER})")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="one-peer-exp",
                        help="gossip topology (default one-peer-exp)")
    parser.add_argument("--steps", type=int, help="steps of every run; overrides the sizing by --time-budget (default 1000 "
                        "without a budget; --small: 30)")
    parser.add_argument("--time-budget", type=float, metavar="S", help="wall seconds for the whole script: size the steps "
                        "so that every run fits, and stop every run where it is when they run out")
    parser.add_argument("--probe-steps", type=int, default=2, help="timed steps a group before sizing (default 2)")
    parser.add_argument("--eval-every", type=int,
                        help=f"steps between validations (default steps / {EVALUATIONS}; --small: 10)")
    parser.add_argument("--val-sequences", type=int, help="held-out sequences of a validation (default 128; --small: 32)")
    parser.add_argument("--corpus", help="a folder of text to train on (default: the standard library's sources)")
    parser.add_argument("--corpus-bytes", type=int, help=f"at most this many bytes of text (default {DEFAULT_MAX_BYTES})")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order (default 0)")
    parser.add_argument("--device", help="torch device (default cuda when there is one, else cpu)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write runs.jsonl, evals.jsonl and summary.json here")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object, the last line")
    args = parser.parse_args(argv)
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None and not (key == "steps" and args.time_budget is not None):  # a budget sizes them
            setattr(args, key, value)
    if args.steps is None and args.time_budget is None:
        args.steps = 1000
    args.peers, args.methods = list(dict.fromkeys(args.peers)), list(dict.fromkeys(args.methods))  # each run once
    lrs = {method: list(dict.fromkeys(args.lr)) for method in args.methods}
    for method, *values in args.lr_for:
        if method not in args.methods:
            parser.error(f"--lr-for: {method!r} is not one of --methods ({', '.join(args.methods)})")
        try:
            lrs[method] = list(dict.fromkeys(float(v) for v in values))
        except ValueError:
            parser.error(f"--lr-for {method}: learning rates must be numbers, got {' '.join(values)}")
        if not values:
            parser.error(f"--lr-for {method}: give at least one learning rate")
    args.lrs = lrs
    problems = [
        (any(p < 1 for p in args.peers), f"--peers must be at least 1, got {args.peers}"),
        (args.seq_len < 1 or args.tokens_per_peer < args.seq_len or args.tokens_per_peer % args.seq_len,
         f"--tokens-per-peer ({args.tokens_per_peer}) must be a positive multiple of --seq-len ({args.seq_len})"),
        (any(not lr > 0 or not math.isfinite(lr) for v in lrs.values() for lr in v),
         f"learning rates must be positive and finite: {lrs}"),
        (args.steps is not None and args.steps < 1, f"--steps must be at least 1, got {args.steps}"),
        (args.time_budget is not None and not args.time_budget > 0,
         f"--time-budget must be positive, got {args.time_budget}"),
        (args.eval_every is not None and args.eval_every < 1, f"--eval-every must be at least 1, got {args.eval_every}"),
        (args.probe_steps < 1 or args.val_sequences < 1, "--probe-steps and --val-sequences must be at least 1"),
        (args.outer_after < 0, f"--outer-after must be >= 0, got {args.outer_after}"),
        (not math.isfinite(args.clip_norm) or args.clip_norm < 0, f"--clip-norm must be >= 0, got {args.clip_norm}"),
        (args.clip_norm > 0 and not CAN_CLIP, "--clip-norm: this checkout's AdamConfig has no clip_norm (no clipping yet)"),
        (args.model != "gpt2-small" and args.model not in PRESETS, f"--model: unknown {args.model!r} (known: gpt2-small, "
         f"{', '.join(PRESETS)})"),
    ]
    for bad, message in problems:
        if bad:
            parser.error(message)
    return args


def describe(args: argparse.Namespace, bench: Bench, configs: list[RunConfig], name: str) -> None:
    spec, corpus, size = bench.spec, bench.corpus, bench.shell.flat.size
    say(f"gossip at scale: {spec.name} ({size / 1e6:.1f}M parameters, {spec.layers} x {spec.hidden}, {spec.heads} heads, "
        f"vocabulary {spec.vocab}), {args.seq_len}-token sequences, {bench.sequences} a peer-step "
        f"({args.tokens_per_peer} tokens), on {name} ({'bf16 autocast' if bench.device.type == 'cuda' else 'fp32'}), "
        f"torch {torch.__version__}; corpus {corpus.description} ({corpus.windows(args.seq_len)} training windows); "
        f"validation of the group's mean parameters on {args.val_sequences} held-out sequences; topology {args.topology}; "
        + (f"gradients clipped to norm {args.clip_norm:g}" if args.clip_norm else "no gradient clipping"))
    for peers in args.peers:
        held = sum(state_bytes(c, size) for c in configs if c.peers == peers)
        say(f"  {peers} peers: {peers * args.tokens_per_peer} tokens a step; {16 * size / 1e9:.2f} GB a gossiping peer "
            f"(fp32 parameters, mixing buffer, 2 moments), {held / 1e9:.1f} GB for this size's runs, beside the shell's "
            f"{8 * size / 1e9:.2f} GB and one peer-batch's activations")


def size_steps(args: argparse.Namespace, bench: Bench, groups: list[list[RunConfig]], failed: dict[RunConfig, str]
               ) -> tuple[int, dict[int, Cost], dict[RunConfig, float]]:
    """Probe every lockstep group and choose the steps that fit the budget: (steps, each group's Cost by its index,
    each run's seconds a step). A group whose probe fails lands in `failed` and out of the sizing."""
    costs: dict[int, Cost] = {}
    per_step: dict[RunConfig, float] = {}
    for k, group in enumerate(groups):
        try:
            cost, seconds, peak = bench.probe(group, 1000)
        except RuntimeError as error:  # out of memory above all: the other groups may still fit
            failed.update({c: f"probe: {type(error).__name__}: {str(error).splitlines()[0]}" for c in group})
            say(f"  probe, {group[0].peers} peers, failed: {failed[group[0]]}")
            continue
        finally:
            bench.release()
        costs[k] = cost
        per_step.update(zip(group, seconds))
        say(f"  probe, {group[0].peers} peers: build {cost.setup_s:.2f} s, a step of "
            + ", ".join(f"{c.name} {s:.3f} s ({s / c.peers * 1e3:.1f} ms a peer-step)" for c, s in zip(group, seconds))
            + f"; an evaluation of them {cost.eval_s:.2f} s" + (f"; peak {peak / 1e9:.1f} GB" if peak else ""))
    steps = choose_steps(list(costs.values()), args.time_budget - elapsed_s() - RESERVE_S, args)
    planned = sum(c.setup_s + steps * c.step_s + evaluations(steps, eval_every_for(args, steps)) * c.eval_s
                  for c in costs.values())
    say(f"  budget {args.time_budget:g} s, {elapsed_s():.0f} s spent: {steps} steps a run fit (about {planned:.0f} s for "
        f"{sum(len(groups[k]) for k in costs)} runs in {len(costs)} lockstep groups)")
    if steps < 1:
        say("  not even one step of every run fits: running 1 step, stopping at the budget")
    return max(1, steps), costs, per_step


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.small and device.type == "cpu":
        torch.set_num_threads(1)  # the tiny model gains nothing from more, and a busy machine's other work stalls them
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the model's products run in bf16; this covers fp32 leftovers
        torch.backends.cudnn.allow_tf32 = True
    corpus = (Corpus.from_folder(args.corpus, max_bytes=args.corpus_bytes) if args.corpus
              else Corpus.default(max_bytes=args.corpus_bytes))
    spec = gpt2_small(args.seq_len, corpus.vocab) if args.model == "gpt2-small" else replace(
        preset(args.model), seq_len=args.seq_len, vocab=corpus.vocab)
    bench = Bench(args, spec, corpus, device)
    bench.deadline_s = args.time_budget
    configs = [RunConfig(p, m, lr) for p in args.peers for m in args.methods for lr in args.lrs[m]]
    limit = int(torch.cuda.mem_get_info(device)[0] * MEMORY_SHARE) if device.type == "cuda" else None
    groups = groups_of(configs, bench.shell.flat.size, limit)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    describe(args, bench, configs, name)
    records: list[Record] = []
    outputs = Outputs(args.out)
    failed: dict[RunConfig, str] = {}
    exit_code = 0
    try:
        costs: dict[int, Cost] = {}
        per_step: dict[RunConfig, float] = {}
        steps = args.steps
        if steps is None:
            steps, costs, per_step = size_steps(args, bench, groups, failed)
        every = eval_every_for(args, steps)
        records = [Record(c, steps, c.peers * args.tokens_per_peer, probe_s_per_step=per_step.get(c), seed=args.seed)
                   for c in configs]
        by_config = {r.config: r for r in records}
        for peers in args.peers:
            say(f"  {peers} peers: {steps} steps read {steps * peers * bench.sequences / corpus.windows(args.seq_len):.2f} "
                "epochs of the corpus")
        say(f"  {steps} steps a run, learning rate warmup {adam_config('allreduce', 1.0, steps).warmup_steps} steps, then "
            f"cosine to {MIN_LR_RATIO:g}x; evaluation every {every} steps")
        for k, group in enumerate(groups):
            batch = [by_config[c] for c in group]
            if group[0] in failed:
                for record in batch:
                    record.status, record.error = "failed", failed[record.config]
            elif not bench.late(0.0):
                try:
                    bench.run_group(batch, every, outputs.evaluated, costs.get(k))
                except RuntimeError as error:  # out of memory above all: the other groups may still fit, so go on
                    say(f"  {group[0].peers} peers failed: {type(error).__name__}: {str(error).splitlines()[0]}")
                    for record in batch:
                        record.status, record.error = "failed", f"{type(error).__name__}: {str(error).splitlines()[0]}"
                bench.release()
            for record in batch:
                if record.status != "pending":
                    outputs.finished(record)
    except (Stopped, KeyboardInterrupt) as why:
        say(f"stopped by {why or 'Ctrl-C'}: reporting what was measured")
        exit_code = 1
        for record in records:
            if record.status == "running":
                record.status = "stopped"
                outputs.finished(record)
    for record in records:
        if record.status == "pending":
            record.status = "skipped"
            outputs.finished(record)
    exit_code = exit_code or int(any(r.status == "failed" for r in records))
    comparison = compare(records)
    print_table(comparison)
    summary = {"benchmark": "gossip_scale", "device": name, "torch": torch.__version__, "model": spec.name,
               "params": bench.shell.flat.size, "seed": args.seed, "seq_len": args.seq_len, "tokens_per_peer": args.tokens_per_peer,
               "topology": args.topology, "clip_norm": args.clip_norm, "steps": records[0].steps if records else None,
               "corpus_bytes": corpus.size_bytes, "time_budget_s": args.time_budget, "elapsed_s": round(elapsed_s(), 1),
               "complete": bool(records) and all(r.status == "done" for r in records),
               "comparison": {str(k): v for k, v in comparison.items()}, "runs": [r.to_json() for r in records]}
    outputs.summary(summary)
    say(f"done in {elapsed_s():.0f} s" + ("" if summary["complete"] else " (not every run finished)"))
    if args.json:
        print(json.dumps(summary), flush=True)
    return exit_code


class Outputs:
    """Where results go as they come: the console, and with --out the folder's JSON lines."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            for name in ("runs.jsonl", "evals.jsonl"):
                (folder / name).write_text("")

    def _append(self, name: str, entry: dict) -> None:
        if self.folder is not None:
            with (self.folder / name).open("a") as handle:
                handle.write(json.dumps(entry) + "\n")

    def evaluated(self, records: list[Record], step: int, steps: int, step_s: float | None) -> None:
        peers = records[0].config.peers
        pace = "" if step_s is None else (
            f"  {step_s:.3f} s/step ({step_s / (peers * len(records)) * 1e3:.1f} ms a peer-step)")
        parts = []
        for record in records:
            if step == 0:
                parts.append(f"{record.config.name}: val {record.initial_loss:.4f}")
                self._append("evals.jsonl", {"peers": peers, "run": record.config.name, "step": 0,
                                             "val_loss": record.initial_loss})
                continue
            train = mean_of_last(record.train)
            consensus = record.consensus[-1][1]
            parts.append(f"{record.config.name}: train {train:.4f} val {record.curve[-1][1]:.4f} cons {consensus:.1e}")
            self._append("evals.jsonl", {"peers": peers, "run": record.config.name, "step": step,
                                         "val_loss": record.curve[-1][1], "train_loss": train, "consensus": consensus,
                                         "s_per_step": step_s})
        say(f"  [{peers} peers] step {step}/{steps}{pace}  |  " + "  |  ".join(parts))

    def finished(self, record: Record) -> None:
        entry = record.to_json()
        say(json.dumps({"run": {k: v for k, v in entry.items() if k not in ("curve", "consensus_curve", "noise_scale_curve")}}))
        self._append("runs.jsonl", entry)

    def summary(self, summary: dict) -> None:
        if self.folder is not None:
            (self.folder / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
