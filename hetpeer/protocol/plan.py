"""The plan: which peers hold which layers, how they chain into lanes, and how each group syncs.

A plan is what the coordinator publishes and what `hetpeer plan --json` prints. Its wire form:

    {"version": 1, "epoch": int, "start_step": int, "cost_model": "dtfm" | "time",
     "model": str, "layers": int, "batch": int, "micro_batch": int, "micro_batches": int, "dtype": str,
     "lane_batches": [int per lane],                  # optional: sequences each lane takes a step, summing to batch
                                                      #   (absent: every lane ceil(batch / lanes)); micro_batches is
                                                      #   then the most micro-batches any lane runs
     "seq_len": int,                                  # optional: tokens per sequence it was made for
     "stages": [{"index": s, "layer_start": int, "layer_end": int (exclusive),
                 "devices": [device id per lane], "sync": "allreduce" | "gossip" | "outer" | "none",
                 "outer_every": int,                  # with sync "outer" only: steps between outer steps (H)
                 "outer_delay": int,                  # optional, < outer_every: steps its exchange overlaps
                 "recompute": int,                    # optional: its first N layers recompute activations in backward
                 "forward": [codec per lane],         # optional (all raw): how each lane's activations travel to
                 "backward": [codec per lane]}],      #   the next stage, and their gradients back (not on the last)
     "lanes": [[device id per stage], ...],          # lanes[l][s] == stages[s].devices[l]
     "standby": [device id, ...],
     "standby_reasons": [[reason, count], ...],       # optional: why, in runs over the standby list (words)
     "cost": {"total_s": float, ...},                 # predicted seconds, by component
     "steps_factor": float,                           # optional (1): all-reduce's steps to a loss over this plan's
                                                      #   (its gossip or outer-step groups' cost in steps, docs/gossip.md)
     "estimated_links": [[device id, device id], ...],  # optional: links it uses that were never measured (estimated)
     "relay_load": [[device id, int, float], ...],    # optional: per relay it routes pairs through, the pairs and the
                                                      #   bytes it carries a step (predicted)
     "recipe": {...},                                 # the organizer's training recipe (protocol/recipe.py); optional in
                                                      #   the file: the defaults
     "data_position": int,                            # optional: training windows the swarm read before start_step
     "dataset": {"manifest": str, "url": str}}        # optional: the prepared corpus (its manifest's sha256) and
                                                      #   where its files are served (optional)

`from_wire` checks every invariant a peer relies on, so a plan that parses is a plan a peer can run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field as dataclass_field, replace
from typing import Any, Mapping

from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.modelspec import DTYPE_BYTES
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.wire import (
    SchemaError,
    field,
    need_int,
    need_list,
    need_mapping,
    need_number,
    need_str,
    no_extra_fields,
)

PLAN_VERSION = 1
SYNC_MODES = ("allreduce", "gossip", "outer", "none")
SYNC_CHOICES = ("auto", "allreduce", "gossip", "outer")  # what a planner may be asked for: auto chooses per group
# An outer-step group's parameter change travels in fp16: OpenDiLoCo (Jaghouar et al. 2024) found fp16 pseudo-
# gradients train as well as fp32 ones, and fp16 keeps the small changes bf16's 8-bit mantissa would round away.
OUTER_CODEC = "fp16"
MAX_OUTER_EVERY = 10_000  # steps between outer steps a plan may ask for
RECOMPUTE_CHOICES = ("auto", "never", "always")  # activation recomputation: auto where a stage fits no other way
COST_MODELS = ("dtfm", "time")
MAX_STANDBY_REASONS = 16  # distinct reasons a plan states; each covers many devices
MAX_REASON_CHARS = 200
MAX_URL_CHARS = 2048


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int
    layer_start: int
    layer_end: int  # exclusive
    devices: tuple[str, ...]  # one per lane, in lane order
    sync: str
    recompute: int = 0  # its first this many layers keep only their input and recompute activations in backward
    # the hop from this stage to the next, per lane: the codec of activations (forward) and of their gradients
    # coming back (backward); () where every lane sends raw (and on the last stage, which has no next)
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    # sync "outer": every this many steps the group averages its parameter change and takes an outer step,
    # the exchange overlapping the next `outer_delay` steps (0: before the next step)
    outer_every: int = 0
    outer_delay: int = 0

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def sync_words(self) -> str:
        """The group's sync mode, with H for outer steps ("outer H=50")."""
        if self.sync != "outer":
            return self.sync
        return f"outer H={self.outer_every}" + (f" D={self.outer_delay}" if self.outer_delay else "")

    def codecs(self, lane: int) -> tuple[str, str]:
        """(forward, backward): how lane `lane` crosses the hop from this stage to the next."""
        return (self.forward[lane] if self.forward else "raw", self.backward[lane] if self.backward else "raw")

    @property
    def hop_codecs(self) -> str:
        """The codecs of this stage's hop to the next in words, FORWARD/BACKWARD per kind of lane ("" when raw)."""
        if not self.forward and not self.backward:
            return ""
        return ", ".join(sorted({"/".join(self.codecs(lane)) for lane in range(len(self.devices))}))


