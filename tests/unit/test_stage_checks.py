"""Stage checks (`peer/pipeline/checks.py`) in one process over MemoryTransport: members of a group recompute each
other's micro-batches and match what the lane neighbours received exactly under all-reduce; a stage that scales what
it hands its lane is caught by the other members of its group, and nobody else is; what does not belong to a check is
refused with a reason, and a helper asked too late declines instead of leaving the checker waiting."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from test_worker import Pipeline, make_plan
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.pipeline.checks import AHEAD, DECLINE, EXACT, SKETCH, Check, Declined, distance, sketch
from hetpeer.peer.pipeline.worker import WorkerConfig
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.wire import SchemaError

STEPS = 10  # 8 steps of checks (the first are asked for LEAD steps ahead): each member picks each other lane some time


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.default()


def seeded(pipeline: Pipeline) -> Pipeline:
    """The checkers' private choices drawn from fixed seeds, so that a run is the same run every time."""
    for k, worker in enumerate(pipeline.workers.values()):
        worker.checks.rng = random.Random(k)
    return pipeline


def grouped(stages: int, lanes: int, sync: str = "allreduce", check: float = 1.0):
    plan = make_plan(stages, lanes=lanes, lane_batch=4, micro_batch=2, recipe=Recipe(check=check))
    return replace(plan, stages=tuple(replace(stage, sync=sync) for stage in plan.stages))


def lying(pipeline: Pipeline, device: str, factor: float) -> None:
    """`device` scales every activation and gradient it hands its lane neighbours."""
    transport = pipeline.transports[device]
    honest = transport.send

    def send(to, kind, tensor, **options):
        if kind in ("activation", "gradient"):
            tensor, options["copy"] = tensor * factor, False
        return honest(to, kind, tensor, **options)

    transport.send = send


def train(pipeline: Pipeline, steps: int = STEPS) -> None:
    for _ in range(steps):
        pipeline.run(lambda worker: worker.train_step())


def test_a_sketch_is_the_seeds_and_measures_relative_distance():
    x = torch.randn(4, 64, 32)
    assert torch.equal(sketch(x, 7), sketch(x.clone(), 7))
    assert sketch(x, 7).shape == (SKETCH,)
    assert not torch.equal(sketch(x, 7), sketch(x, 8))
    assert distance(sketch(x, 7), sketch(x, 7)) == 0.0
    assert distance(sketch(x * 1.3, 7), sketch(x, 7)) == pytest.approx(0.3, rel=1e-4)  # linear
    assert distance(sketch(-x, 7), sketch(x, 7)) == pytest.approx(2.0, rel=1e-4)
    # noise of the same size is about sqrt(2) off (within the sketch's spread)
    assert 1.0 < distance(sketch(torch.randn_like(x), 7), sketch(x, 7)) < 2.0


def test_honest_stages_pass_every_check_exactly_under_allreduce(corpus):
    pipeline = seeded(Pipeline(grouped(3, 3), corpus, WorkerConfig(timeout_s=30)))
    train(pipeline)
    whats = set()
    for device, worker in pipeline.workers.items():
        checks = worker.checks
        assert checks.judged > 0 and checks.failed == 0 and checks.dropped == 0, device
        assert all(v.error <= 1e-6 for v in checks.verdicts)
        assert all(v.checked != device and v.checked in pipeline.plan.stages[checks.stage].devices for v in checks.verdicts)
        whats |= {(checks.stage, v.what) for v in checks.verdicts}
        assert checks.caught() == {}
    # the first stage's activations, the middle one's both ways, the last one's gradients
    assert whats == {(0, "activations"), (1, "activations"), (1, "gradients"), (2, "gradients")}


