"""The gradient noise scale estimator (`peer/gossip/noise.py`, McCandlish et al. 2018, appendix A) on gradients
whose noise is known, and what it says where it cannot tell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetpeer.peer.gossip.noise import NoiseMeter, noise_scale


def test_the_estimate_recovers_a_known_noise_scale():
    """Per-example gradients G + e, e of variance sigma^2 on each of d coordinates: tr(S) = d sigma^2. A lane of b
    examples has noise of variance sigma^2 / b; the mean of n lanes sigma^2 / (n b)."""
    rng = np.random.default_rng(1)
    d, sigma, b, n = 2000, 2.0, 16, 8
    g = rng.normal(size=d) * 0.1
    meter = NoiseMeter()
    for _ in range(300):
        lanes = g + rng.normal(size=(n, d)) * sigma / np.sqrt(b)
        meter.lane(torch.from_numpy(lanes[0]))  # one peer's own lane
        meter.mean(torch.from_numpy(lanes.mean(axis=0)), n)
    expected = d * sigma**2 / float(np.square(g).sum())
    assert meter.estimate(b, n * b) == pytest.approx(expected, rel=0.2)
    # the same figures in tokens: 64 tokens an example
    assert meter.estimate(64 * b, 64 * n * b) == pytest.approx(64 * meter.estimate(b, n * b))


def test_lanes_of_unlike_shares_weighted_by_them():
    """Lanes of 4, 12 and 16 examples, their mean weighted by their shares: the mean is a batch of 32, and one
    peer's lane (12) against it recovers the same noise scale."""
    rng = np.random.default_rng(2)
    d, sigma, shares = 2000, 2.0, np.array([4, 12, 16])
    g = rng.normal(size=d) * 0.1
    meter = NoiseMeter()
    for _ in range(300):
        lanes = g + rng.normal(size=(len(shares), d)) * sigma / np.sqrt(shares)[:, None]
        meter.lane(torch.from_numpy(lanes[1]))
        meter.mean(torch.from_numpy(shares @ lanes / shares.sum()), len(shares))
    expected = d * sigma**2 / float(np.square(g).sum())
    assert meter.estimate(12, 32) == pytest.approx(expected, rel=0.2)


def test_by_hand():
    # |g_b|^2 = 5 at b = 1, |g_B|^2 = 2 at B = 4: |G|^2 = (4 * 2 - 5) / 3 = 1, tr(S) = 3 / (1 - 1/4) = 4
    assert noise_scale(5.0, 2.0, 1, 4) == pytest.approx(4.0)
    assert noise_scale(5.0, 2.0, 2, 8) == pytest.approx(8.0)  # the same in units of half an example


def test_nothing_is_said_where_nothing_can_be_told():
    meter = NoiseMeter()
    assert meter.estimate(512, 4096) is None  # before a step
    assert noise_scale(1.0, 2.0, 512, 4096) is None  # the mean's norm above a lane's: noise swamped the estimate
    assert noise_scale(5.0, 2.0, 512, 512) is None  # a group of one holds no second batch size
    assert noise_scale(5.0, 2.0, 0, 4) is None


def test_a_new_group_size_starts_the_averages_again():
    meter = NoiseMeter()
    for _ in range(50):
        meter.lane(torch.full((4,), 3.0))
        meter.mean(torch.full((4,), 1.0), 8)
    meter.lane(torch.full((4,), 2.0))
    meter.mean(torch.full((4,), 1.0), 2)
    assert (meter.steps, meter.peers) == (1, 2)
    assert meter.estimate(1, 2) == pytest.approx(noise_scale(16.0, 4.0, 1, 2))
