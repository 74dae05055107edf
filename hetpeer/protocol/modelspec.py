"""A transformer's shape, as the planner and the peers count it: parameters, FLOPs, stored activations.

The planner and the peer runtime read the same `ModelSpec`, so that the plan's FLOPs and bytes describe
the model the peers actually run. Three families share one set of counts:

- `gpt`: hetpeer's own byte-level GPT (the presets below), pre-norm LayerNorm blocks with a 4h GELU MLP,
  learned or rotary positions, an untied head;
- `gpt2`: GPT-2 as Hugging Face `transformers` defines it (`model_type: gpt2`): learned positions, a
  GELU MLP of `n_inner` (4h by default), an output head tied to the token embedding;
- `llama`: Llama as `transformers` defines it (`model_type: llama`): RMSNorm, rotary positions,
  grouped-query attention (`num_key_value_heads`), a SwiGLU MLP of `intermediate_size`, a head tied or not.

`ModelSpec.from_config` reads a `config.json` of the last two (pure: no `transformers` needed), or the one
`hetpeer export` writes for the first.
Counting conventions (per token unless said, h = hidden, a = heads, k = key/value heads, d = head size,
f = the MLP's inner width; multiply-adds count 2 FLOPs):

- a block's parameters are its projections (with their biases where the family has them) and norms
  (LayerNorm: 2h, RMSNorm: h); `gpt` and `gpt2` with f = 4h have 12 h^2 + 13 h;
- its forward pass costs 2 x (its projections' weights) + 4 seq a d FLOPs per token (QK^T and attention
  times V), backward twice that (Narayanan et al., SC 2021); 24 h^2 + 4 seq h for `gpt`;
- stage 0 also holds the token (and, with learned positions, position) embeddings; the last stage the
  final norm and the output head of vocab x h, which costs 2 h vocab FLOPs per token. A tied head is
  one matrix in the model (`params` counts it once, as `transformers` does), but a stage that holds
  the last layer keeps its own copy of it, tied by adding the two gradients (`stored_params`);
- a block keeps for its backward pass, per token, what hetpeer's blocks save (measured in tests/unit/
  test_model.py; fused attention saves no a seq^2 term): the residual stream is fp32 (4 bytes), matrices
  take 16-bit inputs under autocast (w = 2 bytes; 4 in fp32). Each norm keeps its input (4 h; RMSNorm also
  its normalised output, 4 h), and the projections reading it their own copy of its output (w h each under
  autocast: `gpt`/`gpt2` 2, Llama 5; in fp32 one 4 h a norm); attention keeps q, k, v (key/value heads
  repeated), its output and that output reshaped (5 w a d; `gpt` with rotary positions also the rotated q
  and k); the MLP its inner activations (2 w f, SwiGLU 4 w f). For `gpt` in bf16: 38 h (Korthikanti et al.,
  2022, count 34 h for Megatron's blocks);
- training state is 16 bytes per parameter: fp32 weights, gradients and two Adam moments (as the runtime
  holds them; ZeRO, Rajbhandari et al. 2020, counts the same 16 for 16-bit weights and gradients beside fp32
  master weights and moments).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
FAMILIES = ("gpt", "gpt2", "llama")
HF_FAMILIES = {"gpt2": "gpt2", "llama": "llama"}  # config.json's model_type -> family
LLAMA_ROPE_TYPES = ("default", "llama3")


class ModelConfigError(ValueError):
    """A model configuration (a config.json) that hetpeer cannot train, with what and where."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden: int
    heads: int
    seq_len: int  # tokens per training sequence
    vocab: int
    layers: int
    positions: str = "learned"  # or "rotary"
    family: str = "gpt"  # gpt (hetpeer's own), gpt2 or llama (transformers' definitions)
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    head_dim: int = 0  # 0: hidden / heads
    inner: int = 0  # the MLP's inner width; 0: 4 x hidden
    tied: bool = False  # the output head is the token embedding
    max_positions: int = 0  # learned position table / context; 0: seq_len
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3-style rotary scaling, (key, value) pairs
    attention_bias: bool = True  # gpt and gpt2 always; llama's attention_bias
    mlp_bias: bool = True  # gpt and gpt2 always; llama's mlp_bias

    def __post_init__(self) -> None:
        for attr in ("hidden", "heads", "seq_len", "vocab", "layers"):
            if getattr(self, attr) < 1:
                raise ValueError(f"model {self.name}: {attr} must be at least 1, got {getattr(self, attr)}")
        for attr in ("kv_heads", "head_dim", "inner", "max_positions"):
            if getattr(self, attr) < 0:
                raise ValueError(f"model {self.name}: {attr} must not be negative, got {getattr(self, attr)}")
        if self.family not in FAMILIES:
            raise ValueError(f"model {self.name}: family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.head_dim == 0 and self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.key_value_heads:
            raise ValueError(f"model {self.name}: heads {self.heads} is not a multiple of key/value heads {self.key_value_heads}")
        if self.tied and self.family == "gpt":
            raise ValueError(f"model {self.name}: hetpeer's own GPT has an untied head")
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"model {self.name}: positions must be 'learned' or 'rotary', got {self.positions!r}")
        if self.seq_len > self.context:
            raise ValueError(f"model {self.name}: sequences of {self.seq_len} tokens exceed its context of {self.context}")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"model {self.name}: norm_eps and rope_theta must be positive")

    def with_layers(self, layers: int) -> "ModelSpec":
        return replace(self, layers=layers)

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def mlp_inner(self) -> int:
        return self.inner or 4 * self.hidden

    @property
    def context(self) -> int:
        """The longest sequence the model takes: its position table (learned) or its configured context."""
        return self.max_positions or self.seq_len

    @property
    def gated(self) -> bool:
        """SwiGLU (gate and up projections) rather than one GELU projection."""
        return self.family == "llama"

    @property
    def norm_params(self) -> int:
        return self.hidden if self.family == "llama" else 2 * self.hidden  # RMSNorm: a gain; LayerNorm: and a bias

    @property
    def _projections(self) -> int:
        """Weights of a block's matrices: attention (q, k, v, output) and the MLP."""
        h, q, kv, f = self.hidden, self.heads * self.head_size, self.key_value_heads * self.head_size, self.mlp_inner
        return h * (q + 2 * kv) + q * h + (3 if self.gated else 2) * h * f

    @property
    def layer_params(self) -> int:
        h, q, kv, f = self.hidden, self.heads * self.head_size, self.key_value_heads * self.head_size, self.mlp_inner
        biases = (q + 2 * kv + h if self.attention_bias else 0) + ((2 if self.gated else 1) * f + h if self.mlp_bias else 0)
        return self._projections + biases + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        positions = self.context * self.hidden if self.positions == "learned" else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        """The final norm and the output head as a last stage holds them (a tied head as its own copy)."""
        return self.vocab * self.hidden + self.norm_params

    @property
    def stored_params(self) -> int:
        """Parameters the stages hold between them: a tied head counted on the last stage too."""
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    @property
    def params(self) -> int:
        """Parameters of the model, a tied head counted once (as `transformers`' num_parameters())."""
        return self.stored_params - (self.vocab * self.hidden if self.tied else 0)

    def layer_fwd_flops_per_token(self) -> float:
        return float(2 * self._projections + 4 * self.seq_len * self.heads * self.head_size)

    def stored_activation_bytes_per_token(self, dtype: str) -> float:
        """Bytes a block keeps per token for its backward pass, computing in `dtype` (the module's docstring)."""
        h, q, f = self.hidden, self.heads * self.head_size, self.mlp_inner
        w = DTYPE_BYTES[dtype]
        llama = self.family == "llama"
        norms = (16 if llama else 8) * h
        inputs = (5 if llama else 2) * w * h if w < 4 else 8 * h  # fp32: the norms' outputs themselves
        rotated = 2 * w * q if self.family == "gpt" and self.positions == "rotary" else 0  # q and k, rotated apart
        return float(norms + inputs + 5 * w * q + rotated + (4 if self.gated else 2) * w * f)

    def param_range(self, layer_start: int, layer_end: int) -> tuple[int, int]:
        """[start, end) of a stage's parameters in the whole model's flat parameter vector: embeddings,
        blocks in order, final norm and head. Stages are contiguous in it, so any peer's state is a slice."""
        if not 0 <= layer_start < layer_end <= self.layers:
            raise ValueError(f"layers [{layer_start}, {layer_end}) are not a stage of a {self.layers}-layer model")
        start = 0 if layer_start == 0 else self.embedding_params + layer_start * self.layer_params
        end = self.embedding_params + layer_end * self.layer_params + (self.head_params if layer_end == self.layers else 0)
        return start, end

    @property
    def digest(self) -> str:
        """SHA-256 of the architecture (every field but the name): peers that agree on it run the same model."""
        fields = {k: v for k, v in asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config.json", seq_len: int | None = None,
                    layers: int | None = None) -> "ModelSpec":
        """The spec of a `transformers` config (a parsed config.json) of the GPT-2 or Llama family, or of an
        export of hetpeer's GPT; `seq_len` defaults to the one exported, else the model's context. Its name is
        `<family>-<digest prefix>`, the same on every peer that has the same architecture (an export of a
        preset's shape: the preset's name). A config this runtime cannot reproduce exactly is refused,
        naming the key."""
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type == "hetpeer-gpt":
            spec = _own_gpt(config, source, layers)
            if seq_len is not None and seq_len != spec.seq_len:
                raise ModelConfigError(f"{source}: hetpeer's GPT trains the sequence length it was made for, {spec.seq_len}")
            return spec
        if model_type not in HF_FAMILIES:
            raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported (supported: "
                                   f"{', '.join(HF_FAMILIES)}, hetpeer-gpt)")
        read = _ConfigReader(config, source)
        if model_type == "gpt2":
            context = read.integer("n_positions", 1024)
            activation = read.text("activation_function", "gelu_new")
            if activation not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ModelConfigError(f"{source}: activation_function {activation!r} is not supported (gelu_new)")
            for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
                if read.flag(key, False):
                    raise ModelConfigError(f"{source}: {key} true is not supported")
            if not read.flag("scale_attn_weights", True):
                raise ModelConfigError(f"{source}: scale_attn_weights false is not supported")
            spec = dict(hidden=read.integer("n_embd", 768), heads=read.integer("n_head", 12), layers=read.integer("n_layer", 12),
                        vocab=read.integer("vocab_size", 50257), inner=read.integer("n_inner", 0, allow_none=True) or 4 * read.integer("n_embd", 768),
                        max_positions=context, norm_eps=read.number("layer_norm_epsilon", 1e-5),
                        tied=read.flag("tie_word_embeddings", True), positions="learned")
        else:
            context = read.integer("max_position_embeddings", 2048)
            if read.text("hidden_act", "silu") != "silu":
                raise ModelConfigError(f"{source}: hidden_act {config.get('hidden_act')!r} is not supported (silu)")
            heads, hidden = read.integer("num_attention_heads", 32), read.integer("hidden_size", 4096)
            # transformers 5 writes rope_parameters (theta, type and scaling in one); 4.x rope_theta and rope_scaling
            rope = config.get("rope_parameters")
            if rope is not None and not isinstance(rope, Mapping):
                raise ModelConfigError(f"{source}: rope_parameters must be an object, got {rope!r}")
            theta = _ConfigReader(rope, f"{source} rope_parameters") if rope is not None else read
            spec = dict(hidden=hidden, heads=heads, layers=read.integer("num_hidden_layers", 32),
                        vocab=read.integer("vocab_size", 32000), inner=read.integer("intermediate_size", 11008),
                        kv_heads=read.integer("num_key_value_heads", heads, allow_none=True) or heads,
                        head_dim=read.integer("head_dim", 0, allow_none=True) or (hidden // heads if heads else 0),
                        max_positions=context, norm_eps=read.number("rms_norm_eps", 1e-6),
                        rope_theta=theta.number("rope_theta", 10_000.0),
                        rope_scaling=_rope_scaling(rope if rope is not None else config.get("rope_scaling"), source),
                        attention_bias=read.flag("attention_bias", False), mlp_bias=read.flag("mlp_bias", False),
                        tied=read.flag("tie_word_embeddings", False), positions="rotary")
        if layers is not None:
            spec["layers"] = layers
        seq_len = seq_len or read.integer("hetpeer_seq_len", 0, allow_none=True) or context  # as exported
        try:
            anonymous = cls(name="-", family=HF_FAMILIES[model_type], seq_len=seq_len, **spec)
        except ValueError as error:
            raise ModelConfigError(f"{source}: {error.args[0].replace('model -: ', '')}") from None
        return replace(anonymous, name=f"{anonymous.family}-{anonymous.digest[:12]}")


def _own_gpt(config: Mapping[str, Any], source: str, layers: int | None) -> ModelSpec:
    """hetpeer's own GPT from the config `hetpeer export` writes: named as the preset of its shape, if any."""
    read = _ConfigReader(config, source)
    shape = dict(hidden=read.integer("hidden", 0), heads=read.integer("heads", 0), seq_len=read.integer("seq_len", 0),
                 vocab=read.integer("vocab", 0), layers=layers or read.integer("layers", 0),
                 positions=read.text("positions", "learned"))
    try:
        anonymous = ModelSpec(name="-", **shape)
    except ValueError as error:
        raise ModelConfigError(f"{source}: {error.args[0].replace('model -: ', '')}") from None
    for name, spec in PRESETS.items():
        if replace(spec, name="-", layers=anonymous.layers) == anonymous:  # plans name a preset of any depth
            return replace(spec, layers=anonymous.layers)
    return replace(anonymous, name=f"gpt-{anonymous.digest[:12]}")


class _ConfigReader:
    """Typed reads of a config.json's keys, each error naming the key and the file."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config, self.source = config, source

    def integer(self, key: str, default: int, allow_none: bool = False) -> int:
        value = self.config.get(key, default)
        if value is None and allow_none:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(f"{self.source}: {key} must be a non-negative integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelConfigError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise ModelConfigError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str) -> str:
        value = self.config.get(key, default)
        if not isinstance(value, str):
            raise ModelConfigError(f"{self.source}: {key} must be a string, got {value!r}")
        return value


def _rope_scaling(value: Any, source: str) -> tuple[tuple[str, float], ...]:
    """Llama's rope_scaling: none, or the llama3 kind (Llama 3.1 and later), as sorted (key, value) pairs."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ModelConfigError(f"{source}: rope_scaling must be an object or null, got {value!r}")
    kind = value.get("rope_type", value.get("type", "default"))
    if kind == "default":
        return ()
    if kind != "llama3":
        raise ModelConfigError(f"{source}: rope_scaling of type {kind!r} is not supported ({', '.join(LLAMA_ROPE_TYPES)})")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    pairs = []
    for key in keys:
        number = value.get(key)
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
            raise ModelConfigError(f"{source}: rope_scaling.{key} must be a positive number, got {number!r}")
        pairs.append((key, float(number)))
    return tuple(pairs)


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


def load_model(name_or_path: str, layers: int | None = None, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, or the spec of a model folder's config.json (GPT-2 or Llama); `layers` and
    `seq_len` override the depth and the training sequence length."""
    if name_or_path in PRESETS:
        spec = preset(name_or_path, layers)
        if seq_len is not None and seq_len != spec.seq_len:
            raise ModelConfigError(f"model preset {name_or_path} trains sequences of {spec.seq_len} tokens; "
                                   "a sequence length applies to model folders")
        return spec
    folder = Path(name_or_path)
    if not folder.exists():
        raise ModelConfigError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a folder")
    config = folder / "config.json" if folder.is_dir() else folder
    try:
        raw = json.loads(config.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"model folder {folder} has no config.json") from None
    except OSError as error:
        raise ModelConfigError(f"cannot read {config}: {error.strerror or error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelConfigError(f"{config} is not valid JSON: {error}") from None
    if layers is not None and layers < 1:
        raise ModelConfigError(f"layers must be at least 1, got {layers}")
    if seq_len is not None and seq_len < 1:
        raise ModelConfigError(f"sequence length must be at least 1, got {seq_len}")
    return ModelSpec.from_config(raw, str(config), seq_len=seq_len, layers=layers)
