"""What a peer counts for the credit ledger (`coordinator/ledger.py`): the work it did (`Claim`s) and the work of
others it took (`Receipt`s), both per plan epoch and cumulative within one, so the newest record says everything.

A stage counts a receipt for each micro-batch frame its worker accepted and used: activations from the previous
peer of its lane, gradients from the next; in a one-stage lane, each group member whose parameters (or all-reduce
share) it mixed into a step. It claims a step's micro-batches once its forward and backward are done. Only the
last `EPOCHS` epochs are kept: the coordinator reads records every heartbeat, and has folded older epochs long
before a peer runs that many more plans.
"""

from __future__ import annotations

import threading

from hetpeer.protocol.credit import MAX_CLAIMS, MAX_RECEIPTS, Claim, Receipt

EPOCHS = 4  # epochs of receipts and claims a record carries


class Tally:
    """Thread-safe counts: the main thread adds as it trains, the control thread reads them into the record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receipts: dict[tuple[str, int, str], list[int]] = {}  # (sender, epoch, kind) -> [first, last, micro, sequences]
        self._claims: dict[int, list[int]] = {}  # epoch -> [first, last, micro, sequences]

    def received(self, sender: str, epoch: int, kind: str, step: int, sequences: int, micro: int = 1) -> None:
        with self._lock:
            _add(self._receipts, (sender, epoch, kind), step, micro, sequences)

    def trained(self, epoch: int, step: int, micro: int, sequences: int) -> None:
        with self._lock:
            _add(self._claims, epoch, step, micro, sequences)

    def receipts(self) -> tuple[Receipt, ...]:
        """The receipts of the last `EPOCHS` epochs, newest epochs first when there are more than a record holds."""
        with self._lock:
            epochs = set(sorted({e for _, e, _ in self._receipts})[-EPOCHS:])
            for key in [k for k in self._receipts if k[1] not in epochs]:
                del self._receipts[key]
            rows = sorted(self._receipts.items(), key=lambda item: (-item[0][1], item[0]))[:MAX_RECEIPTS]
        return tuple(Receipt(sender, epoch, kind, *counts) for (sender, epoch, kind), counts in rows)

    def claims(self) -> tuple[Claim, ...]:
        with self._lock:
            for epoch in sorted(self._claims)[:-EPOCHS]:
                del self._claims[epoch]
            rows = sorted(self._claims.items())[-MAX_CLAIMS:]
        return tuple(Claim(epoch, *counts) for epoch, counts in rows)


def _add(table: dict, key, step: int, micro: int, sequences: int) -> None:
    counts = table.get(key)
    if counts is None:
        table[key] = [step, step, micro, sequences]
    else:
        counts[0], counts[1] = min(counts[0], step), max(counts[1], step)
        counts[2] += micro
        counts[3] += sequences
