"""What a group's sync costs in steps: the steps factor the planner multiplies a plan's step time by, so that it
compares plans by time to a loss, not by steps a second.

A group that all-reduces every step takes Adam's step on the mean of its lanes' gradients: the swarm's batch
in one step. A gossip group (decentralized Adam) or one that takes outer steps trains each lane on its own
batch between exchanges, and needs more steps to reach the same loss: `steps factor` = all-reduce's steps to
that loss over its own, measured by benchmarks/gossip_scale.py and tabled by benchmarks/gossip_table.py
(docs/gossip.md, "The quality table"). It grows with the group (each lane's share of the batch shrinks) and
falls as a lane's batch grows against the gradient's noise (McCandlish et al. 2018: where a batch is well below
the noise scale, averaging n of them is worth up to n steps; well above it, little).

`Table.factor` reads it for a group of n lanes each stepping on `lane_tokens` tokens:

- bilinear in (log2 n, log2 lane tokens) between the measured points; a group of 1 has factor 1;
- outside the table, the stated fallback: lane tokens clamp to its range (above the largest measured, the
  largest's factor, which overstates the cost as batches grow); group sizes above the largest grow by the
  measured sizes' mean growth a doubling (from the smallest measured to the largest; never a fall), for each
  doubling beyond;
- outer steps every H steps read H's column, interpolated in log H between the measured H (clamped to them);
- never below 1: a cell whose mode ended below all-reduce (within its seeds' spread) is counted as parity;
- placed by the gradient noise scale where the swarm measures one (`noise_tokens`, the group's B_simple in
  tokens, McCandlish et al. appendix A): lane tokens are read at lane tokens x the table's own noise scale /
  the swarm's, so a model whose noise scale is 10x the table model's reads its 16K-token lanes where the
  table's 1.6K-token ones are.

A plan's factor is its largest group's: every stage's group must reach the loss, and the slowest to learn sets
the pace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOOR = 1.0  # no mode is counted better than all-reduce


@dataclass(frozen=True)
class Table:
    peers: tuple[int, ...]  # group sizes measured, ascending, each >= 2
    lane_tokens: tuple[int, ...]  # tokens a lane-step measured, ascending
    gossip: tuple[tuple[float, ...], ...]  # [peers][lane_tokens] steps factor of decentralized Adam
    outer: dict[int, tuple[tuple[float, ...], ...]]  # H -> [peers][lane_tokens] steps factor of outer steps every H
    noise_tokens: float  # the gradient noise scale (B_simple, tokens) of the runs the table was measured on
    source: str  # where the figures come from, in words

    def __post_init__(self) -> None:
        shape = (len(self.peers), len(self.lane_tokens))
        for name, rows in (("gossip", self.gossip), *((f"outer H={h}", r) for h, r in self.outer.items())):
            if np.shape(rows) != shape or not np.all(np.isfinite(rows)) or np.min(rows) <= 0:
                raise ValueError(f"steps factor table {name}: wants {shape} positive figures, got {np.shape(rows)}")
        if list(self.peers) != sorted(set(self.peers)) or self.peers[0] < 2:
            raise ValueError(f"group sizes must ascend from at least 2, got {self.peers}")
        if list(self.lane_tokens) != sorted(set(self.lane_tokens)) or self.lane_tokens[0] < 1:
            raise ValueError(f"lane tokens must ascend, got {self.lane_tokens}")
        if not self.noise_tokens > 0:
            raise ValueError(f"the table's noise scale must be positive, got {self.noise_tokens}")

    def factor(self, mode: str, peers: int, lane_tokens: float, every: int = 0, noise_tokens: float | None = None) -> float:
        """Steps factor of a group of `peers` lanes syncing by `mode` (allreduce, gossip, outer every `every` steps,
        none for a group of one), each lane stepping on `lane_tokens`; `noise_tokens`: the swarm's measured noise
        scale, where there is one."""
        if peers <= 1 or mode in ("allreduce", "none"):
            return 1.0
        if mode == "gossip":
            return self._read(np.asarray(self.gossip, dtype=float), peers, self._placed(lane_tokens, noise_tokens))
        if mode != "outer":
            raise ValueError(f"no steps factor for sync {mode!r}")
        return float(self.outer_factors(peers, lane_tokens, np.array([every or max(self.outer)]), noise_tokens)[0])

    def outer_factors(self, peers: int, lane_tokens: float, every: np.ndarray, noise_tokens: float | None = None) -> np.ndarray:
        """Steps factors of outer steps every `every` (an array of H) steps: interpolated in log H between the
        measured H, clamped to them."""
        if peers <= 1:
            return np.ones(np.shape(every))
        tokens = self._placed(lane_tokens, noise_tokens)
        spans = np.array(sorted(self.outer), dtype=float)
        measured = np.array([self._read(np.asarray(self.outer[int(h)], dtype=float), peers, tokens) for h in spans])
        return np.interp(np.log(np.clip(every, spans[0], spans[-1])), np.log(spans), measured)

    def _placed(self, lane_tokens: float, noise_tokens: float | None) -> float:
        """Where a lane's batch reads on the table: scaled by the table's noise scale over the swarm's, where known."""
        return lane_tokens * (self.noise_tokens / noise_tokens if noise_tokens else 1.0)

    def _read(self, table: np.ndarray, peers: int, tokens: float) -> float:
        """Bilinear in (log2 peers, log2 tokens), with a group of 1 at factor 1 below the first measured size."""
        x = np.log2(np.asarray(self.lane_tokens, dtype=float))
        t = float(np.clip(np.log2(max(tokens, 1.0)), x[0], x[-1]))
        column = np.array([np.interp(t, x, row) for row in table])  # (peers,) at these tokens
        sizes = np.log2(np.asarray((1, *self.peers), dtype=float))
        values = np.concatenate([[1.0], column])
        p = np.log2(peers)
        if p <= sizes[-1]:
            value = float(np.interp(p, sizes, values))
        else:  # the stated fallback: the measured sizes' mean growth a doubling (none: held), for each doubling beyond
            slope = max(0.0, (values[-1] - values[1]) / (sizes[-1] - sizes[1])) if len(sizes) > 2 else 0.0
            value = float(values[-1] + slope * (p - sizes[-1]))
        return max(FLOOR, value)