@pytest.mark.parametrize("liar", ["s0l1", "s1l1", "s2l1"])
def test_a_stage_that_scales_what_it_hands_its_lane_is_caught_by_its_group_only(corpus, liar):
    pipeline = seeded(Pipeline(grouped(3, 3), corpus, WorkerConfig(timeout_s=30)))
    lying(pipeline, liar, 1.1)  # 10% off: twice the exact tolerance
    train(pipeline)
    stage = pipeline.plan.position(liar)[0]
    for device, worker in pipeline.workers.items():
        caught = worker.checks.caught()
        if device != liar and device in pipeline.plan.stages[stage].devices:
            assert set(caught) == {liar}, device
            assert "off what this peer recomputed" in caught[liar].words
        else:
            assert caught == {}, device
    if stage + 1 < len(pipeline.plan.stages):
        # its lane neighbour got the scaled input, and its checkers the honest copy: they drop their checks of that
        # neighbour as disputed rather than blame it
        downstream = [pipeline.workers[d].checks for d in pipeline.plan.stages[stage + 1].devices if d[-1] != liar[-1]]
        assert sum(checks.dropped for checks in downstream) > 0


def test_checks_of_a_member_whose_weights_differ_are_dropped_and_a_gossip_group_checks_nothing(corpus):
    # as a member that entered the plan steps apart from its partner holds them: drift as large as a lie
    pipeline = seeded(Pipeline(grouped(2, 3), corpus, WorkerConfig(timeout_s=30)))
    torch.manual_seed(0)
    drifted = pipeline.workers["s0l1"].flat.data
    drifted.add_(torch.randn_like(drifted) * 1e-3)
    train(pipeline)
    verdicts = [(device, v) for device, worker in pipeline.workers.items() for v in worker.checks.verdicts]
    assert not [v for device, v in verdicts if "s0l1" in (device, v.checked)]
    assert pipeline.workers["s0l1"].checks.dropped > 0
    assert verdicts and all(v.error <= 1e-6 and not v.caught for _, v in verdicts)
    gossip = seeded(Pipeline(grouped(2, 3, sync="gossip"), corpus, WorkerConfig(timeout_s=30)))
    lying(gossip, "s0l2", -1.0)
    train(gossip, 4)
    assert not {header.kind for _, header, _ in gossip.frames} & {"check", "sketch"}  # the plan says it is unchecked


def test_no_checks_when_the_recipe_turns_them_off(corpus):
    pipeline = Pipeline(grouped(2, 2, check=0.0), corpus)
    train(pipeline, 4)
    kinds = {header.kind for _, header, _ in pipeline.frames}
    assert not kinds & {"check", "check_input", "check_labels", "check_grad", "sketch"}
    assert all(worker.checks.judged == 0 for worker in pipeline.workers.values())


def header(kind: str, sender: str, step: int, micro: int = 0, shape=(1,), dtype="int64", epoch: int = 0) -> FrameHeader:
    return FrameHeader(kind=kind, dtype=dtype, shape=shape, sender=sender, step=step, micro=micro, epoch=epoch)


