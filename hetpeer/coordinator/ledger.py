"""The credit ledger: what each volunteer's peer trained, as far as others confirm it, kept across restarts.

Every record carries the peer's claims (`Claim`: per plan epoch, the steps, micro-batches and sequences it trained)
and its receipts for the work of others (`Receipt`: the activations its previous lane neighbour sent it, the
gradients its next neighbour sent back, in a one-stage lane the parameters its group members' steps gave it). Both
are cumulative within an epoch and signed with the record, so the newest record of each peer says it all.

A peer's credit in an epoch is what its claim and its witnesses agree on:

- in a lane of stages, the least of its claim and each lane neighbour's receipt for it (the next stage's for its
  activations, the previous stage's for its gradients): a claim no neighbour saw gets nothing, and one neighbour
  cannot confirm beyond what the other saw;
- in a one-stage lane, its claim as far as the steps a group member mixed its parameters in span (gossip mixes a
  few members a step, so the best-placed member speaks);
- never more than its lane's share of the batch for each step of the epoch's window: from the plan's start step up
  to the median step the epoch's peers claim (and, once a later plan starts below that, the steps up to it: work
  on steps the swarm rolled back to a checkpoint is taken back).

What a peer claims beyond its witnesses (by more than the steps it is ahead of them, and one more) for
`SUSPECT_ROUNDS` rounds in a row makes it a suspect on the leaderboard, once per epoch.

The ledger keeps the last `OPEN_EPOCHS` epochs whole (claims, receipts, credit); an older epoch's credit is added
to its volunteers' totals and the epoch is dropped: a rollback further back than that is not taken back. A
volunteer is its device id (`NAME-<key fingerprint>`, the key its peer keeps across restarts), so its credit
follows the key. `fold` costs O(receipts of the records read) a round; a volunteer's totals take at most
`VOLUNTEER_BYTES` of the ledger's file.

This is derived state kept in the coordinator's home, the one exception to "nothing the coordinator needs is not in
the DHT": records expire, credit must not. Losing the file loses the credit history, not the training.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from hetpeer.protocol.plan import Plan
from hetpeer.protocol.credit import Claim, Receipt
from hetpeer.protocol.records import TEAM_RE, PeerRecord
from hetpeer.protocol.workload import Workload

LEDGER_VERSION = 1
OPEN_EPOCHS = 4  # epochs kept whole: a later plan's rollback takes their credit back
BUCKET_S = 600.0  # the last hour's credit, in buckets of this many seconds
BUCKETS = 6
SUSPECT_ROUNDS = 5  # rounds in a row a claim runs past its witnesses before its peer is a suspect
MAX_GAP_S = 60.0  # a peer unseen longer than this between its records (times the fold's share) was not online meanwhile
FOLD_PER_ROUND = 250  # records a round folds, about: a larger swarm's are folded in turns
VOLUNTEER_BYTES = 400  # the most a volunteer's totals take in the ledger's file (tested with 10,000)


class LedgerError(ValueError):
    """The ledger's file cannot be read: the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class Credit:
    """One volunteer's credit: confirmed work (all time and the last hour), its time in the swarm, and whether it
    claimed work its neighbours did not see."""

    device_id: str
    team: str | None
    micro_batches: int
    sequences: int
    tokens: int
    flops: float
    online_s: float
    training_s: float
    last_hour_tokens: int
    last_hour_flops: float
    claimed_sequences: int  # what it claims in the epochs still open (its credit there is at most this)
    suspect: bool  # it claimed work beyond what its neighbours confirm, round after round
    last_seen: float  # DHT time of its last record

    @property
    def name(self) -> str:
        return self.device_id.rpartition("-")[0]


@dataclass(frozen=True, slots=True)
class TeamCredit:
    team: str
    volunteers: int
    tokens: int
    flops: float
    online_s: float
    training_s: float
    last_hour_tokens: int
    last_hour_flops: float


