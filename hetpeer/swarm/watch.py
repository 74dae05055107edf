"""Following a swarm through its coordinator's API, as any organizer's tool would: each plan it publishes,
and its progress, until it reaches a step, its peers are gone, or it stops moving. Shared by the
launchers that show a run live (`hetpeer swarm`, `hetpeer testbed`)."""

from __future__ import annotations

import math
import time
from typing import Callable

from hetpeer.coordinator.api_client import ApiClient
from hetpeer.coordinator.api_errors import ApiError
from hetpeer.coordinator.view import Progress
from hetpeer.protocol.plan import Plan

POLL_S = 0.5


class StalledError(RuntimeError):
    """The swarm's step has not moved for too long."""


def describe(progress: Progress, target: float) -> str:
    """One status line: step (of `target`, when finite), loss, throughput, plan and peers by state."""
    loss = f"{progress.loss:.4f}" if progress.loss is not None else "-"
    if progress.val_loss is not None:
        loss += f" (val {progress.val_loss:.4f})"
    of = f"/{target:g}" if math.isfinite(target) else ""
    plan = f"plan epoch {progress.epoch}" if progress.epoch >= 0 else "no plan yet"
    peers = ", ".join(f"{n} {s}" for s, n in sorted(progress.peers_by_state.items())) or "none yet"
    return f"step {progress.step}{of}  loss {loss}  {progress.tokens_per_s:,.0f} tok/s  {plan}  peers {peers}"


def follow(
    client: ApiClient,
    target: float,
    *,
    stall_s: float,
    on_plan: Callable[[Plan], None],
    on_progress: Callable[[Progress], None],
    gone: Callable[[], bool] = lambda: False,
    gone_grace_s: float = 5.0,
) -> str:
    """Poll until the swarm's step reaches `target` ("reached"), or `gone()` has held for `gone_grace_s`
    ("left": the coordinator has read their last records by then); StalledError when the step has not
    moved for `stall_s`. A coordinator that does not answer (restarting) is waited for."""
    seen: set[int] = set()
    last_step, moved = -1, time.monotonic()
    left_at: float | None = None
    while True:
        time.sleep(POLL_S)
        if left_at is None and gone():
            left_at = time.monotonic()
        if left_at is not None and time.monotonic() - left_at > gone_grace_s:
            return "left"
        try:
            progress = client.call_get_progress()
            plan, _ = client.call_get_plan()
        except ApiError:
            continue  # the coordinator may be restarting; the peers go on without it
        if plan is not None and plan.epoch not in seen:
            seen.add(plan.epoch)
            on_plan(plan)
        if progress.step != last_step:
            last_step, moved = progress.step, time.monotonic()
            on_progress(progress)
        if progress.step >= target:
            return "reached"
        if time.monotonic() - moved > stall_s:
            raise StalledError(f"the swarm made no progress for {stall_s:g} s (at step {last_step})")
