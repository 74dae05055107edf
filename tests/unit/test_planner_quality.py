"""The steps factor table (`planner/quality.py`): its measured points read back, what lies between them is
interpolated in log group size and log tokens, and what lies outside follows the stated fallback."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetpeer.coordinator.planner.quality import TABLE, Table

SMALL = Table(peers=(4, 8), lane_tokens=(512, 2048), gossip=((1.4, 1.2), (2.0, 1.5)),
              outer={10: ((1.1, 1.0), (1.2, 1.1)), 50: ((1.3, 1.2), (1.5, 1.3))}, noise_tokens=1000.0, source="test")


def test_measured_points_read_back():
    for i, peers in enumerate(SMALL.peers):
        for j, tokens in enumerate(SMALL.lane_tokens):
            assert SMALL.factor("gossip", peers, tokens) == pytest.approx(SMALL.gossip[i][j])
            for h, rows in SMALL.outer.items():
                assert SMALL.factor("outer", peers, tokens, h) == pytest.approx(rows[i][j])


def test_between_points_it_is_bilinear_in_logs():
    # 1,024 tokens is a half of the way from 512 to 2,048 in log2; 2 lanes half-way from 1 (factor 1) to 4
    assert SMALL.factor("gossip", 4, 1024) == pytest.approx(1.3)
    assert SMALL.factor("gossip", 2, 512) == pytest.approx(1.2)
    assert SMALL.factor("gossip", 2, 1024) == pytest.approx((1 + 1.3) / 2)
    # H = 22 lies log(2.2) / log(5) of the way from 10 to 50
    assert SMALL.factor("outer", 4, 512, every=22) == pytest.approx(1.1 + 0.2 * math.log(22 / 10) / math.log(5))


def test_outside_the_table_the_stated_fallback():
    assert SMALL.factor("gossip", 4, 100_000) == SMALL.factor("gossip", 4, 2048)  # lane tokens clamp
    assert SMALL.factor("gossip", 4, 10) == SMALL.factor("gossip", 4, 512)
    assert SMALL.factor("gossip", 16, 512) == pytest.approx(2.6)  # one more doubling: +0.6 again
    assert SMALL.factor("gossip", 32, 512) == pytest.approx(3.2)
    # over three measured sizes, their mean growth a doubling; one that fell is held, never extrapolated down
    three = Table(peers=(4, 8, 16), lane_tokens=(512,), gossip=((1.4,), (2.2,), (2.0,)), outer={10: ((1.1,), (1.2,), (1.3,))},
                  noise_tokens=1.0, source="t")
    assert three.factor("gossip", 32, 512) == pytest.approx(2.0 + (2.0 - 1.4) / 2)
    assert three.factor("outer", 64, 512, 10) == pytest.approx(1.3 + 2 * (1.3 - 1.1) / 2)
    fell = Table(peers=(4, 8), lane_tokens=(512,), gossip=((1.4,), (1.2,)), outer={10: ((1.1,), (1.1,))}, noise_tokens=1.0,
                 source="t")
    assert fell.factor("gossip", 32, 512) == pytest.approx(1.2)
    assert SMALL.factor("outer", 4, 512, every=200) == SMALL.factor("outer", 4, 512, every=50)  # H clamps
    assert SMALL.factor("outer", 4, 512) == SMALL.factor("outer", 4, 512, every=50)  # no H: the largest


def test_groups_of_one_and_all_reduce_cost_no_steps_and_nothing_reads_below_one():
    assert SMALL.factor("gossip", 1, 512) == SMALL.factor("allreduce", 8, 512) == SMALL.factor("none", 1, 512) == 1.0
    better = Table(peers=(4,), lane_tokens=(512,), gossip=((0.9,),), outer={10: ((0.8,),)}, noise_tokens=1.0, source="t")
    assert better.factor("gossip", 4, 512) == better.factor("outer", 4, 512, 10) == 1.0
    with pytest.raises(ValueError, match="no steps factor for sync 'ring'"):
        SMALL.factor("ring", 4, 512)


def test_the_noise_scale_places_a_group_on_the_table():
    # a swarm whose noise scale is 4x the table's reads 2,048-token lanes where the table's 512-token ones are
    assert SMALL.factor("gossip", 8, 2048, noise_tokens=4000.0) == pytest.approx(SMALL.factor("gossip", 8, 512))
    assert SMALL.factor("gossip", 8, 512, noise_tokens=250.0) == pytest.approx(SMALL.factor("gossip", 8, 2048))
    vector = SMALL.outer_factors(8, 2048, np.array([10, 50]), noise_tokens=4000.0)
    assert vector == pytest.approx([SMALL.outer[10][1][0], SMALL.outer[50][1][0]])


@pytest.mark.parametrize("change, words", [
    (dict(gossip=((1.4,), (2.0,))), "steps factor table gossip"),
    (dict(peers=(8, 4)), "group sizes must ascend"),
    (dict(peers=(1, 8)), "from at least 2"),
    (dict(lane_tokens=(2048, 512)), "lane tokens must ascend"),
    (dict(noise_tokens=0.0), "noise scale must be positive"),
    (dict(outer={10: ((1.1, float("nan")), (1.2, 1.1))}), "outer H=10"),
])
def test_a_malformed_table_is_refused(change, words):
    fields = dict(peers=SMALL.peers, lane_tokens=SMALL.lane_tokens, gossip=SMALL.gossip, outer=SMALL.outer,
                  noise_tokens=SMALL.noise_tokens, source="test")
    with pytest.raises(ValueError, match=words):
        Table(**{**fields, **change})


def test_the_shipped_table_says_larger_lane_batches_cost_fewer_steps():
    """What the measurements behind it show (docs/gossip.md): at every group size, gossip and outer steps cost fewer
    steps as a lane's batch grows, outer steps every 50 more than every 10, and nothing reads below all-reduce."""
    for rows in (TABLE.gossip, *TABLE.outer.values()):
        rows = np.asarray(rows)
        assert np.all(np.diff(rows, axis=1) < 0) and np.all(rows >= 1)
    assert np.all(np.asarray(TABLE.outer[50]) > np.asarray(TABLE.outer[10]))
