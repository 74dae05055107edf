"""Transformer stages whose parameters and FLOPs match `protocol.workload`: hetpeer's own GPT (`gpt.py`),
and GPT-2 and Llama as `transformers` defines them (`families.py`)."""

from __future__ import annotations

import torch

from hetpeer.peer.model.families import FamilyStage
from hetpeer.peer.model.gpt import Block, Stage
from hetpeer.protocol.modelspec import ModelSpec

__all__ = ["Block", "FamilyStage", "Stage", "build_stage"]


def build_stage(
    spec: ModelSpec, layer_start: int, layer_end: int, seed: int = 0, device: str | torch.device = "cpu"
) -> Stage | FamilyStage:
    """The stage of `spec` holding layers [layer_start, layer_end), initialised from `seed` on the CPU
    (the same values whatever the cut) and moved to `device`."""
    kind = Stage if spec.family == "gpt" else FamilyStage
    return kind(spec, layer_start, layer_end, seed=seed).to(device)

