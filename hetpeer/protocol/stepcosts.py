"""What a stage's step costs a peer's device beyond its blocks, as its probe timed them (`peer.pipeline.steptime`):
a field of its record (`records.PeerRecord.step_costs`), read by the coordinator's time model. No dependencies:
a fixed-plan peer, which needs no DHT, imports it too."""

from __future__ import annotations

import math
from dataclasses import dataclass

# each codec but raw (`frame.CODECS`): encode plus decode seconds per value of an activation, on the peer's device
CODEC_FIELDS = {"fp16": "fp16_s_per_value", "bf16": "bf16_s_per_value", "int8": "int8_s_per_value",
                "int4": "int4_s_per_value", "int6": "int6_s_per_value"}
FIELDS = ("embed_s_per_seq", "head_s_per_seq", "update_s_per_param", "micro_s", "recompute_share",
          *CODEC_FIELDS.values())  # their wire order
OLDER_FIELDS = (4, 5)  # records of peers that time no recomputation end at micro_s, of those that time no codecs at it
MAX_SEQ_S = 60.0  # a step cost per sequence (or micro-batch) no device takes: past it, a record is wrong
MAX_PARAM_S = 1e-3  # an optimizer step per parameter no device takes
MAX_RECOMPUTE = 10.0  # recomputing a block's activations costs no device ten times its forward and backward
MAX_VALUE_S = 1e-6  # encoding and decoding a value (4 MB/s of fp32) no device is that slow at
MOST = {"update_s_per_param": MAX_PARAM_S, "recompute_share": MAX_RECOMPUTE,
        **{name: MAX_VALUE_S for name in CODEC_FIELDS.values()}}  # the rest: MAX_SEQ_S
# What recomputing a block's activations adds to its forward and backward where a device did not time it: one
# forward more, a third of them (the backward is about twice the forward). A GPU comes close; a CPU running a
# small model pays more (Python and the autograd graph built twice): 0.7 to 1.0 for the demo's tiny model.
RECOMPUTE_SHARE = 1 / 3


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What a stage's step costs on a peer's device beyond its blocks, as its probe timed them
    (`peer.pipeline.steptime`): seconds per sequence of the embedding (forward and backward, the first stage's)
    and of the final norm, head and loss (the last stage's); seconds per parameter of the optimizer's step, once a
    step; seconds of the Python around each micro-batch; what recomputing a block's activations in backward
    adds to the block's forward and backward, as a share of them; and per codec, seconds to encode and decode a
    value of an activation (`peer.pipeline.steptime.codec_s_per_value`). Zeros: not measured (a peer that does
    not say: the time model then counts the head by its FLOPs, as a block's, recomputation as `RECOMPUTE_SHARE`,
    codecs at one CPU thread's rates (`planner.codecs.WORK_S_PER_VALUE`), and nothing else)."""

    embed_s_per_seq: float = 0.0
    head_s_per_seq: float = 0.0
    update_s_per_param: float = 0.0
    micro_s: float = 0.0
    recompute_share: float = 0.0
    fp16_s_per_value: float = 0.0
    bf16_s_per_value: float = 0.0
    int8_s_per_value: float = 0.0
    int4_s_per_value: float = 0.0
    int6_s_per_value: float = 0.0

    def __post_init__(self) -> None:
        for name in FIELDS:
            value, most = getattr(self, name), MOST.get(name, MAX_SEQ_S)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= most):
                unit = "" if name == "recompute_share" else " seconds"
                raise ValueError(f"{name} must be 0 to {most:g}{unit}, got {value!r}")

    @property
    def recompute(self) -> float:
        """What a recomputed block adds to its forward and backward, as a share of them: measured, else the default."""
        return self.recompute_share or RECOMPUTE_SHARE

    def to_wire(self) -> list[float]:
        return [float(getattr(self, name)) for name in FIELDS]
