"""Outer steps (sync "outer"): the group trains apart for H steps and then takes one outer step from the
averaged parameter change; every member ends it on the same parameters, a joiner enters at the group's
anchor, a checkpoint keeps the outer state, and plans that switch a group into or out of outer steps keep
the members equal."""

from __future__ import annotations

import pytest
import torch

from hetpeer.peer.checkpoint import StageCheckpoint
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.gossip.outer import OuterConfig, OuterState, outer_step
from hetpeer.peer.gossip.state import StateServer, fetch_state
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.wire import SchemaError
from in_threads import results

SPEC = preset("tiny")
MEMBERS = ("p0", "p1", "p2")
MEAN_OUTER = Recipe(lr=1e-2, outer_after=0, outer_lr=1.0, outer_momentum=0.0)  # an outer step to the members' mean


def group_plan(sync: str, every: int = 0, members: tuple[str, ...] = MEMBERS, epoch: int = 0, start_step: int = 0,
               recipe: Recipe = Recipe(lr=1e-2, outer_after=0)) -> Plan:
    stage = StagePlan(0, 0, SPEC.layers, members, sync, outer_every=every)
    return Plan("time", SPEC.name, SPEC.layers, 2 * len(members), 2, 1, "fp32", (stage,), epoch=epoch, start_step=start_step,
                recipe=recipe)


def workers(plan: Plan, hub: MemoryHub | None = None, servers: bool = False,
            only: tuple[str, ...] | None = None) -> dict[str, StageWorker]:
    hub, corpus, built = hub or MemoryHub(), Corpus.default(), {}
    config = WorkerConfig(timeout_s=30)
    for device in only or plan.devices:
        transport = MemoryTransport(device, hub)
        transport.start()
        server = StateServer(transport, device, known=lambda sender: True) if servers else None
        built[device] = StageWorker(plan, device, transport, corpus, config, server=server)
    return built


def train(built: dict[str, StageWorker], steps: int) -> None:
    for _ in range(steps):
        results([lambda w=w: w.train_step() for w in built.values()], 60.0)


def test_the_outer_step_is_nesterov_momentum_on_the_averaged_change():
    x = torch.tensor([1.0, 2.0])
    state = OuterState(torch.tensor([0.0, 0.0]))
    state.momentum.copy_(torch.tensor([1.0, -1.0]))
    outer_step(x, torch.tensor([0.5, 0.5]), state, OuterConfig(lr=0.5, momentum=0.5))
    # u = 0.5 u + d = [1.0, 0.0]; anchor -= 0.5 (d + 0.5 u) = -0.5 [1.0, 0.5]
    assert torch.equal(state.momentum, torch.tensor([1.0, 0.0]))
    assert torch.equal(state.anchor, torch.tensor([-0.5, -0.25])) and torch.equal(x, state.anchor)


@pytest.mark.parametrize("settings", [dict(lr=0.0), dict(lr=float("nan")), dict(momentum=1.0), dict(momentum=-0.1)])
def test_outer_settings_out_of_range_are_refused(settings):
    with pytest.raises(ValueError, match="outer"):
        OuterConfig(**settings)


def test_members_train_apart_between_outer_steps_and_end_each_on_the_average_of_what_they_reached():
    """With lr 1 and no momentum an outer step is the mean of the members' parameters: checked against the
    same members trained with no sync at all (the same data, the same steps), averaged here."""
    apart = workers(group_plan("none"))
    outer = workers(group_plan("outer", every=3, recipe=MEAN_OUTER))
    train(apart, 2)
    train(outer, 2)
    for device in MEMBERS:  # no outer step yet: each member is where training alone took it
        assert torch.equal(outer[device].flat.data, apart[device].flat.data), device
    assert not torch.equal(outer["p0"].flat.data, outer["p1"].flat.data)
    train(apart, 1)
    train(outer, 1)  # step 2 closes the first window of 3
    mean = torch.stack([apart[d].flat.data for d in MEMBERS]).mean(0)
    for device in MEMBERS:
        x = outer[device].flat.data
        assert torch.equal(x, outer["p0"].flat.data) and torch.equal(x, outer[device].sync.outer.anchor)
        # the change travels in fp16: what differs from the exact mean is its rounding, far below the spread
        error, spread = float((x - mean).abs().max()), float((apart[device].flat.data - mean).abs().max())
        assert error < 1e-2 * spread, (error, spread)
    train(outer, 3)
    assert all(torch.equal(outer[d].flat.data, outer["p0"].flat.data) for d in MEMBERS)


