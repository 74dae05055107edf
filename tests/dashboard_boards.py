"""A small swarm as the dashboard sees it (`coordinator.board.Board`), and a credit leaderboard, for the dashboard's tests."""

from __future__ import annotations

from hetpeer.coordinator.board import Board
from hetpeer.coordinator.gate import Ban
from hetpeer.coordinator.history import History
from hetpeer.coordinator.ledger import Credit, CreditBoard, TeamCredit
from hetpeer.coordinator.view import SwarmView
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.records import LinkMeasurement, PeerRecord

NOW = 5000.0


def record(device: str, state_: str = "training", **kw) -> PeerRecord:
    fields = dict(device_id=device, model="tiny", dtype="fp32", device_name=f"GPU {device}", tflops=2.0,
                  memory_bytes=8 << 30, address=PeerAddress(direct=("127.0.0.1", 7000)), state=state_, time=NOW - 1.0,
                  epoch=1, step=40, software="hetpeer 0.1.0")
    return PeerRecord(**(fields | kw))


def make_plan() -> Plan:
    """2 stages x 3 lanes: a-b, c-d, e-f; s on standby; the link e-f never measured (estimated)."""
    return Plan(cost_model="time", model="tiny", layers=4, batch=6, micro_batch=1, micro_batches=2, dtype="fp32",
                stages=(StagePlan(0, 0, 2, ("a", "c", "e"), "gossip"), StagePlan(1, 2, 4, ("b", "d", "f"), "gossip")),
                standby=("s",), cost={"total_s": 0.25}, epoch=1, estimated_links=(("e", "f"),),
                standby_reasons=(("too slow: one layer takes longer than a whole step without it (0.25 s)", 1),))


def board(**changes) -> Board:
    peers = {
        "a": record("a", links={"b": LinkMeasurement(0.004, 5e7), "c": LinkMeasurement(0.001, 1e9)}),
        "b": record("b", loss=2.5, tokens_per_s=100.0),
        "c": record("c", links={"e": LinkMeasurement(0.002, 2e8)}),
        "d": record("d", links={"c": LinkMeasurement(0.003, 3e7)}, loss=3.5, tokens_per_s=50.0),  # measured from the far end
        "e": record("e"),
        # f has gone quiet: planned, no record
        "s": record("s", "standby", device_name="<img src=x onerror=alert(1)>"),
        "x": record("x", "waiting", suspects=("a",)),
    }
    history = History()
    view = SwarmView("demo", "ab" * 32, make_plan(), NOW - 30, peers, 1, NOW)
    history.observe(NOW, peers, view.plan, view.plan_time, 40, 3.0, None, 150.0)
    fields = dict(view=view, history=history.snapshot(), refused={"x": "not on the allow-list"},
                  bans={"d": Ban(NOW + 100, 1, "reported by 2 of 2"), "old": Ban(NOW - 1, 1, "over")}, admission="open")
    return Board(**(fields | changes))


def credit_board() -> CreditBoard:
    """Three volunteers, most tokens first (as the ledger orders them); the last hour ranks them the other way
    round; eve has no team and is a suspect."""
    def credit(device, team, tokens, hour_tokens, suspect=False):
        return Credit(device, team, micro_batches=tokens // 64, sequences=tokens // 16, tokens=tokens, flops=tokens * 6e9,
                      online_s=7200.0, training_s=tokens * 0.5, last_hour_tokens=hour_tokens, last_hour_flops=hour_tokens * 6e9,
                      claimed_sequences=tokens // 8 if suspect else tokens // 16, suspect=suspect, last_seen=NOW - 2.0)
    volunteers = (credit("ann-1a2b3c4d", "red", 9000, 100), credit("bob-5e6f7a8b", "red", 5000, 1000),
                  credit("eve-9c0d1e2f", None, 1000, 3000, suspect=True))
    teams = (TeamCredit("red", 2, 14000, 14000 * 6e9, 14400.0, 7000.0, 1100, 1100 * 6e9),)
    return CreditBoard(NOW - 1.0, volunteers, teams)