@dataclass(frozen=True, slots=True)
class CreditBoard:
    """What the API, the dashboard and `hetpeer status --credit` show: every volunteer and team, most tokens first."""

    time: float
    volunteers: tuple[Credit, ...]
    teams: tuple[TeamCredit, ...]

    def of(self, device_id: str) -> Credit | None:
        return next((c for c in self.volunteers if c.device_id == device_id), None)

    def to_wire(self) -> dict[str, Any]:
        return {"time": self.time,
                "volunteers": [{**_fields(c), "name": c.name} for c in self.volunteers],
                "teams": [_fields(t) for t in self.teams]}


CSV_COLUMNS = ("device_id", "name", "team", "micro_batches", "sequences", "tokens", "flops", "online_s", "training_s",
               "last_hour_tokens", "last_hour_flops", "claimed_sequences", "suspect", "last_seen")


def _fields(row: Any) -> dict[str, Any]:
    return {name: getattr(row, name) for name in row.__slots__}


@dataclass(frozen=True, slots=True)
class _Place:
    """A device's place in an epoch's plan, as far as its credit goes."""

    previous: str | None
    next: str | None
    stage: int  # its group is the stage's devices (`_Epoch.groups`)
    lane_sequences: int  # a step's
    micro_per_step: int
    flops_per_sequence: float


@dataclass(slots=True)
class _Epoch:
    start_step: int
    places: dict[str, _Place]
    groups: tuple[tuple[str, ...], ...]  # each stage's devices
    clip: int | None = None  # a later plan started at this step: work on steps from it on was rolled back
    claims: dict[str, Claim] = field(default_factory=dict)
    receipts: dict[tuple[str, str, str], Receipt] = field(default_factory=dict)  # (witness, sender, kind)
    credited: dict[str, tuple[int, int]] = field(default_factory=dict)  # device -> (micro-batches, sequences)
    over: dict[str, int] = field(default_factory=dict)  # device -> rounds in a row its claim ran past its witnesses
    flagged: set[str] = field(default_factory=set)
    capped: set[str] = field(default_factory=set)  # devices whose credit the epoch's window holds back (not saved)
    voided: set[str] = field(default_factory=set)  # devices banned while this epoch ran: none of its work is credited


@dataclass(slots=True)
class _Volunteer:
    team: str | None = None
    micro_batches: int = 0  # of settled epochs (open ones are added when shown)
    sequences: int = 0
    flops: float = 0.0
    online_s: float = 0.0
    training_s: float = 0.0
    last_seen: float = 0.0
    buckets: list[list[float]] = field(default_factory=list)  # [bucket index, tokens, FLOPs] of the last hour
    suspect: bool = False


