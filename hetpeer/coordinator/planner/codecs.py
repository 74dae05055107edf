"""How a lane's hops carry activations and their gradients: the codec pairs the planner may choose from, what
each costs in loss (measured), and what each costs a hop in time (wire bytes, and encoding and decoding).

A hop between two stages sends each micro-batch's activation forward and its gradient back. In a codec pair
(FORWARD, BACKWARD) the activation travels in FORWARD and the gradient in BACKWARD. With `--compress auto` the
planner takes, for every hop of every lane, the pair that makes that hop shortest,

    x = wire bytes forward and back / 2 x seconds per byte of the link + (encode and decode work) / 2

(the mean of the two directions, as the time model counts a hop), among the pairs whose measured loss effect
is within `QUALITY_BUDGET`. A fixed `--compress FORWARD/BACKWARD` is the one pair everywhere.

A pair can cost steps: int4 activations need about 3% more steps to reach raw's loss. `STEPS_FACTOR` holds
each pair's measured factor (raw's steps to a validation loss over the pair's), and the time model weighs a
plan's hops in time to loss, as it weighs sync: a lane's factor is the largest of its hops' pairs, the plan's
the largest of its lanes', and it multiplies the plan's step. Choosing hop by hop, it compares two tiers for
every grid, the pairs that cost no steps and all of them, and keeps the one whose step x factor is least
(`HopCodecs.occupancy(exact=...)`). That is exact when the pairs that cost steps cost the same, as they do
within the table's resolution.

`LOSS_GAP` and `STEPS_FACTOR` come from `benchmarks/compression.py --part quality` (the `tiny` preset on
2 stages x 2 lanes, 300 steps, 6 seeds; the same data, seed and weights for raw and every pair of a seed):
each pair's validation loss against raw's of the same seed at equal tokens, and its steps factor, the means
over seeds (docs/compression.md, where each has its 95% interval: the widest gap's is +-0.15%). A gap or
factor below raw's (within its interval of it) counts as raw's. A pair the table has not measured (a fixed
`--compress fp16/int8`, say) takes the largest factor of the measured pairs with the same forward codec,
1 where there is none. A hop's codec work is what
its two devices measured: each peer times every codec's encoding and decoding of an activation on its own
device when it joins (`peer.pipeline.steptime`) and announces the rates in its step costs; a GPU encodes int8
at 13 GB/s on the H200, about 15 times one CPU thread (docs/pipeline.md). Devices that measured nothing (a
topology file without `codec_s`) count `WORK_S_PER_VALUE`, one CPU thread's encode plus decode time per value
(`--part speed`, an activation of 1 x 1024 x 1600 values).
"""

from __future__ import annotations

import numpy as np

from hetpeer.protocol.frame import CODECS, bytes_per_value
from hetpeer.protocol.stepcosts import CODEC_FIELDS, FIELDS as STEP_COSTS

AUTO = ("auto", "auto")
# (forward, backward) -> validation loss over raw's - 1 at equal tokens, the mean over 6 seeds (tiny, 2026-12-03;
# benchmarks/compression.py --part quality): bf16 -0.01% and int8 -0.04%, within their intervals of raw, count 0
LOSS_GAP: dict[tuple[str, str], float] = {
    ("raw", "raw"): 0.0,
    ("bf16", "bf16"): 0.0,
    ("int8", "int8"): 0.0,
    ("int4", "int8"): 0.0023,
    ("int4", "int6"): 0.0023,
    ("int4", "int4"): 0.0026,
}
# (forward, backward) -> raw's steps to a validation loss over the pair's, the same runs' means (int8's 0.996
# counts 1)
STEPS_FACTOR: dict[tuple[str, str], float] = {
    ("raw", "raw"): 1.0,
    ("bf16", "bf16"): 1.0,
    ("int8", "int8"): 1.0,
    ("int4", "int8"): 1.025,
    ("int4", "int6"): 1.026,
    ("int4", "int4"): 1.029,
}
# auto takes pairs that cost at most this share of the loss at equal tokens: every pair measured (the table
# resolves 0.5%); their steps weigh in through STEPS_FACTOR
QUALITY_BUDGET = 0.01
# codec -> seconds per value to encode and decode on one CPU thread (benchmarks/compression.py --part speed)
WORK_S_PER_VALUE: dict[str, float] = {"raw": 0.0, "fp16": 8.94e-10, "bf16": 6.74e-10, "int8": 5.86e-09, "int4": 1.41e-08,
                                      "int6": 1.71e-08}


def codec_rates(step_costs: np.ndarray | None) -> np.ndarray | None:
    """(n, len(CODECS)) encode plus decode seconds per value on each device, from the step costs devices measured
    ((n, len(stepcosts.FIELDS)): `Problem.step_costs`), `WORK_S_PER_VALUE` where a device measured none; None where
    no device measured any (every device then counts `WORK_S_PER_VALUE`)."""
    if step_costs is None:
        return None
    columns = [STEP_COSTS.index(CODEC_FIELDS[codec]) for codec in CODECS[1:]]
    measured = step_costs[:, columns]
    if not measured.any():
        return None
    default = np.array([WORK_S_PER_VALUE[codec] for codec in CODECS[1:]])
    rates = np.where(measured > 0, measured, default)
    return np.concatenate([np.zeros((len(rates), 1)), rates], axis=1)  # raw: nothing to do


def steps_factor(pair: tuple[str, str]) -> float:
    """The pair's steps factor: measured, else the largest measured with the same forward codec, else 1."""
    if pair in STEPS_FACTOR:
        return STEPS_FACTOR[pair]
    return max((factor for (forward, _), factor in STEPS_FACTOR.items() if forward == pair[0]), default=1.0)


