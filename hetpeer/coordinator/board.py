"""What the organizer's dashboard shows, as plain data: one JSON document of the swarm (`state`) and its
Prometheus series (`SwarmCollector`). Pure: the coordinator's view and history in, data out; O(peers +
plan links + history).

The document's parts are also served alone (`/api/plan`, `/api/peers`, `/api/credit`, ...). Peer-supplied text
(device names, software, team names) is passed on as data; the page writes it as text, never as markup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily
from prometheus_client.registry import Collector

from hetpeer.coordinator.gate import Ban
from hetpeer.coordinator.history import Past
from hetpeer.coordinator.ledger import CreditBoard
from hetpeer.coordinator.view import SwarmView, progress, route
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

MISSING = "missing"  # a planned peer without a fresh record


@dataclass(frozen=True)
class Board:
    """Everything the dashboard reads, taken together once a round."""

    view: SwarmView
    history: Past
    refused: Mapping[str, str]  # device -> why it is left out of plans
    bans: Mapping[str, Ban]
    admission: str  # in words
    credit: CreditBoard | None = None  # the credit ledger's leaderboard (`ledger.py`)


def state(board: Board) -> dict[str, Any]:
    """The whole document `/api/state` serves."""
    view = board.view
    p = progress(view)
    return {
        "swarm": view.swarm,
        "coordinator_key": view.coordinator_key,
        "now": view.now,
        "clock": "unix",
        "version": board.history.version,
        "admission": board.admission,
        "progress": {
            "epoch": p.epoch, "step": p.step, "loss": _finite(p.loss), "val_loss": _finite(p.val_loss),
            "tokens_per_s": _finite(p.tokens_per_s), "peers_by_state": dict(p.peers_by_state), "dropped": p.dropped,
            "banned": sum(1 for b in board.bans.values() if b.until > view.now), "refused": len(board.refused),
            "step_overhead_s": p.step_overhead_s,
        },
        "plan": plan_document(view.plan, view.plan_time, view.peers, board.history),
        "peers": peer_rows(board),
        "history": board.history.to_wire(),
        "credit": credit_document(board),
    }


def credit_document(board: Board) -> dict[str, Any]:
    """The credit leaderboard as `/api/credit` serves it (`CreditBoard.to_wire`); an empty one before the ledger's
    first round."""
    if board.credit is None:
        return {"time": board.view.now, "volunteers": [], "teams": []}
    return board.credit.to_wire()


def plan_document(plan: Plan | None, published: float | None, peers: Mapping[str, PeerRecord],
                  history: Past | None = None) -> dict[str, Any] | None:
    """The plan as the picture needs it: stages, lanes, standby, and the links that matter with what was measured."""
    if plan is None:
        return None
    entry = history.current(plan.epoch) if history is not None else None
    return {
        "epoch": plan.epoch, "start_step": plan.start_step, "published": published, "cost_model": plan.cost_model,
        "model": plan.model, "dtype": plan.dtype, "batch": plan.batch, "micro_batch": plan.micro_batch,
        "micro_batches": plan.micro_batches, "predicted_step_s": _finite(plan.total_s),
        "lane_batches": [plan.lane_sequences(lane) for lane in range(plan.group_size)],  # sequences each lane takes
        "overhead_s": plan.cost.get("overhead_s", 0.0),  # what the prediction counts beyond the time model's terms
        "steps_factor": plan.steps_factor,  # all-reduce's steps to a loss over this plan's (planner/quality.py)
        "measured_step_s": entry.measured_step_s if entry is not None else None,
        "stages": [{"index": s.index, "layers": [s.layer_start, s.layer_end], "sync": s.sync_words, "devices": list(s.devices),
                    "hop": s.hop_codecs, "checked": plan.checked(s.index)} for s in plan.stages],
        "standby": list(plan.standby),
        "standby_reasons": [[reason, count] for reason, count in plan.standby_reasons],
        "links": plan_links(plan, peers),
        "recipe": plan.recipe.to_wire(), "recipe_words": plan.recipe.words,
    }


def plan_links(plan: Plan, peers: Mapping[str, PeerRecord]) -> list[dict[str, Any]]:
    """Lane edges (each stage to the next, per lane) and group edges (each lane to the next, per stage, in a
    ring), with the bandwidth and latency either end measured (the sender's figure first); `measured` is
    False where neither did (the planner estimated it); how the pair talks now (`view.route`), and how it failed."""
    estimated = {frozenset(pair) for pair in plan.estimated_links}
    pairs: list[tuple[str, str, str]] = []
    for lane in plan.lanes:
        pairs += [(a, b, "lane") for a, b in zip(lane, lane[1:])]
    for stage in plan.stages:
        ring = list(stage.devices)
        pairs += [(a, b, "group") for a, b in zip(ring, ring[1:])]
        if len(ring) > 2:
            pairs.append((ring[-1], ring[0], "group"))
    links = []
    for a, b, kind in pairs:
        found = _measured(peers, a, b) or _measured(peers, b, a)
        links.append({
            "from": a, "to": b, "kind": kind,
            "bandwidth_bytes_per_s": found.bandwidth_bytes_per_s if found else None,
            "latency_s": found.latency_s if found else None,
            "measured": found is not None, "estimated": found is None and frozenset((a, b)) in estimated,
            "route": (path := route(peers, a, b))[0], "failed": path[1] or None,
        })
    return links


def _measured(peers: Mapping[str, PeerRecord], a: str, b: str):
    record = peers.get(a)
    return record.links.get(b) if record is not None else None


def peer_rows(board: Board) -> list[dict[str, Any]]:
    """One row per peer with a record, and one per planned peer without a fresh one (state `missing`)."""
    view, plan = board.view, board.view.plan
    places = positions(plan)
    reasons = {d: reason for reason, ids in plan.reasons.items() for d in ids} if plan is not None else {}
    rows = []
    for device in sorted(set(view.peers) | set(places)):
        record = view.peers.get(device)
        stage, lane = places.get(device, (None, None))
        ban = board.bans.get(device)
        if ban is not None and ban.until > view.now:
            admission = f"banned {ban.until - view.now:.0f} s more: {ban.reason}"
        else:
            admission = board.refused.get(device, "admitted")
        row = {
            "device_id": device, "state": record.state if record is not None else MISSING,
            "stage": stage, "lane": lane, "standby": plan is not None and device in plan.standby,
            "standby_reason": reasons.get(device), "admission": admission,
        }
        if record is not None:
            row.update({
                "layers": list(record.layers) if record.layers else None, "epoch": record.epoch, "step": record.step,
                "loss": _finite(record.loss), "val_loss": _finite(record.val_loss), "tokens_per_s": record.tokens_per_s,
                "tflops": record.tflops, "achieved_tflops": record.achieved_tflops, "memory_bytes": record.memory_bytes,
                "device_name": record.device_name, "software": record.software, "age_s": max(0.0, view.now - record.time),
                "links": len(record.links), "suspects": list(record.suspects), "reachable": record.reachable,
                "reach": record.reach_words(), "punched": list(record.punched), "relayed": list(record.relayed),
            })
        rows.append(row)
    return rows


def positions(plan: Plan | None) -> dict[str, tuple[int, int]]:
    """(stage, lane) of every planned device: one pass over the plan, not one search per peer."""
    if plan is None:
        return {}
    return {device: (s, lane) for s, stage in enumerate(plan.stages) for lane, device in enumerate(stage.devices)}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class SwarmCollector(Collector):
    """Prometheus series of the swarm and each peer, read from the latest `Board` at each scrape."""

    def __init__(self, get_board: Callable[[], Board | None]) -> None:
        self.get_board = get_board

    def collect(self) -> Iterator:
        board = self.get_board()
        if board is None:
            return
        view, history = board.view, board.history
        p = progress(view)

        def gauge(name: str, doc: str, value: float | None, labels: Mapping[str, str] | None = None):
            family = GaugeMetricFamily(name, doc, labels=list(labels or ()))
            if value is not None:
                family.add_metric(list((labels or {}).values()), value)
            return family

        yield gauge("hetpeer_swarm_step", "highest step the swarm's training peers announce", p.step)
        yield gauge("hetpeer_swarm_loss", "training loss: mean over the plan's last-stage peers", p.loss)
        yield gauge("hetpeer_swarm_val_loss", "validation loss: mean over the plan's last-stage peers", p.val_loss)
        yield gauge("hetpeer_swarm_tokens_per_second", "tokens trained per second, summed over the lanes", _finite(p.tokens_per_s))
        yield gauge("hetpeer_swarm_records_dropped", "peer records refused in the coordinator's last read", p.dropped)
        yield gauge("hetpeer_swarm_banned_peers", "peers banned now", sum(1 for b in board.bans.values() if b.until > view.now))
        yield gauge("hetpeer_swarm_refused_peers", "peers left out of plans (admission or ban)", len(board.refused))
        by_state = GaugeMetricFamily("hetpeer_swarm_peers", "peers announcing, by state", labels=["state"])
        for state_, n in p.peers_by_state.items():
            by_state.add_metric([state_], n)
        yield by_state
        plan = view.plan
        yield gauge("hetpeer_plan_epoch", "the running plan's epoch (-1: none)", p.epoch)
        if plan is not None:
            entry = history.current(plan.epoch)
            yield gauge("hetpeer_plan_stages", "pipeline stages of the running plan", len(plan.stages))
            yield gauge("hetpeer_plan_lanes", "lanes (data-parallel group size) of the running plan", plan.group_size)
            yield gauge("hetpeer_plan_standby_peers", "peers the running plan leaves on standby", len(plan.standby))
            yield gauge("hetpeer_plan_predicted_step_seconds", "the running plan's predicted step time", _finite(plan.total_s))
            yield gauge("hetpeer_plan_measured_step_seconds", "measured step time under the running plan (the mean over windows of 10+ steps, stalls left out)",
                        entry.measured_step_s if entry is not None else None)
            yield from _link_families(plan, view)
        plans = CounterMetricFamily("hetpeer_plans", "plans published or found running since the coordinator started")
        plans.add_metric([], history.plans_seen)
        yield plans
        yield from _peer_families(view, plan)


def _link_families(plan: Plan, view: SwarmView) -> Iterator:
    """Per planned peer, the narrowest and the slowest of its measured lane and group links (every link's
    figures are in /api/plan: a series per link would be thousands in a large swarm)."""
    narrowest: dict[str, float] = {}
    slowest: dict[str, float] = {}
    for link in plan_links(plan, view.peers):
        if link["measured"]:
            for device in (link["from"], link["to"]):
                narrowest[device] = min(narrowest.get(device, math.inf), link["bandwidth_bytes_per_s"])
                slowest[device] = max(slowest.get(device, 0.0), link["latency_s"])
    for name, doc, values in (
        ("hetpeer_peer_plan_link_min_bandwidth_bytes_per_second", "the narrowest measured link a peer has in the plan",
         narrowest),
        ("hetpeer_peer_plan_link_max_latency_seconds", "the slowest measured link a peer has in the plan", slowest),
    ):
        family = GaugeMetricFamily(name, doc, labels=["peer"])
        for device, value in sorted(values.items()):
            family.add_metric([device], value)
        yield family


def _peer_families(view: SwarmView, plan: Plan | None) -> Iterator:
    labels = ["peer"]
    families = {
        "step": GaugeMetricFamily("hetpeer_peer_step", "the step a peer announces", labels=labels),
        "loss": GaugeMetricFamily("hetpeer_peer_loss", "a last-stage peer's training loss (last-stage peers only)",
                                  labels=labels),
        "tokens": GaugeMetricFamily("hetpeer_peer_tokens_per_second", "a last-stage peer's lane throughput (last-stage "
                                    "peers only)", labels=labels),
        "tflops": GaugeMetricFamily("hetpeer_peer_tflops", "a peer's measured TFLOPS in the training dtype", labels=labels),
        "achieved": GaugeMetricFamily("hetpeer_peer_achieved_tflops", "TFLOPS a peer's training steps achieve", labels=labels),
        "memory": GaugeMetricFamily("hetpeer_peer_memory_bytes", "a peer's free accelerator memory", labels=labels),
        "age": GaugeMetricFamily("hetpeer_peer_record_age_seconds", "how old a peer's announcement was when read", labels=labels),
        "stage": GaugeMetricFamily("hetpeer_peer_stage", "the stage a peer holds in the running plan (-1: none)", labels=labels),
        "suspects": GaugeMetricFamily("hetpeer_peer_suspects", "peers a peer reports as misbehaving (reporting peers only)",
                                      labels=labels),
    }
    info = GaugeMetricFamily("hetpeer_peer_info", "a peer's state, device and whether others can dial it (always 1)",
                             labels=["peer", "state", "device", "software", "reachable"])
    places = positions(plan)
    last = len(plan.stages) - 1 if plan is not None else None
    for device, r in sorted(view.peers.items()):
        stage = places.get(device, (-1, None))[0]
        values = {  # series only where they say something: a large swarm's scrape stays small
            "step": r.step, "loss": r.loss if stage == last else None, "tokens": r.tokens_per_s if stage == last else None,
            "tflops": r.tflops,
            "achieved": r.achieved_tflops, "memory": r.memory_bytes, "age": max(0.0, view.now - r.time), "stage": stage,
            "suspects": len(r.suspects) or None,
        }
        for key, value in values.items():
            if value is not None:
                families[key].add_metric([device], value)
        info.add_metric([device, r.state, r.device_name, r.software, r.reachable], 1)
    yield from families.values()
    yield info
