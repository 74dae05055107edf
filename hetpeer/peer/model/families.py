"""GPT-2 and Llama, as `transformers` defines them, cut into pipeline stages.

A stage's modules and parameters carry `transformers`' own names (`transformer.h.3.attn.c_attn.weight`,
`model.layers.3.self_attn.q_proj.weight`, ...), so a stage loads its tensors straight from a model
folder's safetensors and a set of stages writes back a folder that `from_pretrained` loads. Parameters
are registered in the order `ModelSpec.param_range` counts them (embeddings, blocks, final norm, head),
and a fresh model is initialised part by part from generators seeded by (seed, part, block), as
`gpt.Stage` is: any cut of the model holds the same values.

A tied output head is a copy of the token embedding on the stage that holds the last layer, tied by
adding the two gradients before each optimizer step (`tied_parameters`; the stage worker adds them, or
exchanges them between the two ends of a lane), so the copies take the same steps. Dropout is not
applied: the config's `*_pdrop` / `attention_dropout` are read as 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetpeer.peer.model.gpt import (
    INIT_STD, _BLOCK, _HEAD, _POSITIONS, _TOKENS, _generator, _rotate, head_logits, run_blocks, token_loss,
)
from hetpeer.protocol.modelspec import ModelSpec


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored (in, out), y = x W + b."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_in, fan_out))
        self.bias = nn.Parameter(torch.empty(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class GPT2Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, h = spec.heads, spec.hidden
        self.c_attn = Conv1D(h, 3 * h)
        self.c_proj = Conv1D(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(hidden, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class GPT2MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.c_fc = Conv1D(spec.hidden, spec.mlp_inner)
        self.c_proj = Conv1D(spec.mlp_inner, spec.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's gelu_new


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.attn = GPT2Attention(spec)
        self.ln_2 = nn.LayerNorm(spec.hidden, eps=spec.norm_eps)
        self.mlp = GPT2MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RMSNorm(nn.Module):
    """Llama's norm: x / rms(x) in fp32, times a gain, in the input's dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def rotary_frequencies(spec: ModelSpec) -> torch.Tensor:
    """Llama's inverse frequencies (head_size / 2,), with llama3 scaling when the config asks for it
    (Llama 3.1: long wavelengths divided by `factor`, a smooth ramp between the two cut-offs)."""
    d = spec.head_size
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if not spec.rope_scaling:
        return inv_freq
    scaling = dict(spec.rope_scaling)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    ramp = (original / wavelength - low) / (high - low)
    smoothed = (1 - ramp) * scaled / factor + ramp * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_size
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.key_value_heads, d
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:  # grouped-query attention: each key/value head serves a group of query heads
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f, bias = spec.hidden, spec.mlp_inner, spec.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.self_attn = LlamaAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = LlamaMLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class FamilyStage(nn.Module):
    """Blocks [layer_start, layer_end) of a GPT-2 or Llama `spec`, with the embeddings on the first stage
    and the final norm and head on the last; the interface of `gpt.Stage`."""

    def __init__(self, spec: ModelSpec, layer_start: int, layer_end: int, seed: int = 0) -> None:
        super().__init__()
        if spec.family not in ("gpt2", "llama"):
            raise ValueError(f"model {spec.name} is of family {spec.family}, not gpt2 or llama")
        if not 0 <= layer_start < layer_end <= spec.layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not a non-empty range within "
                             f"model {spec.name}'s layers [0, {spec.layers})")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.spec, self.layer_start, self.layer_end = spec, layer_start, layer_end
        self.recompute = 0  # the first this many blocks keep only their input and recompute the rest in backward
        h, gpt2 = spec.hidden, spec.family == "gpt2"
        with torch.device("meta"):
            body = nn.Module()
            if self.first:
                if gpt2:
                    body.wte = nn.Embedding(spec.vocab, h)
                    body.wpe = nn.Embedding(spec.context, h)
                else:
                    body.embed_tokens = nn.Embedding(spec.vocab, h)
            blocks = nn.ModuleDict({str(i): (GPT2Block if gpt2 else LlamaBlock)(spec) for i in range(layer_start, layer_end)})
            if gpt2:
                body.h = blocks
            else:
                body.layers = blocks
            if self.last:
                if gpt2:
                    body.ln_f = nn.LayerNorm(h, eps=spec.norm_eps)
                else:
                    body.norm = RMSNorm(h, spec.norm_eps)
            setattr(self, "transformer" if gpt2 else "model", body)
            if self.last:
                self.lm_head = nn.Linear(h, spec.vocab, bias=False)
        self.to_empty(device="cpu")
        self.register_buffer("inv_freq", rotary_frequencies(spec) if not gpt2 else torch.empty(0), persistent=False)
        self._initialise(seed)

    @property
    def first(self) -> bool:
        return self.layer_start == 0

    @property
    def last(self) -> bool:
        return self.layer_end == self.spec.layers

    @property
    def body(self) -> nn.Module:
        return self.transformer if self.spec.family == "gpt2" else self.model

    @property
    def blocks(self) -> nn.ModuleDict:
        return self.body.h if self.spec.family == "gpt2" else self.body.layers

    @property
    def embedding(self) -> nn.Embedding:
        return self.body.wte if self.spec.family == "gpt2" else self.body.embed_tokens

    def tied_parameters(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """(token embedding, head) of a tied model as far as this stage holds them; (None, None) if untied."""
        if not self.spec.tied:
            return None, None
        return (self.embedding.weight if self.first else None), (self.lm_head.weight if self.last else None)

    def decays(self, name: str, param: nn.Parameter) -> bool:
        """Whether weight decay applies: matrices, but not the embedding tables nor a head tied to one (the
        two copies must take the same steps)."""
        embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        return param.dim() >= 2 and not embedding and not (self.spec.tied and name == "lm_head.weight")

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        out_std = INIT_STD / math.sqrt(2 * self.spec.layers)  # residual outputs, as GPT-2 scales them
        for index, block in self.blocks.items():
            generator = _generator(seed, _BLOCK, int(index))
            for name, param in block.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                elif "ln" in name or "layernorm" in name:
                    param.fill_(1.0)
                else:
                    residual = name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight", "o_proj.weight", "down_proj.weight"))
                    param.normal_(0.0, out_std if residual else INIT_STD, generator=generator)
        if self.first:
            self.embedding.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _TOKENS))
            if self.spec.family == "gpt2":
                self.body.wpe.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _POSITIONS))
        if self.last:
            final = self.body.ln_f if self.spec.family == "gpt2" else self.body.norm
            for name, param in final.named_parameters():
                param.fill_(1.0) if name == "weight" else param.zero_()
            # a tied head starts as the embedding: the same generator draws the same values
            self.lm_head.weight.normal_(0.0, INIT_STD, generator=_generator(seed, _TOKENS if self.spec.tied else _HEAD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) on the first stage, hidden states (batch, seq, hidden) on the others;
        returns hidden states, or logits (batch, seq, vocab) on the last stage."""
        spec = self.spec
        if self.first:
            if x.dtype != torch.long or x.dim() != 2:
                raise ValueError(f"stage [0, {self.layer_end}) takes token ids of dtype torch.int64 and shape "
                                 f"(batch, seq), got {x.dtype} of shape {tuple(x.shape)}")
        elif not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != spec.hidden:
            raise ValueError(f"stage [{self.layer_start}, {self.layer_end}) takes floating hidden states of shape "
                             f"(batch, seq, {spec.hidden}), got {x.dtype} of shape {tuple(x.shape)}")
        seq = x.shape[1]
        if not 1 <= seq <= spec.context:
            raise ValueError(f"sequence length {seq} is outside 1..{spec.context} of model {spec.name}")
        if self.first:
            hidden = self.embedding(x)
            if spec.family == "gpt2":
                hidden = hidden + self.body.wpe(torch.arange(seq, device=x.device))
        else:
            hidden = x
        if spec.family == "gpt2":
            hidden = run_blocks(self.blocks, hidden, self.recompute)
            if self.last:
                hidden = head_logits(self.body.ln_f(hidden), self.lm_head.weight)
            return hidden
        angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)  # as transformers casts them
        hidden = run_blocks(self.blocks, hidden, self.recompute, cos, sin)
        if self.last:
            hidden = head_logits(self.body.norm(hidden), self.lm_head.weight)
        return hidden

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, labels, self.spec.vocab)
