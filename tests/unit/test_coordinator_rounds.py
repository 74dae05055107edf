"""The coordinator's rounds over a control plane held in memory: what it publishes as the swarm reaches its
last step, loses peers, and loses every holder of some layers."""

from __future__ import annotations

import concurrent.futures
from dataclasses import replace
from pathlib import Path

import pytest

from hetpeer.coordinator.config import CoordinatorConfig
from hetpeer.coordinator.policy import MEASURE_WAIT_HEARTBEATS
from hetpeer.coordinator.service import Coordinator
from hetpeer.protocol.addresses import PeerAddress
from hetpeer.protocol.control import SignedPlan
from hetpeer.protocol.records import PeerRecord

KEY = b"ssh-rsa AAAAcoordinator"
# rounds to the first plan: settling, then the wait for links, which these peers never measure
FIRST_PLAN_ROUNDS = 4 + MEASURE_WAIT_HEARTBEATS


class Control:
    """The part of `ControlPlane` a coordinator's round uses, holding records and plans in memory."""

    def __init__(self) -> None:
        self.records: dict[str, PeerRecord] = {}
        self.plans: list[SignedPlan] = []
        self.clock = 1000.0
        self.public_key = KEY

    def now(self) -> float:
        return self.clock

    def read_peers(self, max_age_s: float):
        return {d: r for d, r in self.records.items() if r.time >= self.clock - max_age_s}, []

    def read_plans(self):
        return sorted(self.plans, key=lambda p: -p.plan.epoch), []

    def publish_plan(self, plan, ttl_s: float) -> bool:
        self.plans.append(SignedPlan(plan, self.clock, KEY))
        return True

    def remember(self, maddrs) -> None:
        list(maddrs)

    def heal(self) -> None:
        return None

    def announce(self, device: str, **changes) -> None:
        fields = dict(
            device_id=device, model="tiny", dtype="fp32", device_name="cpu", tflops=1.0, memory_bytes=16 << 30,
            address=PeerAddress(direct=("127.0.0.1", 7000)), state="waiting", time=self.clock,
        )  # fmt: skip
        old = self.records.get(device)
        self.records[device] = replace(old, time=self.clock, **changes) if old else PeerRecord(**(fields | changes))


@pytest.fixture
def coordinator(tmp_path: Path):
    lines: list[str] = []
    config = CoordinatorConfig(swarm="t", home=tmp_path, heartbeat_s=1.0, min_peers=2, time_budget_s=0.2, steps=80,
                               stages=1, replan_interval_s=3600)
    made = Coordinator(config, lines.append)
    made.control = Control()
    made.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    made.lines = lines
    yield made
    made.executor.shutdown()


def rounds(coordinator: Coordinator, n: int) -> None:
    for _ in range(n):
        coordinator.control.clock += coordinator.config.heartbeat_s
        for device, record in list(coordinator.control.records.items()):
            if record.state != "leaving":  # live peers announce every heartbeat; leaving ones said their last word
                coordinator.control.announce(device)
        coordinator.tick()


def test_a_swarm_that_reached_its_last_step_is_never_planned_again(coordinator):
    control = coordinator.control
    for d in ("a", "b", "c"):
        control.announce(d)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    first = control.plans[-1].plan
    trained = [d for d in first.devices]
    for d in trained:
        control.announce(d, state="training", epoch=first.epoch, layers=(0, 4), step=80)
    for d in first.standby:
        control.announce(d, state="standby", epoch=first.epoch)
    rounds(coordinator, 1)
    assert any("reached step 80: no more plans" in line for line in coordinator.lines)
    for d in trained:  # they leave at their last step; their records expire soon after
        control.announce(d, state="leaving")
    rounds(coordinator, 20)
    assert all(d not in control.read_peers(6.0)[0] for d in trained)
    assert [p.plan.epoch for p in control.plans] == [first.epoch]  # not a plan "from step 1" for the standby peers


