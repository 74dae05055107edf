"""A poisoning swarm peer for benchmarks/poison.py: `hetpeer join` that poisons what it sends its group.

    python3 benchmarks/poison_peer.py [stage-]MODE join --swarm ...

MODE: `scale` (x100), `flip` (sign-flipped) or `random` (Gaussian noise of the same RMS), applied to every
tensor it sends its group, whatever the plan's sync mode: its parameters in gossip, its contributions to the
all-reduce (its gradient every step, its change at an outer step). With `stage-`, to what it hands its lane
instead: the activations it sends the next stage and the gradients it sends the previous one (a copy a checker
asks of it as an input provider stays honest: the lie is to its lane). The tensors stay finite and of the right
shape, so every frame passes the receivers' checks: only what the numbers do gives it away. It trains honestly
otherwise: what it keeps for itself is not poisoned.
"""

from __future__ import annotations

import sys

import torch

from hetpeer import cli
from hetpeer.peer.transport.base import Transport

POISONS = {
    "scale": lambda x: x * 100.0,
    "flip": lambda x: -x,
    "random": lambda x: torch.randn_like(x) * x.pow(2).mean().sqrt(),
}
GROUP_KINDS = ("params", "allreduce")  # what a group member sends its group (frame.KINDS)
LANE_KINDS = ("activation", "gradient")  # what a stage hands its lane neighbours


def poisoned(poison, kinds: tuple[str, ...]):
    honest_send = Transport.send

    def send(self: Transport, to: str, kind: str, tensor: torch.Tensor, **options) -> None:
        if kind in kinds:
            tensor, options["copy"] = poison(tensor.detach().float()).to(tensor.dtype), False
        honest_send(self, to, kind, tensor, **options)

    return send


if __name__ == "__main__":
    mode = sys.argv.pop(1)
    lane = mode.startswith("stage-")
    if mode.removeprefix("stage-") not in POISONS:
        raise SystemExit(f"poison must be one of {', '.join(POISONS)}, or one of them after stage-, got {mode!r}")
    Transport.send = poisoned(POISONS[mode.removeprefix("stage-")], LANE_KINDS if lane else GROUP_KINDS)
    sys.exit(cli.main())
