"""The swarm's data order: every window once an epoch whatever the plans' shapes, and the data position
that plans, checkpoints and resumptions carry."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from hetpeer.coordinator.publishing import Publisher
from hetpeer.peer.data.order import OrderError, WindowOrder
from hetpeer.protocol.plan import Plan, StagePlan


def plan_of(lanes: int, batch: int, start_step: int, epoch: int, data_position: int = 0) -> Plan:
    devices = tuple(f"d{i}" for i in range(lanes))
    return Plan("time", "tiny", 4, batch, 1, -(-batch // lanes), "fp32", (StagePlan(0, 0, 4, devices, "gossip"),),
                epoch=epoch, start_step=start_step, data_position=data_position)


@pytest.mark.parametrize("counts, block", [([5, 0, 7, 3, 11, 2, 9], 2), ([100], 4), ([3] * 10, 4), ([1, 1], 1)])
def test_each_epoch_visits_every_window_once(counts, block):
    order = WindowOrder(counts, seed=7, block_shards=block)
    total = sum(counts)
    every = {(s, w) for s, c in enumerate(counts) for w in range(c)}
    for epoch in range(3):
        shards, windows = order.locate(np.arange(epoch * total, (epoch + 1) * total))
        assert set(zip(shards.tolist(), windows.tolist())) == every and len(shards) == total
    first = order.locate(np.arange(total))
    again = WindowOrder(counts, seed=7, block_shards=block).locate(np.arange(total))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))  # reproducible from the seed alone


def test_a_block_keeps_its_shards_together_and_epochs_reshuffle():
    counts = [50] * 12
    order = WindowOrder(counts, seed=1, block_shards=4)
    shards, _ = order.locate(np.arange(600))
    assert [len(set(shards[i : i + 200].tolist())) for i in range(0, 600, 200)] == [4, 4, 4]  # three blocks of four shards
    now, after = order.blocks_at(0)
    assert set(now) == set(shards[:200].tolist()) and set(after) == set(shards[200:400].tolist())  # read now, and next
    assert not np.array_equal(shards, order.locate(np.arange(600, 1200))[0])  # the next epoch: another order


def test_bad_orders_are_refused():
    for counts in ([], [0, 0], [-1, 4]):
        with pytest.raises(OrderError):
            WindowOrder(counts)
    with pytest.raises(OrderError, match="positions must be >= 0"):
        WindowOrder([4]).locate([-1])


def test_plans_of_any_shape_tile_the_order_and_the_coordinator_carries_the_position():
    """Lanes read their slices of each step's rows; the coordinator gives each new plan the position at its start step
    from the plan the swarm ran before it, so a run through re-plans reads each position exactly once."""
    publisher = SimpleNamespace(recent_plans=[])
    shapes = [(2, 16, 0), (3, 16, 7), (4, 10, 12), (1, 5, 20), (3, 12, 22)]  # lanes, batch, start step
    published = []
    for epoch, (lanes, batch, start) in enumerate(shapes, 1):
        plan = plan_of(lanes, batch, start, epoch)
        if epoch == len(shapes):  # lanes of unlike speed, taking unlike shares
            plan = replace(plan, lane_batches=(7, 1, 4), micro_batches=7)
        plan = replace(plan, data_position=Publisher._data_position(publisher, start))
        publisher.recent_plans.append(plan)
        published.append(plan)
    # a plan published and then superseded before its start step never ran: the next takes the position from before it
    dropped = replace(plan_of(2, 8, 30, 5), data_position=Publisher._data_position(publisher, 30))
    publisher.recent_plans.append(dropped)
    later = replace(plan_of(2, 8, 26, 6), data_position=Publisher._data_position(publisher, 26))
    published.append(later)
    read = []
    for plan, end in zip(published, [p.start_step for p in published[1:]] + [40]):
        for step in range(plan.start_step, end):
            for lane in range(plan.group_size):
                first = plan.data_position_at(step) + plan.lane_offset(lane)
                read += range(first, first + plan.lane_sequences(lane))
    assert sorted(read) == list(range(len(read)))  # none twice, none skipped
    assert published[1].data_position == 7 * 16 and later.data_position == published[4].data_position_at(26)
    with pytest.raises(ValueError, match="before plan epoch"):
        published[1].data_position_at(3)
