"""What a stage's step costs on this peer's device beyond its blocks, timed as the stage worker runs it.

A joining peer announces it (`StepCosts`) beside its block's TFLOPS (`peer.probe`), so that the coordinator's
time model counts a stage's whole step, not its blocks alone:

- the embedding (the first stage's) and the final norm, head and loss (the last stage's), forward and backward,
  per sequence: a one-block stage holding them, less the block alone;
- the optimizer's step per parameter: a gossip round's average with one neighbour, then Adam with clipping, as
  `GroupSync` runs them once a step;
- the Python around a micro-batch: a one-stage worker's whole step (`StageWorker.train_step` on a one-block
  model: data, forward, loss, backward, the optimizer), less the parts above, per micro-batch;
- what recomputing a block's activations adds (`gpt.run_blocks`): the block's forward and backward with its
  activations recomputed over the same without, less one. The time model counts it for stages that recompute:
  a forward more in FLOPs, a third, but 0.7 to 1.0 for the tiny model on this machine's CPU cores (micro-batches
  of 4 and 2), where the second forward's Python and autograd graph cost as much as its arithmetic;
- each codec's encoding and decoding of a micro-batch's activation, per value (`codec_s_per_value`): where a hop
  is compressed, the time model counts its two peers' own rates, not one CPU thread's (a GPU encodes int8 about
  15 times faster).

Each is timed in the training dtype under the peer's emulated slowdown, as the worker runs its forward and
backward passes (the optimizer outside it, as there), the fastest of passes over about `seconds`
(`probe.time_per_call`): what the device gives a peer that has it to itself.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.adam import AdamConfig, AdamState, adam_update
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.probe import Slowdown, autocast_for, time_per_call
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.peer.transport.codec import TORCH_DTYPES, as_received
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.stepcosts import CODEC_FIELDS, MAX_RECOMPUTE, MAX_VALUE_S, StepCosts
from hetpeer.protocol.workload import Workload

MICRO_BATCHES = 4  # of the one-stage worker's step
UPDATE_PARAMS = 1 << 20  # the optimizer's step is timed over at least this many parameters (a block's, if more)
RECOMPUTE_ROUNDS = 3  # the block is timed plain and recomputing this many times each, alternately
RECOMPUTE_FLOOR = 0.01  # a recomputation timed as free is noise: it costs at least this share (0 would read as untimed)


def step_costs(spec: ModelSpec, micro_batch: int, device: str = "cpu", seconds: float = 0.5, dtype: str = "fp32",
               slowdown: float = 1.0, tflops: float | None = None) -> StepCosts:
    """`StepCosts` of `spec`'s stages at `micro_batch` on `device`; takes about 6.5 x `seconds`. Given `tflops`, the
    block's figure the peer announces (`probe.profile_machine`), the embedding and the head are reckoned against
    it rather than against the block timed again: they hold what a stage's step takes beyond its blocks at the
    announced figure (for a slowed peer, also what a pass started cold after its sleep loses)."""
    autocast = autocast_for(device, dtype)
    two = spec.with_layers(2)
    block = build_stage(spec.with_layers(3), 1, 2, device=device)  # one block alone: no embeddings, no head
    first, last = build_stage(two, 0, 1, device=device), build_stage(two, 1, 2, device=device)
    tokens = torch.randint(spec.vocab, (micro_batch, spec.seq_len), device=device)
    x = torch.randn(micro_batch, spec.seq_len, spec.hidden, device=device, requires_grad=True)

    def timed(forward: Callable[[], torch.Tensor], seconds: float = seconds) -> float:
        around = Slowdown(slowdown) if slowdown != 1 else contextlib.nullcontext()  # one per kind of work

        def run() -> None:
            with around:
                with autocast:
                    out = forward()
                out.backward()

        return time_per_call(run, device, seconds, best=True)

    # the block plain and recomputing, in alternating rounds, the fastest of each: peers that start together probe
    # at once, and a ratio of two timings taken seconds apart under their changing load read 0.4 to 1.9
    plain, again = [], []
    for _ in range(RECOMPUTE_ROUNDS):
        plain.append(timed(lambda: block(x).float().sum(), seconds / RECOMPUTE_ROUNDS))
        block.recompute = 1
        again.append(timed(lambda: block(x).float().sum(), seconds / RECOMPUTE_ROUNDS))
        block.recompute = 0
    plain_s = min(plain)
    recompute_share = max(RECOMPUTE_FLOOR, min(again) / plain_s - 1)
    if tflops is None:
        block_s = plain_s
    else:
        block_s = 3 * micro_batch * Workload(spec, batch=micro_batch, micro_batch=micro_batch).layer_fwd_flops_per_seq / (tflops * 1e12)
    embed_s = max(0.0, timed(lambda: first(tokens).float().sum()) - block_s)
    head_s = max(0.0, timed(lambda: last.loss(last(x), tokens)) - block_s)
    update_s = _update_s_per_param(sum(p.numel() for p in block.parameters()), device, seconds)
    one = spec.with_layers(1)
    step_s = _worker_step_s(one, micro_batch, device, dtype, slowdown, seconds)
    parts_s = MICRO_BATCHES * (block_s + embed_s + head_s) + update_s * one.params
    micro_s = max(0.0, step_s - parts_s) / MICRO_BATCHES
    codecs = codec_s_per_value(micro_batch * spec.seq_len * spec.hidden, device, dtype, seconds / 2)
    return StepCosts(embed_s / micro_batch, head_s / micro_batch, update_s, micro_s, min(recompute_share, MAX_RECOMPUTE),
                     **{CODEC_FIELDS[codec]: rate for codec, rate in codecs.items()})


def codec_s_per_value(values: int, device: str = "cpu", dtype: str = "fp32", seconds: float = 0.25) -> dict[str, float]:
    """Per codec but raw, seconds to encode and decode one value of an activation of `values` values in `dtype` on
    `device`, as a hop does (`codec.as_received`: encoded where it lies, rebuilt from its bytes), the fastest of
    timings over about `seconds` in all."""
    activation = torch.randn(values, device=device).to(TORCH_DTYPES[dtype])
    rates = {}
    for codec in CODEC_FIELDS:
        call_s = time_per_call(lambda: as_received(activation, codec), device, seconds / len(CODEC_FIELDS), best=True)
        rates[codec] = min(max(call_s / values, 1e-15), MAX_VALUE_S)  # a zero would read as not measured
    return rates


def _update_s_per_param(block_params: int, device: str, seconds: float) -> float:
    size = max(UPDATE_PARAMS, block_params)
    params, grad, other = (torch.randn(size, device=device) for _ in range(3))
    state, config = AdamState(size, device), AdamConfig()

    def update() -> None:
        params.mul_(0.5).add_(other, alpha=0.5)
        adam_update(params, grad, state, config)

    return time_per_call(update, device, seconds, best=True) / size


def one_stage_worker(spec: ModelSpec, corpus: Corpus, batch: int, micro_batch: int, device: str = "cpu",
                     dtype: str = "fp32", recipe: Recipe = Recipe(), slowdown: float = 1.0) -> StageWorker:
    """A worker holding the whole of `spec` as the one stage of a one-lane plan, on a memory transport (started:
    `worker.transport.shutdown()` when done): what a peer's step is with no neighbours (this probe, benchmarks)."""
    plan = Plan(cost_model="time", model=spec.name, layers=spec.layers, batch=batch, micro_batch=micro_batch,
                micro_batches=-(-batch // micro_batch), dtype=dtype,
                stages=(StagePlan(0, 0, spec.layers, ("peer",), "none"),), recipe=recipe)
    transport = MemoryTransport("peer", MemoryHub())
    transport.start()
    return StageWorker(plan, "peer", transport, corpus, WorkerConfig(device=device, slowdown=slowdown, model=spec))


def _worker_step_s(spec: ModelSpec, micro_batch: int, device: str, dtype: str, slowdown: float, seconds: float) -> float:
    """The fastest whole step of a one-stage worker of `spec` (the whole model on this peer), `MICRO_BATCHES` of
    `micro_batch` a step, on random tokens."""
    batch = MICRO_BATCHES * micro_batch
    corpus = Corpus(np.random.default_rng(0).integers(0, spec.vocab, 64 * batch * (spec.seq_len + 1)).astype(np.uint16),
                    "the step probe's random tokens", files=0, vocab=spec.vocab)
    worker = one_stage_worker(spec, corpus, batch, micro_batch, device, dtype, slowdown=slowdown)
    try:
        return time_per_call(worker.train_step, device, seconds, best=True)
    finally:
        worker.transport.shutdown()