@dataclass(frozen=True, slots=True)
class Dataset:
    """A prepared corpus as a plan names it: the sha256 of its manifest.json, and the URL its folder is served
    at (empty: peers find it in their own --data folder)."""

    manifest: str
    url: str = ""

    def __post_init__(self) -> None:
        if len(self.manifest) != 64 or any(c not in "0123456789abcdef" for c in self.manifest):
            raise SchemaError("plan.dataset.manifest", f"must be a sha256 in 64 lowercase hex digits, got {self.manifest!r}")
        if self.url and (not self.url.startswith(("http://", "https://")) or len(self.url) > MAX_URL_CHARS
                         or any(c.isspace() for c in self.url)):
            raise SchemaError("plan.dataset.url", f"must be an http(s) URL of at most {MAX_URL_CHARS} characters, got {self.url[:100]!r}")

    def to_wire(self) -> dict[str, str]:
        return {"manifest": self.manifest, **({"url": self.url} if self.url else {})}

    @staticmethod
    def from_wire(raw: Any) -> "Dataset":
        record = need_mapping(raw, "plan.dataset")
        no_extra_fields(record, {"manifest", "url"}, "plan.dataset")
        url = need_str(record["url"], "plan.dataset.url") if "url" in record else ""
        return Dataset(need_str(field(record, "manifest", "plan.dataset"), "plan.dataset.manifest"), url)


