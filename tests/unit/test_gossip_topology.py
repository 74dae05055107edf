"""Mixing topologies: every matrix is doubly stochastic with the sparsity the module describes, the
exponential graphs reach the exact average in log2(n) rounds for n a power of two (from any round),
and for other n mixing alone (no one computes) still closes the spread, only never exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetpeer.peer.gossip.topology import TOPOLOGIES, mixing_matrix, neighbours, rounds_to_average

SIZES = list(range(1, 10)) + [12, 16, 17, 32]
POWERS_OF_TWO = [1, 2, 4, 8, 16, 32]
NOT_POWERS = [3, 5, 6, 7, 9, 12, 17]
EXPONENTIAL = ("one-peer-exp", "alternating-exp-ring")


def rounds_checked(n: int) -> range:
    return range(0, 2 * math.ceil(math.log2(n)) + 3) if n > 1 else range(3)


def product(topology: str, n: int, start: int, rounds: int) -> np.ndarray:
    """W(start + rounds - 1) ... W(start): what `rounds` rounds of x <- W x do to x."""
    p = np.eye(n)
    for r in range(start, start + rounds):
        p = mixing_matrix(topology, n, r) @ p
    return p


def spread(x: np.ndarray) -> float:
    """The widest gap between two peers in any coordinate."""
    return float(np.ptp(x, axis=0).max())


# -- every matrix -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_round_is_doubly_stochastic_and_non_negative(topology, n):
    for r in rounds_checked(n):
        w = mixing_matrix(topology, n, r)
        assert w.shape == (n, n)
        assert (w >= 0).all() and (w <= 1).all()
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-15, err_msg=f"rows, round {r}")
        np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-15, err_msg=f"columns, round {r}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_neighbours_are_the_nonzero_pattern(topology, n):
    for r in rounds_checked(n):
        w = mixing_matrix(topology, n, r)
        for i in range(n):
            incoming, outgoing = neighbours(w, i)
            assert incoming == [j for j in range(n) if j != i and w[i, j] != 0]
            assert outgoing == [j for j in range(n) if j != i and w[j, i] != 0]
            assert i not in incoming and i not in outgoing


@pytest.mark.parametrize("n", [n for n in SIZES if n > 1])
def test_each_topology_has_the_shape_its_docstring_gives(n):
    for r in rounds_checked(n):
        # one-peer-exp: i averages itself with i - 2^(r mod ceil(log2 n)): one send, one receive
        shift = 2 ** (r % math.ceil(math.log2(n)))
        w = mixing_matrix("one-peer-exp", n, r)
        for i in range(n):
            assert neighbours(w, i) == ([(i - shift) % n], [(i + shift) % n])
            assert w[i, i] == 0.5 and w[i, (i - shift) % n] == 0.5
        # alternating-exp-ring: symmetric pairs i XOR 2^k; a peer whose partner is n or more keeps its own
        w = mixing_matrix("alternating-exp-ring", n, r)
        np.testing.assert_array_equal(w, w.T)
        for i in range(n):
            partner = i ^ shift
            assert neighbours(w, i)[0] == ([partner] if partner < n else [])
            assert w[i, i] == (0.5 if partner < n else 1.0)
        # ring: adjacent pairs only, symmetric, each peer in at most one pair
        w = mixing_matrix("ring", n, r)
        np.testing.assert_array_equal(w, w.T)
        for i in range(n):
            incoming, _ = neighbours(w, i)
            assert len(incoming) <= 1
            assert all((j - i) % n in (1, n - 1) for j in incoming)
        np.testing.assert_array_equal(mixing_matrix("complete", n, r), np.full((n, n), 1.0 / n))


def test_ring_alternates_pairs_as_documented():
    even, odd = mixing_matrix("ring", 6, 0), mixing_matrix("ring", 6, 1)
    assert [neighbours(even, i)[0] for i in range(6)] == [[1], [0], [3], [2], [5], [4]]
    assert [neighbours(odd, i)[0] for i in range(6)] == [[5], [2], [1], [4], [3], [0]]
    # odd n: the peer left without a partner keeps its own parameters
    even, odd = mixing_matrix("ring", 5, 2), mixing_matrix("ring", 5, 3)
    assert [neighbours(even, i)[0] for i in range(5)] == [[1], [0], [3], [2], []]
    assert [neighbours(odd, i)[0] for i in range(5)] == [[], [2], [1], [4], [3]]
    assert even[4, 4] == 1.0 and odd[0, 0] == 1.0


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_group_of_one_mixes_with_itself(topology):
    for r in range(5):
        np.testing.assert_array_equal(mixing_matrix(topology, 1, r), np.ones((1, 1)))
        assert neighbours(mixing_matrix(topology, 1, r), 0) == ([], [])


# -- the exact average ----------------------------------------------------------------------------------


def test_rounds_to_average():
    assert [rounds_to_average(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize("n", POWERS_OF_TWO)
@pytest.mark.parametrize("topology", EXPONENTIAL)
def test_log2_n_rounds_from_any_round_multiply_to_the_exact_average(topology, n):
    k = rounds_to_average(n)
    assert 2**k == n
    for start in range(2 * k + 3):
        np.testing.assert_array_equal(product(topology, n, start, k), np.full((n, n), 1.0 / n), err_msg=f"start {start}")
        if k > 1:  # and one round fewer is not enough
            assert not np.allclose(product(topology, n, start, k - 1), 1.0 / n)


@pytest.mark.parametrize("n", SIZES)
def test_complete_is_the_exact_average_every_round(n):
    for r in rounds_checked(n):
        np.testing.assert_allclose(mixing_matrix("complete", n, r) @ np.eye(n), np.full((n, n), 1.0 / n), rtol=0, atol=1e-16)


# -- when no one computes: pure mixing of random vectors ---------------------------------------------------


def mix(topology: str, x: np.ndarray, start: int, rounds: int) -> list[np.ndarray]:
    """x after each of `rounds` rounds of x <- W(r) x, r = start, start + 1, ..."""
    states = [x]
    for r in range(start, start + rounds):
        states.append(mixing_matrix(topology, len(x), r) @ states[-1])
    return states


@pytest.mark.parametrize("n", [n for n in POWERS_OF_TWO if n > 1])
@pytest.mark.parametrize("topology", EXPONENTIAL)
def test_mixing_alone_reaches_the_average_in_log2_n_rounds(topology, n):
    rng = np.random.default_rng(n)
    for start in (0, 1, 5):
        x = rng.normal(size=(n, 7)) * 10
        states = mix(topology, x, start, math.ceil(math.log2(n)))
        average = x.mean(axis=0)
        np.testing.assert_allclose(states[-1], np.broadcast_to(average, x.shape), rtol=1e-13, atol=1e-12)
        assert spread(states[-2]) > 1e-3 * spread(x)  # not earlier


@pytest.mark.parametrize("n", NOT_POWERS)
@pytest.mark.parametrize("topology", ("one-peer-exp", "alternating-exp-ring", "ring"))
def test_for_other_sizes_mixing_closes_the_spread_but_never_exactly(topology, n):
    """The module's promise for n not a power of two: every round is doubly stochastic (the mean is kept),
    log2 n rounds come close to the average but not onto it; it is approached, never reached."""
    rng = np.random.default_rng(100 + n)
    x = rng.normal(size=(n, 5))
    average = x.mean(axis=0)
    states = mix(topology, x, 0, 500)
    for before, after in zip(states, states[1:]):
        np.testing.assert_allclose(after.mean(axis=0), average, rtol=0, atol=1e-12)  # the mean is kept
        assert spread(after) <= spread(before) + 1e-12  # each peer's new value is an average: no overshoot
    k = rounds_to_average(n)
    assert spread(states[k]) > 1e-3 * spread(x)  # log2 n rounds are not the exact average ...
    assert spread(states[k]) < spread(x)  # ... but they did close the gap
    assert spread(states[-1]) < 1e-3 * spread(x)  # mixing alone converges to the average (ring: slowly)
    for start in (0, 1):  # no product of these rounds is exactly J/n (its entries are dyadic; 1/n is not)
        for rounds in range(1, 3 * k + 1):
            assert not np.array_equal(product(topology, n, start, rounds), np.full((n, n), 1.0 / n))


# -- bad arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topology, n, round_, message",
    [
        ("star", 4, 0, r"unknown topology 'star' \(known: one-peer-exp, alternating-exp-ring, ring, complete\)"),
        ("", 4, 0, "unknown topology ''"),
        ("one-peer-exp", 0, 0, "at least one peer.*n=0"),
        ("ring", -3, 0, "n=-3"),
        ("complete", 4, -1, "round >= 0.*round -1"),
        ("alternating-exp-ring", 1, -2, "round -2"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_the_problem(topology, n, round_, message):
    with pytest.raises(ValueError, match=message):
        mixing_matrix(topology, n, round_)
