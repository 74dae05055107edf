"""Stage checkpoints and the exported model: what a peer writes of its stage, and one model folder from many.

A stage checkpoint is one safetensors file: the stage's parameters under the model's own names (`blocks.5.
qkv.weight`, `transformer.h.5.attn.c_attn.weight`, ...), the optimizer's flat tensors (`optimizer.m`,
`optimizer.v`; `optimizer.window` under AccumAdam; `optimizer.anchor` and `optimizer.outer_momentum` in an
outer-step group), and metadata: the model's name and architecture, the stage's layers,
the step it was taken after, the plan epoch and the optimizer's step count. It is written to a temporary
file beside the target, flushed to disk and renamed over it: a crash mid-write leaves the previous
checkpoint (or none), never a torn one.

`export` joins the checkpoints of a run's stages into one model folder: `config.json` and
`model.safetensors`, every part of the model taken from the checkpoint that holds it at the highest step.
A GPT-2 or Llama folder is what `transformers`' `from_pretrained` loads; hetpeer's own GPT gets a config of
its own (`model_type: hetpeer-gpt`) that `--model FOLDER` loads.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

import torch

from hetpeer.peer.gossip.group import NEEDED, STATE_TENSORS
from hetpeer.protocol.modelspec import ModelSpec
from hetpeer.protocol.recipe import Recipe

FORMAT = "hetpeer-stage-1"
OPTIMIZER = STATE_TENSORS[1:]  # a stage's state tensors but its parameters, which go under the model's own names
OPTIONAL = tuple(name for name in OPTIMIZER if name not in NEEDED)  # a checkpoint without them still restores: they start afresh
_BLOCK_RE = re.compile(r"^(?:blocks|transformer\.h|model\.layers)\.(\d+)\.")
_FIRST = ("tokens.", "positions.", "transformer.wte.", "transformer.wpe.", "model.embed_tokens.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or used here, with the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class StageCheckpoint:
    path: Path
    spec: ModelSpec
    layers: tuple[int, int]
    step: int  # the next step to train: the checkpoint holds the weights after step - 1
    epoch: int
    adam_step: int
    data_position: int = 0  # windows the swarm had read before `step` (peer/data/order.py); 0 in older checkpoints
    recipe: Recipe | None = None  # the recipe it trained by; None in older checkpoints

    @classmethod
    def read(cls, path: str | Path) -> "StageCheckpoint":
        """The metadata of a stage checkpoint (no tensor is loaded)."""
        from safetensors import safe_open

        path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint at {path}") from None
        except Exception as error:  # safetensors raises its own error type for a file that is not one of its
            raise CheckpointError(f"{path} is not a safetensors file ({error})") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a hetpeer stage checkpoint (format {meta.get('format')!r})")
        try:
            raw = json.loads(meta["spec"])
            spec = ModelSpec(**{f.name: _tupled(raw[f.name]) for f in fields(ModelSpec)})
            recipe = Recipe.from_wire(json.loads(meta["recipe"]), f"{path} recipe") if "recipe" in meta else None
            return cls(path, spec, (int(meta["layer_start"]), int(meta["layer_end"])), int(meta["step"]),
                       int(meta["epoch"]), int(meta["adam_step"]), int(meta.get("data_position", 0)), recipe)
        except (KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({error})") from None

    def tensors(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.path))


def _tupled(value):
    """JSON lists back to the tuples a frozen spec holds (rope scaling pairs)."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def save_stage(path: str | Path, model: torch.nn.Module, optimizer: Mapping[str, torch.Tensor], *, spec: ModelSpec,
               layers: tuple[int, int], step: int, epoch: int, adam_step: int, data_position: int = 0,
               recipe: Recipe | None = None) -> Path:
    """Write a stage checkpoint atomically, `optimizer` by its `OPTIMIZER` names; returns its path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", torch.float32).contiguous() for name, p in model.named_parameters()}
    for name, tensor in optimizer.items():
        if name not in OPTIMIZER:
            raise ValueError(f"optimizer tensor {name!r} is not one a checkpoint holds ({', '.join(OPTIMIZER)})")
        tensors[f"optimizer.{name}"] = tensor.detach().to("cpu", torch.float32).contiguous()
    meta = {"format": FORMAT, "model": spec.name, "spec": json.dumps(asdict(spec)), "layer_start": str(layers[0]),
            "layer_end": str(layers[1]), "step": str(step), "epoch": str(epoch), "adam_step": str(adam_step),
            "data_position": str(data_position), **({"recipe": json.dumps(recipe.to_wire())} if recipe is not None else {})}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=meta)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)
    return path


def load_stage(checkpoint: StageCheckpoint, model: torch.nn.Module, optimizer: Mapping[str, torch.Tensor], spec: ModelSpec,
               layers: tuple[int, int]) -> set[str]:
    """Fill a stage (its parameters and `optimizer` tensors by name, in place) from a checkpoint of exactly that
    stage; the optimizer tensors it held. An `OPTIONAL` one it lacks is left as it was (a window is emptied)."""
    if checkpoint.spec.digest != spec.digest:
        raise CheckpointError(f"{checkpoint.path} is a checkpoint of model {_described(checkpoint.spec)}, this peer trains "
                              f"{_described(spec)}")
    if checkpoint.layers != layers:
        raise CheckpointError(f"{checkpoint.path} holds layers {checkpoint.layers[0]}-{checkpoint.layers[1] - 1}, "
                              f"this peer's stage is {layers[0]}-{layers[1] - 1}")
    stored = checkpoint.tensors()
    targets = dict(model.named_parameters()) | {f"optimizer.{n}": t for n, t in optimizer.items()}
    if "optimizer.window" in targets and "optimizer.window" not in stored:  # saved by plain Adam: a window starts empty
        targets.pop("optimizer.window").zero_()
    for name in OPTIONAL:
        if f"optimizer.{name}" not in stored:
            targets.pop(f"optimizer.{name}", None)
    missing = sorted(set(targets) - set(stored))
    if missing:
        raise CheckpointError(f"{checkpoint.path} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    with torch.no_grad():
        for name, target in targets.items():
            tensor = stored[name]
            if tensor.shape != target.shape or not torch.isfinite(tensor).all():
                raise CheckpointError(f"{checkpoint.path}: {name} is {list(tensor.shape)} or not finite, expected {list(target.shape)}")
            target.copy_(tensor.to(target.device, target.dtype))
    return {name for name in optimizer if f"optimizer.{name}" in targets}


def _described(spec: ModelSpec) -> str:
    return f"{spec.name} ({spec.layers} layers, architecture {spec.digest[:12]})"


def part_of(name: str, layers: int) -> int:
    """Which part of the model a parameter belongs to: -1 the embeddings, i block i, `layers` the final norm and head."""
    found = _BLOCK_RE.match(name)
    if found:
        return int(found.group(1))
    return -1 if name.startswith(_FIRST) else layers


def export(paths: list[Path], out: Path) -> dict:
    """Join stage checkpoints into one model folder at `out`; returns what was taken from where."""
    from safetensors.torch import save_file

    if not paths:
        raise CheckpointError("no checkpoints given")
    checkpoints = [StageCheckpoint.read(p) for p in paths]
    spec = checkpoints[0].spec
    for c in checkpoints[1:]:
        if c.spec.digest != spec.digest:
            raise CheckpointError(f"{c.path} is of model {c.spec.name}, {checkpoints[0].path} of {spec.name}: one model at a time")
    # each part from the checkpoint holding it at the highest step (parts: embeddings, blocks, head)
    source: dict[int, StageCheckpoint] = {}
    for c in checkpoints:
        start, end = c.layers
        for part in range(start - (start == 0), end + (end == spec.layers)):
            if part not in source or c.step > source[part].step:
                source[part] = c
    absent = [p for p in range(-1, spec.layers + 1) if p not in source]
    if absent:
        named = ", ".join("the embeddings" if p == -1 else "the head" if p == spec.layers else f"layer {p}" for p in absent)
        raise CheckpointError(f"no checkpoint holds {named} of {spec.name} (given: "
                              + ", ".join(f"{c.path.name} layers {c.layers[0]}-{c.layers[1] - 1}" for c in checkpoints) + ")")
    tensors: dict[str, torch.Tensor] = {}
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    for part, c in sorted(source.items()):
        stored = loaded.setdefault(c.path, c.tensors())
        for name, tensor in stored.items():
            if not name.startswith("optimizer.") and part_of(name, spec.layers) == part:
                tensors[name] = tensor
    if spec.tied:
        tensors.pop("lm_head.weight", None)  # from_pretrained ties it to the embedding
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=1) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    steps = sorted({c.step for c in source.values()})
    return {"model": spec.name, "tensors": len(tensors), "parts": {p: c.path.name for p, c in source.items()}, "steps": steps}


def hf_config(spec: ModelSpec) -> dict:
    """The config.json of `spec`: transformers' keys for GPT-2 and Llama; hetpeer's own for its GPT."""
    if spec.family == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": spec.hidden, "n_head": spec.heads,
                "n_layer": spec.layers, "n_positions": spec.context, "n_inner": spec.mlp_inner, "vocab_size": spec.vocab,
                "layer_norm_epsilon": spec.norm_eps, "activation_function": "gelu_new", "tie_word_embeddings": spec.tied,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "hetpeer_seq_len": spec.seq_len}
    if spec.family == "llama":
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": spec.hidden,
                  "intermediate_size": spec.mlp_inner, "num_attention_heads": spec.heads,
                  "num_key_value_heads": spec.key_value_heads, "head_dim": spec.head_size, "num_hidden_layers": spec.layers,
                  "max_position_embeddings": spec.context, "vocab_size": spec.vocab, "rms_norm_eps": spec.norm_eps,
                  "rope_theta": spec.rope_theta, "attention_bias": spec.attention_bias, "mlp_bias": spec.mlp_bias,
                  "tie_word_embeddings": spec.tied, "hidden_act": "silu", "hetpeer_seq_len": spec.seq_len}
        if spec.rope_scaling:
            config["rope_scaling"] = {"rope_type": "llama3", **dict(spec.rope_scaling)}
        return config
    return {"model_type": "hetpeer-gpt", "hidden": spec.hidden, "heads": spec.heads, "seq_len": spec.seq_len,
            "vocab": spec.vocab, "layers": spec.layers, "positions": spec.positions}