def test_the_coordinator_says_what_its_first_plan_waits_for_once_each(coordinator):
    control = coordinator.control
    control.announce("a", timings=1)
    rounds(coordinator, 2)
    control.announce("b", timings=1)
    rounds(coordinator, 4)
    control.announce("a", timings=2)  # a count changes, not what it waits for: not said again
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    said = [line for line in coordinator.lines if line.startswith("first plan:")]
    assert said == ["first plan: waiting for peers: 1 of at least 2", "first plan: 1 peer(s) arrived less than 2 s ago",
                    "first plan: 1 link(s) between the peers not measured and 2 peer(s) not timed twice yet "
                    "(waiting up to 10 s more)"]
    assert [p.plan.epoch for p in control.plans] == [1]  # and once it waited long enough, it planned


def test_a_plan_that_fails_its_own_schema_is_not_published_and_the_coordinator_goes_on(coordinator, monkeypatch):
    control = coordinator.control
    for d in ("a", "b"):
        control.announce(d)
    made = coordinator._data_position
    monkeypatch.setattr(coordinator, "_data_position", lambda step: -1)  # a defect: every plan made now fails the schema
    rounds(coordinator, FIRST_PLAN_ROUNDS + 3)  # it would have raised out of the round, and the coordinator exited
    assert control.plans == [] and coordinator.plan is None
    said = [line for line in coordinator.lines if "fails the plan schema" in line]
    assert len(said) == 1 and "plan.data_position" in said[0] and "no plan runs yet" in said[0]  # once, not each round
    monkeypatch.setattr(coordinator, "_data_position", made)
    rounds(coordinator, 1)
    assert [p.plan.epoch for p in control.plans] == [1]


def test_no_plan_is_published_to_start_once_the_swarm_has_done_its_steps(coordinator):
    """A plan that would take effect at or past --steps is kept back: the peers leave under the running plan, and its
    progress counts their last step (a new epoch would leave a watcher waiting for step 80 at step 0)."""
    control = coordinator.control
    first = two_stages_of_three_peers(coordinator, steps=80)
    for d in first.devices:
        s = first.position(d)[0]
        control.announce(d, state="training", epoch=first.epoch, layers=(first.stages[s].layer_start, first.stages[s].layer_end), step=79)
    rounds(coordinator, 1)
    control.announce(first.stages[1].devices[0], state="leaving")  # a member leaves at the last step but one
    rounds(coordinator, 1)
    assert [p.plan.epoch for p in control.plans] == [first.epoch]
    assert any(line == f"kept epoch {first.epoch}: a new plan would start at step 80, when the swarm has done its 80 steps"
               for line in coordinator.lines)


def test_a_plan_after_every_holder_left_starts_past_the_reached_step_and_says_so(coordinator):
    coordinator.config = replace(coordinator.config, steps=None)
    control = coordinator.control
    for d in ("a", "b"):
        control.announce(d)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    first = control.plans[-1].plan
    for d in first.devices:
        control.announce(d, state="training", epoch=first.epoch, layers=(0, 4), step=50)
    rounds(coordinator, 1)
    for d in ("a", "b"):
        control.announce(d, state="leaving")
    rounds(coordinator, 20)  # their records expire: nothing left says the swarm reached step 50
    control.announce("c")
    control.announce("d")
    rounds(coordinator, 4)
    last = control.plans[-1].plan
    assert set(last.devices) <= {"c", "d"} and last.start_step == 51
    assert any("no live peer holds layers 0-3" in line and "fresh weights" in line for line in coordinator.lines)