@dataclass(frozen=True, slots=True)
class Plan:
    cost_model: str
    model: str
    layers: int
    batch: int
    micro_batch: int
    micro_batches: int  # per lane per step: the most any lane runs, where lanes take unlike shares
    dtype: str
    stages: tuple[StagePlan, ...]
    standby: tuple[str, ...] = ()
    cost: Mapping[str, float] = dataclass_field(default_factory=dict)
    # how many of its steps make one all-reduce step's progress (>= 1, the planner's `quality.py`): time to a loss is
    # total_s x this
    steps_factor: float = 1.0
    epoch: int = 0
    start_step: int = 0
    estimated_links: tuple[tuple[str, str], ...] = ()  # links it uses (`links`) the planner had no measurement of
    # per relay it routes pairs through (peers behind NAT that talk through a public peer): (the relay, the pairs,
    # the bytes it carries a step, both ways), as the planner predicted them (`coordinator/planner/relays.py`)
    relay_load: tuple[tuple[str, int, float], ...] = ()
    # Why the standby devices were left out, in runs over `standby`: its first n1 devices for reason 1, the next
    # n2 for reason 2... (device ids are most of a plan's bytes at 10,000 peers: none is written twice).
    standby_reasons: tuple[tuple[str, int], ...] = ()
    seq_len: int = 0  # tokens per training sequence it was made for (0: not stated, the model's own)
    recipe: Recipe = Recipe()  # the organizer's training recipe: every peer of the plan trains by it
    # the position in the swarm's window order (peer/data/order.py) at start_step: windows read before it
    data_position: int = 0
    dataset: Dataset | None = None  # the prepared corpus every first stage reads; None: each peer's own data
    # Sequences each lane takes a step, in lane order, summing to `batch`: faster lanes take more, so that lanes of
    # unlike speed finish together. Empty: every lane takes ceil(batch / lanes).
    lane_batches: tuple[int, ...] = ()
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        _check(self)

    @property
    def eval_every(self) -> int:
        """Every lane measures the validation loss at the steps divisible by this (0: never)."""
        return self.recipe.eval_every

    @property
    def eval_batch(self) -> int:
        """Held-out sequences each lane measures it on."""
        return self.recipe.eval_batch

    @property
    def outer_after(self) -> int:
        """Groups with outer steps take them only from this swarm step on; before it they all-reduce every step (a
        warm start: training apart from a fresh model costs far more than from a trained one: docs/gossip.md)."""
        return self.recipe.outer_after

    @property
    def reasons(self) -> dict[str, tuple[str, ...]]:
        """The standby devices by the reason they were left out; empty when the plan states none."""
        grouped, at = {}, 0
        for reason, count in self.standby_reasons:
            grouped[reason] = self.standby[at : at + count]
            at += count
        return grouped

    def checked(self, stage: int) -> str:
        """How the work stage `stage` hands its lane is checked (peer/pipeline/checks.py, docs/trust.md): "checked" (a
        majority of its other group members can convict), "pair" (a failed check is a dispute: the coordinator parts the pair
        and their next partners decide, `coordinator/gate.py`), "unchecked" (its only holder's work is believed, its
        gossip group's members never hold one set of weights, or the recipe turned checks off), or "" (one
        stage: nothing is handed along a lane)."""
        if len(self.stages) == 1:
            return ""
        holders, gossip = len(self.stages[stage].devices), self.stages[stage].sync == "gossip"
        return "unchecked" if holders == 1 or gossip or not self.recipe.check else "pair" if holders == 2 else "checked"

    @property
    def check_links(self) -> tuple[tuple[str, str], ...]:
        """The pairs (sorted) stage checks send over beyond `links`: a checker, holding a checked stage in one lane, and
        the checked peer's lane neighbours in every other lane, which copy it inputs and sketches."""
        pairs = set()
        for s, stage in enumerate(self.stages):
            if self.checked(s) not in ("checked", "pair"):
                continue
            for lane in self.lanes:
                for checker in stage.devices:
                    pairs.update(tuple(sorted((checker, lane[t]))) for t in (s - 1, s + 1)
                                 if 0 <= t < len(lane) and checker != lane[s])
        return tuple(sorted(pairs - set(self.links)))

    def check_lines(self, first: int = 0) -> list[str]:
        """The stages whose work is not fully checked, in words, a line each (none when all are); stages numbered from
        `first`."""
        if len(self.stages) > 1 and not self.recipe.check:
            return ["no stage's work is checked: the recipe's check is 0"]
        words = {"unchecked": "unchecked: its one holder's work is believed",
                 "pair": "checked in a pair: a failed check is a dispute, which the next plan's partners decide"}
        gossip = "unchecked: its gossip group's members hold weights too far apart to judge each other's work"
        return [f"stage {s + first}: {gossip if self.stages[s].sync == 'gossip' and len(self.stages[s].devices) > 1 else words[self.checked(s)]}"
                for s in range(len(self.stages)) if self.checked(s) in words]

    def standby_lines(self, names_shown: int = 8) -> list[str]:
        """The standby devices in words, one line per reason (devices named while few): what organizers read,
        short at 10,000 peers."""
        groups = self.reasons or ({"without a stated reason": self.standby} if self.standby else {})
        return [f"{len(ids)} {reason}" + (f" ({' '.join(ids)})" if len(ids) <= names_shown else "")
                for reason, ids in groups.items()]

    @property
    def links(self) -> set[tuple[str, str]]:
        """The device pairs (each sorted) that the plan's traffic crosses: consecutive stages of a lane; in a group
        that averages exactly (all-reduce, outer steps) every pair, which its butterfly uses; in a gossip group the
        pairs of the one-peer exponential graph (lane l with lane l + 2^r). O(stages x lanes x log lanes) with
        gossip, O(stages x lanes^2) with exact averaging, which groups of a few dozen lanes can list."""
        pairs = {tuple(sorted(hop)) for lane in self.lanes for hop in zip(lane, lane[1:])}
        m = self.group_size
        for stage in self.stages:
            if stage.sync in ("allreduce", "outer"):
                pairs |= {tuple(sorted((a, b))) for k, a in enumerate(stage.devices) for b in stage.devices[k + 1:]}
                continue
            shift = 1
            while shift < m:
                pairs |= {tuple(sorted((stage.devices[l], stage.devices[(l + shift) % m]))) for l in range(m)}
                shift *= 2
        return pairs

    @property
    def lanes(self) -> tuple[tuple[str, ...], ...]:
        return tuple(zip(*(stage.devices for stage in self.stages)))

    @property
    def group_size(self) -> int:
        return len(self.stages[0].devices)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for stage in self.stages for d in stage.devices)

    def lane_sequences(self, lane: int) -> int:
        """Sequences lane `lane` processes a step: its share of `lane_batches`, else the batch split over the lanes,
        rounded up."""
        return self.lane_batches[lane] if self.lane_batches else -(-self.batch // self.group_size)

    def lane_offset(self, lane: int) -> int:
        """Sequences the lanes before `lane` process a step: where its slice of a step's windows starts."""
        return sum(self.lane_batches[:lane]) if self.lane_batches else lane * self.lane_sequences(0)

    @property
    def rows_per_step(self) -> int:
        """Training windows the swarm reads a step: every lane's sequences."""
        return self.lane_offset(self.group_size)

    def data_position_at(self, step: int) -> int:
        """The swarm's data position at `step` (>= start_step) of this plan: windows read before that step."""
        if step < self.start_step:
            raise ValueError(f"step {step} is before plan epoch {self.epoch}'s start step {self.start_step}")
        return self.data_position + (step - self.start_step) * self.rows_per_step

    def micro_batch_sizes(self, lane: int) -> tuple[int, ...]:
        """Sequences in each of lane `lane`'s micro-batches; the last one takes what is left."""
        full, rest = divmod(self.lane_sequences(lane), self.micro_batch)
        return (self.micro_batch,) * full + ((rest,) if rest else ())

    def position(self, device: str) -> tuple[int, int]:
        """(stage, lane) of a device in the plan; KeyError for a device on standby or not in the plan."""
        for stage in self.stages:
            if device in stage.devices:
                return stage.index, stage.devices.index(device)
        raise KeyError(f"device {device!r} holds no stage in plan epoch {self.epoch}")

    def neighbours(self, device: str) -> list[str]:
        """Whom `device` exchanges frames with: its lane neighbours, then its group's other members (a device
        that holds no stage has none)."""
        if device not in self.devices:
            return []
        stage, lane = self.position(device)
        chain = self.lanes[lane]
        near = [chain[s] for s in (stage - 1, stage + 1) if 0 <= s < len(chain)]
        return near + [d for d in self.stages[stage].devices if d != device]

    @property
    def eval_sizes(self) -> tuple[int, ...]:
        """Sequences in each of a lane's validation micro-batches (micro-batch numbers after the training ones)."""
        full, rest = divmod(self.eval_batch, self.micro_batch)
        return (self.micro_batch,) * full + ((rest,) if rest else ())

    def evaluates(self, step: int) -> bool:
        return self.eval_every > 0 and step % self.eval_every == 0

    def with_codecs(self, forward: str, backward: str) -> "Plan":
        """This plan with every lane's hops carrying activations in `forward` and their gradients in `backward`."""
        lanes, last = len(self.stages[0].devices), len(self.stages) - 1
        hop = {"forward": () if forward == "raw" else (forward,) * lanes,
               "backward": () if backward == "raw" else (backward,) * lanes}
        return replace(self, stages=tuple(
            replace(stage, **(hop if s < last else {"forward": (), "backward": ()})) for s, stage in enumerate(self.stages)
        ))

    @property
    def total_s(self) -> float:
        return self.cost.get("total_s", math.nan)

    @property
    def to_loss_s(self) -> float:
        """Seconds this plan takes to make an all-reduce step's progress: its step times its steps factor."""
        return self.total_s * self.steps_factor

    @property
    def predicted(self) -> str:
        """The predicted step time in words (a plan rebuilt from checkpoints has none), with the fixed overhead it
        counts where it counts one (efficiency terms, or what a coordinator learned: `coordinator/calibration.py`)."""
        if not math.isfinite(self.total_s):
            return "no prediction"
        overhead = self.cost.get("overhead_s")
        return f"{self.total_s:.3f} s/step" + (f", {overhead * 1e3:+.0f} ms overhead included" if overhead else "")

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "epoch": self.epoch,
            "start_step": self.start_step,
            "cost_model": self.cost_model,
            "model": self.model,
            "layers": self.layers,
            "batch": self.batch,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "dtype": self.dtype,
            **({"lane_batches": list(self.lane_batches)} if self.lane_batches else {}),
            **({"seq_len": self.seq_len} if self.seq_len else {}),
            "stages": [
                {
                    "index": s.index,
                    "layer_start": s.layer_start,
                    "layer_end": s.layer_end,
                    "devices": list(s.devices),
                    "sync": s.sync,
                    **({"outer_every": s.outer_every} if s.outer_every else {}),
                    **({"outer_delay": s.outer_delay} if s.outer_delay else {}),
                    **({"recompute": s.recompute} if s.recompute else {}),
                    **({"forward": list(s.forward)} if s.forward else {}),
                    **({"backward": list(s.backward)} if s.backward else {}),
                }
                for s in self.stages
            ],
            "lanes": [list(lane) for lane in self.lanes],
            "standby": list(self.standby),
            "cost": dict(self.cost),
            **({"steps_factor": self.steps_factor} if self.steps_factor != 1.0 else {}),
            **({"estimated_links": [list(pair) for pair in self.estimated_links]} if self.estimated_links else {}),
            **({"relay_load": [list(load) for load in self.relay_load]} if self.relay_load else {}),
            **({"standby_reasons": [[r, n] for r, n in self.standby_reasons]} if self.standby_reasons else {}),
            "recipe": self.recipe.to_wire(),
            **({"data_position": self.data_position} if self.data_position else {}),
            **({"dataset": self.dataset.to_wire()} if self.dataset is not None else {}),
        }

    @staticmethod
    def from_wire(raw: Any) -> "Plan":
        root = need_mapping(raw, "plan")
        no_extra_fields(
            root,
            {"version", "epoch", "start_step", "cost_model", "model", "layers", "batch", "micro_batch",
             "micro_batches", "dtype", "stages", "lanes", "standby", "cost", "steps_factor", "estimated_links", "relay_load", "standby_reasons",
             "seq_len", "recipe", "data_position", "dataset", "lane_batches"},
            "plan",
        )
        version = need_int(field(root, "version", "plan"), "plan.version")
        if version != PLAN_VERSION:
            raise SchemaError("plan.version", f"unsupported plan version {version} (this peer reads {PLAN_VERSION})")
        stages = []
        for i, entry in enumerate(need_list(field(root, "stages", "plan"), "plan.stages")):
            path = f"plan.stages[{i}]"
            record = need_mapping(entry, path)
            no_extra_fields(record, {"index", "layer_start", "layer_end", "devices", "sync", "outer_every", "outer_delay", "recompute",
                                     "forward", "backward"}, path)
            stages.append(
                StagePlan(
                    index=need_int(field(record, "index", path), f"{path}.index"),
                    layer_start=need_int(field(record, "layer_start", path), f"{path}.layer_start", minimum=0),
                    layer_end=need_int(field(record, "layer_end", path), f"{path}.layer_end", minimum=1),
                    devices=tuple(
                        need_str(d, f"{path}.devices[{j}]")
                        for j, d in enumerate(need_list(field(record, "devices", path), f"{path}.devices"))
                    ),
                    sync=need_str(field(record, "sync", path), f"{path}.sync"),
                    outer_every=need_int(record.get("outer_every", 0), f"{path}.outer_every", minimum=0),
                    outer_delay=need_int(record.get("outer_delay", 0), f"{path}.outer_delay", minimum=0),
                    recompute=need_int(record.get("recompute", 0), f"{path}.recompute", minimum=0),
                    forward=_strings(record.get("forward", []), f"{path}.forward"),
                    backward=_strings(record.get("backward", []), f"{path}.backward"),
                )
            )
        cost: dict[str, float] = {}
        for key, value in need_mapping(field(root, "cost", "plan"), "plan.cost").items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SchemaError(f"plan.cost.{key}", f"must be a number, got {value!r}")
            try:
                cost[key] = float(value)
            except OverflowError:  # an integer past a float's range
                raise SchemaError(
                    f"plan.cost.{key}", f"must be a finite number of seconds, got an integer of {value.bit_length()} bits"
                ) from None
        plan = Plan(
            cost_model=need_str(field(root, "cost_model", "plan"), "plan.cost_model"),
            model=need_str(field(root, "model", "plan"), "plan.model"),
            layers=need_int(field(root, "layers", "plan"), "plan.layers", minimum=1),
            batch=need_int(field(root, "batch", "plan"), "plan.batch", minimum=1),
            micro_batch=need_int(field(root, "micro_batch", "plan"), "plan.micro_batch", minimum=1),
            micro_batches=need_int(field(root, "micro_batches", "plan"), "plan.micro_batches", minimum=1),
            dtype=need_str(field(root, "dtype", "plan"), "plan.dtype"),
            lane_batches=tuple(need_int(b, f"plan.lane_batches[{j}]", minimum=1)
                               for j, b in enumerate(need_list(root.get("lane_batches", []), "plan.lane_batches"))),
            stages=tuple(stages),
            standby=tuple(
                need_str(d, f"plan.standby[{j}]")
                for j, d in enumerate(need_list(root.get("standby", []), "plan.standby"))
            ),
            cost=cost,
            steps_factor=need_number(root.get("steps_factor", 1.0), "plan.steps_factor"),
            epoch=need_int(field(root, "epoch", "plan"), "plan.epoch", minimum=0),
            start_step=need_int(field(root, "start_step", "plan"), "plan.start_step", minimum=0),
            estimated_links=_pairs(root.get("estimated_links", []), "plan.estimated_links"),
            relay_load=_relay_load(root.get("relay_load", [])),
            standby_reasons=_reasons(root.get("standby_reasons", [])),
            seq_len=need_int(root.get("seq_len", 0), "plan.seq_len", minimum=0),
            recipe=Recipe.from_wire(root["recipe"], "plan.recipe") if "recipe" in root else Recipe(),
            data_position=need_int(root.get("data_position", 0), "plan.data_position", minimum=0),
            dataset=Dataset.from_wire(root["dataset"]) if "dataset" in root else None,
            version=version,
        )
        if "lanes" in root:
            lanes = [tuple(need_list(lane, f"plan.lanes[{i}]")) for i, lane in enumerate(need_list(root["lanes"], "plan.lanes"))]
            if tuple(lanes) != plan.lanes:
                raise SchemaError("plan.lanes", "do not match the stages' device lists (lanes[l][s] must be stages[s].devices[l])")
        return plan