# Measured on this project's CPU (the tiny preset, 600 steps at 512 tokens a lane-step, 300 at 4,096; best learning
# rate against best, warmup and cosine: docs/gossip.md, "The quality table", 2026-11-29). Gossip is decentralized
# Adam with the recipe's default second moment (`lane`): 4, 8 (three seeds) and 16 peers at 512 tokens, 8 peers at
# 4,096. Outer steps every 10: the same cells; every 50: 8 peers at 512 tokens. The cells not run are scaled from
# the measured ones on (factor - 1): 4 and 16 peers at 4,096 tokens by 8 peers' 4,096 / 512 ratio (gossip 0.40,
# H = 10 0.41), H = 50 by 8 peers' H = 50 / H = 10 ratio at 512 tokens (2.53).
TABLE = Table(
    peers=(4, 8, 16),
    lane_tokens=(512, 4096),
    gossip=((1.39, 1.16), (2.17, 1.47), (1.98, 1.39)),
    outer={10: ((1.31, 1.13), (1.51, 1.21), (1.60, 1.25)), 50: ((1.78, 1.32), (2.29, 1.53), (2.52, 1.62))},
    noise_tokens=3907.0,  # 8 peers at 512 tokens: all-reduce's gradient noise scale over the second half (median)
    source="tiny preset on a CPU, 2026-11-29",
)


def plan_factor(factors: np.ndarray) -> np.ndarray:
    """A plan's steps factor from its groups' (..., stages): the largest."""
    return factors.max(axis=-1)