def test_each_round_leaves_the_dashboard_a_board_with_the_run_so_far(coordinator):
    from hetpeer.coordinator.board import state

    control = coordinator.control
    for d in ("a", "b", "c"):
        control.announce(d)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    plan = control.plans[-1].plan
    for step in range(1, 6):
        for d in plan.devices:
            control.announce(d, state="training", epoch=plan.epoch, layers=(0, 4), step=step, loss=5.0 - step / 2,
                             tokens_per_s=100.0)
        rounds(coordinator, 1)
    control.announce("c", state="leaving")
    rounds(coordinator, 1)
    doc = state(coordinator.board)
    kinds = [(e["kind"], e["text"]) for e in doc["history"]["events"]]
    assert ("join", "a, b, c joined") in kinds and ("leave", "c left") in kinds
    assert any(kind == "plan" and text.startswith(f"plan epoch {plan.epoch} from step 0") for kind, text in kinds)
    first = doc["history"]["plans"][0]
    assert first["epoch"] == plan.epoch and first["reason"].startswith("no plan yet") and first["steps"] == 5
    assert first["measured_step_s"] == coordinator.config.heartbeat_s  # a step a round
    fields = doc["history"]["sample_fields"]
    losses = [dict(zip(fields, s))["loss"] for s in doc["history"]["samples"]]
    assert losses[-2:] == [2.5, 2.5] and doc["progress"]["step"] == 5


def two_stages_of_three_peers(coordinator, **config):
    """The first plan of peers a, b and c in two stages of one lane (one on standby), with `config` set."""
    coordinator.config = replace(coordinator.config, **{"steps": None, **config})
    coordinator.planner = replace(coordinator.planner, stages=2, group_size=1)
    for d in ("a", "b", "c"):
        coordinator.control.announce(d)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    return coordinator.control.plans[-1].plan


def test_a_member_that_left_is_replaced_by_a_peer_on_standby_without_a_search(coordinator):
    control = coordinator.control
    first = two_stages_of_three_peers(coordinator)
    (spare,) = first.standby
    for d in first.devices:
        s = first.position(d)[0]
        control.announce(d, state="training", epoch=first.epoch, layers=(first.stages[s].layer_start, first.stages[s].layer_end), step=30)
    rounds(coordinator, 1)
    solved_at = coordinator.last_solve
    leaver = first.stages[1].devices[0]
    control.announce(leaver, state="leaving")
    rounds(coordinator, 1)
    mended = control.plans[-1].plan
    assert mended.epoch == first.epoch + 1 and mended.start_step == 31
    assert mended.stages[1].devices == (spare,) and mended.stages[0].devices == first.stages[0].devices
    assert [s.layers for s in mended.stages] == [s.layers for s in first.stages]
    assert any("repaired: " in line and f"{leaver} stopped announcing" in line for line in coordinator.lines)
    assert not any(line.startswith("solving:") for line in coordinator.lines[-5:])  # no search for it
    assert coordinator.last_solve == solved_at  # the periodic re-solve stays due when it was


def test_the_first_solve_after_a_repair_publishes_any_better_plan(coordinator):
    """A repaired plan was never searched for: a solve replaces it without the --gain hysteresis."""
    control = coordinator.control
    first = two_stages_of_three_peers(coordinator, gain=0.99)  # no searched plan could beat a running one
    leaver = first.stages[1].devices[0]
    control.announce(leaver, state="leaving")
    rounds(coordinator, 1)
    mended = control.plans[-1].plan
    assert mended.epoch == first.epoch + 1 and coordinator.repaired_epoch == mended.epoch
    control.announce(leaver)  # back, as a newcomer
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    latest = control.plans[-1].plan
    kept = any(line.startswith(f"kept epoch {mended.epoch}: predicted") for line in coordinator.lines)
    assert latest.epoch == mended.epoch + 1 or not kept  # published, or the planner chose the mended plan again
    assert not any("is not 99% better" in line for line in coordinator.lines)


def test_a_plan_that_cannot_avoid_a_pair_without_a_path_leaves_a_peer_out_and_says_why(coordinator):
    """A group of three fixed, two of them behind NAT: every such group needs their pair. Nothing is published
    that makes them neighbours; the coordinator says who stays out and why."""
    control = coordinator.control
    coordinator.planner = replace(coordinator.planner, stages=1, group_size=3)
    coordinator.config = replace(coordinator.config, steps=None, min_peers=3)
    for device, reachable in (("a", "none"), ("b", "none"), ("c", "direct")):
        control.announce(device, reachable=reachable)
    rounds(coordinator, FIRST_PLAN_ROUNDS)
    assert not any(("a", "b") in p.plan.links for p in control.plans)
    assert any(line.startswith("a stays on standby: nobody can dial it, nor b, whom the plan needed as its neighbours")
               for line in coordinator.lines), coordinator.lines[-10:]


