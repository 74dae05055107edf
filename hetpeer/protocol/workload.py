"""What is being trained, and what a stage of it costs: the batch and numeric type around a `ModelSpec`
(`modelspec.py`, with the counting conventions the costs follow).

What a stage holds at its peak (`Workload.stage_memory`), as measured against the runtime (tests/unit/
test_memory_model.py on the CPU, `benchmarks/gpu.py` on a GPU): its training state; in a group of more than
one, a neighbour's fp32 parameters received for mixing (mixed in place; the copy a peer sends leaves before
the step's activations exist); for every micro-batch in flight
(min(M, S - s) at stage s under 1F1B), each block's stored activations and, in bf16, the 16-bit copies of
its weights that autocast makes and the backward pass keeps; on the last stage, 12 bytes per logit at the
loss's backward (fp32 log-probabilities, the gradient of the loss and theirs) and the head's 16-bit (or, in fp32,
padded) copy; on
the first stage, the embedding's dense fp32 gradient before it is added to the stage's own.
A block whose activations are recomputed (`recompute`) keeps only its input (fp32) for each micro-batch in
flight, and the backward pass rebuilds one block's activations at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetpeer.protocol.modelspec import DTYPE_BYTES, ModelSpec
from hetpeer.protocol.stepcosts import RECOMPUTE_SHARE

STATE_BYTES_PER_PARAM = 16
SYNC_BYTES_PER_PARAM = 4  # a group's exchange: a neighbour's fp32 parameters, mixed in place
OUTER_BYTES_PER_PARAM = 16  # outer steps: the anchor, the outer momentum, the change being averaged and (overlapped) its copy
LOGIT_BYTES = 12  # per logit at the loss's backward: fp32 log-probabilities, the loss's gradient and theirs
RESIDUAL_BYTES = 4  # per value of the residual stream a recomputed block keeps (fp32: autocast leaves it wide)
# The output head's rows are padded to a multiple of this for its matrix products: tensor cores take a 16-bit
# matrix whose leading dimension is a multiple of 8, and a vocabulary like GPT-2's 50257 otherwise leaves the
# head, a quarter of GPT-2 124M's FLOPs, on slow kernels (on an H200 its forward and backward took 42 ms of a
# 46 ms last layer; nanoGPT pads to 50304 for the same reason).
HEAD_ROWS = 64


@dataclass(frozen=True, slots=True)
class Workload:
    """A model, a global batch of `batch` sequences per step, split into micro-batches of `micro_batch`."""

    model: ModelSpec
    batch: int
    micro_batch: int = 1
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1 sequence, got {self.batch}")
        if self.micro_batch < 1:
            raise ValueError(f"micro-batch must be at least 1 sequence, got {self.micro_batch}")
        if self.micro_batch > self.batch:
            raise ValueError(f"micro-batch {self.micro_batch} is larger than the batch {self.batch}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_fwd_flops_per_seq(self) -> float:
        return self.model.seq_len * self.model.layer_fwd_flops_per_token()

    @property
    def head_fwd_flops_per_seq(self) -> float:
        m = self.model
        return float(m.seq_len * 2 * m.hidden * m.vocab)

    def stage_flops(self, layers: float, *, last: bool, sequences: int, recompute: int = 0,
                    recompute_share: float = RECOMPUTE_SHARE) -> float:
        """A stage's FLOPs for a step of `sequences` as the planner's time model counts them: forward and backward
        (3x the forward) through its layers, each of the `recompute` recomputed ones `recompute_share` of that more
        (`StepCosts.recompute`; by default a forward), and the head on the last stage."""
        head = self.head_fwd_flops_per_seq if last else 0.0
        return sequences * (3 * (layers + recompute_share * recompute) * self.layer_fwd_flops_per_seq + 3 * head)

    @property
    def boundary_bytes_per_seq(self) -> float:
        """Bytes of the activation (or its gradient) passed between two stages, per sequence."""
        return float(self.model.seq_len * self.model.hidden * self.dtype_bytes)

    @property
    def stored_activation_bytes_per_layer_per_seq(self) -> float:
        return self.model.seq_len * self.model.stored_activation_bytes_per_token(self.dtype)

    @property
    def logits_bytes_per_seq(self) -> float:
        """What the logits take at the loss's backward, the last stage's largest buffer (`LOGIT_BYTES` each)."""
        return float(LOGIT_BYTES * self.model.seq_len * self.model.vocab)

    @property
    def weight_copy_bytes_per_param(self) -> int:
        """The 16-bit copy of a weight autocast makes for a micro-batch (kept for its backward); none in fp32."""
        return 0 if self.dtype == "fp32" else 2

    @property
    def head_copy_bytes(self) -> int:
        """The copy of the head's weight its product keeps for the backward pass: 16-bit under autocast; in fp32, the
        zero-padded copy (`HEAD_ROWS`) where the vocabulary needs padding, else none."""
        m = self.model
        rows = m.vocab + -m.vocab % HEAD_ROWS
        return rows * m.hidden * (self.weight_copy_bytes_per_param or (4 if rows != m.vocab else 0))

    def layer_activation_bytes(self, micro_batch: int) -> float:
        """What one block keeps for the backward pass of one micro-batch: stored activations and weight copies."""
        m = self.model
        return micro_batch * self.stored_activation_bytes_per_layer_per_seq + self.weight_copy_bytes_per_param * m.layer_params

    def layer_recomputed_bytes(self, micro_batch: int) -> float:
        """What a block whose activations are recomputed keeps for one micro-batch: its input."""
        return float(micro_batch * self.model.seq_len * self.model.hidden * RESIDUAL_BYTES)

    def stage_memory(self, layers, *, first, last, in_flight, micro_batch: int, group_size: int, recompute=0,
                     outer: bool = False) -> dict[str, Any]:
        """Peak bytes of a stage of `layers` blocks (`recompute` of them recomputed) that runs micro-batches of
        `micro_batch` sequences, by part: training state, the group's exchange (or its `outer` state), activations (micro-batches in
        flight, and the block being rebuilt), the model's ends (logits, embedding gradient). Arithmetic only: numpy arrays of stages evaluate at once
        (the planner), plain numbers give one stage."""
        m, micro = self.model, micro_batch
        params = layers * m.layer_params + first * m.embedding_params + last * m.head_params
        rebuilt = (recompute > 0) * self.layer_activation_bytes(micro)
        return {
            "state_bytes": STATE_BYTES_PER_PARAM * params,
            "sync_bytes": ((OUTER_BYTES_PER_PARAM if outer else SYNC_BYTES_PER_PARAM) if group_size > 1 else 0) * params,
            "activation_bytes": in_flight * ((layers - recompute) * self.layer_activation_bytes(micro)
                                             + recompute * self.layer_recomputed_bytes(micro)) + rebuilt,
            # the last stage's logits and its head's 16-bit copy; the first stage's dense embedding gradient (fp32)
            # before it is added to the stage's own
            "ends_bytes": last * (micro * self.logits_bytes_per_seq + self.head_copy_bytes) + first * 4 * m.vocab * m.hidden,
        }
