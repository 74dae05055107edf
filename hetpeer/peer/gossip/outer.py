"""Outer steps: a group that syncs every H steps instead of every step (DiLoCo, Douillard et al. 2023).

Between outer steps each peer trains alone (its own Adam steps; its moments never travel). Every H steps
the group averages its parameter change since the last outer step, the pseudo-gradient

    delta_i = anchor - x_i,        delta = mean_i delta_i            (all-reduce: `group.py`)

and every peer takes the same Nesterov step from the shared anchor:

    u = mu u + delta,   anchor = anchor - lr_outer (delta + mu u),   x_i = anchor

DiLoCo's settings are the defaults: lr_outer 0.7, mu 0.9, H = 500 for models it trained from a pretrained
start; lr_outer 1, mu 0 is plain model averaging every H steps.

Overlapped (a plan's `outer_delay` D > 0): the exchange of the change taken after step t runs beside steps
t + 1 .. t + D (`Exchange`), and the outer step lands after step t + D, keeping what the peer learned
meanwhile (as Streaming DiLoCo's overlap does, Douillard et al. 2025):

    x_i = anchor_new + (x_i - x_i(t)) = x_i + delta_i + (anchor_new - anchor) Every member holds the same anchor and
momentum after an outer step (they start equal and change by the same averaged delta), so they are what a
peer that (re)joins downloads with the parameters, and what a checkpoint keeps.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, slots=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not math.isfinite(self.lr) or not self.lr > 0:
            raise ValueError(f"the outer learning rate must be positive and finite, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {self.momentum}")


class OuterState:
    """The anchor (the parameters after the last outer step) and the outer momentum of one stage, flat."""

    def __init__(self, x: torch.Tensor) -> None:
        self.anchor = x.detach().clone()
        self.momentum = torch.zeros_like(x)

    def restart(self, x: torch.Tensor) -> None:
        """Anchor at `x` with no momentum: a group that enters outer steps, or state that came without them."""
        self.anchor.copy_(x)
        self.momentum.zero_()


@torch.no_grad()
def delta(x: torch.Tensor, state: OuterState) -> torch.Tensor:
    """This peer's parameter change since the last outer step, as a new vector (anchor - x)."""
    return state.anchor - x


@torch.no_grad()
def outer_step(x: torch.Tensor, mean_delta: torch.Tensor, state: OuterState, config: OuterConfig,
               own: torch.Tensor | None = None) -> None:
    """Apply the group's averaged change: move the anchor by one (Nesterov) momentum step and set x to it, or,
    given `own` (this peer's change the average was taken of, after which x moved on), move x as the anchor
    moved from the point `own` was taken at. `mean_delta` is used as scratch."""
    if own is not None:
        x.add_(own).sub_(state.anchor)  # what x learned since the change was taken, from the old anchor
    state.momentum.mul_(config.momentum).add_(mean_delta)
    direction = mean_delta.add_(state.momentum, alpha=config.momentum) if config.nesterov else state.momentum
    state.anchor.sub_(direction, alpha=config.lr)
    if own is None:
        x.copy_(state.anchor)
    else:
        x.add_(state.anchor)


class Exchange:
    """An outer step's exchange running beside the next steps' compute: `run` (the ring, averaging `mean` in
    place) in a thread of its own, to be applied after step `at`. `own` is this peer's change, kept."""

    def __init__(self, run: Callable[[], None], own: torch.Tensor, mean: torch.Tensor, at: int) -> None:
        self.own, self.mean, self.at = own, mean, at
        self._run, self._error = run, None
        self._thread = threading.Thread(target=self._body, name=f"outer-exchange-{at}", daemon=True)

    def start(self) -> "Exchange":
        self._thread.start()
        return self

    def _body(self) -> None:
        try:
            self._run()
        except BaseException as error:  # raised where the result is waited for
            self._error = error

    def wait(self) -> None:
        """Until the exchange has ended; what it raised is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
