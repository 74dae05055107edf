"""A model folder on disk (`config.json` and safetensors, as `save_pretrained` writes them): each peer
reads only the tensors of its own stage.

The weights are `model.safetensors`, or shards listed by `model.safetensors.index.json`. A folder with a
config and no weights trains from fresh weights. Tensors are looked up under `transformers`' names with
or without the model's prefix (GPT-2's hub files say `h.0.attn.c_attn.weight`, `save_pretrained` writes
`transformer.h.0.attn.c_attn.weight`); a tied head absent from the files is the token embedding.
Reading opens each file lazily (safetensors maps it): a stage of 2 layers of 32 reads about 2/32 of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hetpeer.protocol.modelspec import ModelConfigError, ModelSpec

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ModelFolder:
    path: Path
    spec: ModelSpec
    files: dict[str, Path]  # tensor name -> the safetensors file holding it; empty: fresh weights

    @classmethod
    def open(cls, path: str | Path, spec: ModelSpec) -> "ModelFolder":
        """The folder of `spec` (read with `modelspec.load_model`), and where each of its tensors lies."""
        root = Path(path)
        index = root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise ModelConfigError(f"{index}: not a safetensors index ({error})") from None
            if not isinstance(weight_map, dict):
                raise ModelConfigError(f"{index}: weight_map must map tensor names to files")
            files = {str(name): root / str(file) for name, file in weight_map.items()}
        elif (root / WEIGHTS).is_file():
            files = {name: root / WEIGHTS for name in _tensor_names(root / WEIGHTS)}
        else:
            files = {}
        return cls(root, spec, files)

    @property
    def has_weights(self) -> bool:
        return bool(self.files)

    def load_into(self, stage: nn.Module) -> int:
        """Copy this stage's tensors from the files into `stage` (a `FamilyStage` of this folder's spec);
        returns the bytes read. Every parameter must be found with its shape, or nothing is trusted."""
        from safetensors import safe_open

        wanted = {name: self._find(name) for name, _ in stage.named_parameters()}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name, stored in wanted.items():
            by_file.setdefault(self.files[stored], []).append((name, stored))
        params = dict(stage.named_parameters())
        read = 0
        with torch.no_grad():
            for file, names in by_file.items():
                try:
                    handle = safe_open(str(file), framework="pt")
                except Exception as error:  # an OSError, or safetensors' own SafetensorError
                    raise ModelConfigError(f"{file}: cannot read safetensors ({error})") from None
                with handle:
                    for name, stored in names:
                        tensor = handle.get_tensor(stored)
                        if tuple(tensor.shape) != tuple(params[name].shape):
                            raise ModelConfigError(f"{file}: tensor {stored} has shape {list(tensor.shape)}, the "
                                                   f"config says {list(params[name].shape)} (a checkpoint of another model?)")
                        if not torch.isfinite(tensor).all():
                            raise ModelConfigError(f"{file}: tensor {stored} holds values that are not finite")
                        params[name].copy_(tensor.to(params[name].dtype))
                        read += tensor.numel() * tensor.element_size()
        return read

    def _find(self, name: str) -> str:
        """The stored name of parameter `name`: as it is, without the model's prefix, or (a tied head) the embedding."""
        candidates = [name, name.split(".", 1)[1]] if name.startswith(("transformer.", "model.")) else [name]
        if name == "lm_head.weight" and self.spec.tied:
            embedding = "transformer.wte.weight" if self.spec.family == "gpt2" else "model.embed_tokens.weight"
            candidates += [embedding, embedding.split(".", 1)[1]]
        for candidate in candidates:
            if candidate in self.files:
                return candidate
        raise ModelConfigError(f"{self.path}: no tensor {name} in its safetensors (a checkpoint of another model?)")


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header, read without loading any tensor."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(handle.read(size))
    except (OSError, ValueError) as error:
        raise ModelConfigError(f"{path}: not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise ModelConfigError(f"{path}: not a safetensors file (its header is not an object)")
    return [name for name in header if name != "__metadata__"]
