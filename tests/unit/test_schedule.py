"""The 1F1B schedule and the plan's micro-batching: every micro-batch once each way, in order, with bounded
activations; micro-batches that cover a lane's share of the batch exactly once."""

from __future__ import annotations

import itertools

import pytest

from hetpeer.peer.pipeline.schedule import BACKWARD, FORWARD, in_flight, one_f_one_b
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.wire import SchemaError

SHAPES = list(itertools.product(range(1, 7), range(1, 10)))  # (stages, micro-batches)


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_every_micro_batch_runs_forward_then_backward_once_and_in_order(stages, micro_batches):
    for stage in range(stages):
        ops = one_f_one_b(stage, stages, micro_batches)
        assert set(op for op, _ in ops) <= {FORWARD, BACKWARD}
        forwards = [i for op, i in ops if op == FORWARD]
        backwards = [i for op, i in ops if op == BACKWARD]
        assert forwards == list(range(micro_batches))
        assert backwards == list(range(micro_batches))
        assert len(ops) == 2 * micro_batches
        for i in range(micro_batches):
            assert ops.index((FORWARD, i)) < ops.index((BACKWARD, i))


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_activations_in_flight_are_bounded_by_the_depth_below(stages, micro_batches):
    for stage in range(stages):
        assert in_flight(one_f_one_b(stage, stages, micro_batches)) == min(stages - stage, micro_batches)


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_the_last_stage_alternates_from_the_start(stages, micro_batches):
    ops = one_f_one_b(stages - 1, stages, micro_batches)
    expected = [(FORWARD, i) if k == 0 else (BACKWARD, i) for i in range(micro_batches) for k in range(2)]
    assert list(ops) == expected


@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_a_stage_never_waits_on_a_backward_that_needs_a_forward_it_has_not_sent(stages, micro_batches):
    # Replaying all stages together must finish: stage s's forward i needs stage s-1's forward i,
    # and its backward i needs stage s+1's backward i. A schedule that deadlocks leaves work undone.
    schedules = [list(one_f_one_b(s, stages, micro_batches)) for s in range(stages)]
    done = [set() for _ in range(stages)]
    progressed = True
    while progressed:
        progressed = False
        for s, ops in enumerate(schedules):
            while ops:
                op, i = ops[0]
                if op == FORWARD and s > 0 and (FORWARD, i) not in done[s - 1]:
                    break
                if op == BACKWARD and s < stages - 1 and (BACKWARD, i) not in done[s + 1]:
                    break
                done[s].add(ops.pop(0))
                progressed = True
    assert all(not ops for ops in schedules)


def test_in_flight_counts_the_peak():
    assert in_flight(()) == 0
    assert in_flight(((FORWARD, 0), (BACKWARD, 0), (FORWARD, 1), (BACKWARD, 1))) == 1
    assert in_flight(((FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (FORWARD, 2), (BACKWARD, 1), (BACKWARD, 2))) == 2


@pytest.mark.parametrize(
    "stage, stages, micro_batches, message",
    [
        (-1, 4, 2, "stage -1 is not in 0..3"),
        (4, 4, 2, "stage 4 is not in 0..3"),
        (0, 0, 2, "stage 0 is not in 0..-1"),
        (0, 4, 0, "micro_batches must be at least 1, got 0"),
        (0, 4, -3, "got -3"),
    ],
)
def test_bad_arguments_are_refused(stage, stages, micro_batches, message):
    with pytest.raises(ValueError, match=message):
        one_f_one_b(stage, stages, micro_batches)


# -- the plan's micro-batches ---------------------------------------------------------------------


def _plan(batch: int, lanes: int, micro_batch: int, micro_batches: int, stages: int = 2) -> Plan:
    return Plan(
        cost_model="time",
        model="tiny",
        layers=stages,
        batch=batch,
        micro_batch=micro_batch,
        micro_batches=micro_batches,
        dtype="fp32",
        stages=tuple(
            StagePlan(s, s, s + 1, tuple(f"s{s}l{l}" for l in range(lanes)), "gossip") for s in range(stages)
        ),
    )


def _fitting(batch: int, lanes: int):
    """(micro_batch, micro_batches) pairs a plan can hold: found by trying counts, not by a formula."""
    lane_batch = -(-batch // lanes)
    for micro_batch in range(1, lane_batch + 1):
        count = next(m for m in range(1, lane_batch + 1) if m * micro_batch >= lane_batch)
        yield micro_batch, count


@pytest.mark.parametrize("lanes", [1, 2, 3, 5])
def test_micro_batch_sizes_cover_the_lane_batch_exactly(lanes):
    checked = 0
    for batch in range(lanes, 24):
        for micro_batch, count in _fitting(batch, lanes):
            plan = _plan(batch, lanes, micro_batch, count)
            sizes = plan.micro_batch_sizes(lanes - 1)
            lane_batch = plan.lane_sequences(lanes - 1)
            # Every lane takes its share, rounded up: together the lanes cover the whole batch.
            assert lane_batch * lanes >= batch > (lane_batch - 1) * lanes
            assert sum(sizes) == lane_batch
            assert len(sizes) == plan.micro_batches == count
            assert all(size == micro_batch for size in sizes[:-1])
            assert 1 <= sizes[-1] <= micro_batch
            checked += 1
    assert checked > 20


def test_an_uneven_split_leaves_the_rest_to_the_last_micro_batch():
    plan = _plan(batch=10, lanes=2, micro_batch=2, micro_batches=3)
    assert plan.lane_sequences(0) == plan.lane_sequences(1) == 5
    assert plan.micro_batch_sizes(1) == (2, 2, 1)


def test_position_names_stage_and_lane():
    plan = _plan(batch=6, lanes=3, micro_batch=1, micro_batches=2, stages=3)
    assert plan.position("s0l0") == (0, 0)
    assert plan.position("s2l1") == (2, 1)
    assert plan.position("s1l2") == (1, 2)
    with pytest.raises(KeyError, match="holds no stage"):
        plan.position("s3l0")


@pytest.mark.parametrize(
    "batch, lanes, micro_batch, micro_batches",
    [
        (8, 1, 2, 3),  # too few: 6 of 8 sequences
        (8, 1, 2, 5),  # too many: a micro-batch would be empty
        (8, 2, 2, 1),  # a lane has 4
        (9, 2, 2, 2),  # a lane has 5 (9 over 2, rounded up)
        (8, 2, 6, 1),  # a micro-batch larger than the lane's share
        (7, 1, 3, 2),
    ],
)
def test_micro_batches_that_do_not_cover_the_lane_batch_are_refused(batch, lanes, micro_batch, micro_batches):
    wire = _plan(batch, lanes, 1, -(-batch // lanes)).to_wire()
    wire.update(micro_batch=micro_batch, micro_batches=micro_batches)
    with pytest.raises(SchemaError) as caught:
        Plan.from_wire(wire)
    assert caught.value.path == "plan.micro_batches"
    assert f"{micro_batches} micro-batches of {micro_batch}" in str(caught.value)
    with pytest.raises(SchemaError):
        _plan(batch, lanes, micro_batch, micro_batches)