def test_check_frames_that_belong_to_no_check_are_refused_with_a_reason(corpus):
    pipeline = Pipeline(grouped(3, 3), corpus)
    middle = pipeline.workers["s1l0"]
    # requests: only from a neighbouring stage's holder in another lane, for a step ahead
    assert middle.accept(header("check", "s0l1", 1)) is None
    assert "checks nothing here" in middle.accept(header("check", "s0l0", 1))  # its own lane neighbour
    assert "checks nothing here" in middle.accept(header("check", "s1l1", 1))  # its own group
    assert "not in plan" in middle.accept(header("check", "stranger", 1))
    assert "micro-batch 9" in middle.accept(header("check", "s2l1", 1, micro=9))
    assert "check frame fp32" in middle.accept(header("check", "s2l1", 1, dtype="fp32"))
    assert middle.accept(header("check", "s2l1", AHEAD + 1)) == f"check of step {AHEAD + 1} at step 0"  # not blamed
    # what helpers send: only for a check this peer runs, from its helpers, of the right form
    middle.checks.mine[2] = check = Check(2, 1, 0, 5, "s1l1", "s0l1", "s2l1")
    rows = (2, 64)
    assert middle.accept(header("check_input", "s0l1", 2, shape=(*rows, 64), dtype="fp32")) is None
    assert middle.accept(header("sketch", "s2l1", 2, shape=(SKETCH,), dtype="fp32")) is None
    assert "not expected from s2l1" in middle.accept(header("check_input", "s2l1", 2, shape=(*rows, 64), dtype="fp32"))
    assert f"expected fp32[{SKETCH}]" in middle.accept(header("sketch", "s0l1", 2, shape=(32,), dtype="fp32"))
    assert "for no check" in middle.accept(header("sketch", "s2l1", 3, shape=(SKETCH,), dtype="fp32"))
    assert "for no check" in middle.accept(header("sketch", "s2l1", 2, micro=1, shape=(SKETCH,), dtype="fp32"))
    # the checked peer's answer, from it only; a question, from its group only
    assert middle.accept(header("attested", "s1l1", 2, shape=(5,))) is None
    assert "not expected from s0l1" in middle.accept(header("attested", "s0l1", 2, shape=(5,)))
    assert "expected int64[5]" in middle.accept(header("attested", "s1l1", 2, shape=(3,)))
    assert middle.accept(header("attest", "s1l2", 1)) is None
    assert "not in this peer's group" in middle.accept(header("attest", "s0l1", 1))
    assert check.checked == "s1l1"


def test_a_helper_asked_for_a_step_it_is_at_declines_and_the_check_is_dropped(corpus):
    pipeline = Pipeline(grouped(2, 2), corpus)
    checker, helper = pipeline.workers["s1l0"], pipeline.workers["s0l1"]
    check = Check(0, 1, 0, 3, "s1l1", "s0l1", None)
    checker.checks.mine[0] = check
    pipeline.transports["s1l0"].send("s0l1", "check", torch.tensor([check.seed]), step=0, micro=0, epoch=0)
    with pytest.raises(Declined, match="after its lane reached step 0"):
        checker.checks.receive("check_input", "s0l1", check, deadline=float("inf"))
    assert helper.checks.asked == {}
    # a request for a step ahead is kept, one a step from each checker
    for _ in range(2):
        pipeline.transports["s1l0"].send("s0l1", "check", torch.tensor([11]), step=2, micro=1, epoch=0)
    assert helper.checks.asked == {(2, 1): [("s1l0", 11)]}
    assert DECLINE < 0


def test_the_check_share_is_a_recipe_setting_in_range():
    assert Recipe().check == 0.02
    assert Recipe.from_wire({"check": 0.1}).check == 0.1
    with pytest.raises(SchemaError, match="recipe.check"):
        Recipe(check=1.5)
    with pytest.raises(SchemaError, match="recipe.check"):
        Recipe(check=-0.1)


def test_a_checker_with_no_way_to_a_helper_asks_nothing_and_the_lanes_train_on(corpus):
    """Two peers behind one router, say: the checker's helpers are no plan neighbours of it, and where it has no way
    to one it drops the check rather than queue a frame that cannot leave (which would stall its step)."""
    pipeline = seeded(Pipeline(grouped(2, 2), corpus, WorkerConfig(timeout_s=30)))
    cut = {("s0l0", "s1l1"), ("s1l1", "s0l0"), ("s0l1", "s1l0"), ("s1l0", "s0l1")}  # the pairs no plan link joins
    for device, transport in pipeline.transports.items():
        transport.reaches = lambda peer, me=device: (me, peer) not in cut
    train(pipeline)
    kinds = {header.kind for _, header, _ in pipeline.frames}
    assert not kinds & {"check", "check_input", "check_labels", "check_grad", "sketch"}, kinds
    assert all(w.checks.judged == 0 and w.checks.dropped > 0 for w in pipeline.workers.values())
    assert all(w.step == STEPS for w in pipeline.workers.values())