class Ledger:
    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.volunteers: dict[str, _Volunteer] = {}
        self.epochs: dict[int, _Epoch] = {}
        self.last_round: float | None = None
        self.rounds = 0
        self.board_due = True  # credit moved enough to show afresh (`board`); a caller may show the last board until then
        self._slots: dict[str, int] = {}

    # -- a round ----------------------------------------------------------------------------------------
    def fold(self, plans: Iterable[Plan], records: Mapping[str, PeerRecord], now: float, workload: Workload) -> list[str]:
        """Take this round's plans and records (leaving peers' last ones included); the lines worth saying (a peer
        that became a suspect). A round folds at most about `FOLD_PER_ROUND` records: in a larger swarm each
        volunteer's records are folded every `share` rounds, by its slot (counts are cumulative, so a record
        folded later says all the skipped ones did), and a newcomer's or a leaving peer's at once. O(records
        folded x their receipts and claims)."""
        for plan in sorted(plans, key=lambda p: p.epoch):
            self._book(plan, workload)
        self.rounds += 1
        share = max(1, -(-len(records) // FOLD_PER_ROUND))
        self.board_due |= self.rounds % share == 0
        max_gap_s = MAX_GAP_S * share
        touched: dict[int, set[str]] = {}
        turn, slots, volunteers = self.rounds % share, self._slots, self.volunteers
        for device, record in records.items():
            volunteer = volunteers.get(device)
            if volunteer is None:
                volunteer = volunteers[device] = _Volunteer()
                self.board_due = True
            elif record.state == "leaving":
                self.board_due |= record.time > volunteer.last_seen
            elif share > 1 and (slots.get(device) or slots.setdefault(device, zlib.crc32(device.encode()))) % share != turn:
                continue
            if record.team is not None:
                volunteer.team = record.team
            gap_s = record.time - volunteer.last_seen
            if 0 < gap_s <= max_gap_s and record.state != "leaving":  # online since its last record folded
                volunteer.online_s += gap_s
                volunteer.training_s += gap_s if record.state == "training" else 0.0
            volunteer.last_seen = max(volunteer.last_seen, record.time)
            for claim in record.trained:
                book = self.epochs.get(claim.epoch)
                if book is not None and device in book.places and _newer(claim, book.claims.get(device)):
                    book.claims[device] = claim
                    touched.setdefault(claim.epoch, set()).add(device)
            for receipt in record.received:
                book = self.epochs.get(receipt.epoch)
                if book is None or not _witness(book, device, receipt):
                    continue
                key = (device, receipt.sender, receipt.kind)
                if _newer(receipt, book.receipts.get(key)):
                    book.receipts[key] = receipt
                    touched.setdefault(receipt.epoch, set()).add(receipt.sender)
        for epoch, book in self.epochs.items():
            if book.capped:
                touched.setdefault(epoch, set()).update(book.capped)
        for epoch, devices in touched.items():
            self._credit(epoch, self.epochs[epoch], devices, now)
        self.last_round = now
        return self._suspects()

    def _suspects(self) -> list[str]:
        """Count another round for each claim that runs past its witnesses; one that has for `SUSPECT_ROUNDS` rounds
        makes its peer a suspect (said once an epoch)."""
        said = []
        for epoch, book in self.epochs.items():
            for device in book.over:
                book.over[device] += 1
                if book.over[device] >= SUSPECT_ROUNDS and device not in book.flagged:
                    book.flagged.add(device)
                    self.volunteers.setdefault(device, _Volunteer()).suspect = True
                    claim, (_, sequences) = book.claims[device], book.credited[device]
                    said.append(f"credit: {device} claims {claim.sequences} sequences in epoch {epoch}; its neighbours "
                                f"confirm {sequences}, which is all it is credited")
        return said

    def _book(self, plan: Plan, workload: Workload) -> None:
        """Learn an epoch's plan (once); a plan that starts below steps of earlier epochs rolls them back."""
        if plan.epoch in self.epochs or (self.epochs and plan.epoch < min(self.epochs)):
            return
        for epoch, book in self.epochs.items():
            if epoch < plan.epoch:
                book.clip = plan.start_step if book.clip is None else min(book.clip, plan.start_step)
        places = {}
        last, lanes = len(plan.stages) - 1, plan.lanes
        for s, stage in enumerate(plan.stages):
            flops = Workload(workload.model, batch=plan.batch, micro_batch=plan.micro_batch, dtype=plan.dtype) \
                .stage_flops(stage.layers, last=s == last, sequences=1, recompute=stage.recompute)
            for lane, device in enumerate(stage.devices):
                places[device] = _Place(lanes[lane][s - 1] if s > 0 else None, lanes[lane][s + 1] if s < last else None,
                                        s, plan.lane_sequences(lane), len(plan.micro_batch_sizes(lane)), flops)
        self.epochs[plan.epoch] = _Epoch(plan.start_step, places, tuple(stage.devices for stage in plan.stages))
        for epoch in sorted(self.epochs)[:-OPEN_EPOCHS]:
            self._settle(epoch)
        for epoch, book in self.epochs.items():  # their clip may have moved
            if epoch < plan.epoch:
                self._credit(epoch, book, set(book.claims), self.last_round or 0.0)

    def void(self, device: str, epoch: int, now: float) -> bool:
        """Take back `device`'s credit for plan `epoch` and credit it nothing more there (it was banned while that plan
        ran: its work there cannot be told from its poison); False if the ledger holds no such epoch (settled, or never
        seen)."""
        book = self.epochs.get(epoch)
        if book is None:
            return False
        book.voided.add(device)
        self._credit(epoch, book, {device}, now)
        self.board_due = True
        return True

    def _settle(self, epoch: int) -> None:
        book = self.epochs.pop(epoch)
        for device, (micro, sequences) in book.credited.items():
            volunteer = self.volunteers.setdefault(device, _Volunteer())
            volunteer.micro_batches += micro
            volunteer.sequences += sequences
            volunteer.flops += sequences * book.places[device].flops_per_sequence

    def _credit(self, epoch: int, book: _Epoch, devices: set[str], now: float) -> None:
        claimed_last = [c.last for c in book.claims.values()]
        median_last = statistics.median_low(claimed_last) if claimed_last else -1
        for device in devices:
            claim, place = book.claims.get(device), book.places.get(device)
            if claim is None or place is None:
                continue
            sequences, last = _confirmed(book, device, claim, place)
            if book.clip is not None and last >= book.clip:  # rolled back: the steps from the clip on are not credited
                sequences -= (last - book.clip + 1) * place.lane_sequences
                last = book.clip - 1
            window = min(last, median_last + 1) - book.start_step + 1  # a colluding pair cannot run ahead of the swarm
            if sequences > window * place.lane_sequences:  # credited afresh as the swarm's median moves on
                book.capped.add(device)
            else:
                book.capped.discard(device)
            sequences = 0 if device in book.voided else max(0, min(sequences, window * place.lane_sequences))
            micro = sequences * place.micro_per_step // place.lane_sequences
            before = book.credited.get(device, (0, 0))[1]
            book.credited[device] = (micro, sequences)
            self._gained(device, (sequences - before) * self.seq_len, (sequences - before) * place.flops_per_sequence, now)
            ahead = max(0, claim.last - last)
            if claim.sequences > sequences + (ahead + 1) * place.lane_sequences and book.clip is None:
                book.over.setdefault(device, 0)  # counted each round it stays so (`_suspects`)
            else:
                book.over.pop(device, None)

    def _gained(self, device: str, tokens: int, flops: float, now: float) -> None:
        if not tokens:
            return
        volunteer = self.volunteers.setdefault(device, _Volunteer())
        bucket = math.floor(now / BUCKET_S)
        if volunteer.buckets and volunteer.buckets[-1][0] == bucket:
            volunteer.buckets[-1][1] += tokens
            volunteer.buckets[-1][2] += flops
        else:
            volunteer.buckets.append([bucket, tokens, flops])
        volunteer.buckets = [b for b in volunteer.buckets if b[0] > bucket - BUCKETS]

    # -- what is shown ------------------------------------------------------------------------------------
    def board(self, now: float) -> CreditBoard:
        """Every volunteer's credit (settled epochs and open ones), most tokens first; and the teams'. O(volunteers)."""
        self.board_due = False
        open_credit: dict[str, list[float]] = {}
        for book in self.epochs.values():
            for device, (micro, sequences) in book.credited.items():
                row = open_credit.setdefault(device, [0, 0, 0.0, 0])
                row[0] += micro
                row[1] += sequences
                row[2] += sequences * book.places[device].flops_per_sequence
            for device, claim in book.claims.items():
                open_credit.setdefault(device, [0, 0, 0.0, 0])[3] += claim.sequences
        bucket = math.floor(now / BUCKET_S)
        rows = []
        for device, v in self.volunteers.items():
            micro, sequences, flops, claimed = open_credit.get(device, (0, 0, 0.0, 0))
            hour_tokens, hour_flops = 0, 0.0
            for b in v.buckets:
                if b[0] > bucket - BUCKETS:
                    hour_tokens += b[1]
                    hour_flops += b[2]
            rows.append(Credit(
                device, v.team, v.micro_batches + int(micro), v.sequences + int(sequences),
                (v.sequences + int(sequences)) * self.seq_len, v.flops + flops, v.online_s, v.training_s,
                max(0, int(hour_tokens)), max(0.0, hour_flops), int(claimed), v.suspect, v.last_seen))
        rows.sort(key=lambda c: (-c.tokens, c.device_id))
        teams: dict[str, list[Credit]] = {}
        for row in rows:
            if row.team is not None:
                teams.setdefault(row.team, []).append(row)
        team_rows = [TeamCredit(team, len(members), sum(c.tokens for c in members), sum(c.flops for c in members),
                                sum(c.online_s for c in members), sum(c.training_s for c in members),
                                sum(c.last_hour_tokens for c in members), sum(c.last_hour_flops for c in members))
                     for team, members in teams.items()]
        team_rows.sort(key=lambda t: (-t.tokens, t.team))
        return CreditBoard(now, tuple(rows), tuple(team_rows))

    # -- its file -------------------------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {
            "version": LEDGER_VERSION, "seq_len": self.seq_len, "last_round": self.last_round,
            "volunteers": {d: [v.team, v.micro_batches, v.sequences, v.flops, round(v.online_s, 1),
                               round(v.training_s, 1), round(v.last_seen, 1), [[int(b), t, f] for b, t, f in v.buckets],
                               int(v.suspect)]
                           for d, v in self.volunteers.items()},
            "epochs": {str(e): _epoch_to_wire(book) for e, book in self.epochs.items()},
        }

    @staticmethod
    def from_wire(raw: Any, seq_len: int) -> "Ledger":
        """The ledger a file held; ValueError, KeyError or TypeError where it is not one (`load` names the file)."""
        if not isinstance(raw, dict) or raw.get("version") != LEDGER_VERSION:
            raise ValueError(f"not a credit ledger of version {LEDGER_VERSION}")
        ledger = Ledger(seq_len)
        ledger.last_round = None if raw["last_round"] is None else float(raw["last_round"])
        for device, (team, micro, sequences, flops, online, training, seen, buckets, suspect) in raw["volunteers"].items():
            if team is not None and not TEAM_RE.match(team):
                raise ValueError(f"volunteer {device}: team {team!r}")
            ledger.volunteers[str(device)] = _Volunteer(team, int(micro), int(sequences), float(flops),
                                                        float(online), float(training), float(seen),
                                                        [[int(b), int(t), float(f)] for b, t, f in buckets], bool(suspect))
        for epoch, book in raw["epochs"].items():
            ledger.epochs[int(epoch)] = _epoch_from_wire(book)
        return ledger

    def save(self, path: Path) -> None:
        """Write the ledger to `path` atomically (a crash leaves the old file or the new one, never half of one)."""
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_wire(), separators=(",", ":")))
        os.replace(temporary, path)

    @staticmethod
    def load(path: Path, seq_len: int) -> "Ledger":
        """The ledger in `path`, or a fresh one where there is no file; LedgerError names a file that is not one."""
        if not path.exists():
            return Ledger(seq_len)
        try:
            return Ledger.from_wire(json.loads(path.read_text()), seq_len)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise LedgerError(f"the credit ledger {path} cannot be read ({str(error)[:120] or type(error).__name__}): "
                              "move it away to start a new one (its credit history is then lost)") from None