def test_each_solve_goes_on_from_the_search_before_it(coordinator, monkeypatch):
    """The coordinator keeps the planner's memory between rounds: every solve but the first is given the one before's."""
    from hetpeer.coordinator import publishing

    given, returned = [], []

    def solve(problem, config, rng, memory=None, islands=None):
        given.append(memory)
        returned.append(real(problem, config, rng, memory=memory, islands=islands))
        return returned[-1]

    real = publishing.solve
    monkeypatch.setattr(publishing, "solve", solve)
    coordinator.config = replace(coordinator.config, steps=None, replan_interval_s=2.0)
    for d in ("a", "b", "c"):
        coordinator.control.announce(d)
    rounds(coordinator, FIRST_PLAN_ROUNDS + 12)  # a plan whose steps are not measured is re-solved every other interval
    assert len(given) >= 3 and given[0] is None
    assert all(memory is solution.memory for memory, solution in zip(given[1:], returned))
    assert coordinator.search_memory is returned[-1].memory and returned[-1].memory.shapes


def test_rounds_on_two_workers_keep_them_and_go_on_with_one_when_a_worker_dies(tmp_path):
    """A coordinator with `workers` 2 starts its worker process at the first solve and keeps it between rounds, each
    round going on from every island's memory, the worker's too once it answers in time; a worker killed under it costs one round's plan, said once, and the
    rounds after plan with one worker."""
    from hetpeer.coordinator.planner import Memory
    from hetpeer.coordinator.planner.islands import Archipelago

    lines: list[str] = []
    config = CoordinatorConfig(swarm="t", home=tmp_path, heartbeat_s=1.0, min_peers=2, time_budget_s=0.2,
                               stages=1, replan_interval_s=2.0, workers=2)
    coordinator = Coordinator(config, lines.append)
    coordinator.control = Control()
    coordinator.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        for d in ("a", "b", "c"):
            coordinator.control.announce(d)
        rounds(coordinator, FIRST_PLAN_ROUNDS)
        assert [p.plan.epoch for p in coordinator.control.plans] == [1]
        worker = coordinator.islands._processes[0]
        # the first solve's 0.2 s may end before the worker has imported the planner; re-solves of the running plan
        # have it, the same process
        rounds(coordinator, 6)
        assert isinstance(coordinator.search_memory, Archipelago) and len(coordinator.search_memory.memories) == 2
        assert coordinator.islands._processes == [worker] and worker.poll() is None
        worker.kill()
        worker.wait()
        rounds(coordinator, 12)
        said = [line for line in lines if "goes on with one worker" in line]
        assert len(said) == 1 and "island 2" in said[0], lines
        assert coordinator.islands is None and coordinator.planner.workers == 1
        assert isinstance(coordinator.search_memory, Memory)  # a later round solved, in this process alone
    finally:
        coordinator.executor.shutdown()
        if coordinator.islands is not None:
            coordinator.islands.close()


