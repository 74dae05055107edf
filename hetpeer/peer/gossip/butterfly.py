"""Robust all-reduce: a butterfly in which each part's owner aggregates with CenteredClip, and each member bounds
what an owner hands back by its own contribution. Used wherever a group averages exactly: gradients every step
(all-reduce, and the warm start of an outer-step group) and parameter changes at outer steps.

The vector is split into one part per member. Member i sends part j of its contribution to member j (the part's
owner); the owner aggregates the n contributions to its part and sends the result to every member. Each member
sends 2 (n - 1) / n of the vector and receives as much, as in a ring, in two rounds instead of 2 (n - 1).

What a minority cannot do (after BTARD-SGD, Gorbunov et al., ICML 2022, arXiv 2106.11257):

- **Steer a part as a contributor.** With `clip` set and three or more members, the owner takes the weighted
  CenteredClip of the contributions: the fixed point x of x = x + sum_k w_k clip(c_k - x, tau) / sum_k w_k,
  with tau = clip x the median distance of the others to their medoid over sqrt(2) (two honest contributions lie
  sqrt(2) times further apart than each from their centre). While fewer than half the members lie, the medoid
  is an honest contribution and tau an honest distance, so the liars move x at most their weight over the
  honest members' times tau from the honest members' mean. Honest contributions lie within tau of their mean
  (their distances concentrate), so an honest group's result is its exact weighted mean, found in one pass.
- **Replace a part as its owner.** Each member takes an owner's result only where it lies within `clip` x the
  norm of its own contribution to that part from that contribution, and holds that contribution at half its
  weight or more (`judge`); otherwise it takes its own contribution for that part, a noisier but honest one.
  An honest result passes both by a wide margin: the members' differences are mostly noise, so |mean - c_i| is
  about |c_i| sqrt((n - 1) / n), and the others' noise is nearly orthogonal to c_i. A result scaled, flipped,
  replaced by noise or by anything that leaves a member's contribution out fails for every member. What an
  owner can still add unseen is a vector orthogonal to every contribution and shorter than the bound.
- **In a pair** there is no majority to find: each owner takes the other's contribution only as far as `clip` x
  its own from its own, and each member takes the other owner's result only within half that (the norm of its
  own), so no part a member takes is further than its own contribution's norm from it: its step never points
  against its own gradient, whatever the other sends.

Who is far (a contributor past `OUTLIER_FACTOR` x tau at its owner; an owner whose result is that many times past
a member's bound, or leaves its contribution out) is returned, for the group's reports (`GroupSync.outliers`). Complexity per member
and exchange: O(n x part) memory at an owner (one vector in all) and three passes over it (`centered_clip`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.codec import as_received

PASSES = 16  # CenteredClip's iterations at most, from the medoid, when someone is clipped
OUTLIER_FACTOR = 2.0  # "far": this many times the bound; an honest member a little past it is only clipped
CONTRIBUTION, RESULT = 0, 1  # the two rounds, as a frame's micro


@dataclass(frozen=True, slots=True)
class Aggregate:
    mean: torch.Tensor
    radius: float  # tau: how far from the mean a contribution counts whole (inf: no clipping)
    scales: tuple[float, ...]  # what each contribution counted for, 1.0 whole, in member order
    far: tuple[bool, ...]  # whether each was past OUTLIER_FACTOR x the radius


def centered_clip(contributions: torch.Tensor, weights: torch.Tensor, clip: float | None, own: int | None = None) -> Aggregate:
    """The weighted CenteredClip of `contributions` ([n, d]) with `weights` ([n], positive): where they all lie
    within the radius of their weighted mean, that mean, exactly. `own` (in a pair): the radius is `clip` x the
    norm of contribution `own`, centred on it, since two contributions have no majority to find a centre by.

    The centre and the iteration live in the contributions' span: every point is sum_k a_k c_k with sum_k a_k = 1,
    and every distance comes from their Gram matrix, so the whole costs two passes over the contributions (the
    Gram matrix and the mean) plus O(n^3) per iteration, however far the iteration has to go."""
    n = len(contributions)
    w = (weights.double() / weights.double().sum()).to(contributions.device)
    mean = w.to(contributions.dtype) @ contributions
    if clip is None or n < 2:
        return Aggregate(mean, float("inf"), (1.0,) * n, (False,) * n)
    deviations = contributions - mean
    gram = (deviations @ deviations.T).double()

    def distances(a: torch.Tensor) -> torch.Tensor:
        """|c_k - sum_j a_j c_j| for every k, from the Gram matrix of the deviations from the mean."""
        e = torch.eye(n, dtype=torch.float64, device=gram.device) - a  # row k: the coefficients of c_k - x
        return torch.einsum("ki,ij,kj->k", e, gram, e).clamp_min(0.0).sqrt()

    def point(a: torch.Tensor) -> torch.Tensor:
        return mean + (a - w).to(contributions.dtype) @ deviations  # sum_k a_k c_k, exact where a = w

    if own is not None:
        radius = clip * float(contributions[own].norm())
        start = torch.zeros(n, dtype=torch.float64, device=gram.device)
        start[own] = 1.0
        far = distances(start)
        scales = torch.clamp(radius / far.clamp_min(1e-30), max=1.0)
        a = start + w * scales - start * float((w * scales).sum())  # own + sum_k w_k s_k (c_k - own)
        return Aggregate(point(a), radius, tuple(scales.tolist()), tuple((far > OUTLIER_FACTOR * radius).tolist()))
    # the centre: the medoid, the contribution nearest to all the others; while most are honest it is an honest one
    pairwise = (gram.diagonal()[:, None] + gram.diagonal()[None, :] - 2 * gram).clamp_min(0.0).sqrt()
    medoid = int(pairwise.sum(dim=1).argmin())
    # two honest contributions lie sqrt(2) times further apart than each from their centre (independent noise)
    radius = clip * float(pairwise[medoid][torch.arange(n) != medoid].median()) / math.sqrt(2)
    a = w.clone()
    if radius == 0.0:  # a majority sent the same: that is the answer
        a = torch.zeros_like(w)
        a[medoid] = 1.0
    else:
        for step in range(PASSES):
            scales = torch.clamp(radius / distances(a).clamp_min(1e-30), max=1.0)
            if bool((scales == 1.0).all()):
                break  # none is past the radius of the weighted mean of all of them: the fixed point
            if step == 0:
                a = torch.zeros_like(w)
                a[medoid] = 1.0  # someone is far: start from the medoid, which a minority cannot move far
                continue
            a = a + w * scales - a * float((w * scales).sum())  # x + sum_k w_k s_k (c_k - x)
    final = distances(a)
    scales = torch.clamp(radius / final.clamp_min(1e-30), max=1.0) if radius > 0 else (final == 0).double()
    return Aggregate(mean if torch.equal(a, w) else point(a), radius, tuple(scales.tolist()),
                     tuple((final > OUTLIER_FACTOR * radius).tolist()))


@dataclass(frozen=True, slots=True)
class Verdict:
    taken: bool  # within the bound and holding the member's own contribution: taken as it is
    far: bool  # past OUTLIER_FACTOR x the bound, or not holding the member's contribution at all: a sign of a liar


def judge(result: torch.Tensor, own: torch.Tensor, weight: float, factor: float) -> Verdict:
    """Whether a member takes an owner's `result` for a part to which it contributed `own` with `weight` (its share
    of the group's weights): within `factor` x |own| of `own`, and holding `own` at half its weight or more
    (<result, own> >= weight |own|^2 / 2). An honest result holds it at its weight or more: the others'
    contributions add their noise, nearly orthogonal to it, and the shared signal, which only adds."""
    norm2 = float(own.pow(2).sum())
    if norm2 == 0.0:
        return Verdict(True, False)  # nothing of its own to compare with
    distance = float((result - own).norm()) / (factor * math.sqrt(norm2))
    presence = float(result.flatten() @ own.flatten()) / (weight * norm2)
    return Verdict(distance <= 1.0 and presence >= 0.5, distance > OUTLIER_FACTOR or presence < 0.25)


@dataclass(frozen=True, slots=True)
class Outcome:
    clipped: int  # contributions this peer clipped as an owner, and owners' results it did not take as a member
    far: tuple[str, ...]  # members far off this exchange (a contributor, or an owner's result: `Verdict.far`)
    near: tuple[str, ...]  # members within their bound


class Butterfly:
    """One member's side of a group's robust all-reduce. `sizes`: the parts' lengths, member order."""

    def __init__(self, transport: Transport, members: tuple[str, ...], index: int, sizes: list[int], epoch: int,
                 clip: float | None) -> None:
        self.transport, self.members, self.index, self.sizes = transport, members, index, sizes
        self.epoch, self.clip = epoch, clip

    def shape(self, sender: str, micro: int) -> tuple[int, ...] | None:
        """The shape of `sender`'s frame `micro` this member expects, or None when there is no such frame."""
        if sender not in self.members:
            return None
        if micro == CONTRIBUTION:
            return (self.sizes[self.index],)
        if micro == RESULT:
            return (self.sizes[self.members.index(sender)],)
        return None

    def average(self, vector: torch.Tensor, step: int, weights: list[float], timeout_s: float, codec: str = "raw") -> Outcome:
        """Replace `vector` (this member's contribution) by the group's robust weighted average, in place."""
        n, i = len(self.members), self.index
        parts = list(vector.tensor_split(n))
        own = [part.clone() for part in parts] if self.clip is not None else parts
        others = [j for j in range(n) if j != i]
        for j in others:
            self.transport.send(self.members[j], "allreduce", parts[j], step=step, micro=CONTRIBUTION, epoch=self.epoch, codec=codec)
        received = {j: self.transport.recv("allreduce", self.members[j], step, CONTRIBUTION, timeout_s).to(vector.device)
                    for j in others}
        mine = as_received(parts[i], codec) if codec != "raw" else parts[i]
        stack = torch.stack([mine if j == i else received[j] for j in range(n)])
        aggregate = centered_clip(stack, torch.tensor(weights, dtype=torch.float64, device=vector.device),
                                  self.clip, own=i if n == 2 else None)
        # what the others take of this part is what the frame carries: keep the same, so the members agree exactly
        parts[i].copy_(as_received(aggregate.mean, codec) if codec != "raw" else aggregate.mean)
        for j in others:
            self.transport.send(self.members[j], "allreduce", parts[i], step=step, micro=RESULT, epoch=self.epoch, codec=codec)
        clipped = sum(scale < 1.0 for scale in aggregate.scales)
        far = {self.members[j] for j in others if aggregate.far[j]}
        near = {self.members[j] for j in others if aggregate.scales[j] == 1.0}
        share = weights[i] / sum(weights)
        for j in others:
            result = self.transport.recv("allreduce", self.members[j], step, RESULT, timeout_s).to(vector.device)
            if self.clip is not None:
                verdict = judge(result, own[j], share, self.clip / 2 if n == 2 else self.clip)
                if not verdict.taken:  # its own contribution instead: its lane's gradient (or change), a noisier one
                    result = own[j]
                    clipped += 1
                    near.discard(self.members[j])
                if verdict.far:
                    far.add(self.members[j])
            parts[j].copy_(result)
        return Outcome(clipped, tuple(sorted(far)), tuple(sorted(near - far)))