def test_a_joiner_enters_at_the_groups_anchor_with_its_outer_momentum():
    hub = MemoryHub()
    group = workers(group_plan("outer", every=2, members=("p0", "p1")), hub=hub, servers=True)
    train(group, 3)  # one outer step (after step 1), then a step apart
    joiner = workers(group_plan("outer", every=2, members=("p0", "p1", "p2"), epoch=1, start_step=3), hub=hub, servers=True,
                     only=("p2",))["p2"]
    download = fetch_state(joiner.server, joiner.sync, *joiner.param_range, ["p0", "p1"], 10.0)
    anchor = group["p0"].sync.outer
    assert torch.equal(joiner.sync.outer.anchor, anchor.anchor) and torch.equal(joiner.sync.outer.momentum, anchor.momentum)
    assert torch.count_nonzero(anchor.momentum) > 0
    assert torch.equal(joiner.flat.data, anchor.anchor) and not torch.equal(joiner.flat.data, group["p0"].flat.data)
    assert download.bytes == 5 * 4 * joiner.flat.size  # parameters, two moments, anchor, outer momentum


def test_a_joiner_whose_donors_hold_no_outer_state_anchors_where_it_enters():
    hub = MemoryHub()
    group = workers(group_plan("gossip", members=("p0", "p1")), hub=hub, servers=True)
    train(group, 2)
    joiner = workers(group_plan("outer", every=2, members=("p0", "p1", "p2"), epoch=1, start_step=2), hub=hub, servers=True,
                     only=("p2",))["p2"]
    download = fetch_state(joiner.server, joiner.sync, *joiner.param_range, ["p0"], 10.0)
    assert torch.equal(joiner.flat.data, group["p0"].flat.data)
    assert torch.equal(joiner.sync.outer.anchor, joiner.flat.data) and torch.count_nonzero(joiner.sync.outer.momentum) == 0
    assert download.bytes == 3 * 4 * joiner.flat.size


def test_a_checkpoint_keeps_the_outer_state_and_a_restored_member_resumes_at_the_anchor(tmp_path):
    group = workers(group_plan("outer", every=2, members=("p0", "p1")))
    train(group, 3)
    group["p0"].save(tmp_path)
    stored = StageCheckpoint.read(tmp_path / "p0.safetensors").tensors()
    assert torch.equal(stored["optimizer.anchor"], group["p0"].sync.outer.anchor)
    restored = workers(group_plan("outer", every=2, members=("p0", "p1")))["p0"]
    restored.restore(tmp_path / "p0.safetensors")
    assert torch.equal(restored.sync.outer.momentum, group["p0"].sync.outer.momentum)
    assert torch.equal(restored.flat.data, group["p0"].sync.outer.anchor)


def test_a_plan_that_ends_outer_steps_puts_every_member_back_on_the_shared_anchor():
    old = workers(group_plan("outer", every=4, members=("p0", "p1")))
    train(old, 2)  # apart since the start: x differs from member to member, the anchor does not
    new = workers(group_plan("allreduce", members=("p0", "p1"), epoch=1, start_step=2))
    for device in new:
        new[device].sync.take(old[device].sync)
    assert torch.equal(new["p0"].flat.data, new["p1"].flat.data)
    assert torch.equal(new["p0"].flat.data, old["p0"].sync.outer.anchor)
    entering = workers(group_plan("outer", every=4, members=("p0", "p1"), epoch=2, start_step=2))
    for device in entering:
        entering[device].sync.take(new[device].sync)
        assert torch.equal(entering[device].sync.outer.anchor, new[device].flat.data)


@pytest.mark.parametrize("sync, every, words", [
    ("outer", 0, "must be 1 to 10000 steps with sync outer"),
    ("gossip", 5, "absent otherwise, got 5 with sync gossip"),
    ("outer", 10_001, "got 10001"),
])
def test_a_plan_with_outer_steps_names_h_and_only_then(sync, every, words):
    wire = group_plan("allreduce").to_wire()
    wire["stages"][0] |= {"sync": sync, "outer_every": every}
    with pytest.raises(SchemaError, match=words):
        Plan.from_wire(wire)


