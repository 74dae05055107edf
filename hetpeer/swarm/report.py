"""The run report of `hetpeer swarm`: what ran, under which plans, how fast, and how the loss went.

`write_report` puts the report in a folder: report.md for people, report.json for programs (the
`RunReport` itself, `to_json`/`from_json` round trip), report.html (one self-contained file: the
coordinator's dashboard page showing the run, its charts drawn by plotly.js) and, where matplotlib is
installed, loss.png (loss and tokens/s against step, plan switches and events marked). `summarize`
derives each plan's measured figures from the samples; it is pure and O(samples log samples).

Conventions: `Sample.step` is the index (from 0) of the step just completed and `Sample.time_s` the
seconds since the run started when it completed; a plan's `start_step` is the index of its first step.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple, Sequence

import numpy as np

from hetpeer.coordinator.history import SAMPLE_FIELDS, Pace
from hetpeer.coordinator.web import page
from hetpeer.swarm import plots

REPORT_VERSION = 1


@dataclass(frozen=True, slots=True)
class PeerInfo:
    device_id: str
    slowdown: float  # compute is this many times slower than the machine's own GPU or CPU
    bandwidth_cap_mbit: float | None
    tflops: float | None
    device_name: str
    latency_ms: float = 0.0  # one-way, emulated: frames it sends are held back this long


class StageUse(NamedTuple):
    layer_start: int
    layer_end: int  # exclusive
    devices: tuple[str, ...]  # one per lane


@dataclass(frozen=True, slots=True)
class PlanUse:
    epoch: int
    start_step: int
    published_s: float  # seconds since the run started
    stages: tuple[StageUse, ...]
    standby: tuple[str, ...] = ()
    predicted_step_s: float | None = None
    measured_step_s: float | None = None  # wall time per step while the plan ran (`Pace`)
    tokens_per_s: float | None = None
    steps: int = 0  # steps run under this plan

    def __post_init__(self) -> None:
        stages = tuple(StageUse(int(a), int(b), tuple(devices)) for a, b, devices in self.stages)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "standby", tuple(self.standby))

    @property
    def ratio(self) -> float | None:
        """Measured over predicted step time; None where either is missing or the prediction is 0."""
        if self.measured_step_s is None or not self.predicted_step_s:
            return None
        return self.measured_step_s / self.predicted_step_s


@dataclass(frozen=True, slots=True)
class Sample:
    time_s: float
    step: int
    loss: float
    tokens_per_s: float | None
    epoch: int
    val_loss: float | None = None  # the mean of the lanes' validation losses at this step, where the plan asked


class LaneStep(NamedTuple):
    """A lane's last stage completing a step, as its peer printed it."""

    time_s: float
    epoch: int
    lane: int
    step: int  # index (from 0) of the step completed
    loss: float
    tokens_per_s: float  # the lane's rate over that step
    val_loss: float | None = None  # its validation loss, on the steps the plan asks for one


# a step line of a lane's last stage (the others print "loss -"): epoch, lane (from 1), step (from 1), loss, tok/s
STEP_RE = re.compile(r"^e(\d+) stage \d+ lane (\d+)\s+step (\d+)\S*\s+loss ([\d.]+)\s+([\d,.]+) tok/s")
VAL_RE = re.compile(r"\)\s+val ([\d.]+)\s*$")  # the validation loss closes a step line


def lane_step(line: str, time_s: float) -> LaneStep | None:
    """A peer's step line (its time stamp taken off) as the LaneStep it reports, or None for any other line."""
    found = STEP_RE.match(line)
    if found is None:
        return None
    epoch, lane, step, loss, rate = found.groups()
    val = VAL_RE.search(line)
    return LaneStep(time_s, int(epoch), int(lane) - 1, int(step) - 1, float(loss), float(rate.replace(",", "")),
                    float(val.group(1)) if val else None)


def samples_from_lanes(points: Sequence[LaneStep]) -> list[Sample]:
    """One sample per step: the mean loss of the lanes that completed it, at the time the first of them
    did, with the swarm's tokens/s the lanes' mean rate at that step times the lanes seen under that plan
    (lanes have equal shares of the batch). O(points log points)."""
    lanes: dict[int, set[int]] = {}
    by_step: dict[int, list[LaneStep]] = {}
    for p in points:
        lanes.setdefault(p.epoch, set()).add(p.lane)
        by_step.setdefault(p.step, []).append(p)
    samples = []
    for step in sorted(by_step):
        done = by_step[step]
        epoch = max(p.epoch for p in done)
        rate = sum(p.tokens_per_s for p in done) / len(done) * len(lanes[epoch])
        vals = [p.val_loss for p in done if p.val_loss is not None]
        samples.append(Sample(min(p.time_s for p in done), step, sum(p.loss for p in done) / len(done), rate, epoch,
                              sum(vals) / len(vals) if vals else None))
    return samples


