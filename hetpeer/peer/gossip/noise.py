"""The gradient noise scale, measured where a group all-reduces: each lane's gradient against the group's mean.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", appendix A) estimate the simple noise scale
B_simple = tr(S) / |G|^2 (S the per-example gradient covariance, G the true gradient) from the squared gradient
norm at two batch sizes b < B, whose expectations are |G|^2 + tr(S) / b and |G|^2 + tr(S) / B:

    |G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b),      tr(S) ~ (|g_b|^2 - |g_B|^2) / (1 / b - 1 / B)

An all-reduce group holds both for free: each lane's own gradient (b = the lane's tokens a step, before the
ring) and the mean, weighted by the lanes' shares of the batch (B = the group's tokens a step, after it).
Both estimators are noisy, so each is averaged
(an exponential average over steps, as the paper advises) before their ratio is taken. B_simple in tokens is
where a batch stops paying: a lane batch well below it gains nearly n-fold from averaging n of them, one well
above it little, which is what places a swarm on the planner's steps factor table (`planner/quality.py`).
A stage's peers see their stage's gradient only, so each measures its stage's noise scale; the coordinator takes
the median over the swarm's peers.
"""

from __future__ import annotations

import torch

SMOOTHING = 0.05  # weight of a new step in the averages: about the last 20 steps


def noise_scale(small: float, big: float, lane_tokens: float, group_tokens: float) -> float | None:
    """B_simple in tokens from the mean squared gradient norm at a lane's batch (`small`, `lane_tokens` tokens)
    and at the group's (`big`, `group_tokens` tokens); None where the estimate is not positive (too few steps to
    tell) or the group holds no larger batch than the lane."""
    if not 0 < lane_tokens < group_tokens:
        return None
    b, nb = lane_tokens, group_tokens
    gradient = (nb * big - b * small) / (nb - b)
    trace = (small - big) / (1 / b - 1 / nb)
    return trace / gradient if gradient > 0 and trace > 0 else None


class NoiseMeter:
    """Running averages of |g_lane|^2 and |g_mean|^2 for one peer of an all-reduce group, kept on the gradient's
    device (no host sync a step): `lane` before the ring, `mean` after it, `estimate` when asked."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.squares = torch.zeros(2, dtype=torch.float64, device=device)  # averaged |g_lane|^2, |g_mean|^2
        self.pending = torch.zeros((), dtype=torch.float64, device=device)
        self.steps = 0
        self.peers = 0

    def lane(self, grad: torch.Tensor) -> None:
        self.pending = torch.linalg.vector_norm(grad).double().square()

    def mean(self, grad: torch.Tensor, peers: int) -> None:
        if peers != self.peers:  # a different group: what came before is another batch size
            self.steps, self.peers = 0, peers
        step = torch.stack([self.pending, torch.linalg.vector_norm(grad).double().square()])
        weight = max(SMOOTHING, 1.0 / (self.steps + 1))  # the plain mean until there are enough steps (the first: itself)
        self.squares.mul_(1 - weight).add_(step, alpha=weight)
        self.steps += 1

    def estimate(self, lane_tokens: float, group_tokens: float) -> float | None:
        """B_simple in tokens from the averages (this lane's tokens a step, and its group's), or None before a step
        or where it is not positive."""
        if not self.steps or self.peers < 2:
            return None
        small, big = self.squares.tolist()
        return noise_scale(small, big, lane_tokens, group_tokens)
