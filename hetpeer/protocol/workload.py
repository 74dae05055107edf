"""What is being trained: a GPT shape, the batch, and the numeric type; and what that costs per layer.

The planner and the peer runtime read the same presets, so that the plan's FLOPs and bytes describe
the model the peers actually run. Counting conventions (per sequence of `seq_len` tokens, h = hidden):

- a block has 12 h^2 + 13 h parameters (QKV and output projections, a 4h MLP, two LayerNorms);
- its forward pass costs 24 h^2 + 4 seq h FLOPs per token (every weight once as a multiply-add, plus
  QK^T and attention-times-V), backward twice that (Narayanan et al., SC 2021);
- stage 0 also holds the token (and, with learned positions, position) embeddings; the last stage the
  final LayerNorm and an untied output head of vocab x h, which costs 2 h vocab FLOPs per token;
- a block keeps about 34 seq h bytes of 16-bit activations per sequence for its backward pass with
  fused attention (Korthikanti et al., 2022, without the 5 a seq^2 term that fused attention removes);
- training state is 16 bytes per parameter: 16-bit weights and gradients, fp32 master weights and two
  Adam moments (Rajbhandari et al., ZeRO, 2020); in fp32 it is the same 16 (weights, grads, two moments).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    layers: int
    positions: str = "learned"  # or "rotary"

    def __post_init__(self) -> None:
        for attr in ("hidden", "heads", "seq_len", "vocab", "layers"):
            if getattr(self, attr) < 1:
                raise ValueError(f"model {self.name}: {attr} must be at least 1, got {getattr(self, attr)}")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"model {self.name}: positions must be 'learned' or 'rotary', got {self.positions!r}")

    def with_layers(self, layers: int) -> "ModelSpec":
        return replace(self, layers=layers)

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def embedding_params(self) -> int:
        positions = self.seq_len * self.hidden if self.positions == "learned" else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden + 2 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    def param_range(self, layer_start: int, layer_end: int) -> tuple[int, int]:
        """[start, end) of a stage's parameters in the whole model's flat parameter vector: embeddings,
        blocks in order, final norm and head. Stages are contiguous in it, so any peer's state is a slice."""
        if not 0 <= layer_start < layer_end <= self.layers:
            raise ValueError(f"layers [{layer_start}, {layer_end}) are not a stage of a {self.layers}-layer model")
        start = 0 if layer_start == 0 else self.embedding_params + layer_start * self.layer_params
        end = self.embedding_params + layer_end * self.layer_params + (self.head_params if layer_end == self.layers else 0)
        return start, end


PRESETS: dict[str, ModelSpec] = {
    # GPT-3 XL (Brown et al., 2020, Table 2.1): 1.3B parameters at 24 layers.
    "gpt3-xl": ModelSpec("gpt3-xl", hidden=2048, heads=16, seq_len=2048, vocab=50257, layers=24),
    # Byte-level models for CPUs: `tiny` trains in seconds (tests, demos); in `small` the matrix
    # multiplies dominate a step, as on real GPUs (benchmarks that hold the planner to the runtime).
    "tiny": ModelSpec("tiny", hidden=64, heads=4, seq_len=64, vocab=256, layers=4),
    "small": ModelSpec("small", hidden=256, heads=8, seq_len=128, vocab=256, layers=8),
    # 38M parameters: a peer of a few GB holds a stage of it, but not the whole model with its optimizer
    # state and a data-parallel averager's buffers (benchmarks/vs_hivemind.py's memory case).
    "medium": ModelSpec("medium", hidden=512, heads=8, seq_len=128, vocab=256, layers=12),
}


def preset(name: str, layers: int | None = None) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    spec = PRESETS[name]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        spec = spec.with_layers(layers)
    return spec


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
        m = self.model
        return float(m.seq_len * (24 * m.hidden**2 + 4 * m.seq_len * m.hidden))

    @property
    def head_fwd_flops_per_seq(self) -> float:
        m = self.model
        return float(m.seq_len * 2 * m.hidden * m.vocab)

    @property
    def boundary_bytes_per_seq(self) -> float:
        """Bytes of the activation (or its gradient) passed between two stages, per sequence."""
        return float(self.model.seq_len * self.model.hidden * self.dtype_bytes)

    @property
    def stored_activation_bytes_per_layer_per_seq(self) -> float:
        return float(34 * self.model.seq_len * self.model.hidden * self.dtype_bytes / 2)

    @property
    def logits_bytes_per_seq(self) -> float:
        """fp32 logits and their gradient at the loss, the last stage's largest buffer."""
        return float(2 * 4 * self.model.seq_len * self.model.vocab)
