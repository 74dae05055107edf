"""What a record says of work, for the credit ledger (`coordinator/ledger.py`): a peer's claims and its receipts
for others' work. Plain values, free of the DHT's schema, so a peer that runs a fixed plan without hivemind
counts them too (`peer/pipeline/tally.py`); `records.py` carries and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_RECEIPTS = 64  # (sender, epoch, kind) a record confirms: lane neighbours and group members over a few epochs
MAX_CLAIMS = 8  # epochs a record claims work in
RECEIPT_KINDS = ("activations", "gradients", "params")  # what of a sender's work a receipt counts


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a peer took of `sender`'s work in plan `epoch`: its `kind` of frames (activations it forwarded, gradients
    it sent back, parameters its group mixed) for steps `first` to `last`, `micro` micro-batches of `sequences`
    sequences in all. Counts are cumulative over the epoch, so a later record supersedes an earlier one."""

    sender: str
    epoch: int
    kind: str
    first: int
    last: int
    micro: int
    sequences: int


@dataclass(frozen=True, slots=True)
class Claim:
    """The work a peer says it did in plan `epoch`: steps `first` to `last` trained, `micro` micro-batches of
    `sequences` sequences in all (cumulative over the epoch, as a `Receipt`)."""

    epoch: int
    first: int
    last: int
    micro: int
    sequences: int