@dataclass(frozen=True, slots=True)
class PeerCredit:
    """A peer's work as it printed it (its step lines) beside what the coordinator's ledger credits it."""

    device_id: str
    trained_steps: int  # step lines it printed
    trained_sequences: int  # those steps' sequences (its lane's share of each step's batch)
    credited_sequences: int  # confirmed by its neighbours (`coordinator/ledger.py`)
    credited_tokens: int
    credited_flops: float

    @property
    def credited_steps(self) -> float:
        """Its credit in its own steps: the sequences credited over the sequences a step of its trained."""
        return self.credited_sequences * self.trained_steps / self.trained_sequences if self.trained_sequences else 0.0


# a step line of any stage: epoch, stage (from 1), lane (from 1), step (from 1)
ANY_STEP_RE = re.compile(r"^e(\d+) stage (\d+) lane (\d+)\s+step (\d+)")


@dataclass(frozen=True, slots=True)
class Event:
    time_s: float
    text: str  # e.g. "peer p3 killed", "plan epoch 2 published"


@dataclass(frozen=True, slots=True)
class RunReport:
    swarm: str
    model: str
    steps: int
    wall_s: float
    peers: tuple[PeerInfo, ...]
    plans: tuple[PlanUse, ...]
    samples: tuple[Sample, ...]
    events: tuple[Event, ...] = ()
    credit: tuple[PeerCredit, ...] = ()  # each peer's trained and credited work, once the ledger has its last steps

    def __post_init__(self) -> None:
        for name in ("peers", "plans", "samples", "events", "credit"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def tokens_per_s(self) -> float | None:
        """Median of the samples' tokens/s over the whole run."""
        values = [s.tokens_per_s for s in self.samples if _finite(s.tokens_per_s)]
        return median(values) if values else None

    def to_json(self) -> str:
        data = {"version": REPORT_VERSION, **asdict(self)}
        return json.dumps(_nan_to_none(data), indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> RunReport:
        data: dict[str, Any] = json.loads(text)
        version = data.pop("version", None)
        if version != REPORT_VERSION:
            raise ValueError(f"run report: expected version {REPORT_VERSION}, got {version!r}")
        return cls(
            swarm=data["swarm"], model=data["model"], steps=data["steps"], wall_s=data["wall_s"],
            peers=[PeerInfo(**p) for p in data["peers"]],
            plans=[PlanUse(**p) for p in data["plans"]],
            samples=[Sample(**{**s, "loss": math.nan if s["loss"] is None else s["loss"]}) for s in data["samples"]],
            events=[Event(**e) for e in data["events"]],
            credit=[PeerCredit(**c) for c in data.get("credit", [])],
        )  # fmt: skip


def summarize(samples: Sequence[Sample], plans: Sequence[PlanUse]) -> list[PlanUse]:
    """Each plan with measured_step_s, tokens_per_s and steps derived from the samples of its epoch.

    measured_step_s is the plan's `Pace`, as the dashboard measures it: the mean over windows of ten steps
    or more of each window's seconds per step, stalled windows left out.
    steps is the distance to the next plan's start_step, or for the last plan up to its last sample.
    A plan whose epoch has no samples keeps the figures it came with.
    """
    ordered = sorted(plans, key=lambda p: p.start_step)
    out = []
    for i, plan in enumerate(ordered):
        mine = sorted((s for s in samples if s.epoch == plan.epoch), key=lambda s: s.step)
        if not mine:
            out.append(plan)
            continue
        pace = Pace()
        for sample in mine:
            pace = pace.add(sample.time_s, sample.step)
        rates = [s.tokens_per_s for s in mine if _finite(s.tokens_per_s)]
        if i + 1 < len(ordered):
            steps = ordered[i + 1].start_step - plan.start_step
        else:
            steps = mine[-1].step - plan.start_step + 1
        out.append(replace(
            plan,
            measured_step_s=pace.step_s if pace.step_s is not None else plan.measured_step_s,
            tokens_per_s=median(rates) if rates else plan.tokens_per_s,
            steps=max(steps, 0),
        ))  # fmt: skip
    return out


def write_report(report: RunReport, folder: str | Path) -> dict[str, Path]:
    """Write report.md, report.json, report.html and (with matplotlib) loss.png into `folder` (created if
    missing); their paths by kind ("md", "json", "html", "png"). A dashboard.png already there is linked too."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"md": folder / "report.md", "json": folder / "report.json", "html": folder / "report.html"}
    paths["json"].write_text(report.to_json() + "\n")
    paths["html"].write_text(page(report_state(report)))
    if plots.available():
        paths["png"] = folder / "loss.png"
        paths["png"].write_bytes(loss_png(report))
    pictures = [p.name for p in (paths.get("png"), folder / "dashboard.png") if p is not None and p.exists()]
    paths["md"].write_text(format_markdown(report, pictures))
    return paths


def report_state(report: RunReport) -> dict[str, Any]:
    """The run as a dashboard document (`coordinator/board.py`'s shape, on the run's clock: seconds from its
    start), so report.html is the dashboard's page showing it. Links were not recorded: the plan picture has
    none."""
    samples = sorted(report.samples, key=lambda s: s.step)
    plans = summarize(samples, report.plans)
    last = plans[-1] if plans else None
    placed = {d: (s, lane) for s, stage in enumerate(last.stages) for lane, d in enumerate(stage.devices)} if last else {}
    standby = set(last.standby) if last else set()
    rows = []
    for p in report.peers:
        stage, lane = placed.get(p.device_id, (None, None))
        emulated = [f"{p.slowdown:g}x slower"] if p.slowdown != 1 else []
        emulated += [f"sends at most {p.bandwidth_cap_mbit:g} Mbit/s"] if p.bandwidth_cap_mbit is not None else []
        emulated += [f"its frames {p.latency_ms:g} ms on the way"] if p.latency_ms else []
        rows.append({
            "device_id": p.device_id, "state": "standby" if p.device_id in standby else "training" if stage is not None else "left",
            "stage": stage, "lane": lane, "standby": p.device_id in standby, "tflops": p.tflops,
            "device_name": p.device_name + (f" ({', '.join(emulated)})" if emulated else ""), "admission": "admitted",
        })
    finite = [s for s in samples if _finite(s.loss)]
    vals = [s for s in samples if s.val_loss is not None]
    return {
        "swarm": report.swarm, "coordinator_key": "", "now": report.wall_s, "clock": "run", "version": 0, "admission": "",
        "progress": {
            "epoch": last.epoch if last else -1, "step": report.steps, "loss": finite[-1].loss if finite else None,
            "val_loss": vals[-1].val_loss if vals else None, "tokens_per_s": report.tokens_per_s or 0.0,
            "peers_by_state": dict(sorted(Counter(row["state"] for row in rows).items())), "dropped": 0, "banned": 0, "refused": 0,
        },
        "plan": None if last is None else {
            "epoch": last.epoch, "start_step": last.start_step, "published": last.published_s, "model": report.model,
            "predicted_step_s": _finite_or_none(last.predicted_step_s), "measured_step_s": last.measured_step_s,
            "stages": [{"index": i, "layers": [s.layer_start, s.layer_end], "sync": "gossip" if len(s.devices) > 1 else "none",
                        "devices": list(s.devices)} for i, s in enumerate(last.stages)],
            "standby": list(last.standby), "links": [],
        },
        "peers": rows,
        "history": {
            "sample_fields": list(SAMPLE_FIELDS),
            "samples": [[s.time_s, s.step, s.epoch, _finite_or_none(s.loss), s.val_loss, _finite_or_none(s.tokens_per_s), None,
                         None] for s in samples],  # in SAMPLE_FIELDS' order; how many trained and the noise scale are
                                                   # not in the lanes' lines
            "plans": [{"epoch": p.epoch, "start_step": p.start_step, "published": p.published_s, "stages": len(p.stages),
                       "lanes": len(p.stages[0].devices) if p.stages else 0, "standby": len(p.standby),
                       "predicted_step_s": _finite_or_none(p.predicted_step_s), "measured_step_s": p.measured_step_s,
                       "steps": p.steps, "reason": ""} for p in plans],
            "events": [{"time": e.time_s, "kind": "plan" if e.text.startswith("plan ") else "swarm", "text": e.text}
                       for e in sorted(report.events, key=lambda e: e.time_s)],
        },
    }


def _finite_or_none(value: float | None) -> float | None:
    return value if _finite(value) else None


def loss_png(report: RunReport) -> bytes:
    """Two charts stacked (matplotlib): loss against step, then tokens/s against step; both mark plan switches
    (every plan after the first, at its start_step) and events (placed at the step reached by then)."""
    samples = sorted(report.samples, key=lambda s: s.step)
    steps = [s.step for s in samples]
    markers = [(p.start_step, f"plan epoch {p.epoch}") for p in sorted(report.plans, key=lambda p: p.start_step)[1:]]
    if samples:
        times, steps_at = [s.time_s for s in samples], [float(s.step) for s in samples]
        markers += [(float(np.interp(e.time_s, times, steps_at)), _short(e.text)) for e in report.events
                    if not e.text.startswith("plan ")]  # fmt: skip  # plan switches are marked already
    series = [("loss", steps, [s.loss for s in samples])]
    validated = [s for s in samples if s.val_loss is not None]
    if validated:
        series.append(("validation", [s.step for s in validated], [s.val_loss for s in validated]))
    return plots.charts_png([
        {"series": series, "title": f"{report.model}: training loss", "x_label": "step", "y_label": "loss", "markers": markers},
        {"series": [("tokens/s", steps, [s.tokens_per_s for s in samples])], "title": "throughput", "x_label": "step",
         "y_label": "tokens/s", "markers": markers},
    ])


def _short(text: str, most: int = 40) -> str:
    """An event's first clause, for a chart's label (the report lists it whole)."""
    head = re.split(r"[:;(]", text, maxsplit=1)[0].strip()
    return head if len(head) <= most else head[: most - 3] + "..."


def format_markdown(report: RunReport, pictures: Sequence[str] = ()) -> str:
    """The human summary: setup, plans with predicted vs measured step time, throughput, loss, events."""
    finite_losses = [s.loss for s in sorted(report.samples, key=lambda s: s.step) if _finite(s.loss)]
    vals = [s.val_loss for s in sorted(report.samples, key=lambda s: s.step) if s.val_loss is not None]
    lines = [
        f"# hetpeer swarm run: {report.swarm}", "",
        f"- model: {report.model}",
        f"- steps: {report.steps} in {report.wall_s:.1f} s",
        f"- throughput: {_num(report.tokens_per_s, '.0f')} tokens/s (median over samples)",
        f"- loss: first {_num(finite_losses[0] if finite_losses else None, '.4f')}, "
        f"last {_num(finite_losses[-1] if finite_losses else None, '.4f')}",
        *([f"- validation loss: first {vals[0]:.4f}, last {vals[-1]:.4f} ({len(vals)} measurements)"] if vals else []),
        "", "## Peers", "",
        "| peer | device | slowdown | bandwidth cap (Mbit/s) | latency (ms, one way) | TFLOPS |", "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for p in report.peers:
        cap = "none" if p.bandwidth_cap_mbit is None else f"{p.bandwidth_cap_mbit:g}"
        lines.append(f"| {p.device_id} | {p.device_name} | {p.slowdown:g}x | {cap} | {p.latency_ms:g} | {_num(p.tflops, '.3g')} |")
    lines += ["", "## Plans used", "",
              "| epoch | from step | published (s) | steps | stages | standby "
              "| predicted step (s) | measured step (s) | measured / predicted | tokens/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in sorted(report.plans, key=lambda p: p.start_step):
        stages = "; ".join(f"L{s.layer_start}-{s.layer_end}: {' '.join(s.devices)}" for s in p.stages)
        lines.append(
            f"| {p.epoch} | {p.start_step} | {p.published_s:.1f} | {p.steps} | {stages} | {' '.join(p.standby) or '-'} "
            f"| {_num(p.predicted_step_s, '.3f')} | {_num(p.measured_step_s, '.3f')} | {_num(p.ratio, '.2f')} "
            f"| {_num(p.tokens_per_s, '.0f')} |"
        )  # fmt: skip
    if report.credit:
        lines += ["", "## Credit", "",
                  "What each peer trained (its step lines) and what the coordinator's ledger credits it: work its lane "
                  "neighbours (or, in a one-stage lane, its group) confirm receiving.", "",
                  "| peer | steps trained | sequences trained | sequences credited | credited (its steps) | tokens | TFLOP |",
                  "|---|---|---|---|---|---|---|"]
        for c in report.credit:
            lines.append(f"| {c.device_id} | {c.trained_steps} | {c.trained_sequences} | {c.credited_sequences} "
                         f"| {c.credited_steps:.1f} | {c.credited_tokens} | {c.credited_flops / 1e12:.3g} |")
    lines += ["", "## Events", ""]
    lines += [f"- {e.time_s:.1f} s: {e.text}" for e in sorted(report.events, key=lambda e: e.time_s)] or ["- none"]
    lines += ["", "## Charts", "", "report.html has the loss, validation loss and tokens/s charts (open it in a browser).", ""]
    words = {"loss.png": "loss and tokens/s against step", "dashboard.png": "the coordinator's dashboard at the end of the run"}
    lines += [f"![{words.get(name, name)}]({name})\n" for name in pictures]
    return "\n".join(lines)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _num(value: float | None, spec: str) -> str:
    return format(value, spec) if _finite(value) else "-"


def _nan_to_none(value: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null (a NaN loss reads back as NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value
