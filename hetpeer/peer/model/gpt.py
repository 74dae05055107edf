"""A GPT decoder cut into pipeline stages, built so that any cut trains the same model.

A `Stage` holds the global blocks [layer_start, layer_end) of a `ModelSpec`; the first stage also holds
the embeddings, the last the final LayerNorm and an untied head. Its parameters and forward FLOPs are
exactly the ones `protocol.workload` counts (12 h^2 + 13 h parameters and 24 h^2 + 4 seq h FLOPs per
token per block; 2 h vocab FLOPs per token for the head), so the planner's numbers describe what runs.

Parameter names are global (`blocks.<i>.…`, `tokens.weight`, `head.weight`), and every block, embedding
and the head is initialised from its own generator seeded by (seed, part, index): a stage built alone
holds exactly the values of the same names in the whole model, however the model is cut. Stages are
built on the meta device and materialised on the CPU, so building one never reads or advances torch's
global random state.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetpeer.protocol.modelspec import ModelSpec

from hetpeer.protocol.workload import HEAD_ROWS

INIT_STD = 0.02
ROTARY_BASE = 10_000.0

# Parts of the model, each initialised from its own generator (with the block's global index for blocks).
_BLOCK, _TOKENS, _POSITIONS, _HEAD = range(4)


def _rotary_tables(
    seq_len: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim) for rotate-half rotary embeddings (Su et al., 2021)."""
    inv_freq = ROTARY_BASE ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); 12 h^2 + 13 h parameters."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h = spec.hidden
        self.heads = spec.heads
        self.rotary = spec.positions == "rotary"
        if self.rotary and (h // spec.heads) % 2:
            raise ValueError(
                f"model {spec.name}: rotary positions need an even head size, got hidden {h} / heads {spec.heads}"
            )
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        # (batch, seq, 3, heads, head_dim) -> three (batch, heads, seq, head_dim) views of one buffer
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(batch, seq, 3, self.heads, head_dim).unbind(2))
        if self.rotary:
            cos, sin = _rotary_tables(seq, head_dim, x.device, q.dtype)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class Stage(nn.Module):
    """Global blocks [layer_start, layer_end) of `spec`, with the embeddings on the first stage and the
    final LayerNorm and head on the last. A stage of all layers is the whole model."""

    def __init__(self, spec: ModelSpec, layer_start: int, layer_end: int, seed: int = 0) -> None:
        super().__init__()
        if not 0 <= layer_start < layer_end <= spec.layers:
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) is not a non-empty range within "
                f"model {spec.name}'s layers [0, {spec.layers})"
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self._spec = spec
        self._layer_start = layer_start
        self._layer_end = layer_end
        self.recompute = 0  # the first this many blocks keep only their input and recompute the rest in backward
        h = spec.hidden
        with torch.device("meta"):  # shapes only; values come from the seeded generators below
            if self.first:
                self.tokens = nn.Embedding(spec.vocab, h)
                if spec.positions == "learned":
                    self.positions = nn.Embedding(spec.seq_len, h)
            self.blocks = nn.ModuleDict({str(i): Block(spec) for i in range(layer_start, layer_end)})
            if self.last:
                self.norm = nn.LayerNorm(h)
                self.head = nn.Linear(h, spec.vocab, bias=False)
        self.to_empty(device="cpu")
        self._initialise(seed)

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def layer_start(self) -> int:
        return self._layer_start

    @property
    def layer_end(self) -> int:
        return self._layer_end

    @property
    def first(self) -> bool:
        return self._layer_start == 0

    @property
    def last(self) -> bool:
        return self._layer_end == self._spec.layers

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        # GPT-2: residual output projections scaled by 1/sqrt(2 * layers), as each block adds two of them.
        out_std = INIT_STD / math.sqrt(2 * self._spec.layers)
        for index, block in self.blocks.items():
            generator = _generator(seed, _BLOCK, int(index))
            linears = ((block.qkv, INIT_STD), (block.proj, out_std), (block.fc1, INIT_STD), (block.fc2, out_std))
            for linear, std in linears:
                linear.weight.normal_(0.0, std, generator=generator)
                linear.bias.zero_()
            for norm in (block.ln1, block.ln2):
                norm.weight.fill_(1.0)
                norm.bias.zero_()
        if self.first:
            self.tokens.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _TOKENS))
            if hasattr(self, "positions"):
                self.positions.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _POSITIONS))
        if self.last:
            self.norm.weight.fill_(1.0)
            self.norm.bias.zero_()
            self.head.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _HEAD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) on the first stage, hidden states (batch, seq, hidden) on the others;
        returns hidden states, or logits (batch, seq, vocab) on the last stage."""
        spec = self._spec
        if self.first:
            if x.dtype != torch.long:
                raise ValueError(f"stage [0, {self._layer_end}) takes token ids of dtype torch.int64, got {x.dtype}")
            if x.dim() != 2:
                raise ValueError(f"token ids must have shape (batch, seq), got {tuple(x.shape)}")
        else:
            if not x.is_floating_point():
                raise ValueError(
                    f"stage [{self._layer_start}, {self._layer_end}) takes floating hidden states, got dtype {x.dtype}"
                )
            if x.dim() != 3 or x.shape[-1] != spec.hidden:
                raise ValueError(
                    f"hidden states must have shape (batch, seq, {spec.hidden}) for model {spec.name}, "
                    f"got {tuple(x.shape)}"
                )
        seq = x.shape[1]
        if not 1 <= seq <= spec.seq_len:
            raise ValueError(f"sequence length {seq} is outside 1..{spec.seq_len} of model {spec.name}")
        if self.first:
            hidden = self.tokens(x)
            if hasattr(self, "positions"):
                hidden = hidden + self.positions(torch.arange(seq, device=x.device))
        else:
            hidden = x
        hidden = run_blocks(self.blocks, hidden, self.recompute)
        if self.last:
            hidden = head_logits(self.norm(hidden), self.head.weight)
        return hidden

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, labels, self._spec.vocab)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight^T, the weight's rows padded with zeros to a multiple of `HEAD_ROWS` for the product and the
    logits of the padding cut off again (a view: the loss reads it, its gradient flows only to the real rows)."""
    vocab = weight.shape[0]
    pad = -vocab % HEAD_ROWS
    if pad == 0:
        return F.linear(hidden, weight)
    return F.linear(hidden, F.pad(weight, (0, 0, 0, pad)))[..., :vocab]