@pytest.mark.parametrize("pace", [1.5, 0.8])
def test_what_the_running_plans_steps_took_beyond_its_prediction_goes_into_the_next_plans(coordinator, pace):
    """Peers whose steps take 1.5x (or 0.8x) what the model predicts: once the plan's pace has closed its windows,
    the coordinator's learned overhead is the difference (time taken off where the model over-predicts), the API's
    progress says it, and the plan that mends the swarm after a member leaves is predicted and published with it."""
    from hetpeer.coordinator import calibration, policy
    from hetpeer.coordinator.board import state
    from hetpeer.coordinator.view import progress

    control = coordinator.control
    first = two_stages_of_three_peers(coordinator)
    assert coordinator.calibration.overhead_s == 0.0 and progress(coordinator.view).step_overhead_s == 0.0
    per_round = 10  # steps a round: a window of the pace each
    coordinator.config = replace(coordinator.config, heartbeat_s=pace * first.total_s * per_round)
    step = 0
    for _ in range(calibration.WINDOWS + 2):  # a round to start the pace, one a window, one to read the last
        step += per_round
        for d in first.devices:
            s = first.position(d)[0]
            control.announce(d, state="training", epoch=first.epoch, step=step,
                             layers=(first.stages[s].layer_start, first.stages[s].layer_end))
        rounds(coordinator, 1)
    learned = coordinator.calibration
    assert learned.epoch == first.epoch and learned.overhead_s == pytest.approx((pace - 1) * first.total_s, rel=0.01)
    assert progress(coordinator.view).step_overhead_s == learned.overhead_s
    assert any(line.startswith(f"plan epoch {first.epoch} measures") and "every prediction adds" in line for line in coordinator.lines)

    leaver = first.stages[1].devices[0]
    control.announce(leaver, state="leaving")
    rounds(coordinator, 1)
    mended = control.plans[-1].plan
    assert mended.epoch == first.epoch + 1
    live = {d: r for d, r in control.records.items() if r.state != "leaving"}
    plain = policy.running_report(policy.build_problem(live, coordinator.config.workload, mended)[0], coordinator.planner, mended).cost["total_s"]
    assert mended.total_s == pytest.approx(plain + learned.overhead_s) and mended.cost["overhead_s"] == learned.overhead_s
    assert f"{mended.total_s:.3f} s/step, {'+' if pace > 1 else '-'}" in mended.predicted
    doc = state(coordinator.board)  # the dashboard's
    assert doc["plan"]["overhead_s"] == learned.overhead_s and doc["progress"]["step_overhead_s"] == learned.overhead_s


def test_an_overhead_is_learned_only_from_a_whole_plan_that_ran_its_windows_and_is_held_to_bounds():
    from hetpeer.coordinator.calibration import BOUNDS, WINDOWS, Calibration, due, learn
    from hetpeer.coordinator.history import Pace
    from hetpeer.coordinator.planner import PlannerConfig
    from hetpeer.protocol.modelspec import preset
    from hetpeer.protocol.plan import StagePlan
    from hetpeer.protocol.workload import Workload
    from hetpeer.protocol.plan import Plan

    control = Control()
    for d in ("a", "b"):
        control.announce(d)
    plan = Plan(cost_model="time", model="tiny", layers=4, batch=8, micro_batch=2, micro_batches=4, dtype="fp32",
                stages=(StagePlan(0, 0, 2, ("a",), "none"), StagePlan(1, 2, 4, ("b",), "none")), epoch=3)
    workload, planner = Workload(preset("tiny"), batch=8, micro_batch=2, dtype="fp32"), PlannerConfig()

    def pace(step_s: float, windows: int) -> Pace:
        made = Pace()
        for step in range(0, 10 * windows + 1):
            made = made.add(step * step_s, step)
        return made

    assert not due(Calibration(), plan, pace(1.0, WINDOWS - 1)) and not due(Calibration(), None, pace(1.0, WINDOWS))
    assert due(Calibration(), plan, pace(1.0, WINDOWS))
    slow = learn(plan, pace(1000.0, WINDOWS), control.records, workload, planner)
    fast = learn(plan, pace(1e-9, WINDOWS), control.records, workload, planner)
    assert slow.overhead_s == BOUNDS[1] * slow.predicted_s and slow.measured_s == pytest.approx(1000.0)
    assert fast.overhead_s == BOUNDS[0] * fast.predicted_s  # a model more than 2x off is to mend, not to patch
    exact = learn(plan, pace(slow.predicted_s * 1.2, WINDOWS), control.records, workload, planner)
    assert exact.overhead_s == pytest.approx(0.2 * slow.predicted_s)
    assert not due(slow, plan, pace(1000.0, WINDOWS)) and due(slow, plan, pace(1000.0, WINDOWS + 1))
    del control.records["b"]
    assert learn(plan, pace(1.0, WINDOWS), control.records, workload, planner) is None  # a member is gone
