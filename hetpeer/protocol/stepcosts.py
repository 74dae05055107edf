"""What a stage's step costs a peer's device beyond its blocks, as its probe timed them (`peer.pipeline.steptime`):
a field of its record (`records.PeerRecord.step_costs`), read by the coordinator's time model. No dependencies:
a fixed-plan peer, which needs no DHT, imports it too."""

from __future__ import annotations

import math
from dataclasses import dataclass

FIELDS = ("embed_s_per_seq", "head_s_per_seq", "update_s_per_param", "micro_s")  # their wire order
MAX_SEQ_S = 60.0  # a step cost per sequence (or micro-batch) no device takes: past it, a record is wrong
MAX_PARAM_S = 1e-3  # an optimizer step per parameter no device takes


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What a stage's step costs on a peer's device beyond its blocks, as its probe timed them
    (`peer.pipeline.steptime`): seconds per sequence of the embedding (forward and backward, the first stage's)
    and of the final norm, head and loss (the last stage's); seconds per parameter of the optimizer's step, once a
    step; and seconds of the Python around each micro-batch. Zeros: not measured (a peer that does not say: the
    time model then counts the head by its FLOPs, as a block's, and nothing else)."""

    embed_s_per_seq: float = 0.0
    head_s_per_seq: float = 0.0
    update_s_per_param: float = 0.0
    micro_s: float = 0.0

    def __post_init__(self) -> None:
        for name in FIELDS:
            value, most = getattr(self, name), MAX_PARAM_S if name == "update_s_per_param" else MAX_SEQ_S
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= most):
                raise ValueError(f"{name} must be 0 to {most:g} seconds, got {value!r}")

    def to_wire(self) -> list[float]:
        return [float(getattr(self, name)) for name in FIELDS]
