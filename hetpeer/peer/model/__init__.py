"""GPT decoder blocks cut into pipeline stages whose parameters and FLOPs match `protocol.workload`."""

from hetpeer.peer.model.gpt import Block, Stage, build_stage

__all__ = ["Block", "Stage", "build_stage"]