def _confirmed(book: _Epoch, device: str, claim: Claim, place: _Place) -> tuple[int, int]:
    """(sequences, last step) of `device`'s claim its witnesses confirm, before the epoch's window."""
    if place.previous is None and place.next is None:  # a one-stage lane: the group members that mixed it in
        best = (0, -1)
        for member in book.groups[place.stage]:
            receipt = book.receipts.get((member, device, "params"))
            if receipt is not None:
                spanned = (receipt.last - max(receipt.first, claim.first) + 1) * place.lane_sequences
                best = max(best, (min(claim.sequences, spanned), min(claim.last, receipt.last)))
        return best
    sequences, last = claim.sequences, claim.last
    for witness, kind in ((place.previous, "gradients"), (place.next, "activations")):
        if witness is None:
            continue
        receipt = book.receipts.get((witness, device, kind))
        if receipt is None:
            return 0, -1
        sequences, last = min(sequences, receipt.sequences), min(last, receipt.last)
    return sequences, last


def _witness(book: _Epoch, witness: str, receipt: Receipt) -> bool:
    """Whether `witness` is one whose receipt of this kind counts for its sender in this epoch's plan."""
    place = book.places.get(receipt.sender)
    if place is None:
        return False
    if receipt.kind == "params":
        return (place.previous is None and place.next is None and witness != receipt.sender
                and book.places.get(witness, place).stage == place.stage)
    return (receipt.kind, witness) in (("gradients", place.previous), ("activations", place.next))


