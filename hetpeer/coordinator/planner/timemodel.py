"""Predicted seconds per training step for a grid: the cost model the runtime is held to.

For a grid (rows = stages in order, columns = lanes), with M micro-batches per lane per step:

- layers: each stage gets at least one layer; the rest go one at a time to the stage whose slowest
  device would then finish its micro-batch soonest (optimal for the min-max), within memory;
- a device's time per micro-batch t = its stage's layers x 3 x forward FLOPs / its TFLOPS (backward
  is twice the forward), plus what it measured of the rest of a stage's step (`Problem.step_costs`: the
  Python around a micro-batch on every stage, the embedding on the first, the head and loss on the last;
  a device that measured none counts the head by its FLOPs); devices of the grid that compute on one
  shared device (one machine's CPU cores, one GPU) are slowed by their fair share of it (`sharing.py`);
- a hop between consecutive stages of a lane costs h = latency + x, x = a micro-batch's activation bytes
  on the wire / bandwidth (the link's occupancy), once forward (activations, in the forward codec) and
  once backward (their gradients, in the backward codec), on a full-duplex link, plus half the codecs'
  encode and decode work each way (`codecs.py`); with two codecs of unlike size, x is their mean in C
  below and their larger in P; `--compress auto` takes each hop's codecs to make its x shortest;
- a lane under 1F1B takes
      T = C + (M - 1) P,   C = sum t + 2 sum h,   P = max(max t, max x, C / S if M > S)
  C is one micro-batch's round trip (fill and drain); each further micro-batch costs the lane's
  bottleneck: a stage's compute, a link's occupancy (latency is no resource: micro-batches in flight
  share it), or, once there are more micro-batches than stages, a round trip per S of them (1F1B holds
  at most S - s in flight on stage s). Against an event simulation of the runtime's schedule this is
  exact for M = 1 and within a few percent on average (`tests/unit/test_timemodel.py`); a model with a
  tied head adds the exchange of that matrix's gradient between the lane's two ends (both ways at
  once, after the backward pass) when they are different devices;
- a pair of peers behind NAT that talk through a relay has its relay's two hops as its link, and the k relayed
  pairs a grid routes through one relay share its link: at most its capacity / k each (`relays.py`);
- a group syncs its stage's parameters either by all-reduce after the step (`peer/gossip/exact.py`): robust (the
  recipe's default, `robust`), every member sends its stage to every other in one round,
      max ring latency + (m - 1) stage bytes / min ring bandwidth,
  or plain, a butterfly in which each member sends 1/m of its stage to every other and gets back their mean,
      2 (max ring latency + (m - 1) stage bytes / (m min ring bandwidth)),
  where the ring's pairs (lane l with lane l + 1) stand for all the group's, as screening a swap against every
  pair would cost O(m) instead of O(1) (`screens.py`): exact for bandwidth where a pair's is the lesser of its
  two devices' (the ring passes through the slowest), and for latency within two regions (the ring crosses
  between them); across three or more it may miss the farthest pair;
  or by gossip (decentralized Adam, one-peer exponential graph: round r pairs lane l with lane
  l + 2^r mod m, one round a step, in turn), whose exchange overlaps the step's compute, so a round
  shows only where it outlasts the step: the mean over rounds of max(0, round - T), where a round
  takes its slowest pair (the mean of the rounds first would hide a slow round behind fast ones);
  or, unless the organizer forbids them (`outer_every` None), by outer steps: that all-reduce once every H steps
  with the parameter change in fp16, overlapping the next D steps, so max(0, all-reduce - D T) / H a step
  (`outer.py`), where the group's devices hold the outer state too;
- a step of gossip or outer steps is worth less than an all-reduce step: the steps factor (`quality.py`, by
  group size and tokens a lane-step) is how many of them make one; `auto` takes, for every set of modes, each
  group's fastest of the set, and keeps the set whose step x factor (the plan's factor: its groups' largest)
  is least, so a plan is judged by its time to all-reduce's loss;
- a hop's codecs can cost steps too (int4 activations: `codecs.STEPS_FACTOR`): a lane's codec factor is its
  hops' largest, and the plan's factor is its sync's times its lanes' largest; where the hops' best pairs
  cost steps, the grid is evaluated again with each hop's best among those that cost none, and the better of
  the two (step x factor) is its cost (`exact`: which it took);
- step = slowest lane + slowest group's exposed sync + the slowest optimizer step (a device's stage
  parameters x its measured seconds per parameter: it follows the lane's last gradient) (+ the problem's
  fixed step overhead: 0 unless efficiency terms give one, or the coordinator learned one from the plan it
  runs; a negative one takes at most half the step off); the search minimises the step plus
  TIE_BREAK (1%) of the mean lane time and mean exposed sync, so that swaps which do not move the
  slowest lane or group still show whether they help, times the steps factor;
- memory per device: what `Workload.stage_memory` counts for its stage (training state, the group's
  exchange, the activations of min(M, S - s) micro-batches in flight at stage s under 1F1B, the last
  stage's logits); a grid that does not fit is penalised, not dropped, so the search can walk out of it;
- activation recomputation (`recompute`): with `auto`, a stage whose group's smallest device cannot hold
  its layers' activations recomputes as few of its layers as make it fit, each costing what its devices
  timed (`StepCosts.recompute`: the share of a layer's forward and backward that recomputing adds; a third,
  one more forward, where not timed; a stage pays its devices' largest); `always` recomputes every layer,
  `never` none. The layer split weighs it:
  a stage that would need recomputation for one more layer takes it only if that still finishes first;
- with a current plan, every device that must fetch layers it does not hold pays bytes / its best
  incoming bandwidth from a current holder; the slowest such move, spread over `horizon_steps`
  steps, is added to the objective, so a plan must be worth its move; such a device also keeps its
  old stage beside the new one while the new holders download it, and the download staged until it
  is complete, which must fit its memory too.

Costs are evaluated on batches of grids, (K, S, m) -> (K,), in O(K S m log m) plus a few greedy
layer placements per grid (the split starts from its continuous bound).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from hetpeer.coordinator.planner import lanes as balance, outer, quality
from hetpeer.coordinator.planner.codecs import HopCodecs, codec_rates
from hetpeer.coordinator.planner.problem import PlanningError, Problem, Report, Shape
from hetpeer.coordinator.planner.screens import Screens
from hetpeer.protocol.plan import RECOMPUTE_CHOICES, SYNC_CHOICES
from hetpeer.protocol.stepcosts import FIELDS as STEP_COSTS, RECOMPUTE_SHARE
from hetpeer.protocol.workload import OUTER_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM, SYNC_BYTES_PER_PARAM

NAME = "time"
SYNC_MODES = ("allreduce", "gossip", "outer")  # in the order a tie between them goes
OVERFLOW_PENALTY_S_PER_GB = 1e4
# The step is a max over lanes and groups, flat under most swaps; a sliver of the mean lane and
# sync time gives the search a slope on those plateaus.
TIE_BREAK = 0.01


class TimeCost(Screens):
    """Predicted step time for one shape, evaluated on batches of grids; `Screens` adds the cheap
    estimates the search screens its moves with."""

    name = NAME

    def __init__(
        self,
        problem: Problem,
        shape: Shape,
        *,
        sync: str = "auto",
        memory_reserve: float = 0.1,
        horizon_steps: int = 100,
        recompute: str = "auto",
        compress: tuple[str, str] = ("raw", "raw"),
        outer_every: int | None = None,
        hop_codecs: dict[tuple[int, int], tuple[str, str]] | None = None,
        robust: bool = True,
    ) -> None:
        """`hop_codecs`: for hops given as (sender, receiver) device indices, the (forward, backward) pair each must
        take, as a running plan has them (`policy.running_report`); every other hop the best of `compress`'s."""
        if problem.tflops is None:
            raise PlanningError(
                "the time cost model needs tflops for every device (topology.devices[*].tflops); "
                "use --cost-model dtfm for links alone"
            )
        if sync not in SYNC_CHOICES:
            raise PlanningError(f"sync must be one of {', '.join(SYNC_CHOICES)}, got {sync!r}")
        if recompute not in RECOMPUTE_CHOICES:
            raise PlanningError(f"recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, got {recompute!r}")
        self.problem, self.shape, self.sync, self.horizon_steps = problem, shape, sync, horizon_steps
        self.recompute, self.compress, self.outer_every, self.robust = recompute, compress, outer_every, robust
        self.ring_share = outer.ring_share(problem.workload.dtype)
        w, model = problem.workload, problem.workload.model
        stages, m = shape.stages, shape.group_size
        mb = problem.lane_micro_batch(m)
        self.micro_batches = problem.micro_batches(m)  # each lane's in the even split: ceil(batch / m) sequences
        self.total_micro = -(-w.batch // mb)  # the step's micro-batches, shared out over the lanes (`lanes.py`)
        # what a step of each sync mode is worth against all-reduce's (`quality.py`), for this shape's groups
        self.lane_tokens = problem.lanes_batch(m) * model.seq_len
        self.gossip_factor = quality.TABLE.factor("gossip", m, self.lane_tokens, noise_tokens=problem.noise_scale_tokens)
        spans = np.arange(max(outer_every or outer.MAX_EVERY, 1) + 1)  # by H
        self.outer_factor = quality.TABLE.outer_factors(m, self.lane_tokens, spans, problem.noise_scale_tokens)
        self.outer_allowed = m > 1 and (sync == "outer" or (sync == "auto" and outer_every is not None))
        flops_per_s = problem.tflops * 1e12
        self.layer_s = 3 * mb * w.layer_fwd_flops_per_seq / flops_per_s  # (n,)
        self.head_s = 3 * mb * w.head_fwd_flops_per_seq / flops_per_s  # (n,)
        # what a stage's step costs beyond its blocks, where the devices measured it (`StepCosts`)
        costs = problem.step_costs if problem.step_costs is not None else np.zeros((problem.n, len(STEP_COSTS)))
        self.head_s = np.where(costs[:, 1] > 0, mb * costs[:, 1], self.head_s)  # measured, not counted by FLOPs
        self.first_s = mb * costs[:, 0]  # (n,): the embedding's, on the first stage
        self.micro_s = costs[:, 3]  # (n,): the Python around a micro-batch, on every stage
        self.update_s = costs[:, 2]  # (n,): the optimizer's step, seconds per parameter, once a step
        # (n,): what recomputing a layer adds, in layers' worth (of its forward and backward)
        self.recompute_share = np.where(costs[:, 4] > 0, costs[:, 4], RECOMPUTE_SHARE)
        # what a hop costs, in its codecs (those of `hop_codecs` where given), at each device's measured codec rates
        self.hops = HopCodecs(compress, mb * model.seq_len * model.hidden, w.dtype, codec_rates(problem.step_costs),
                              hop_codecs, problem.n)
        self.tied_bytes = model.vocab * model.hidden * w.dtype_bytes if model.tied else 0.0
        # Flat copies: gathering pairs by one flat index is about twice as fast as 2-D indexing.
        self._latency_flat = problem.latency_s.ravel()
        self._seconds_per_byte_flat = problem.seconds_per_byte.ravel()

        first, last = np.arange(stages) == 0, np.arange(stages) == stages - 1
        wire = w.dtype_bytes
        # Per stage, `Workload.stage_memory` as its affine pieces: bytes before any layer, bytes a layer adds,
        # bytes a layer adds when recomputed, and the block rebuilt in backward once any is.
        inflight = np.minimum(self.micro_batches, stages - np.arange(stages))

        def memory(layers: int, recomputed: int) -> np.ndarray:
            parts = w.stage_memory(layers, first=first, last=last, in_flight=inflight, micro_batch=mb, group_size=m,
                                   recompute=recomputed, outer=sync == "outer")
            return sum(parts.values())

        self.mem_fixed = memory(0, 0)
        self.mem_per_layer = memory(1, 0) - self.mem_fixed
        self.mem_per_recomputed = memory(2, 2) - memory(1, 1)
        self.mem_rebuilt = memory(1, 1) - self.mem_fixed - self.mem_per_recomputed
        self.state_per_param = STATE_BYTES_PER_PARAM + (SYNC_BYTES_PER_PARAM if m > 1 else 0)
        # what a group that takes outer steps under `auto` holds beyond an every-step group, a byte of its stage's wire
        self.outer_extra_per_wire = (OUTER_BYTES_PER_PARAM - SYNC_BYTES_PER_PARAM) / w.dtype_bytes if sync == "auto" else 0.0
        self.wire_per_layer = float(model.layer_params * wire)
        self.wire_fixed = (first * model.embedding_params + last * model.head_params) * float(wire)
        self.usable_memory = None if problem.memory_bytes is None else problem.memory_bytes * (1 - memory_reserve)
        rounds = int(np.ceil(np.log2(m))) if m > 1 else 0
        self.partners = (np.arange(m)[None, :] + (2 ** np.arange(rounds))[:, None]) % m  # (rounds, m)
        self._current = _held_layers(problem) if problem.current is not None else None
        self.init_screens(rounds)

    @cached_property
    def link_cost(self) -> np.ndarray:
        """(n, n) seconds to pass one micro-batch's activations; built only for shapes searched."""
        seconds = self.problem.latency_s + self.hops.cheapest(self.problem.seconds_per_byte)
        np.fill_diagonal(seconds, 0.0)
        return seconds

    @cached_property
    def group_cost(self) -> np.ndarray:
        """(n, n) seconds to send one layer's parameters: how much two devices gain from sharing a group."""
        w = self.problem.workload
        return self.problem.transfer_s(w.model.layer_params * w.dtype_bytes)

    # -- the model -------------------------------------------------------------------------------

    def _layers(self, grids: np.ndarray, slowdown: np.ndarray | float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Greedy min-max allocation of layers to stages, within memory where possible: (layers, of them
        recomputed, layers' worth of compute), (K, S) each; `slowdown` is each cell's from sharing a device
        (`_slowdowns`). A stage's finish time only grows with its layers (recomputation too), so taking the layer
        that finishes soonest each time is optimal."""
        K, S, _ = grids.shape
        L = self.problem.layers
        per_layer = (self.layer_s[grids] * slowdown).max(axis=2)  # slowest device of each stage
        share = self.recompute_share[grids].max(axis=2)  # what a recomputed layer adds on the stage's devices
        extra = (self._fixed(grids.transpose(0, 2, 1)).transpose(0, 2, 1) * slowdown).max(axis=2)
        if self.usable_memory is not None:
            room = self.usable_memory[grids].min(axis=2) - self.mem_fixed
            plain = np.floor(room / self.mem_per_layer)
            recomputed = np.floor((room - self.mem_rebuilt) / self.mem_per_recomputed)
            cap = {"never": plain, "always": recomputed, "auto": np.maximum(plain, recomputed)}[self.recompute]
        else:
            room, plain = None, np.full((K, S), np.inf)
            cap = plain
        rate = 1 + share if self.recompute == "always" else 1.0
        # Start from the continuous bound: no stage can finish before `floor` in any allocation, so
        # every count reaching at most `floor` is part of the greedy answer (the bound of layers that
        # need no recomputation: recomputed ones only finish later); the greedy then places the
        # remaining few layers (at most S).
        floor = (L + (extra / (rate * per_layer)).sum(axis=1)) / (1 / (rate * per_layer)).sum(axis=1)
        counts = np.floor((floor[:, None] - extra) / (rate * per_layer)).astype(np.int64)
        first_cap = plain if self.recompute == "auto" else cap
        counts = np.clip(counts, 1, np.where(np.isfinite(first_cap), np.maximum(first_cap, 1), L).astype(np.int64))
        counts[counts.sum(axis=1) > L] = 1
        rows = np.arange(K)
        for _ in range(L - int(counts.sum(axis=1).min())):
            fill = counts.sum(axis=1) < L
            more = counts + 1
            finish = (more + share * self._recomputed(more, room, plain)) * per_layer + extra
            within = np.where(counts + 1 <= cap, finish, np.inf)
            choice = np.where(np.isfinite(within.min(axis=1)), within.argmin(axis=1), finish.argmin(axis=1))
            counts[rows[fill], choice[fill]] += 1
        recomputed = self._recomputed(counts, room, plain)
        return counts, recomputed, counts + share * recomputed

    def _recomputed(self, counts: np.ndarray, room: np.ndarray | None, plain: np.ndarray) -> np.ndarray:
        """Layers of each stage that recompute: none, all, or (auto) the fewest that fit its memory."""
        if self.recompute == "always":
            return counts
        if self.recompute == "never" or room is None:
            return np.zeros_like(counts)
        short = counts * self.mem_per_layer + self.mem_rebuilt - room
        fewest = np.ceil(short / (self.mem_per_layer - self.mem_per_recomputed)).astype(np.int64)
        return np.where(counts <= plain, 0, np.clip(fewest, 1, counts))

    def _lane_parts(self, cols: np.ndarray, work: np.ndarray, slowdown: np.ndarray | float,
                    load: np.ndarray | None = None, exact: bool = False) -> tuple[np.ndarray, ...]:
        """Lanes given as (..., S) device indices with (..., S) layers' worth of compute (layers, recomputation
        counted), each device slowed by `slowdown` (..., S) from sharing its device and each relayed hop by its
        relay's `load` (`_pairs`), their hops' codecs among those that cost no steps where `exact`, apart from how
        many micro-batches they run (`lanes.lane_times` takes those): their round trip, period and once-a-step
        exchange between their ends (...), per-stage compute t (..., S), and their codecs' steps factor (...: the
        largest of their hops')."""
        stages = cols.shape[-1]
        t = (work * self.layer_s[cols] + self._fixed(cols)) * slowdown
        if stages > 1:
            latency, per_byte = self._pairs(cols[..., :-1], cols[..., 1:], load)
            occupancy, peak, choice = self.hops.occupancy(per_byte, cols[..., :-1], cols[..., 1:], exact)
            round_trip = t.sum(-1) + 2 * (latency + occupancy).sum(-1)
            period = np.maximum(t.max(-1), peak.max(-1))
            factor = self.hops.factor[choice].max(-1)
        else:
            round_trip, period, factor = t.sum(-1), t.max(-1), np.ones(cols.shape[:-1])
        ends = np.zeros(round_trip.shape)
        if stages > 1 and self.tied_bytes:
            there, back = self._pairs(cols[..., 0], cols[..., -1], load), self._pairs(cols[..., -1], cols[..., 0], load)
            ends = np.maximum(there[0] + self.tied_bytes * there[1], back[0] + self.tied_bytes * back[1])
        return round_trip, period, ends, t, factor

    def _allocate(self, round_trip: np.ndarray, period: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Micro-batches per lane (K, m): the step's shared out so that its lanes finish together (`lanes.py`), or
        the even split where the step has fewer micro-batches than lanes."""
        if self.total_micro < self.shape.group_size:
            return np.full(round_trip.shape, self.micro_batches, dtype=np.int64)
        return balance.allocate(round_trip, period, ends, self.shape.stages, self.total_micro, self.micro_batches)

    def _fixed(self, cols: np.ndarray) -> np.ndarray:
        """(..., S) seconds a micro-batch costs each device of lanes (..., S) beyond its layers: the Python around it,
        the embedding on the first stage, the head and loss on the last."""
        fixed = self.micro_s[cols]
        fixed[..., 0] += self.first_s[cols[..., 0]]
        fixed[..., -1] += self.head_s[cols[..., -1]]
        return fixed

    def _update(self, grids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """(K,) seconds of the slowest optimizer step in grids (K, S, m) whose stages hold `counts` (K, S) layers:
        it follows each step on every device (once the lane's last gradient is in), so the step waits for it."""
        if not self.update_s.any():
            return np.zeros(len(grids))
        model = self.problem.workload.model
        S = grids.shape[1]
        params = counts * model.layer_params + (np.arange(S) == 0) * model.embedding_params \
            + (np.arange(S) == S - 1) * model.head_params  # (K, S)
        return (params[:, :, None] * self.update_s[grids]).max(axis=(1, 2))

    def _groups(self, rows: np.ndarray, stage_bytes: np.ndarray, load: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(all-reduce seconds (...), each gossip round's seconds before overlap (..., rounds)) for groups
        given as (..., m) devices, relayed pairs given their relay's `load` (`_pairs`)."""
        if rows.shape[-1] == 1:
            return np.zeros(rows.shape[:-1]), np.zeros(rows.shape[:-1] + (1,))
        m = rows.shape[-1]
        # the ring's pairs stand for all of the group's (see the module's docstring)
        latency, per_byte = self._pairs(rows, np.roll(rows, -1, axis=-1), load)
        allreduce = self._exact_s(latency.max(-1), per_byte.max(-1), stage_bytes, m)
        latency, per_byte = self._pairs(rows[..., None, :], rows[..., self.partners], load)  # (..., rounds, m)
        return allreduce, (latency + stage_bytes[..., None, None] * per_byte).max(-1)

    def _slowdowns(self, grids: np.ndarray) -> np.ndarray | float:
        """(K, S, m) slowdown of each cell from sharing its device with others of the grid; 1.0 when the
        problem's devices each have their own."""
        sharing = self.problem.sharing
        return 1.0 if sharing is None else sharing.slowdowns(grids)

    def _device_slowdowns(self, grid: np.ndarray) -> np.ndarray | float:
        """(n,) slowdown of every device from sharing its device with those of `grid` (S, m), a device not in
        it as if it joined them; 1.0 when the problem's devices each have their own."""
        sharing = self.problem.sharing
        if sharing is None:
            return 1.0
        members = np.zeros((1, self.problem.n), dtype=bool)
        members[0, grid.ravel()] = True
        return sharing.device_slowdowns(members)[0]

    def _exact_s(self, latency: np.ndarray, per_byte: np.ndarray, stage_bytes: np.ndarray, m: int) -> np.ndarray:
        """Seconds of a group's all-reduce from its largest pair latency and seconds per byte: robust, each member's
        stage to every other in one round; plain, a butterfly's two rounds of 1/m of it to every other."""
        if self.robust:
            return latency + (m - 1) * stage_bytes * per_byte
        return 2 * (latency + (m - 1) * stage_bytes / m * per_byte)

    def _pairs(self, a: np.ndarray, b: np.ndarray, load: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(latency seconds, seconds per byte) from devices a to devices b, elementwise; with `load` ((K, R): the
        relayed pairs of each of K grids through each relay, `_relay_load`; a and b then (K, ...), or (1, R): one
        grid's for all), a relayed pair's seconds per byte count its share of its relay (`relays.py`)."""
        index = a * self.problem.n + b
        per_byte = self._seconds_per_byte_flat.take(index)
        if load is not None:
            per_byte = self.problem.relays.seconds_per_byte(index, per_byte, load)
        return self._latency_flat.take(index), per_byte

    def _relay_load(self, grids: np.ndarray) -> np.ndarray | None:
        """(K, R): the relayed pairs grids (K, S, m) route through each relay; None when no pair is relayed."""
        relays = self.problem.relays
        return None if relays is None else relays.load(grids)

    def _sync(self, allreduce: np.ndarray, gossip: np.ndarray, lane_s: np.ndarray, base_s: np.ndarray,
              outer_fits: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per group (K, S), from all-reduce (K, S), gossip rounds (K, S, rounds), the slowest lane (K,), the rest of
        the step (K,: lane and optimizer step) and where outer steps' state fits (K, S): exposed sync seconds, whether
        it gossips, whether it takes outer steps, their H and D (0 where it does not), and the grid's steps factor and
        departure factor (K, each: `_departures`).

        `auto` weighs time to loss: for every set of modes it may use, each group takes the fastest of the set, the
        grid's factor is the largest of the modes it took, and the set whose (step x factor x departure factor) is
        least wins. Every set with all-reduce in it, and gossip alone where departures cost: exact for this objective
        (a group's mode moves the step only through the slowest sync, the factor only through the largest, the
        departure factor only through whether every group gossips)."""
        K, S = allreduce.shape
        none = np.zeros((K, S), dtype=np.int64)
        if self.shape.group_size == 1:
            return (np.zeros((K, S)), none.astype(bool), none.astype(bool), none, none, np.ones(K),
                    np.full(K, self._departures(None)))
        gossip = np.maximum(gossip - lane_s[:, None, None], 0.0).mean(-1)
        options = {"allreduce": (allreduce, np.ones((K, S))), "gossip": (gossip, np.full((K, S), self.gossip_factor))}
        every = delay = none
        if self.outer_allowed:
            amortised, every, delay = outer.schedule(allreduce * self.ring_share, lane_s, self.outer_every)
            options["outer"] = (np.where(outer_fits, amortised, np.inf) if self.sync == "auto" else amortised,
                                self.outer_factor[every])
        if self.sync == "auto":
            # all-reduce belongs to every set worth trying: a group that takes it instead adds no time and no factor
            others = [mode for mode in SYNC_MODES[1:] if mode in options]
            sets = [["allreduce", *(mode for k, mode in enumerate(others) if bits >> k & 1)] for bits in range(2 ** len(others))]
            if self.problem.departure_stall:  # a departure stalls one lane only where every group gossips
                sets.append(["gossip"])
        else:
            sets = [[self.sync]]
        best_cost = np.full(K, np.inf)
        chosen = np.zeros((K, S), dtype=np.int64)  # index into SYNC_MODES
        best_sync, best_factor, best_departures = np.full((K, S), np.inf), np.ones(K), np.ones(K)
        for modes in sets:
            seconds = np.stack([options[mode][0] for mode in modes])  # (modes, K, S)
            pick = seconds.argmin(axis=0)  # ties go to the earlier mode
            sync_s = np.take_along_axis(seconds, pick[None], axis=0)[0]
            factors = np.take_along_axis(np.stack([options[mode][1] for mode in modes]), pick[None], axis=0)[0]
            factor = quality.plan_factor(factors)
            departures = self._departures(pick == modes.index("gossip") if "gossip" in modes else None)
            step = base_s + sync_s.max(axis=1)
            cost = (step + self._overhead(step)) * factor * departures
            better = cost < best_cost
            best_cost = np.where(better, cost, best_cost)
            best_sync = np.where(better[:, None], sync_s, best_sync)
            best_factor = np.where(better, factor, best_factor)
            best_departures = np.where(better, departures, best_departures)
            chosen = np.where(better[:, None], np.array([SYNC_MODES.index(mode) for mode in modes])[pick], chosen)
        use_gossip, use_outer = chosen == SYNC_MODES.index("gossip"), chosen == SYNC_MODES.index("outer")
        return (best_sync, use_gossip, use_outer, np.where(use_outer, every, 0), np.where(use_outer, delay, 0),
                best_factor, best_departures)

    def _departures(self, gossiping: np.ndarray | None) -> np.ndarray | float:
        """What departures cost grids whose groups gossip where `gossiping` (K, S; None: none does), as a factor on
        the step: each departure stalls a plan with a group that waits for every member (all-reduce, outer steps;
        a pipeline of one lane) for the problem's stall, x = devices x departure_stall a second; where every group
        gossips, only the departed peer's lane stops, 1 / m of the swarm (`Problem.departure_stall`)."""
        x = self.shape.devices * self.problem.departure_stall
        if not x:
            return 1.0
        if gossiping is None or self.shape.group_size == 1:
            return 1.0 + x
        return np.where(gossiping.all(axis=1), 1.0 + x / self.shape.group_size, 1.0 + x)

    def _overflow(self, rows: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Bytes by which each group's smallest device falls short of `need`; (..., m) -> (...)."""
        if self.usable_memory is None:
            return np.zeros(rows.shape[:-1])
        return np.maximum(need - self.usable_memory[rows].min(-1), 0)

    def _outer_fits(self, rows: np.ndarray, need: np.ndarray, stage_bytes: np.ndarray) -> np.ndarray | bool:
        """Whether groups (..., m) whose stages need `need` bytes with `stage_bytes` on the wire (...) could hold
        outer steps' state too, where `auto` may give them outer steps (True where it decides nothing)."""
        if not (self.outer_allowed and self.outer_extra_per_wire):
            return True
        return self._overflow(rows, need + stage_bytes * self.outer_extra_per_wire) == 0

    def _need(self, counts: np.ndarray, recompute: np.ndarray) -> np.ndarray:
        """Bytes each stage's devices need (`Workload.stage_memory`)."""
        return (self.mem_fixed + counts * self.mem_per_layer - recompute * (self.mem_per_layer - self.mem_per_recomputed)
                + (recompute > 0) * self.mem_rebuilt)

    def _evaluate(self, grids: np.ndarray) -> dict[str, np.ndarray]:
        """Every grid's cost, in its better codec tier where the candidates are tiered (`codecs.py`): its lanes
        and what follows from them (sync hidden behind them, the step, the factor) once with each hop's best pair,
        once with each hop's best among those that cost no steps (where some hop's best costs steps), in one batch of
        2K; the layer split, groups and memory, which the hops do not move, once. `exact` (K,) says which tier each
        grid took."""
        K = grids.shape[0]
        slowdown = self._slowdowns(grids)
        load = self._relay_load(grids)
        counts, recompute, work = self._layers(grids, slowdown)
        lanes_slowdown = slowdown.transpose(0, 2, 1) if np.ndim(slowdown) else slowdown
        each = [self._lane_parts(grids.transpose(0, 2, 1), work[:, None, :], lanes_slowdown, load)]  # lanes: (K, m)
        if self.hops.tiered and (each[0][-1] > 1).any():  # some hop's best pair costs steps: the other tier too
            each.append(self._lane_parts(grids.transpose(0, 2, 1), work[:, None, :], lanes_slowdown, load, exact=True))
        *parts, t, lane_factor = [np.concatenate(part) for part in zip(*each)]  # (T K, m): tier by tier
        T = len(each)
        micro = self._allocate(*parts)
        lane = balance.lane_times(*parts, micro, self.shape.stages)
        slowest = lane.argmax(axis=1)
        lane_s = lane[np.arange(T * K), slowest]
        stage_bytes = counts * self.wire_per_layer + self.wire_fixed  # (K, S)
        allreduce, gossip = self._groups(grids, stage_bytes, load)
        need = self._need(counts, recompute)  # (K, S)
        overflow = self._overflow(grids, need)
        if self._current is not None and self.usable_memory is not None:
            overflow = np.maximum(overflow, self._move_overflow(grids, counts, need))
        update = self._update(grids, counts)
        outer_fits = self._outer_fits(grids, need, stage_bytes)

        def tiled(value):  # a figure of each grid, for each tier
            return np.concatenate([value] * T) if T > 1 and np.ndim(value) else value

        sync_s, use_gossip, use_outer, outer_every, outer_delay, sync_factor, departures = self._sync(
            tiled(allreduce), tiled(gossip), lane_s, lane_s + tiled(update), tiled(outer_fits))
        factor = sync_factor * lane_factor.max(axis=1)  # sync's and codecs' steps: both slow the loss
        step = lane_s + sync_s.max(axis=1) + tiled(update)
        overhead = np.broadcast_to(self._overhead(step), step.shape)
        move = self._move_s(grids, counts) if self._current is not None else np.zeros(K)
        objective = self._objective(lane, sync_s, tiled(overflow), tiled(move), tiled(update), factor * departures)
        exact = objective[K:] < objective[:K] if T > 1 else np.zeros(K, dtype=bool)  # ties to the tier of best pairs
        pick = np.arange(K) + K * exact

        def kept(value):
            return value[pick] if T > 1 else value

        return {
            "counts": counts, "recompute": recompute, "work": work, "need": need, "update": update, "t": kept(t),
            "lane": kept(lane), "parts": [kept(part) for part in parts], "micro": kept(micro),
            "slowest": kept(slowest), "lane_s": kept(lane_s),
            "allreduce": allreduce, "gossip": gossip, "sync_s": kept(sync_s), "use_gossip": kept(use_gossip),
            "total": kept(step + overhead), "use_outer": kept(use_outer), "outer_every": kept(outer_every),
            "outer_delay": kept(outer_delay), "move": move, "overflow": overflow.sum(axis=1), "row_overflow": overflow,
            "objective": kept(objective), "overhead": kept(overhead), "factor": kept(factor),
            "departures": kept(departures), "outer_fits": outer_fits, "load": load, "lane_factor": kept(lane_factor),
            "exact": exact,
        }  # fmt: skip

    def _objective(self, lane: np.ndarray, sync_s: np.ndarray, overflow: np.ndarray, move: np.ndarray,
                   update: np.ndarray, factor: np.ndarray) -> np.ndarray:
        """What the search minimises, from lane times (K, m), exposed sync (K, S), overflow bytes (K, S), move seconds
        (K,), the slowest optimizer step (K,) and the steps factor (K,): the time to all-reduce's loss of a step (the
        step with its tie-break, times the factor), the amortised move, the penalty."""
        step = lane.max(axis=1) + sync_s.max(axis=1) + update
        return (
            (step + self._overhead(step) + TIE_BREAK * (lane.mean(axis=1) + sync_s.mean(axis=1))) * factor
            + move / self.horizon_steps
            + OVERFLOW_PENALTY_S_PER_GB * overflow.sum(axis=1) / 1e9
        )

    def _overhead(self, step: np.ndarray) -> np.ndarray | float:
        """The problem's fixed overhead on steps (K,). A negative one (a coordinator learned that its model
        over-predicts) takes at most half of each step off: it was learned on one plan, and a plan predicted much
        faster must not come out at nothing or less."""
        overhead = self.problem.step_overhead_s
        return overhead if overhead >= 0 else np.maximum(overhead, -0.5 * step)

    def _move_overflow(self, grids: np.ndarray, counts: np.ndarray, need: np.ndarray) -> np.ndarray:
        """(K, S): bytes by which a group's device falls short while it holds the stage it held in the
        current plan beside its new one (it serves the old one until the new holders have it) and the
        state it downloads, staged until the whole of it has arrived."""
        held_start, held_end = self._current[0][grids], self._current[1][grids]  # (K, S, m)
        end = np.cumsum(counts, axis=1)[:, :, None]
        start = end - counts[:, :, None]
        model = self.problem.workload.model
        held_params = ((held_end - held_start) * model.layer_params + (held_start == 0) * model.embedding_params
                       + (held_end == self.problem.layers) * model.head_params)
        moving = (held_end > held_start) & ((held_start != start) | (held_end != end))
        kept = np.clip(np.minimum(end, held_end) - np.maximum(start, held_start), 0, None)
        staged = (counts[:, :, None] - kept) * model.layer_params * STATE_BYTES_PER_PARAM
        peak = need[:, :, None] + np.where(moving, held_params * self.state_per_param + staged, 0.0)
        return np.maximum(peak - self.usable_memory[grids], 0).max(axis=-1)

    def _move_s(self, grids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Seconds for the slowest device to fetch the layers it would hold but does not hold now."""
        held_start, held_end, incoming_bytes_per_s = self._current
        end = np.cumsum(counts, axis=1)[:, :, None]
        start = end - counts[:, :, None]
        kept = np.clip(np.minimum(end, held_end[grids]) - np.maximum(start, held_start[grids]), 0, None)
        missing = (counts[:, :, None] - kept) * self.problem.workload.model.layer_params * STATE_BYTES_PER_PARAM
        return (missing / incoming_bytes_per_s[grids]).max(axis=(1, 2))

    # -- the interface the search uses -----------------------------------------------------------

    def batch_cost(self, grids: np.ndarray) -> np.ndarray:
        return self._evaluate(grids)["objective"]

    def seed_costs(self, grids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Objectives of seed grids and what they promise: the objective without the groups' sync. The search
        starts descents from the seeds best by each in turn: a seed's sync depends on who pairs with whom, which its first descent
        mends (lane order, alignment) far more than its pipeline (at 1024 unlike GPUs, 16 x 32, the fastest
        devices laid out by lanes along the chain started at 14.2 s per step, 12.4 of them sync, and descended
        to 1.98; the seed with the lowest objective, 5.2, descended to 4.34)."""
        e = self._evaluate(grids)
        worth = e["factor"] * e["departures"]
        return e["objective"], e["objective"] - worth * (e["sync_s"].max(axis=1) + TIE_BREAK * e["sync_s"].mean(axis=1))

    def report(self, grid: np.ndarray) -> Report:
        e = self._evaluate(grid[None])
        lane = int(e["slowest"][0])
        t, M = e["t"][0, lane], int(e["micro"][0, lane])
        lane_s = float(e["lane"][0, lane])
        sync = tuple(
            "none" if self.shape.group_size == 1 else ("outer" if o else "gossip" if g else "allreduce")
            for g, o in zip(e["use_gossip"][0], e["use_outer"][0])
        )
        cost = {
            "compute_s": float(M * t.max()),
            "bubble_s": float(t.sum() - t.max()),
            # the rest of the slowest lane: transfers and round trips that compute does not hide
            "activation_s": max(0.0, lane_s - float(M * t.max() + t.sum() - t.max())),
            "sync_s": float(e["sync_s"][0].max()),
            "total_s": float(e["total"][0]),
        }
        if e["update"][0]:
            cost["update_s"] = float(e["update"][0])
        if self.problem.step_overhead_s:
            cost["overhead_s"] = float(e["overhead"][0])
        if self._current is not None:
            cost["move_s"] = float(e["move"][0])
        return Report(
            layers=tuple(int(c) for c in e["counts"][0]),
            sync=sync,
            cost=cost,
            objective=float(e["objective"][0]),
            fits_memory=bool(e["overflow"][0] == 0),
            recompute=tuple(int(k) for k in e["recompute"][0]),
            codecs=self._hop_codecs(grid, e["load"], bool(e["exact"][0])),
            outer_every=tuple(int(h) for h in e["outer_every"][0]),
            outer_delay=tuple(int(d) for d in e["outer_delay"][0]),
            steps_factor=float(e["factor"][0]),
            lane_batches=self._lane_batches(e["micro"][0], e["lane"][0]),
            relay_load=self._relay_bytes(grid, e),
        )

    def _lane_batches(self, micro: np.ndarray, lane_s: np.ndarray) -> tuple[int, ...]:
        """Sequences per lane (`Report.lane_batches`) from its micro-batches (m,) and times (m,); () where that is
        the even split (also where the step has fewer micro-batches than lanes: each lane its rounded-up share)."""
        problem, m = self.problem, self.shape.group_size
        if self.total_micro < m:
            return ()
        shares = balance.sequences(micro, problem.lane_micro_batch(m), problem.workload.batch, lane_s)
        return () if (shares == problem.lanes_batch(m)).all() else tuple(int(b) for b in shares)

    def _hop_codecs(self, grid: np.ndarray, load: np.ndarray | None, exact: bool
                    ) -> tuple[tuple[tuple[str, str], ...], ...]:
        """Per hop (stage s to s + 1) and lane, the (forward, backward) codecs the time model counted (in the
        tier `exact` says)."""
        _, per_byte = self._pairs(grid[:-1], grid[1:], load)
        choice = self.hops.occupancy(per_byte, grid[:-1], grid[1:], exact)[2]
        return tuple(tuple(self.hops.pairs[c] for c in row) for row in choice)

    def _relay_bytes(self, grid: np.ndarray, e: dict[str, np.ndarray]) -> tuple[tuple[str, int, float], ...]:
        """Per relay the grid (S, m) routes pairs through: (its device id, the pairs, the bytes it carries a step,
        both ways), from its evaluation `e`: each relayed hop's micro-batches forward and back in the hop's codecs,
        each relayed pair of a group what its sync sends between them (all-reduce: 2 (m - 1) / m of the stage along
        the ring; gossip: the stage from each lane to its round's partner, a round a step; outer steps: their ring
        once in H steps)."""
        relays = self.problem.relays
        if relays is None:
            return ()
        S, m = grid.shape
        carried, pairs = np.zeros(len(relays.names)), np.zeros(len(relays.names), dtype=np.int64)
        if S > 1:
            label = relays.via[grid[:-1], grid[1:]]  # (S - 1, m)
            _, per_byte = self._pairs(grid[:-1], grid[1:], e["load"])
            choice = self.hops.occupancy(per_byte, grid[:-1], grid[1:], bool(e["exact"][0]))[2]
            hop_bytes = 2 * self.hops.mean_bytes[choice] * e["micro"][0][None, :]  # forward and back, a step
            np.add.at(carried, label[label >= 0], hop_bytes[label >= 0])
            np.add.at(pairs, label[label >= 0], 1)
        if m > 1:
            stage_bytes = e["counts"][0] * self.wire_per_layer + self.wire_fixed  # (S,)
            rounds = len(self.partners)
            for s in range(S):
                mode = ("gossip" if e["use_gossip"][0, s] else "outer" if e["use_outer"][0, s] else "allreduce")
                together: dict[tuple[int, int], float] = {}
                if mode == "gossip":  # round r pairs lane l with l + 2^r: a pair's stage each way, in 1 of `rounds` steps
                    for r in range(rounds):
                        for l in range(m):
                            key = tuple(sorted((int(grid[s, l]), int(grid[s, self.partners[r, l]]))))
                            together[key] = together.get(key, 0.0) + stage_bytes[s] / rounds
                else:
                    share = 2 * (m - 1) / m * (2 if m == 2 else 1)  # a ring of two runs both ways over its one pair
                    if mode == "outer":
                        share *= self.ring_share / max(int(e["outer_every"][0, s]), 1)
                    for l in range(m if m > 2 else 1):
                        key = tuple(sorted((int(grid[s, l]), int(grid[s, (l + 1) % m]))))
                        together[key] = share * stage_bytes[s]
                for (a, b), each_way in together.items():
                    if relays.via[a, b] >= 0:
                        carried[relays.via[a, b]] += each_way
                        pairs[relays.via[a, b]] += 1
        return tuple((relays.names[r], int(pairs[r]), float(carried[r])) for r in np.flatnonzero(pairs))


def _held_layers(problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per device: the layer range it holds in the current plan (empty if none), and the best
    bandwidth into it from a device that holds anything."""
    index = {d: i for i, d in enumerate(problem.device_ids)}
    start = np.zeros(problem.n, dtype=np.int64)
    end = np.zeros(problem.n, dtype=np.int64)
    holders = []
    for stage in problem.current.stages:
        for device in stage.devices:
            if device in index:
                start[index[device]], end[index[device]] = stage.layer_start, stage.layer_end
                holders.append(index[device])
    bandwidth = problem.bandwidth_bytes_per_s.copy()
    np.fill_diagonal(bandwidth, 0.0)
    incoming = bandwidth[holders].max(axis=0) if holders else np.zeros(problem.n)
    # A swarm with no current holder has nothing to move from: the fetch is from the data's owner.
    incoming = np.where(incoming > 0, incoming, np.inf)
    return start, end, incoming

