"""Who the coordinator may plan: admitted peers that are not banned. Pure: records and time in, answers out.

Admission (`--admission`): `open` admits every peer with a valid record; `allowlist` those an allow-list
names; `token` those whose record carries a join token of this swarm's coordinator (`protocol/admission.py`).

Bans. Peers report the peers they saw misbehave (`PeerRecord.suspects`: frames refused, parameters
clipped round after round). A peer that a majority of the other members of its group under the running
plan report at once is left out of plans for a ban period, doubled each time it is banned again. A group
needs at least two other members to judge one: in a pair, each could only accuse the other. A majority of
colluders can ban an honest peer; the defence assumes most of each group is honest, as robust mixing does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetpeer.protocol.admission import Allowlist, token_refusal
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

ADMISSIONS = ("open", "allowlist", "token")
MAX_BAN_DOUBLINGS = 10  # a ban period grows to at most 1024x the first


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


def judge(plan: Plan | None, records: Mapping[str, PeerRecord], bans: Mapping[str, Ban], now: float,
          period_s: float) -> tuple[dict[str, Ban], list[str]]:
    """The bans after this round, and what changed, in words. Bans that ran out stay in the answer (with
    their count, so a repeat offender's next ban is longer). Complexity O(sum over groups of size^2)."""
    updated = dict(bans)
    news = []
    if plan is None or period_s <= 0:
        return updated, news
    for stage in plan.stages:
        for suspect in stage.devices:
            others = [d for d in stage.devices if d != suspect and d in records]
            if len(others) < 2 or (suspect in updated and updated[suspect].until > now):
                continue
            reporters = [d for d in others if suspect in records[d].suspects]
            if 2 * len(reporters) <= len(others):
                continue
            count = updated[suspect].count + 1 if suspect in updated else 1
            seconds = period_s * 2 ** min(count - 1, MAX_BAN_DOUBLINGS)
            reason = f"reported by {len(reporters)} of the {len(others)} other members of its group ({', '.join(reporters)})"
            updated[suspect] = Ban(now + seconds, count, reason)
            news.append(f"banned {suspect} for {seconds:g} s (ban {count}): {reason}")
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