def run_blocks(blocks: nn.ModuleDict, hidden: torch.Tensor, recompute: int, *args: torch.Tensor) -> torch.Tensor:
    """`hidden` through `blocks` in order (each also given `args`). While gradients are taken, the first
    `recompute` blocks keep only their input: the backward pass runs each of them forward again, under the
    same autocast, for one more forward of compute (Chen et al., 2016, "Training deep nets with sublinear
    memory cost")."""
    for i, block in enumerate(blocks.values()):
        if i < recompute and torch.is_grad_enabled():
            hidden = checkpoint(block, hidden, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            hidden = block(hidden, *args)
    return hidden


def token_loss(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Next-token cross entropy averaged over every token, computed on fp32 logits."""
    if logits.dim() != 3 or logits.shape[-1] != vocab:
        raise ValueError(f"logits must have shape (batch, seq, {vocab}), got {tuple(logits.shape)}")
    if labels.dtype != torch.long or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels must be torch.int64 of shape {tuple(logits.shape[:2])}, "
            f"got {labels.dtype} of shape {tuple(labels.shape)}"
        )
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _generator(seed: int, part: int, index: int = 0) -> torch.Generator:
    state = np.random.SeedSequence([seed, part, index]).generate_state(1, np.uint64)[0]
    return torch.Generator(device="cpu").manual_seed(int(state))

