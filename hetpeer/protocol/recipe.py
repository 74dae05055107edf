"""The organizer's training recipe: how every peer of a swarm optimizes, schedules its learning rate and
averages within its group. It travels in every plan (signed with it), so that the members of a group
never train by different rules; a volunteer's own options say only how its machine takes part.

Its wire form is one flat object (every field written; a reader takes defaults for fields left out):

    {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0,
     "warmup_steps": 0, "decay_steps": 0, "min_lr_ratio": 0.1,
     "topology": "one-peer-exp", "accumulate": 1, "second_moment": "lane", "mix_deadline_s": 10.0, "sync_codec": "raw",
     "outer_lr": 0.7, "outer_momentum": 0.9, "outer_after": 100, "robust": 2.0,
     "check": 0.02, "seed": 0, "eval_every": 0, "eval_batch": 8}

A field this peer does not know is an error naming it (`SchemaError`): a peer older than the recipe it is
given refuses the plan instead of training by rules it does not follow. Organizers write the same object
as a JSON or TOML file (`load`); `hetpeer coordinator --print-recipe` prints the defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hetpeer.protocol.frame import CODECS
from hetpeer.protocol.wire import SchemaError, need_int, need_list, need_mapping, need_number, need_str, no_extra_fields

TOPOLOGIES = ("one-peer-exp", "alternating-exp-ring", "ring", "complete")  # who mixes with whom (peer/gossip/topology.py)
# how a gossip peer estimates Adam's second moment: its lane's gradients, scaled to the group's mean, or from the
# mean of its last n gradients (peer/gossip/adam.py)
SECOND_MOMENTS = ("lane", "group", "window")
OUTER_AFTER = 100  # steps of every-step all-reduce before outer steps begin: a warm start (docs/gossip.md measures why)
# on by default: what it costs an honest group is measured in docs/trust.md, and a defence an organizer must know to
# turn on is none
ROBUST = 2.0
CHECK = 0.02
MAX_STEPS = 10**9  # any step count a recipe names


@dataclass(frozen=True, slots=True)
class Recipe:
    # AdamW (decentralized Adam in gossip groups)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # on weight matrices only
    clip_norm: float = 1.0  # each stage's gradient is scaled to at most this L2 norm before the step (0: never)
    # the learning rate over the swarm's steps: linear warmup, then a cosine to min_lr_ratio x lr at decay_steps
    warmup_steps: int = 0
    decay_steps: int = 0  # 0: no decay
    min_lr_ratio: float = 0.1
    # within a group
    topology: str = "one-peer-exp"  # gossip's mixing topology
    accumulate: int = 1  # AccumAdam's window A (1: Adam)
    second_moment: str = "lane"  # a gossip peer's Adam second moment (`SECOND_MOMENTS`)
    mix_deadline_s: float = 10.0  # how long a gossip peer waits for a neighbour's parameters before leaving it out
    sync_codec: str = "raw"  # how parameters travel in gossip
    outer_lr: float = 0.7  # DiLoCo's outer Nesterov step, for groups the plan gives outer steps
    outer_momentum: float = 0.9
    outer_after: int = OUTER_AFTER  # groups with outer steps all-reduce every step before this swarm step
    # robust averaging in every sync mode (0: off): gossip clips a neighbour's difference at this x the typical
    # distance; all-reduce and outer steps take each part's CenteredClip at this x the median distance
    robust: float = ROBUST
    # stage checks (0: off): the share of each lane's micro-batches a member of the stage's group recomputes, at random
    # steps its lane neighbours do not learn of (peer/pipeline/checks.py); about the share of a peer's compute it costs
    check: float = CHECK
    # the run
    seed: int = 0  # the initial weights and the data order
    eval_every: int = 0  # every lane measures its validation loss at the steps divisible by this (0: never)
    eval_batch: int = 8  # held-out sequences per lane for it

    def __post_init__(self) -> None:
        def bad(name: str, wanted: str) -> SchemaError:
            return SchemaError(f"recipe.{name}", f"must be {wanted}, got {getattr(self, name)!r}")

        for name in ("lr", "eps", "mix_deadline_s", "outer_lr"):
            if not _finite(getattr(self, name)) or not getattr(self, name) > 0:
                raise bad(name, "a positive number")
        for name in ("weight_decay", "clip_norm", "robust"):
            if not _finite(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "a number >= 0")
        if len(self.betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in self.betas):
            raise bad("betas", "two numbers in [0, 1)")
        for name in ("min_lr_ratio", "check"):
            if not _finite(getattr(self, name)) or not 0 <= getattr(self, name) <= 1:
                raise bad(name, "in [0, 1]")
        if not _finite(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise bad("outer_momentum", "in [0, 1)")
        for name, least in (("warmup_steps", 0), ("decay_steps", 0), ("accumulate", 1), ("outer_after", 0), ("seed", 0),
                            ("eval_every", 0), ("eval_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_STEPS:
                raise bad(name, f"a whole number from {least} to {MAX_STEPS}")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise bad("decay_steps", f"0 (no decay) or a step past the warmup ({self.warmup_steps})")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"one of {', '.join(TOPOLOGIES)}")
        if self.second_moment not in SECOND_MOMENTS:
            raise bad("second_moment", f"one of {', '.join(SECOND_MOMENTS)}")
        if self.accumulate > 1 and self.second_moment != "lane":
            raise bad("second_moment", f"lane under AccumAdam (accumulate {self.accumulate}), which keeps its own")
        if self.sync_codec not in CODECS:
            raise bad("sync_codec", f"one of {', '.join(CODECS)}")

    def to_wire(self) -> dict[str, Any]:
        return {f.name: list(getattr(self, f.name)) if f.name == "betas" else getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_wire(raw: Any, path: str = "recipe", base: "Recipe | None" = None) -> "Recipe":
        """The recipe `raw` describes; fields it leaves out are `base`'s (the defaults when None)."""
        record = need_mapping(raw, path)
        no_extra_fields(record, set(FIELDS), path)
        given = {name: _read(name, value, f"{path}.{name}") for name, value in record.items()}
        try:
            return replace(base or Recipe(), **given)
        except SchemaError as error:  # the same check, named where this document put it
            raise SchemaError(path + error.path.removeprefix("recipe"), str(error).split(": ", 1)[1]) from None

    def with_setting(self, text: str) -> "Recipe":
        """This recipe with one field set from `NAME=VALUE` text (the command line's `--set`): numbers, words,
        and betas as `B1,B2`."""
        name, sep, value = text.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in FIELDS:
            raise SchemaError(f"recipe.{name or text}", f"--set takes NAME=VALUE with NAME one of {', '.join(FIELDS)}")
        value = value.strip()
        kind = FIELDS[name]
        try:
            parsed: Any = (
                [float(v) for v in value.split(",")] if name == "betas"
                else int(value) if kind is int else float(value) if kind is float else value
            )
        except ValueError:
            raise SchemaError(f"recipe.{name}", f"must be {'two numbers B1,B2' if name == 'betas' else kind.__name__}, "
                                                f"got {value!r}") from None
        return Recipe.from_wire({name: parsed}, base=self)

    def changes(self, other: "Recipe") -> list[str]:
        """What `other` sets differently from this recipe, one 'name old -> new' a field."""
        return [f"{name} {_text(getattr(self, name))} -> {_text(getattr(other, name))}"
                for name in FIELDS if getattr(self, name) != getattr(other, name)]

    @property
    def words(self) -> str:
        """The recipe in one line: what `hetpeer status` and the plan's description show."""
        schedule = (f", warmup {self.warmup_steps}" if self.warmup_steps else "") + (
            f", cosine to {self.min_lr_ratio:g}x at {self.decay_steps}" if self.decay_steps else "")
        sync = f"{self.topology}" + (f" A={self.accumulate}" if self.accumulate > 1 else "") + (
            f" v={self.second_moment}" if self.second_moment != "lane" else "") + (
            f" {self.sync_codec}" if self.sync_codec != "raw" else "")
        clip = f"clip {self.clip_norm:g}" if self.clip_norm else "no clipping"
        robust = f"robust {self.robust:g}" if self.robust else "not robust"
        check = f"checks {self.check:.0%}" if self.check else "no checks"
        return (f"lr {self.lr:g}{schedule}, betas {self.betas[0]:g}/{self.betas[1]:g}, wd {self.weight_decay:g}, {clip}; "
                f"gossip {sync}, {robust}, {check}, seed {self.seed}")

    def to_text(self) -> str:
        """The recipe as the JSON file `load` reads back, a field a line."""
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in self.to_wire().items()) + "\n}"


