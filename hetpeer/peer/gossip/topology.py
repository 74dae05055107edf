"""Who mixes with whom: one doubly stochastic mixing matrix per round, for a group of n peers in lane order.

Row i of W(r) holds the weights peer i gives to the parameters it mixes in round r (row sums are 1,
so a peer's mix is an average; column sums are 1, so the group's mean is preserved). Topologies of
Wang et al. (ICLR 2025), defined here for any n (their decent-dp package calls our
`alternating-exp-ring` `one-peer-exp`; ours of that name is Ying et al.'s directed shift):

- `complete`: W = J / n, the exact average, every peer sending to every other (n - 1 sends);
- `ring`: alternating pairs. Even rounds pair (0,1), (2,3), ...; odd rounds (1,2), (3,4), ... and,
  for even n, (n-1, 0). Paired peers average; a peer left without a partner (odd n) keeps its own.
- `one-peer-exp`: the one-peer exponential graph (Ying et al., NeurIPS 2021). Round r uses the
  shift s = 2^(r mod ceil(log2 n)): peer i averages itself with peer i - s (mod n); each peer sends one
  copy and receives one. For n a power of two, log2 n consecutive rounds multiply to J / n (the exact
  average); for other n every round is still doubly stochastic, but the product is only close to it.
- `alternating-exp-ring`: symmetric pairs 2^k apart. Round r pairs i with i XOR 2^k, k = r mod
  ceil(log2 n); a peer whose partner would be n or more keeps its own. For n a power of two, log2 n
  rounds reach the exact average (a hypercube); otherwise close to it.

Groups of one mix with themselves. Costs O(n^2) per matrix; groups are small.
"""

from __future__ import annotations

import math

import numpy as np

from hetpeer.protocol.recipe import TOPOLOGIES  # the names a recipe may give


def rounds_to_average(n: int) -> int:
    """Rounds of the exponential topologies after which a power-of-two group holds the exact average."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def mixing_matrix(topology: str, n: int, round_: int) -> np.ndarray:
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r} (known: {', '.join(TOPOLOGIES)})")
    if n < 1 or round_ < 0:
        raise ValueError(f"need a group of at least one peer and a round >= 0, got n={n}, round {round_}")
    if n == 1:
        return np.ones((1, 1))
    if topology == "complete":
        return np.full((n, n), 1.0 / n)
    w = np.zeros((n, n))
    if topology == "one-peer-exp":
        shift = 2 ** (round_ % rounds_to_average(n)) % n
        for i in range(n):
            w[i, i] += 0.5
            w[i, (i - shift) % n] += 0.5
        return w
    partner = _ring_partners(n, round_) if topology == "ring" else _hypercube_partners(n, round_)
    for i, j in enumerate(partner):
        if j == i:
            w[i, i] = 1.0
        else:
            w[i, i] = w[i, j] = 0.5
    return w


def neighbours(w: np.ndarray, i: int) -> tuple[list[int], list[int]]:
    """(peers whose parameters i mixes in, peers that mix in i's parameters) under W, i excluded."""
    incoming = [j for j in range(len(w)) if j != i and w[i, j] > 0]
    outgoing = [j for j in range(len(w)) if j != i and w[j, i] > 0]
    return incoming, outgoing


def _ring_partners(n: int, round_: int) -> list[int]:
    partner = list(range(n))
    start = round_ % 2
    pairs = [(i, (i + 1) % n) for i in range(start, n, 2) if (i + 1 < n or (n % 2 == 0 and start == 1))]
    for a, b in pairs:
        partner[a], partner[b] = b, a
    return partner


def _hypercube_partners(n: int, round_: int) -> list[int]:
    bit = 2 ** (round_ % rounds_to_average(n))
    return [i ^ bit if (i ^ bit) < n else i for i in range(n)]
