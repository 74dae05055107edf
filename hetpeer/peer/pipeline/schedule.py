"""The 1F1B micro-batch schedule (Narayanan et al., PipeDream-Flush, SC 2021).

Stage s of S runs min(S - s - 1, M) forward passes to fill the pipeline, then alternates one forward
and one backward, then drains the remaining backwards. At most S - s micro-batches are in flight on a
stage, so stored activations are bounded by the depth below it rather than by M.
"""

from __future__ import annotations

FORWARD, BACKWARD = "forward", "backward"


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> tuple[tuple[str, int], ...]:
    """The ordered (operation, micro-batch) list of one stage for one step."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    warmup = min(stages - stage - 1, micro_batches)
    ops = [(FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        ops += [(FORWARD, warmup + i), (BACKWARD, i)]
    ops += [(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
    return tuple(ops)


def in_flight(ops: tuple[tuple[str, int], ...]) -> int:
    """The most micro-batches whose activations a stage holds at once under `ops`."""
    held = peak = 0
    for op, _ in ops:
        held += 1 if op == FORWARD else -1
        peak = max(peak, held)
    return peak
