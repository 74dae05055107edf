"""Per-sender token buckets on a clock stepped by hand: within its limit a sender is served, past it refused
(as late at first, then counted), and served again once its bucket refills; its debt stops; a changed rate
takes effect; refilled senders are forgotten."""

from __future__ import annotations

import math

import pytest

from hetpeer.peer.ratelimit import DEBT_BURSTS, PRUNE_AT, Rate, TokenBuckets, refusal
from hetpeer.peer.transport.inbox import Late


class Clock:
    """A clock that moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_sender_is_served_within_its_burst_and_refused_past_it(clock):
    buckets = TokenBuckets(Rate(per_s=2.0, burst=10.0), clock)
    assert [buckets.take("a") for _ in range(10)] == [0.0] * 10
    assert buckets.take("a") == pytest.approx(0.1)  # one past a burst of ten
    assert buckets.take("b") == 0.0  # every sender has its own bucket
    assert buckets.take("a", cost=0.0) > 0  # a sender in debt is refused even a free request
    assert buckets.available("b") == 9.0


def test_the_bucket_refills_at_its_rate_up_to_its_burst(clock):
    buckets = TokenBuckets(Rate(per_s=2.0, burst=10.0), clock)
    assert buckets.take("a", cost=10.0) == 0.0
    clock.now += 1.0  # two tokens back
    assert [buckets.take("a") for _ in range(3)][:2] == [0.0, 0.0]
    clock.now += 1000.0
    assert buckets.available("a") == 10.0  # never more than the burst
    assert buckets.take("a", cost=10.0) == 0.0 and buckets.take("a", cost=1.0) > 0


def test_refusals_are_late_up_to_a_burst_past_the_limit_and_counted_beyond(clock):
    buckets = TokenBuckets(Rate(per_s=1.0, burst=10.0), clock)
    reasons = [refusal(buckets.take("a"), "too many") for _ in range(31)]
    assert reasons[:10] == [None] * 10
    assert all(isinstance(r, Late) for r in reasons[10:20])  # an overshoot of up to a burst: no one's fault
    assert reasons[20:] == ["too many"] * 11 and not any(isinstance(r, Late) for r in reasons[20:])


def test_a_sender_that_keeps_asking_stays_refused_and_one_that_stops_is_served_again(clock):
    buckets = TokenBuckets(Rate(per_s=2.0, burst=10.0), clock)
    for _ in range(1000):
        buckets.take("a", cost=5.0)
    assert buckets.available("a") == -DEBT_BURSTS * 10.0  # the debt stops at two bursts
    clock.now += 10.0  # refilled 20: still in debt
    assert buckets.take("a") > 0
    clock.now += (DEBT_BURSTS * 10.0 + 1.0) / 2.0
    assert buckets.take("a") == 0.0


def test_a_new_rate_takes_effect_for_buckets_already_there(clock):
    buckets = TokenBuckets(Rate(per_s=1.0, burst=10.0), clock)
    assert buckets.take("a", cost=10.0) == 0.0
    buckets.rate = Rate(per_s=100.0, burst=1000.0)  # a peer that took on a larger stage
    clock.now += 5.0
    assert buckets.available("a") == 500.0
    assert buckets.take("b", cost=1000.0) == 0.0  # a new sender starts with the new burst
    buckets.rate = Rate(per_s=1.0, burst=3.0)
    clock.now += 100.0
    assert buckets.available("a") == 3.0  # cut to the smaller burst


def test_senders_whose_buckets_refilled_are_forgotten(clock):
    buckets = TokenBuckets(Rate(per_s=1.0, burst=2.0), clock)
    for i in range(PRUNE_AT):
        buckets.take(f"p{i}")
    assert len(buckets) == PRUNE_AT
    clock.now += 1.0  # every one of them is full again
    buckets.take("late")
    assert len(buckets) == 1  # only the sender that just asked


@pytest.mark.parametrize("per_s, burst", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (math.inf, 1.0), (1.0, math.nan)])
def test_a_rate_must_be_positive_and_finite(per_s, burst):
    with pytest.raises(ValueError, match="positive, finite"):
        Rate(per_s, burst)


@pytest.mark.parametrize("cost", [-1.0, math.inf, math.nan])
def test_a_cost_must_be_finite_and_not_negative(clock, cost):
    with pytest.raises(ValueError, match="cost"):
        TokenBuckets(Rate(1.0, 1.0), clock).take("a", cost)