def _newer(new: Claim | Receipt, old: Claim | Receipt | None) -> bool:
    """Counts are cumulative within an epoch: the record that says more is the newer one."""
    return old is None or (new.sequences, new.last) > (old.sequences, old.last)


def _epoch_to_wire(book: _Epoch) -> dict[str, Any]:
    return {
        "start": book.start_step, "clip": book.clip,
        "places": {d: [p.previous, p.next, p.stage, p.lane_sequences, p.micro_per_step, p.flops_per_sequence]
                   for d, p in book.places.items()},
        "groups": [list(g) for g in book.groups],
        "claims": {d: [c.epoch, c.first, c.last, c.micro, c.sequences] for d, c in book.claims.items()},
        "receipts": [[w, r.sender, r.epoch, r.kind, r.first, r.last, r.micro, r.sequences] for (w, _, _), r in book.receipts.items()],
        "credited": {d: list(c) for d, c in book.credited.items()},
        "over": book.over, "flagged": sorted(book.flagged), "voided": sorted(book.voided),
    }


def _epoch_from_wire(raw: Mapping[str, Any]) -> _Epoch:
    places = {d: _Place(p, n, int(g), int(s), int(m), float(f)) for d, (p, n, g, s, m, f) in raw["places"].items()}
    book = _Epoch(int(raw["start"]), places, tuple(tuple(g) for g in raw["groups"]),
                  None if raw["clip"] is None else int(raw["clip"]))
    book.claims = {d: Claim(*map(int, c)) for d, c in raw["claims"].items()}
    for w, sender, epoch, kind, *counts in raw["receipts"]:
        book.receipts[(w, sender, kind)] = Receipt(sender, int(epoch), kind, *map(int, counts))
    book.credited = {d: (int(m), int(s)) for d, (m, s) in raw["credited"].items()}
    book.over = {d: int(n) for d, n in raw["over"].items()}
    book.flagged = set(raw["flagged"])
    book.voided = set(raw.get("voided", ()))  # a ledger written before bans voided credit has none
    return book


def csv_text(board: CreditBoard) -> str:
    """The volunteers' credit as CSV (a header row, then one row each), for the organizer's spreadsheets."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in board.volunteers:
        values = {**_fields(row), "name": row.name}
        writer.writerow(["" if values[c] is None else values[c] for c in CSV_COLUMNS])
    return out.getvalue()


def describe(credit: Credit | None) -> str:
    """A volunteer's credit in a line, as `hetpeer join` says it when it leaves."""
    if credit is None:
        return "no credit yet: no neighbour has confirmed work of this peer"
    hours = credit.training_s / 3600
    return (f"credited {credit.tokens:,} tokens ({credit.micro_batches:,} micro-batches, {credit.flops / 1e12:.3g} TFLOP) "
            f"confirmed by its neighbours; {hours:.2f} h training of {credit.online_s / 3600:.2f} h online"
            + (f"; it claims {credit.claimed_sequences:,} sequences in the open epochs" if credit.suspect else ""))

