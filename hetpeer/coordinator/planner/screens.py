"""The cheap estimates the search screens its moves with, for the time model (`timemodel.py`).

- A swap of two cells: the layer split held at the grid's, only the two lanes and two groups it
  touches re-evaluated (and the step's micro-batches shared out over the lanes again), and in each group
  only the pairs a changed lane is in; devices that share a device keep the slowdown the grid gives them (a
  swap with standby changes it a little).
- An exchange of a run of stages between two lanes: every group keeps its devices, so split, memory
  and weights to move stay; the two lanes' new times come exact from prefix sums and range maxima,
  every segment of every pair of lanes with one of the slowest at once, each lane keeping the micro-batches
  the grid gives it.

Both hold the grid's codec tier (`codecs.py`: whether its hops take pairs that cost steps); a swap counts
its two lanes' codec factors anew. Both are held to the full evaluation by tests/unit/test_timemodel.py; the
search confirms what they rank best with the exact cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetpeer.coordinator.planner import lanes as balance

KEPT_PAIRS = 5  # largest pairs a swap's screen keeps per group and channel: a swap changes at most 4
EXCHANGED_LANES = 32  # lanes whose every pair a screen of exchanges looks at: all of them up to 32 lanes


class Screens:
    """Mixed into `TimeCost`, whose exact pieces it uses: `_evaluate`, `_lane_parts`, `_allocate`, `_pairs`, `_sync`,
    `_overflow`, `_objective`, and its per-device and per-stage figures."""

    def init_screens(self, rounds: int) -> None:
        # What a swap's screen keeps per group, as channels of pairs (lane l with lane l + shift): the
        # ring's latency and its seconds per byte (all-reduce takes the max of each), then each gossip round.
        self._shifts = np.concatenate([[1, 1], 2 ** np.arange(rounds)]).astype(np.int64)
        self._screened: _ScreenBase | None = None

    def screen(self, grid: np.ndarray, batch: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """Approximate objectives of grids that differ from `grid` at two cells each.

        `cells` (K, 2) holds the flat indices of the changed cells (equal when a device came in
        from standby). The layer allocation is held at `grid`'s, so only the two lanes and two
        groups touched are re-evaluated, and in each group only the pairs a changed lane is in (two
        in the ring and two in each gossip round), against the largest pairs the grid's groups keep
        (`_screen_base`). A swap costs O(S + rounds), and O(S rounds) more to set every group's
        gossip against the new slowest lane, where evaluating a grid costs O(S m log m). The cost of
        moving weights is left out. The search confirms the best screened swaps with `batch_cost`.
        """
        key = grid.tobytes()
        if self._screened is None or self._screened.key != key:  # a search screens one grid many times
            self._screened = self._screen_base(grid)
        base = self._screened
        K, m = len(batch), grid.shape[1]
        work = base.evaluation["work"]  # (1, S)
        pick = np.arange(K)[:, None]
        rows, lanes = cells // m, cells % m  # (K, 2)
        parts = [np.repeat(part, K, axis=0) for part in base.evaluation["parts"]]
        changed = batch[pick, :, lanes]
        slowdown = base.slowdown[changed] if np.ndim(base.slowdown) else 1.0  # the grid's: a swap keeps its devices
        load = base.evaluation["load"]  # the grid's: relayed pairs share their relays as in it
        exact = bool(base.evaluation["exact"][0])  # the grid's codec tier
        *new_parts, _, new_factor = self._lane_parts(changed, work[:, None, :], slowdown, load, exact)
        for whole, part in zip(parts, new_parts):
            whole[pick, lanes] = part
        lane_factor = np.repeat(base.evaluation["lane_factor"], K, axis=0)
        lane_factor[pick, lanes] = new_factor
        lane = balance.lane_times(*parts, self._allocate(*parts), grid.shape[0])  # the step shared out again
        lane_s = lane.max(axis=1)
        allreduce = np.repeat(base.evaluation["allreduce"], K, axis=0)
        gossip = np.repeat(base.evaluation["gossip"], K, axis=0)
        if m > 1:
            allreduce[pick, rows], gossip[pick, rows] = self._screen_groups(base, batch[pick, rows], rows, lanes)
        overflow = np.repeat(base.evaluation["row_overflow"], K, axis=0)
        need = base.evaluation["need"][0]
        overflow[pick, rows] = self._overflow(batch[pick, rows], need[rows])
        outer_fits = np.repeat(np.broadcast_to(base.evaluation["outer_fits"], base.evaluation["need"].shape), K, axis=0)
        outer_fits[pick, rows] = self._outer_fits(batch[pick, rows], need[rows], base.stage_bytes[rows])
        update = self._update(batch, np.repeat(base.evaluation["counts"], K, axis=0))
        sync_s, *_, factor, departures = self._sync(allreduce, gossip, lane_s, lane_s + update, outer_fits)
        return self._objective(lane, sync_s, overflow, np.zeros(K), update, factor * lane_factor.max(axis=1) * departures)

    def exchanges(self, grid: np.ndarray, count: int) -> np.ndarray:
        """Up to `count` grids, each `grid` with one segment of stages exchanged between two lanes, that
        screen better than `grid`, the best first ((K, S, m), K may be 0).

        An exchange leaves every group's set of devices as it is, so the layer split, memory and the
        weights to move do not change, and of the lanes only the two exchanging: their new times come
        exact from per-lane prefix sums and range maxima, for every segment of every pair of lanes with
        one of the `EXCHANGED_LANES` slowest at once, in O(min(m, 32) m S^2). The screen holds sync as
        it is (who pairs with whom in a group follows lane order, and the slowest lane sets how much
        gossip it hides); the search confirms the best with `batch_cost`. Where lanes cross regions a
        step goes mostly to hops, and single swaps cannot move a run of stages from one lane to
        another: this is the move for that (the 2-opt* and cross exchanges of vehicle routing, with
        stages held in place).
        """
        S, m = grid.shape
        segments = _segments(S)
        if m == 1 or len(segments) == 0:
            return np.empty((0, S, m), dtype=grid.dtype)
        evaluation = self._evaluate(grid[None])
        lane = evaluation["lane"][0]
        # Pairs with one of the slowest lanes: the slowest is faster only if it exchanges, and at 7 x 256
        # every pair's screen cost a 10,000-peer plan 6% (0.662 against 0.619 s/step in a 30 s search).
        slow = np.zeros(m, dtype=bool)
        slow[np.argsort(-lane, kind="stable")[:EXCHANGED_LANES]] = True
        a, b = np.nonzero(np.triu(slow[:, None] | slow[None, :], 1))
        work = evaluation["work"][0]
        # both lanes of each pair after the exchange, (pairs, segments) each, from one set of lane tables, each
        # lane's micro-batches held at the grid's
        one, other = np.r_[a, b], np.r_[b, a]
        mine, theirs = np.split(self._exchanged_lanes(grid, work, segments, one, other, evaluation["micro"][0][one],
                                                      evaluation["load"], bool(evaluation["exact"][0])), 2)
        # the slowest lane besides a and b: among the three slowest
        top = np.argsort(-lane, kind="stable")[:3]
        others = np.full(len(a), -np.inf)
        for k in top[::-1]:
            others = np.where((a != k) & (b != k), lane[k], others)
        slowest = np.maximum(np.maximum(mine, theirs), others[:, None])
        mean = (lane.sum() - (lane[a] + lane[b])[:, None] + mine + theirs) / m
        # Lanes (slowest, 2 mean - slowest) have the slowest lane and the mean of all m: the objective
        # of each exchange, with every other term as `grid`'s.
        two = np.stack([slowest.ravel(), 2 * mean.ravel() - slowest.ravel()], axis=1)
        # every device keeps its stage (its optimizer step too) and every group its sync
        screened = self._objective(two, evaluation["sync_s"], evaluation["row_overflow"], evaluation["move"],
                                   evaluation["update"], evaluation["factor"] * evaluation["departures"])
        order = np.argsort(screened, kind="stable")[:count]
        order = order[screened[order] < evaluation["objective"][0]]
        pair, segment = np.unravel_index(order, slowest.shape)
        batch = np.repeat(grid[None], len(order), axis=0)
        for k, (la, lb, (s1, s2)) in enumerate(zip(a[pair], b[pair], segments[segment])):
            batch[k, s1:s2, la], batch[k, s1:s2, lb] = grid[s1:s2, lb], grid[s1:s2, la]
        return batch

    def _exchanged_lanes(
        self, grid: np.ndarray, work: np.ndarray, segments: np.ndarray, a: np.ndarray, b: np.ndarray,
        micro: np.ndarray | int, load: np.ndarray | None = None, exact: bool = False,
    ) -> np.ndarray:
        """(pairs, segments): the time of lane a[k] with stages [s1, s2) of lane b[k] in place of its own, taking
        `micro` (pairs,) micro-batches, for every pair k and segment (s1, s2), as `_lane_parts` and
        `lanes.lane_times` compute it (`work`: each stage's layers' worth; `load`: the grid's relays', `_pairs`; `exact`:
        the grid's codec tier)."""
        S = grid.shape[0]
        lanes = grid.T  # (m, S)
        slowdown = self._device_slowdowns(grid)  # an exchange keeps the grid's devices, so their sharing
        slowdown = slowdown[lanes] if np.ndim(slowdown) else slowdown
        t = (work * self.layer_s[lanes] + self._fixed(lanes)) * slowdown
        s1, s2 = segments[:, 0], segments[:, 1]  # (segments,)
        zero = np.zeros((len(lanes), 1))
        t_sum = np.concatenate([zero, np.cumsum(t, axis=1)], axis=1)  # (m, S + 1): stages before k
        t_max = _range_max(t)  # (m, S + 1, S + 1): stages [i, j)
        # a's head, b's segment and a's tail: their compute, then the hops inside each part
        ta, tb = t_sum[a], t_sum[b]
        compute = ta[:, s1] + tb[:, s2] - tb[:, s1] + ta[:, -1:] - ta[:, s2]
        peak = np.maximum(np.maximum(t_max[a, 0][:, s1], t_max[b[:, None], s1, s2]), t_max[a, :, -1][:, s2])
        if S > 1:
            latency, per_byte = self._pairs(lanes[:, :-1], lanes[:, 1:], load)  # (m, S - 1)
            occupancy, larger, _ = self.hops.occupancy(per_byte, lanes[:, :-1], lanes[:, 1:], exact)  # mean, larger direction
            h_sum = np.concatenate([zero, np.cumsum(latency + occupancy, axis=1)], axis=1)  # (m, S): hops before k
            x_max = _range_max(larger)
            # a's hops 0 .. s1 - 2, b's s1 .. s2 - 2, a's s2 .. S - 2 (hop k: stage k to k + 1)
            before, inner, after = np.maximum(s1 - 1, 0), np.maximum(s2 - 1, s1), np.minimum(s2, S - 1)
            ha, hb = h_sum[a], h_sum[b]
            hops = ha[:, before] + hb[:, inner] - hb[:, s1] + ha[:, -1:] - ha[:, after]
            peak_x = np.maximum(x_max[a, 0][:, before], x_max[b[:, None], s1, inner])
            peak_x = np.maximum(peak_x, x_max[a, :, -1][:, after])
            # the joints, where inside the lane: a's stage s1 - 1 to b's s1, and b's s2 - 1 to a's s2
            la, lb = lanes[a], lanes[b]
            joint_latency, joint_per_byte = self._pairs(la[:, before], lb[:, s1], load)
            back_latency, back_per_byte = self._pairs(lb[:, s2 - 1], la[:, after], load)
            joint_x, joint_peak, _ = self.hops.occupancy(joint_per_byte, la[:, before], lb[:, s1], exact)
            back_x, back_peak, _ = self.hops.occupancy(back_per_byte, lb[:, s2 - 1], la[:, after], exact)
            joint_x, joint_peak = np.where(s1 > 0, joint_x, 0.0), np.where(s1 > 0, joint_peak, 0.0)
            back_x, back_peak = np.where(s2 < S, back_x, 0.0), np.where(s2 < S, back_peak, 0.0)
            hops = hops + joint_x + back_x + np.where(s1 > 0, joint_latency, 0.0) + np.where(s2 < S, back_latency, 0.0)
            peak_x = np.maximum(peak_x, np.maximum(joint_peak, back_peak))
            round_trip = compute + 2 * hops
            period = np.maximum(peak, peak_x)
        else:
            round_trip, period = compute, peak
        ends = np.zeros(round_trip.shape)
        if S > 1 and self.tied_bytes:  # the new lane's ends, both ways at once, as `_lane_parts`
            first = np.where(s1 == 0, lanes[b, :1], lanes[a, :1])
            last = np.where(s2 == S, lanes[b, -1:], lanes[a, -1:])
            there, back = self._pairs(first, last, load), self._pairs(last, first, load)
            ends = np.maximum(there[0] + self.tied_bytes * there[1], back[0] + self.tied_bytes * back[1])
        return balance.lane_times(round_trip, period, ends, np.reshape(micro, (-1, 1)), S)

    def _channels(self, src: np.ndarray, dst: np.ndarray, stage_bytes: np.ndarray, load: np.ndarray | None
                  ) -> np.ndarray:
        """Pair values (..., channels) from devices src to dst given as (..., channels): the ring's
        latency, the ring's seconds per byte, then each gossip round's pair seconds for
        `stage_bytes` (broadcast against (..., 1)), computed as `_groups` does (`load`: the grid's relays')."""
        latency, per_byte = self._pairs(src, dst, load)
        values = latency + stage_bytes * per_byte
        values[..., 0] = latency[..., 0]
        values[..., 1] = per_byte[..., 1]
        return values

    def _screen_base(self, grid: np.ndarray) -> _ScreenBase:
        """The grid's evaluation, and per group and channel its largest few pair values: a swap
        changes at most four pairs of a channel, so the largest pair it leaves alone is among them."""
        evaluation = self._evaluate(grid[None])
        stage_bytes = (evaluation["counts"] * self.wire_per_layer + self.wire_fixed)[0]
        m = grid.shape[1]
        partners = (np.arange(m)[:, None] + self._shifts) % m  # (m, channels)
        values = self._channels(grid[:, :, None], grid[:, partners], stage_bytes[:, None, None],
                                evaluation["load"])  # (S, m, channels)
        values = values.transpose(0, 2, 1)
        top = np.argsort(-values, axis=-1, kind="stable")[..., :KEPT_PAIRS]
        # A sentinel no swap touches, for groups too small to keep a pair outside the touched ones.
        sentinel = np.zeros(top.shape[:-1] + (1,), dtype=np.int64)
        return _ScreenBase(
            key=grid.tobytes(),
            evaluation=evaluation,
            stage_bytes=stage_bytes,
            top_pair=np.concatenate([top, sentinel - 1], axis=-1),
            top_value=np.concatenate([np.take_along_axis(values, top, -1), sentinel - np.inf], axis=-1),
            slowdown=self._device_slowdowns(grid),
        )

    def _screen_groups(
        self, base: _ScreenBase, rows_after: np.ndarray, rows: np.ndarray, lanes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(all-reduce (K, 2), gossip rounds (K, 2, rounds)) of the two groups each swap touches,
        given as their devices after the swap (K, 2, m), their rows and the changed lanes (K, 2),
        from the base grid's largest pair values and the pairs the changed lanes are in."""
        K, _, m = rows_after.shape
        channels = len(self._shifts)
        # The lanes changed in each touched group: its own, and the other cell's if in the same group.
        same = rows[:, 0] == rows[:, 1]
        changed = np.stack([lanes, np.where(same[:, None], lanes[:, ::-1], lanes)])  # (2, K, 2)
        # A lane l is in a channel's pair l (as the sender) and pair l - shift (as the partner); the
        # four pairs lead the axes, so that reductions over them are elementwise.
        roles = (np.array([0, 1])[:, None] * self._shifts).reshape(2, 1, 1, 1, channels)
        touched = ((changed[None, ..., None] - roles) % m).reshape(4, K, 2, channels)
        offset = (np.arange(K * 2) * m).reshape(K, 2, 1)
        flat = rows_after.ravel()
        src = flat.take(offset + touched)
        dst = flat.take(offset + (touched + self._shifts) % m)
        stage_bytes = base.stage_bytes[rows]  # (K, 2)
        values = self._channels(src, dst, stage_bytes[..., None], base.evaluation["load"])  # (4, K, 2, channels)
        # The largest pair no changed lane is in: the first of the group's largest few not touched.
        kept = base.top_pair[rows]  # (K, 2, channels, kept pairs + 1)
        hit = kept == touched[0, ..., None]
        for pair in touched[1:]:
            hit |= kept == pair[..., None]
        first = hit.argmin(axis=-1)
        kept_max = base.top_value[rows].reshape(first.size, -1)[np.arange(first.size), first.ravel()]
        channel = np.maximum(values.max(axis=0), kept_max.reshape(first.shape))
        allreduce = self._exact_s(channel[..., 0], channel[..., 1], stage_bytes, m)
        return allreduce, channel[..., 2:]


@dataclass(frozen=True, slots=True)
class _ScreenBase:
    """What screens of swaps on one grid share: its evaluation and, per group (S) and pair
    channel, the indices of its largest pairs (KEPT_PAIRS, then a sentinel -1) and their values
    (then -inf)."""

    key: bytes
    evaluation: dict[str, np.ndarray]
    stage_bytes: np.ndarray  # (S,)
    top_pair: np.ndarray  # (S, channels, KEPT_PAIRS + 1)
    top_value: np.ndarray  # (S, channels, KEPT_PAIRS + 1)
    slowdown: np.ndarray | float  # (n,) each device's from sharing a device with the grid's (1.0: none share)


def _segments(stages: int) -> np.ndarray:
    """(s1, s2) of every run of stages [s1, s2) two lanes may exchange: all but the whole lane (which
    only reorders lanes; `reorder_lanes` does that)."""
    return np.array([(i, j) for i in range(stages) for j in range(i + 1, stages + 1) if j - i < stages],
                    dtype=np.int64).reshape(-1, 2)


def _range_max(values: np.ndarray) -> np.ndarray:
    """(m, L + 1, L + 1) from (m, L) non-negative values: [.., i, j] the largest of i .. j - 1 (0 if none)."""
    m, L = values.shape
    table = np.zeros((m, L + 1, L + 1))
    for i in range(L):
        table[:, i, i + 1:] = np.maximum.accumulate(values[:, i:], axis=1)
    return table