def _strings(raw: Any, path: str) -> tuple[str, ...]:
    return tuple(need_str(item, f"{path}[{j}]") for j, item in enumerate(need_list(raw, path)))


def _pairs(raw: Any, path: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for i, entry in enumerate(need_list(raw, path)):
        pair = need_list(entry, f"{path}[{i}]")
        if len(pair) != 2:
            raise SchemaError(f"{path}[{i}]", f"must be a pair of device ids, got {len(pair)} items")
        pairs.append((need_str(pair[0], f"{path}[{i}][0]"), need_str(pair[1], f"{path}[{i}][1]")))
    return tuple(pairs)


def _relay_load(raw: Any) -> tuple[tuple[str, int, float], ...]:
    loads = []
    for i, entry in enumerate(need_list(raw, "plan.relay_load")):
        where = f"plan.relay_load[{i}]"
        load = need_list(entry, where)
        if len(load) != 3:
            raise SchemaError(where, f"must be [relay device id, pairs, bytes a step], got {len(load)} items")
        carried = need_number(load[2], f"{where}[2]")
        if not (math.isfinite(carried) and carried >= 0):
            raise SchemaError(f"{where}[2]", f"must be a finite number of bytes >= 0, got {carried!r}")
        loads.append((need_str(load[0], f"{where}[0]"), need_int(load[1], f"{where}[1]", minimum=1), float(carried)))
    return tuple(loads)


def _reasons(raw: Any) -> tuple[tuple[str, int], ...]:
    runs = []
    for i, entry in enumerate(need_list(raw, "plan.standby_reasons")):
        run = need_list(entry, f"plan.standby_reasons[{i}]")
        if len(run) != 2:
            raise SchemaError(f"plan.standby_reasons[{i}]", f"must be a [reason, count] pair, got {len(run)} items")
        runs.append((need_str(run[0], f"plan.standby_reasons[{i}][0]"), need_int(run[1], f"plan.standby_reasons[{i}][1]", minimum=1)))
    return tuple(runs)


def standby_runs(groups: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(standby, standby_reasons) for a plan from standby devices grouped by reason (groups left empty are
    dropped)."""
    standby = tuple(d for devices in groups.values() for d in devices)
    return standby, tuple((reason, len(devices)) for reason, devices in groups.items() if len(devices))


def _check(plan: Plan) -> None:
    """Raise SchemaError unless the plan is runnable: contiguous layers, equal groups, no device twice."""
    if plan.cost_model not in COST_MODELS:
        raise SchemaError("plan.cost_model", f"must be one of {', '.join(COST_MODELS)}, got {plan.cost_model!r}")
    if plan.data_position < 0:
        raise SchemaError("plan.data_position", f"must be a count of windows >= 0, got {plan.data_position}")
    if plan.dtype not in DTYPE_BYTES:
        raise SchemaError("plan.dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {plan.dtype!r}")
    if plan.micro_batch > plan.batch:
        raise SchemaError("plan.micro_batch", f"{plan.micro_batch} is larger than the batch {plan.batch}")
    if not plan.stages:
        raise SchemaError("plan.stages", "must hold at least one stage")
    expected_start = 0
    lanes = len(plan.stages[0].devices)
    seen: set[str] = set()
    for s, stage in enumerate(plan.stages):
        path = f"plan.stages[{s}]"
        if stage.index != s:
            raise SchemaError(f"{path}.index", f"must be {s}, got {stage.index}")
        if stage.layer_start != expected_start or stage.layer_end <= stage.layer_start:
            raise SchemaError(
                path, f"layers [{stage.layer_start}, {stage.layer_end}) do not continue from layer {expected_start}"
            )
        expected_start = stage.layer_end
        if not stage.devices or len(stage.devices) != lanes:
            raise SchemaError(f"{path}.devices", f"must list one device per lane ({lanes}), got {len(stage.devices)}")
        if stage.sync not in SYNC_MODES:
            raise SchemaError(f"{path}.sync", f"must be one of {', '.join(SYNC_MODES)}, got {stage.sync!r}")
        if (stage.sync == "outer") != (stage.outer_every > 0) or not 0 <= stage.outer_every <= MAX_OUTER_EVERY:
            raise SchemaError(f"{path}.outer_every", f"must be 1 to {MAX_OUTER_EVERY} steps with sync outer and absent "
                                                     f"otherwise, got {stage.outer_every} with sync {stage.sync}")
        if not 0 <= stage.outer_delay < max(stage.outer_every, 1):
            raise SchemaError(f"{path}.outer_delay", f"must be 0 to outer_every - 1 ({stage.outer_every - 1}) steps, got "
                                                     f"{stage.outer_delay}")
        if not 0 <= stage.recompute <= stage.layers:
            raise SchemaError(f"{path}.recompute", f"must be 0 to the stage's {stage.layers} layers, got {stage.recompute}")
        _check_codecs(stage, path, last=s == len(plan.stages) - 1)
        for device in stage.devices:
            if device in seen:
                raise SchemaError(f"{path}.devices", f"device {device!r} appears more than once in the plan")
            seen.add(device)
    if plan.lane_batches:
        if len(plan.lane_batches) != lanes or sum(plan.lane_batches) != plan.batch or min(plan.lane_batches) < 1:
            raise SchemaError("plan.lane_batches", f"must give each of the {lanes} lanes at least one sequence, "
                              f"{plan.batch} (the batch) in all, got {list(plan.lane_batches)}")
    lane_batch = max(plan.lane_sequences(lane) for lane in range(lanes))
    if plan.micro_batch > lane_batch or plan.micro_batches != -(-lane_batch // plan.micro_batch):
        raise SchemaError(
            "plan.micro_batches",
            f"{plan.micro_batches} micro-batches of {plan.micro_batch} do not cover the largest lane's {lane_batch} "
            f"sequences (batch {plan.batch} over {lanes} lanes) exactly once",
        )
    if expected_start != plan.layers:
        raise SchemaError("plan.stages", f"cover layers [0, {expected_start}) but the model has {plan.layers}")
    for device in plan.standby:
        if device in seen:
            raise SchemaError("plan.standby", f"device {device!r} appears more than once in the plan")
        seen.add(device)
    _check_reasons(plan)
    if not (math.isfinite(plan.steps_factor) and plan.steps_factor >= 1):
        raise SchemaError("plan.steps_factor", f"must be a finite number >= 1, got {plan.steps_factor!r}")
    for key, value in plan.cost.items():
        if not math.isfinite(value):
            raise SchemaError(f"plan.cost.{key}", f"must be a finite number of seconds, got {value!r}")
        if key == "overhead_s":  # a coordinator that learned its model over-predicts takes time off, never half the step
            if value < -plan.cost.get("total_s", 0.0):
                raise SchemaError("plan.cost.overhead_s", f"takes {-value!r} s off a step predicted at "
                                  f"{plan.cost.get('total_s', 0.0)!r} s: more than half of it before the overhead")
        elif value < 0:
            raise SchemaError(f"plan.cost.{key}", f"must be a finite, non-negative number of seconds, got {value!r}")


def _check_codecs(stage: StagePlan, path: str, last: bool) -> None:
    for direction, codecs in (("forward", stage.forward), ("backward", stage.backward)):
        if not codecs:
            continue
        if last:
            raise SchemaError(f"{path}.{direction}", "names codecs, but the last stage sends to no next stage")
        if len(codecs) != len(stage.devices):
            raise SchemaError(f"{path}.{direction}", f"must name one codec per lane ({len(stage.devices)}), got {len(codecs)}")
        for lane, codec in enumerate(codecs):
            if codec not in CODECS:
                raise SchemaError(f"{path}.{direction}[{lane}]", f"codec {codec!r} is not one this peer knows "
                                  f"({', '.join(CODECS)}): a newer hetpeer made this plan")


def _check_reasons(plan: Plan) -> None:
    path = "plan.standby_reasons"
    runs = plan.standby_reasons
    if len(runs) > MAX_STANDBY_REASONS:
        raise SchemaError(path, f"states {len(runs)} reasons, at most {MAX_STANDBY_REASONS}")
    for reason, count in runs:
        if not 0 < len(reason) <= MAX_REASON_CHARS or not reason.isprintable():
            raise SchemaError(path, f"a reason must be 1 to {MAX_REASON_CHARS} printable characters, got {reason[:40]!r}")
        if count < 1:
            raise SchemaError(path, f"the reason {reason[:40]!r} covers {count} devices; a run covers at least one")
    if len({reason for reason, _ in runs}) < len(runs):
        raise SchemaError(path, "states a reason twice: each reason is one run of the standby list")
    if runs and sum(count for _, count in runs) != len(plan.standby):
        raise SchemaError(path, f"cover {sum(count for _, count in runs)} devices but {len(plan.standby)} are on standby")
