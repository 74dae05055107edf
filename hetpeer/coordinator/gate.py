"""Who the coordinator may plan: admitted peers that are not banned. Pure: records and time in, answers out.

Admission (`--admission`): `open` admits every peer with a valid record; `allowlist` those an allow-list
names; `token` those whose record carries a join token of this swarm's coordinator (`protocol/admission.py`).

Bans. Peers report the peers they saw misbehave (`PeerRecord.suspects`: frames refused, what it sent its group
far off round after round, a stage check it failed). A peer that a majority of the other members of its group
under the running plan report at once is left out of plans for a ban period, doubled each time it is banned
again. A majority of colluders can ban an honest peer; the defence assumes most of each group is honest, as
robust averaging does.

Disputes. In a pair, the one other member's word is an accusation, not a verdict: the accuser may be the liar.
The coordinator takes it as a dispute (`disputes`): the pair is parted (the next plan does not put them in one
group or one lane: `policy.build_problem`), so that each meets another checker, and a peer that two different
partners accuse within `DISPUTE_S` is banned (`judge`). A lone false accuser can make the swarm re-plan each time
it is paired anew; it cannot ban anyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetpeer.protocol.admission import Allowlist, token_refusal
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

ADMISSIONS = ("open", "allowlist", "token")
MAX_BAN_DOUBLINGS = 10  # a ban period grows to at most 1024x the first
DISPUTE_S = 900.0  # how long a pair's accusation is remembered, parting the pair and counting toward a ban


@dataclass(frozen=True, slots=True)
class Admission:
    mode: str = "open"
    allowlist: Allowlist | None = None  # for `allowlist`
    coordinator_key: bytes = b""  # for `token`: the key tokens must be signed by (OpenSSH form)
    swarm: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.mode!r}")
        if self.mode == "allowlist" and self.allowlist is None:
            raise ValueError("admission by allow-list needs the allow-list")
        if self.mode == "token" and not (self.coordinator_key and self.swarm):
            raise ValueError("admission by token needs the coordinator's key and the swarm name")

    def refusal(self, record: PeerRecord, now: float) -> str | None:
        """Why `record`'s peer may not be planned, or None when it is admitted (`now`: Unix time)."""
        if self.mode == "allowlist" and not self.allowlist.admits(record.device_id):
            return "not on the allow-list"
        if self.mode == "token":
            return token_refusal(record.token, record.device_id, self.swarm, self.coordinator_key, now)
        return None


@dataclass(frozen=True, slots=True)
class Ban:
    until: float
    count: int  # how many times this peer has been banned
    reason: str


Disputes = dict[tuple[str, str], float]  # (accused, accuser) -> when the accusation was first read


def disputes(plan: Plan | None, records: Mapping[str, PeerRecord], known: Disputes, now: float) -> tuple[Disputes, list[str]]:
    """The disputes after this round (those older than DISPUTE_S forgotten), and the new ones in words: a member of
    a pair group of the running plan that reports the other."""
    updated = {key: at for key, at in known.items() if at > now - DISPUTE_S}
    news = []
    for stage in plan.stages if plan is not None else ():
        if len(stage.devices) != 2 or not all(d in records for d in stage.devices):
            continue
        for accuser, accused in (stage.devices, stage.devices[::-1]):
            if accused in records[accuser].suspects and (accused, accuser) not in updated:
                updated[(accused, accuser)] = now
                news.append(f"{accuser} reports {accused}, its only partner at stage {stage.index}: a dispute, not a "
                            "verdict; the next plan parts them, so that another member checks each")
    return updated, news


def apart(disputed: Disputes) -> set[tuple[str, str]]:
    """The pairs (sorted) that disputes keep out of one group or lane."""
    return {tuple(sorted(key)) for key in disputed}


def parted(plan: Plan, disputed: Disputes, tried: set[tuple[str, str]]) -> str | None:
    """Why the running plan must be replaced because it pairs two peers in dispute (one group or one lane), or None.
    Pairs in `tried` are not asked again (a swarm too small to part them keeps its plan); the pairs asked now are
    added to it."""
    pairs = (apart(disputed) & set(plan.links)) - tried
    tried |= pairs
    if not pairs:
        return None
    return "parting " + ", ".join(f"{a} and {b}" for a, b in sorted(pairs)) + " (one reported the other's work)"


def judge(plan: Plan | None, records: Mapping[str, PeerRecord], bans: Mapping[str, Ban], now: float,
          period_s: float, disputed: Disputes | None = None) -> tuple[dict[str, Ban], list[str]]:
    """The bans after this round, and what changed, in words. Bans that ran out stay in the answer (with
    their count, so a repeat offender's next ban is longer). Complexity O(sum over groups of size^2 + disputes)."""
    updated = dict(bans)
    news = []
    if plan is None or period_s <= 0:
        return updated, news

    def ban(suspect: str, reason: str) -> None:
        count = updated[suspect].count + 1 if suspect in updated else 1
        seconds = period_s * 2 ** min(count - 1, MAX_BAN_DOUBLINGS)
        updated[suspect] = Ban(now + seconds, count, reason)
        news.append(f"banned {suspect} for {seconds:g} s (ban {count}): {reason}")

    for stage in plan.stages:
        for suspect in stage.devices:
            others = [d for d in stage.devices if d != suspect and d in records]
            if len(others) < 2 or (suspect in updated and updated[suspect].until > now):
                continue
            reporters = [d for d in others if suspect in records[d].suspects]
            if 2 * len(reporters) > len(others):
                ban(suspect, f"reported by {len(reporters)} of the {len(others)} other members of its group ({', '.join(reporters)})")
    accusers: dict[str, list[str]] = {}
    for (accused, accuser), at in sorted((disputed or {}).items(), key=lambda item: item[1]):
        accusers.setdefault(accused, []).append(accuser)
    for suspect, who in accusers.items():
        if len(who) >= 2 and not (suspect in updated and updated[suspect].until > now):
            ban(suspect, f"reported by {len(who)} partners in turn ({', '.join(who)}), each its only other group member")
    return updated, news


def plannable(records: Mapping[str, PeerRecord], admission: Admission, bans: Mapping[str, Ban],
              now: float) -> tuple[dict[str, PeerRecord], dict[str, str]]:
    """The records the planner may use, and why each of the others may not."""
    kept, refused = {}, {}
    for device, record in records.items():
        ban = bans.get(device)
        if ban is not None and ban.until > now:
            refused[device] = f"banned for another {ban.until - now:.0f} s: {ban.reason}"
            continue
        reason = admission.refusal(record, now)
        if reason is not None:
            refused[device] = f"not admitted: {reason}"
        else:
            kept[device] = record
    return kept, refused
