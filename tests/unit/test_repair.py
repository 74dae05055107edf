"""repair: the running plan mended after peers left, by invariants and against brute force on small swarms."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetpeer.coordinator.planner import PlannerConfig, Problem, Shape, make_model, solve, synthetic
from hetpeer.coordinator.repair import DROPPED, KEPT, SLOWER, repair
from hetpeer.protocol.plan import Plan, standby_runs
from hetpeer.protocol.topology import Topology
from hetpeer.protocol.modelspec import preset
from hetpeer.protocol.workload import Workload

CONFIG = PlannerConfig(stages=2, group_size=3, time_budget_s=0.5)


def whole(seed: int = 0, devices: int = 9) -> Problem:
    topology = Topology.from_wire(synthetic.random_topology(devices, 3, np.random.default_rng(seed)))
    return Problem.from_topology(topology, Workload(preset("tiny", layers=8), batch=64))


def running(problem: Problem) -> Plan:
    return replace(solve(problem, CONFIG, np.random.default_rng(0)).plan, epoch=4, start_step=120)


def without(problem: Problem, gone: set[str], current: Plan | None = None, **changes) -> Problem:
    """The problem over the devices that did not leave (what the coordinator sees), with the running plan."""
    keep = [i for i, d in enumerate(problem.device_ids) if d not in gone]
    cut = np.ix_(keep, keep)
    return replace(
        problem, device_ids=tuple(problem.device_ids[i] for i in keep), latency_s=problem.latency_s[cut],
        bandwidth_bytes_per_s=problem.bandwidth_bytes_per_s[cut], tflops=problem.tflops[keep],
        memory_bytes=problem.memory_bytes[keep], current=current, **changes,
    )  # fmt: skip


def on_standby(problem: Problem, plan: Plan) -> list[int]:
    """The problem's indices of the plan's standby devices."""
    return [problem.device_ids.index(d) for d in plan.standby]


def grid(plan: Plan, problem: Problem) -> np.ndarray:
    index = {d: i for i, d in enumerate(problem.device_ids)}
    return np.array([[index[d] for d in stage.devices] for stage in plan.stages])


def test_a_departed_member_is_replaced_by_the_standby_peer_that_keeps_the_step_fastest() -> None:
    full = whole()
    plan = running(full)
    assert len(plan.standby) == 3
    gone = plan.stages[1].devices[2]
    live = without(full, {gone}, current=plan)
    mended = repair(plan, live, CONFIG)
    assert mended is not None
    assert gone not in mended.devices and gone not in mended.standby
    assert len(mended.stages) == 2 and mended.group_size == 3
    # every other cell keeps its device; the empty one holds a former standby peer
    for s, stage in enumerate(plan.stages):
        for lane, device in enumerate(stage.devices):
            if device != gone:
                assert mended.stages[s].devices[lane] == device
    chosen = mended.stages[1].devices[2]
    assert chosen in plan.standby
    # brute force over the standby peers: none makes the grid faster under the time model
    steady = replace(live, current=None)
    model = make_model(steady, CONFIG, Shape(2, 3))
    base = grid(plan, full)
    costs = {}
    for candidate in plan.standby:
        trial = [[live.device_ids.index(d) if d != gone else live.device_ids.index(candidate) for d in stage.devices]
                 for stage in plan.stages]
        costs[candidate] = float(model.batch_cost(np.array(trial)[None])[0])
    assert costs[chosen] == min(costs.values())
    assert base.shape == (2, 3)
    # the others stay on standby, kept by the running plan; the plan is runnable and survives the wire
    assert set(mended.standby) == set(plan.standby) - {chosen}
    # each keeps the reason the running plan gave it (the planner names why it left peers out)
    old = {d: reason for reason, devices in plan.reasons.items() for d in devices}
    for reason, devices in mended.reasons.items():
        assert all(old.get(d, KEPT) == reason for d in devices)
    assert Plan.from_wire(mended.to_wire()) == mended
    assert mended.epoch == plan.epoch + 1 and mended.start_step == plan.start_step
    assert mended.cost["total_s"] > 0 and "move_s" in mended.cost


def test_newcomers_are_candidates_too() -> None:
    full = whole(devices=7)
    plan = replace(solve(without(full, {full.device_ids[6]}), CONFIG, np.random.default_rng(0)).plan, epoch=1)
    newcomer = full.device_ids[6]
    assert newcomer not in plan.devices and newcomer not in plan.standby
    gone = set(plan.devices[:1])
    mended = repair(plan, without(full, gone, current=plan), CONFIG)
    assert mended is not None and mended.group_size == 3
    assert set(mended.devices) <= set(full.device_ids) - gone
    # whoever is not in the plan is on standby, with a reason for each
    assert set(mended.standby) == set(full.device_ids) - gone - set(mended.devices)
    assert sum(n for _, n in mended.standby_reasons) == len(mended.standby)


def test_a_lane_is_dropped_when_no_standby_peer_fits_in_memory() -> None:
    full = whole()
    plan = running(full)
    gone = plan.stages[0].devices[1]
    memory = full.memory_bytes.copy()
    memory[on_standby(full, plan)] = 1e6  # a megabyte: no stage of the model fits
    live = without(replace(full, memory_bytes=memory), {gone}, current=plan)
    mended = repair(plan, live, CONFIG)
    assert mended is not None
    assert mended.group_size == 2 and len(mended.stages) == 2  # one device fewer in every stage
    survivor = plan.stages[1].devices[1]  # the departed member's lane partner
    assert survivor in mended.reasons[DROPPED]
    assert set(mended.reasons[DROPPED]) == {survivor}
    assert set(plan.standby) <= set(mended.standby)
    assert mended.lanes == tuple(lane for k, lane in enumerate(plan.lanes) if k != 1)
    assert mended.micro_batches * mended.micro_batch >= -(-mended.batch // 2)
    assert Plan.from_wire(mended.to_wire()) == mended


def test_none_when_no_lane_can_be_restored() -> None:
    full = whole(devices=6)
    plan = replace(solve(full, CONFIG, np.random.default_rng(0)).plan, epoch=2)
    assert plan.standby == ()
    gone = set(plan.stages[0].devices) | set(plan.stages[1].devices[:2])  # one device left: not a lane of two stages
    assert repair(plan, without(full, gone, current=plan), CONFIG) is None


def test_the_survivors_of_a_lost_stage_make_what_lanes_they_can() -> None:
    full = whole(devices=6)
    plan = replace(solve(full, CONFIG, np.random.default_rng(0)).plan, epoch=2)
    gone = set(plan.stages[0].devices)  # a whole stage gone: the other stage's three hold both stages now
    mended = repair(plan, without(full, gone, current=plan), CONFIG)
    assert mended is not None and len(mended.stages) == 2 and mended.group_size == 1
    assert set(mended.devices) | set(mended.standby) == set(plan.stages[1].devices)
    assert set(mended.reasons[DROPPED]) == set(mended.standby) and len(mended.standby) == 1


def test_none_when_nothing_left_or_the_model_differs() -> None:
    full = whole()
    plan = running(full)
    assert repair(plan, replace(full, current=plan), CONFIG) is None
    other = replace(full, workload=Workload(preset("tiny", layers=6), batch=64), current=None)
    assert repair(plan, without(other, {plan.devices[0]}), CONFIG) is None


def test_several_departures_in_one_lane_and_across_lanes() -> None:
    full = whole(seed=3, devices=12)
    plan = running(full)
    gone = {plan.stages[0].devices[0], plan.stages[1].devices[0], plan.stages[1].devices[2]}
    mended = repair(plan, without(full, gone, current=plan), CONFIG)
    assert mended is not None
    assert not gone & (set(mended.devices) | set(mended.standby))
    assert mended.group_size == 3  # six standby peers: enough for three empty cells
    assert len(set(mended.devices)) == 6
    assert repair(plan, without(full, gone, current=plan), CONFIG) == mended  # pure: same answer


def test_reasons_of_the_running_plan_carry_over() -> None:
    full = whole()
    plan = running(full)
    standby, reasons = standby_runs({"too slow": plan.standby[:1], "too far": plan.standby[1:]})
    plan = replace(plan, standby=standby, standby_reasons=reasons)
    gone = plan.stages[0].devices[0]
    mended = repair(plan, without(full, {gone}, current=plan), CONFIG)
    assert mended is not None
    for reason, devices in mended.reasons.items():
        assert reason in ("too slow", "too far")
        assert all(d in plan.reasons[reason] for d in devices)


@pytest.mark.parametrize("seed", range(4))
def test_repaired_plans_always_pass_the_plan_checks(seed: int) -> None:
    full = whole(seed=seed, devices=10)
    plan = running(full)
    rng = np.random.default_rng(seed)
    gone = set(rng.choice(plan.devices + plan.standby, size=3, replace=False).tolist())
    mended = repair(plan, without(full, gone, current=plan), CONFIG)
    if mended is None:
        assert all(any(d in gone for d in lane) for lane in plan.lanes)
        return
    Plan.from_wire(mended.to_wire())
    assert not gone & (set(mended.devices) | set(mended.standby))
    assert set(mended.devices) | set(mended.standby) == set(full.device_ids) - gone


def test_a_lane_is_dropped_when_the_plan_is_faster_without_it_than_with_any_replacement() -> None:
    full = whole()
    plan = running(full)
    gone = plan.stages[0].devices[1]
    tflops = full.tflops.copy()
    tflops[on_standby(full, plan)] /= 1000  # any of them in the lane would set every lane's step
    live = without(replace(full, tflops=tflops), {gone}, current=plan)
    assert repair(plan, live, CONFIG).group_size == 3  # the shape is the organizer's: a replacement, however slow
    mended = repair(plan, live, replace(CONFIG, group_size=None))
    assert mended is not None and mended.group_size == 2
    survivor = plan.stages[1].devices[1]
    assert set(mended.reasons[SLOWER]) == {survivor} and DROPPED not in mended.reasons
    # brute force: the best standby peer in the empty cell gives a slower plan than the two lanes left
    steady = replace(live, current=None)
    two = make_model(steady, CONFIG, Shape(2, 2)).batch_cost(grid(mended, live)[None])[0]
    ids = {d: i for i, d in enumerate(live.device_ids)}
    filled = [np.array([[ids[d] if d != gone else ids[s] for d in stage.devices] for stage in plan.stages])
              for s in plan.standby]
    assert two <= make_model(steady, CONFIG, Shape(2, 3)).batch_cost(np.stack(filled)).min()


def test_a_dropped_lanes_survivors_fill_another_lane() -> None:
    full = whole(devices=6)
    plan = replace(solve(full, CONFIG, np.random.default_rng(0)).plan, epoch=2)
    assert plan.standby == ()
    gone = {plan.stages[0].devices[0], plan.stages[1].devices[1]}  # one member from each of two lanes
    mended = repair(plan, without(full, gone, current=plan), CONFIG)
    assert mended is not None and mended.group_size == 2  # the two halves make one lane: nobody idle
    assert set(mended.devices) == set(full.device_ids) - gone and mended.standby == ()