def candidates(compress: tuple[str, str]) -> list[tuple[str, str]]:
    """The pairs a hop may take: the one given, or with auto those within the budget."""
    if compress == AUTO:
        return [pair for pair, gap in LOSS_GAP.items() if gap <= QUALITY_BUDGET]
    if len(compress) != 2 or any(codec not in CODECS for codec in compress):
        raise ValueError(f"compress must be auto or a (forward, backward) pair of {', '.join(CODECS)}, got {compress!r}")
    return [compress]


class HopCodecs:
    """The hop costs of `candidates(compress)` for a micro-batch of `values` values per activation in `dtype`.

    A hop's codec work is each direction's encoding on its sender and decoding on its receiver. `codec_s` (n,
    len(CODECS)) gives each device's own encode plus decode seconds per value, as it measured them at join
    (`peer.probe.codec_rates`), half of it counted for each end; without it every device counts
    `WORK_S_PER_VALUE`. `fixed` names, for hops given as (sender, receiver) device indices, the pair each
    must take (a running plan's own codecs, to judge it as it runs); every other hop takes its best of the
    candidates."""

    def __init__(self, compress: tuple[str, str], values: float, dtype: str, codec_s: np.ndarray | None = None,
                 fixed: dict[tuple[int, int], tuple[str, str]] | None = None, devices: int = 0) -> None:
        chosen = candidates(compress)
        self.pairs = chosen + sorted(set((fixed or {}).values()) - set(chosen))
        wire = np.array([[values * bytes_per_value(dtype, codec) for codec in pair] for pair in self.pairs])  # (P, 2)
        self.mean_bytes, self.peak_bytes = wire.mean(axis=1), wire.max(axis=1)
        codes = np.array([[CODECS.index(codec) for codec in pair] for pair in self.pairs])  # (P, 2)
        default = np.array([WORK_S_PER_VALUE[codec] for codec in CODECS])
        if codec_s is None:  # one figure for every device: a hop's work is the pair's, whoever sends
            self.work_s, self._device_work = values * default[codes].sum(axis=1) / 2, None
        else:  # (n, P): what a device's ends of a hop cost it, a quarter of its rates for the two codecs
            self.work_s, self._device_work = None, values * codec_s[:, codes].sum(axis=2) / 4
        self._n = devices if codec_s is None else len(codec_s)
        # pairs only fixed hops take: the others never choose them
        self._others = np.where(np.arange(len(self.pairs)) < len(chosen), 0.0, np.inf) if fixed else None
        self.factor = np.array([steps_factor(pair) for pair in self.pairs])  # (P,)
        # two tiers worth comparing: candidates that cost steps and candidates that cost none
        self.tiered = bool((self.factor[:len(chosen)] > 1).any() and (self.factor[:len(chosen)] == 1).any())
        self._costly = np.where(self.factor > 1, np.inf, 0.0)
        if fixed:
            if self._n <= 0:
                raise ValueError("fixed hops need the number of devices")
            self._fixed_keys = np.array([a * self._n + b for a, b in fixed], dtype=np.int64)
            order = np.argsort(self._fixed_keys)
            self._fixed_keys = self._fixed_keys[order]
            self._fixed_pairs = np.array([self.pairs.index(pair) for pair in fixed.values()], dtype=np.int64)[order]
        else:
            self._fixed_keys = None

    def _work(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """(..., P) seconds of codec work on hops from devices `src` to `dst` (...)."""
        if self._device_work is None:
            return np.broadcast_to(self.work_s, np.shape(src) + (len(self.pairs),))
        return self._device_work[src] + self._device_work[dst]

    def cheapest(self, per_byte: np.ndarray) -> np.ndarray:
        """Each link's round-trip occupancy in its best pair, one pair at a time (for (n, n) matrices)."""
        n = len(per_byte)
        best = None
        for p, mean_bytes in enumerate(self.mean_bytes):
            if self._others is not None and self._others[p]:
                continue
            if self._device_work is None:
                each = mean_bytes * per_byte + self.work_s[p]
            else:
                each = mean_bytes * per_byte + self._device_work[:n, p][:, None] + self._device_work[:n, p][None, :]
            best = each if best is None else np.minimum(best, each, out=best)
        return best

    def occupancy(self, per_byte: np.ndarray, src: np.ndarray, dst: np.ndarray,
                  exact: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For hops from devices `src` to `dst` over links of `per_byte` seconds per byte (all of one shape): each
        hop's occupancy in a round trip (the mean of its two directions), in the period (the larger direction),
        and the index of the pair chosen (its steps factor: `self.factor[choice]`). `exact`: only among the
        candidates that cost no steps (where the candidates are `tiered`; fixed hops keep their pairs)."""
        if len(self.pairs) == 1:
            work = self._work(src, dst)[..., 0]
            mean = self.mean_bytes[0] * per_byte + work
            return mean, self.peak_bytes[0] * per_byte + work, np.zeros(np.shape(per_byte), dtype=np.int64)
        work = self._work(src, dst)
        each = self.mean_bytes * per_byte[..., None] + work  # (..., P)
        if self._others is not None:
            each = each + self._others
        if exact and self.tiered:
            each = each + self._costly
        choice = each.argmin(axis=-1)
        if self._fixed_keys is not None:
            key = np.asarray(src, dtype=np.int64) * self._n + dst
            at = np.minimum(np.searchsorted(self._fixed_keys, key), len(self._fixed_keys) - 1)
            choice = np.where(self._fixed_keys[at] == key, self._fixed_pairs[at], choice)
        work = np.take_along_axis(work, choice[..., None], axis=-1)[..., 0]
        return self.mean_bytes[choice] * per_byte + work, self.peak_bytes[choice] * per_byte + work, choice
