"""Which peers this peer reports as misbehaving (`PeerRecord.suspects`), from what it saw itself.

Three signs, all of a peer whose link proved who it is: frames refused (wrong shape, step, epoch, checksum,
not finite: `Inbox.misbehaving`), at least `REFUSALS` within `WINDOW_S`; being a neighbour robust averaging
leaves out (`GroupSync.outliers`: far past the clipping bound round after round); and a stage check that caught
it (`Checks.caught`: its output far from this peer's recomputation, in the group's tolerance). A plan switch can
make an honest peer's frames refused a few times, and an honest neighbour can drift past the bound once in a while; a poisoner is far past it every round. A peer stays reported for
`WINDOW_S` after its last sign, so the reports of a group meet in the coordinator's reading of the records.
"""

from __future__ import annotations

import collections
from typing import Mapping

from hetpeer.protocol.records import MAX_SUSPECTS

REFUSALS = 10
WINDOW_S = 30.0


class Suspicion:
    def __init__(self) -> None:
        self._counted: dict[str, int] = {}  # misbehaving counts at the last update
        self._refused: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._clipped_at: dict[str, float] = {}

    def update(self, misbehaving: Mapping[str, int], outliers: Mapping[str, int], now: float) -> tuple[str, ...]:
        """The peers to report at `now` (seconds, any monotonic clock), given the refusals counted so far per peer
        and the neighbours robust averaging leaves out or a check caught (`outliers`); the most offending first, at
        most MAX_SUSPECTS."""
        for device, count in misbehaving.items():
            new = count - self._counted.get(device, 0)
            self._counted[device] = count
            times = self._refused[device]
            times.extend([now] * min(new, REFUSALS))
            while len(times) > REFUSALS:
                times.popleft()
        for device in outliers:
            self._clipped_at[device] = now
        found = {}
        for device, times in list(self._refused.items()):
            while times and times[0] < now - WINDOW_S:
                times.popleft()
            if len(times) >= REFUSALS:
                found[device] = len(times)
            elif not times:
                del self._refused[device]
        for device, at in list(self._clipped_at.items()):
            if at >= now - WINDOW_S:
                found[device] = max(found.get(device, 0), 1)
            else:
                del self._clipped_at[device]
        return tuple(sorted(found, key=lambda d: (-found[d], -self._counted.get(d, 0), d))[:MAX_SUSPECTS])
