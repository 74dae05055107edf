"""A group's exact averaging: gradients every step (all-reduce, and the warm start of an outer-step group) and
parameter changes at outer steps. Two ways, by the recipe's `robust`:

- **Robust** (the default, `Everyone`): every member sends its whole contribution to every other, chunk by chunk,
  and every member takes the same weighted CenteredClip of the n contributions of each chunk (`centered_clip`).
  Nobody aggregates for anyone else, so there is no aggregator to trust or to check: the members' results are
  the same bits, computed by each from the same inputs. It costs m / 2 times the bytes of the butterfly below
  (each member sends (n - 1) whole vectors), in one round.
- **Plain** (`robust` 0, `Butterfly`): a butterfly whose part owners take the plain weighted mean: member i sends
  part j of its contribution to member j, which sends back the mean of the n contributions to its part. Each
  member sends 2 (n - 1) / n of the vector and receives as much, as in a ring, in two rounds instead of 2 (n - 1).

What a minority cannot do to the robust average (after BTARD-SGD, Gorbunov et al., ICML 2022, arXiv 2106.11257,
whose aggregation rule this is, without its butterfly and the checks that butterfly needs):

- **Steer it.** With three or more members, CenteredClip is the fixed point x of
  x = x + sum_k w_k clip(c_k - x, tau) / sum_k w_k, with tau = clip x the median distance of the others to their
  medoid over sqrt(2) (two honest contributions lie sqrt(2) times further apart than each from their centre).
  While fewer than half the members lie, the medoid is an honest contribution and tau an honest distance, so
  the liars move x at most their weight over the honest members' times tau from the honest members' mean.
  Honest contributions lie within tau of their mean where their distances concentrate, so an honest group's
  result is its exact weighted mean; a lane whose gradient is far larger than the others' (a batch of rare
  text) is clipped like a liar, which is what the defence costs an honest group (docs/trust.md measures it).
- **In a pair** there is no majority to find: each chunk's centre is the smaller of the two contributions and the
  other counts only within `clip` x its norm, so both members take the same step, at most (1 + clip / 2) times
  the smaller contribution, and a member whose own contribution is the smaller never steps against it.

Who is far (past `OUTLIER_FACTOR` x tau in most chunks, or apart from the group: its contributions pointing away
from the others', or nowhere near their direction, round after round, as a sign-flipped or random gradient of
honest size does) is returned, for the group's reports (`GroupSync.outliers`). What the robust average does not
see: a member that sends different contributions to different members (each honest member still bounds it, but
their results then differ by up to that bound). Complexity per member and exchange: O(n x chunk) memory beyond its own copy
of the vector, and O(n x vector) arithmetic (`centered_clip`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hetpeer.peer.transport.base import Transport
from hetpeer.peer.transport.codec import as_received

PASSES = 16  # CenteredClip's iterations at most, from the medoid, when someone is clipped
OUTLIER_FACTOR = 2.0  # "far": this many times the radius; an honest member a little past it is only clipped
OUTLIER_ROUNDS = 8  # exchanges in a row a member is far before it is reported: an honest lane's gradient is far now and then
# A member stands apart from its group where the running cosine of its contribution with the others' mean, over
# the square root of its share (a lane of fewer sequences is noisier), is below APART x the median of the others'
# (their median positive), after APART_AFTER exchanges. Honest lanes share the signal: on the tiny model their
# cosine has a median of 0.27 (below 0 in 12% of single steps), and over 400 steps no lane's running cosine fell
# below 0.36 x the others' median; a sign-flipped gradient's is negative, a random vector's about 0.
APART, APART_AFTER, COSINE_MEMORY = 0.2, 10, 0.9
# Outer steps' changes are sums of H Adam steps, whose sizes do not spike as one step's gradient does, and whose
# directions the members share far more: a member is judged apart after, and reported for, this many of them
CHANGE_ROUNDS = 3
CONTRIBUTION, RESULT = 0, 1  # the butterfly's two rounds, as a frame's micro


@dataclass(frozen=True, slots=True)
class Aggregate:
    mean: torch.Tensor
    radius: float  # tau: how far from the mean a contribution counts whole (inf: no clipping)
    scales: tuple[float, ...]  # what each contribution counted for, 1.0 whole, in member order
    far: tuple[bool, ...]  # whether each was past OUTLIER_FACTOR x the radius


def centered_clip(contributions: torch.Tensor, weights: torch.Tensor, clip: float | None) -> Aggregate:
    """The weighted CenteredClip of `contributions` ([n, d]) with `weights` ([n], positive): where they all lie
    within the radius of their weighted mean, that mean, exactly. Of two contributions, the one of smaller norm is
    the centre and the radius `clip` x its norm, since two have no majority to find a centre by.

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

    def step(a: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return a + w * scales - a * float((w * scales).sum())  # x + sum_k w_k s_k (c_k - x)

    if n == 2:
        centre = torch.zeros_like(w)
        centre[int(contributions.norm(dim=1).argmin())] = 1.0
        radius = clip * float(contributions[int(centre.argmax())].norm())
        far = distances(centre)
        scales = torch.clamp(radius / far.clamp_min(1e-30), max=1.0) if radius > 0 else (far == 0).double()
        a = step(centre, scales)
        return Aggregate(mean if torch.equal(a, w) else point(a), radius, tuple(scales.tolist()),
                         tuple((far > OUTLIER_FACTOR * radius).tolist()))
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
        for iteration in range(PASSES):
            scales = torch.clamp(radius / distances(a).clamp_min(1e-30), max=1.0)
            if bool((scales == 1.0).all()):
                break  # none is past the radius of the weighted mean of all of them: the fixed point
            if iteration == 0:
                a = torch.zeros_like(w)
                a[medoid] = 1.0  # someone is far: start from the medoid, which a minority cannot move far
                continue
            a = step(a, scales)
    final = distances(a)
    scales = torch.clamp(radius / final.clamp_min(1e-30), max=1.0) if radius > 0 else (final == 0).double()
    return Aggregate(mean if torch.equal(a, w) else point(a), radius, tuple(scales.tolist()),
                     tuple((final > OUTLIER_FACTOR * radius).tolist()))


@dataclass(frozen=True, slots=True)
class Outcome:
    clipped: int  # members whose contribution was clipped in some chunk
    far: tuple[str, ...]  # members far past the radius in most chunks this exchange
    near: tuple[str, ...]  # members clipped in no chunk


class Butterfly:
    """One member's side of a group's plain average (no `robust`): each part's owner sends back the weighted mean of
    the contributions to it. `sizes`: the parts' lengths, member order."""

    unit = "round"  # what a frame's micro counts

    def __init__(self, transport: Transport, members: tuple[str, ...], index: int, sizes: list[int], epoch: int) -> None:
        self.transport, self.members, self.index, self.sizes, self.epoch = transport, members, index, sizes, epoch

    def shape(self, sender: str, micro: int) -> tuple[int, ...] | None:
        """The shape of `sender`'s frame `micro` this member expects, or None when there is no such frame."""
        if micro == CONTRIBUTION:
            return (self.sizes[self.index],)
        if micro == RESULT:
            return (self.sizes[self.members.index(sender)],)
        return None

    def average(self, vector: torch.Tensor, step: int, weights: list[float], timeout_s: float, codec: str = "raw") -> Outcome:
        """Replace `vector` (this member's contribution) by the group's weighted mean, in place."""
        n, i = len(self.members), self.index
        parts = list(vector.tensor_split(n))
        others = [j for j in range(n) if j != i]
        for j in others:
            self.transport.send(self.members[j], "allreduce", parts[j], step=step, micro=CONTRIBUTION, epoch=self.epoch, codec=codec)
        mine = as_received(parts[i], codec) if codec != "raw" else parts[i]
        stack = torch.stack([mine if j == i else self.transport.recv("allreduce", self.members[j], step, CONTRIBUTION, timeout_s)
                             .to(vector.device) for j in range(n)])
        mean = centered_clip(stack, torch.tensor(weights, dtype=torch.float64, device=vector.device), None).mean
        # what the others take of this part is what the frame carries: keep the same, so the members agree exactly
        parts[i].copy_(as_received(mean, codec) if codec != "raw" else mean)
        for j in others:
            self.transport.send(self.members[j], "allreduce", parts[i], step=step, micro=RESULT, epoch=self.epoch, codec=codec)
        for j in others:
            parts[j].copy_(self.transport.recv("allreduce", self.members[j], step, RESULT, timeout_s).to(vector.device))
        return Outcome(0, (), tuple(self.members[j] for j in others))


class Everyone:
    """One member's side of a group's robust average: its whole contribution to every other member, in chunks of
    `chunk_elems`, and the CenteredClip of every chunk from all of them."""

    unit = "chunk"  # what a frame's micro counts

    def __init__(self, transport: Transport, members: tuple[str, ...], index: int, size: int, chunk_elems: int,
                 epoch: int, clip: float, apart_after: int = APART_AFTER) -> None:
        self.transport, self.members, self.index, self.epoch, self.clip = transport, members, index, epoch, clip
        self.apart_after = apart_after
        self.size, self.chunk_elems = size, chunk_elems
        self.chunks = -(-size // chunk_elems)
        self.leaning = torch.zeros(len(members), dtype=torch.float64)  # each member's running cosine with the others
        self.exchanges = 0

    def shape(self, sender: str, micro: int) -> tuple[int, ...] | None:
        """The shape of `sender`'s chunk `micro` this member expects, or None when there is no such chunk."""
        if not 0 <= micro < self.chunks:
            return None
        return (min(self.chunk_elems, self.size - micro * self.chunk_elems),)

    def average(self, vector: torch.Tensor, step: int, weights: list[float], timeout_s: float, codec: str = "raw") -> Outcome:
        """Replace `vector` (this member's contribution) by the group's robust weighted average, in place."""
        n, i = len(self.members), self.index
        others = [self.members[j] for j in range(n) if j != i]
        own = vector.detach().clone()  # what the others are sent, unchanged while `vector` takes the average
        for member in others:
            for c, chunk in enumerate(own.split(self.chunk_elems)):
                self.transport.send(member, "allreduce", chunk, step=step, micro=c, epoch=self.epoch, codec=codec, copy=False)
        w = torch.tensor(weights, dtype=torch.float64, device=vector.device)
        far_chunks, clipped = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
        gram = torch.zeros(n, n, dtype=torch.float64)
        for c, (chunk, out) in enumerate(zip(own.split(self.chunk_elems), vector.split(self.chunk_elems))):
            mine = as_received(chunk, codec) if codec != "raw" else chunk  # what the others take of it
            stack = torch.stack([mine if j == i else self.transport.recv("allreduce", self.members[j], step, c, timeout_s)
                                 .to(vector.device) for j in range(n)])
            aggregate = centered_clip(stack, w, self.clip)
            out.copy_(aggregate.mean)
            far_chunks += torch.tensor(aggregate.far, dtype=torch.float32)
            gram += (stack @ stack.T).double().cpu()
            clipped |= torch.tensor(aggregate.scales) < 1.0
        self.transport.flush(timeout_s, to=others)  # `own` is read until its frames have left
        apart = self._apart(gram, w.cpu())
        far = tuple(self.members[j] for j in range(n) if j != i and (far_chunks[j] * 2 > self.chunks or apart[j]))
        near = tuple(self.members[j] for j in range(n) if j != i and not clipped[j] and self.members[j] not in far)
        return Outcome(int(clipped.sum()), far, near)

    def _apart(self, gram: torch.Tensor, w: torch.Tensor) -> list[bool]:
        """Update each member's running cosine with the weighted mean of the others (from the contributions' Gram
        matrix); who stands apart from the group now (`APART`)."""
        n = len(gram)
        cosines = torch.zeros(n, dtype=torch.float64)
        for k in range(n):
            others = w.clone()
            others[k] = 0.0
            norm2 = float(gram[k, k]) * float(others @ gram @ others)
            cosines[k] = float(gram[k] @ others) / math.sqrt(norm2) if norm2 > 0 else 0.0
        self.leaning = cosines if self.exchanges == 0 else COSINE_MEMORY * self.leaning + (1 - COSINE_MEMORY) * cosines
        self.exchanges += 1
        if self.exchanges < self.apart_after or n < 3:
            return [False] * n
        scaled = self.leaning / (w / w.mean()).sqrt()
        apart = []
        for k in range(n):
            typical = float(torch.cat([scaled[:k], scaled[k + 1:]]).median())
            apart.append(typical > 0 and float(scaled[k]) < APART * typical)
        return apart