# each field's kind as its annotation names it (betas: a pair of floats)
FIELDS: dict[str, type] = {f.name: {"int": int, "str": str}.get(f.type, float) for f in fields(Recipe)}


def load(path: Path, base: Recipe | None = None) -> Recipe:
    """The recipe in a JSON or TOML file (TOML by its .toml suffix); fields it leaves out are `base`'s."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise SchemaError(str(path), f"cannot read the recipe file: {error.strerror or error}") from None
    if Path(path).suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise SchemaError(str(path), "a TOML recipe needs Python 3.11 or newer: write it as JSON") from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise SchemaError(str(path), f"is not TOML: {error}") from None
    else:
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise SchemaError(str(path), f"is not JSON: {error}") from None
    return Recipe.from_wire(raw, f"recipe file {path}", base)


def _read(name: str, value: Any, path: str) -> Any:
    if name == "betas":
        pair = need_list(value, path)
        if len(pair) != 2:
            raise SchemaError(path, f"must be two numbers, got {len(pair)}")
        return tuple(need_number(b, f"{path}[{i}]") for i, b in enumerate(pair))
    kind = FIELDS[name]
    if kind is int:
        return need_int(value, path, minimum=0)
    if kind is str:
        return need_str(value, path)
    return need_number(value, path)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _text(value: Any) -> str:
    return "/".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else str(value)