def test_an_outer_plan_round_trips_through_its_wire_form():
    plan = group_plan("outer", every=50)
    assert plan.to_wire()["stages"][0]["outer_every"] == 50
    assert Plan.from_wire(plan.to_wire()) == plan
    assert "outer_every" not in group_plan("gossip").to_wire()["stages"][0]


def test_before_the_plans_outer_after_the_group_all_reduces_every_step_and_anchors_where_it_is():
    group = workers(group_plan("outer", every=2, members=("p0", "p1"), recipe=Recipe(lr=1e-2, outer_after=3)))
    train(group, 3)  # steps 0-2: all-reduced, so the members move together
    x = group["p0"].flat.data
    assert torch.equal(x, group["p1"].flat.data) and torch.equal(group["p0"].sync.outer.anchor, x)
    assert torch.count_nonzero(group["p0"].sync.outer.momentum) == 0  # no outer step yet
    train(group, 1)  # step 3: apart, and (3 + 1) % 2 == 0 ends a window: the first outer step
    assert torch.equal(group["p0"].flat.data, group["p1"].flat.data)
    assert torch.count_nonzero(group["p0"].sync.outer.momentum) > 0
    train(group, 1)  # step 4: apart
    assert not torch.equal(group["p0"].flat.data, group["p1"].flat.data)


def test_an_overlapped_exchange_lands_d_steps_later_keeping_what_each_member_learned_meanwhile():
    """With lr 1 and no momentum the outer step of step t moves the anchor to the mean of the members'
    parameters at t; landing after step t + D, each member keeps what it learned since t: checked against the
    same members trained with no sync at all."""
    from dataclasses import replace

    apart = workers(group_plan("none"))
    plan = group_plan("outer", every=3, recipe=MEAN_OUTER)
    plan = replace(plan, stages=(replace(plan.stages[0], outer_delay=2),))
    assert plan.stages[0].sync_words == "outer H=3 D=2"
    outer = workers(plan)
    train(apart, 3)
    train(outer, 3)  # step 2 closes the window; its exchange runs beside steps 3 and 4
    taken = {d: apart[d].flat.data.clone() for d in MEMBERS}
    assert all(outer[d].sync.exchange is not None for d in MEMBERS)
    train(apart, 2)
    train(outer, 2)  # it lands after step 4
    assert all(outer[d].sync.exchange is None for d in MEMBERS)
    mean = torch.stack(list(taken.values())).mean(0)
    for device in MEMBERS:
        anchor = outer[device].sync.outer.anchor
        assert torch.equal(anchor, outer["p0"].sync.outer.anchor)
        spread = float((taken[device] - mean).abs().max())
        assert float((anchor - mean).abs().max()) < 1e-2 * spread
        expected = anchor + apart[device].flat.data - taken[device]
        assert float((outer[device].flat.data - expected).abs().max()) < 1e-5 * float(expected.abs().max())


def test_a_plan_change_lands_the_exchange_in_flight_before_the_new_plan_takes_the_state():
    from dataclasses import replace

    plan = group_plan("outer", every=2, members=("p0", "p1"))
    old = workers(replace(plan, stages=(replace(plan.stages[0], outer_delay=1),)))
    train(old, 2)  # step 1 closes the window; its exchange is in flight
    assert old["p0"].sync.exchange is not None
    new = workers(group_plan("outer", every=2, members=("p0", "p1"), epoch=1, start_step=2))
    results([lambda d=d: new[d].sync.take(old[d].sync) for d in new], 60.0)
    assert old["p0"].sync.exchange is None and torch.count_nonzero(new["p0"].sync.outer.momentum) > 0
    assert torch.equal(new["p0"].sync.outer.anchor, new["p1"].sync.outer.anchor)


def test_an_overlap_as_long_as_the_window_is_refused():
    wire = group_plan("outer", every=4).to_wire()
    wire["stages"][0]["outer_delay"] = 4
    with pytest.raises(SchemaError, match="outer_delay.*must be 0 to outer_every - 1"):
        Plan.from_wire(wire)
