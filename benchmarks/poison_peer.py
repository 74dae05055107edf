"""A poisoning swarm peer for benchmarks/poison.py: `hetpeer join` whose gossip sends harmful parameters.

    python3 benchmarks/poison_peer.py MODE join --swarm ...

MODE: `scale` (its parameters x100), `flip` (sign-flipped) or `random` (Gaussian noise of the parameters'
RMS). The parameters stay finite and of the right shape, so every frame passes the receivers' checks: only
what the numbers do gives it away. It trains and mixes honestly otherwise; only what it sends is poisoned.
"""

from __future__ import annotations

import sys

import torch

from hetpeer import cli
from hetpeer.peer.gossip.group import GroupSync

POISONS = {
    "scale": lambda x: x * 100.0,
    "flip": lambda x: -x,
    "random": lambda x: torch.randn_like(x) * x.pow(2).mean().sqrt(),
}


def poisoned(poison):
    honest_send = GroupSync._send_params

    def send(self: GroupSync, step: int) -> None:
        # the caller's thread owns the parameters between steps: swap the poison in for the send only
        with self.lock:
            kept = self.flat.data.detach().clone()
            self.flat.data.copy_(poison(kept))
        try:
            honest_send(self, step)
        finally:
            with self.lock:
                self.flat.data.copy_(kept)

    return send


if __name__ == "__main__":
    mode = sys.argv.pop(1)
    if mode not in POISONS:
        raise SystemExit(f"poison must be one of {', '.join(POISONS)}, got {mode!r}")
    GroupSync._send_params = poisoned(POISONS[mode])
    sys.exit(cli.main())
