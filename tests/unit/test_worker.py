"""Stage workers in one process over MemoryTransport, one thread each: a pipeline computes exactly what the
whole model computes, each lane reads its own data, training lowers the loss, and a peer refuses what
the plan says it should not get and stays alive."""

from __future__ import annotations

import math
import re
import time
from dataclasses import replace
from typing import Callable

import pytest
import torch

from in_threads import results
from hetpeer.peer.data.corpus import Corpus
from hetpeer.peer.model import build_stage
from hetpeer.peer.pipeline.checks import KINDS
from hetpeer.peer.pipeline.worker import StageWorker, WorkerConfig
from hetpeer.peer.transport import MemoryHub, MemoryTransport, TransportTimeout
from hetpeer.peer.transport.codec import checksum, encode
from hetpeer.protocol.frame import FrameHeader, payload_bytes
from hetpeer.protocol.recipe import Recipe
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.modelspec import preset

CHECK_KINDS = ("check", "attest", *KINDS)  # a stage check's frames (`checks.py`)

SPEC = preset("tiny")  # 4 layers, hidden 64, seq_len 64, bytes as tokens
HIDDEN, SEQ = SPEC.hidden, SPEC.seq_len
JOIN_S = 60.0  # a hang guard for the threads, not a timing


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.default()


def make_plan(
    stages: int, *, lanes: int = 1, lane_batch: int = 2, micro_batch: int = 2, dtype: str = "fp32",
    start_step: int = 0, epoch: int = 0, recipe: Recipe = Recipe(),
) -> Plan:
    """`stages` stages over the tiny model's layers, as even as they go; devices are named s<stage>l<lane>."""
    bounds = [round(s * SPEC.layers / stages) for s in range(stages + 1)]
    return Plan(
        cost_model="time",
        model="tiny",
        layers=SPEC.layers,
        batch=lane_batch * lanes,
        micro_batch=micro_batch,
        micro_batches=-(-lane_batch // micro_batch),
        dtype=dtype,
        stages=tuple(
            StagePlan(s, bounds[s], bounds[s + 1], tuple(f"s{s}l{l}" for l in range(lanes)), "none")
            for s in range(stages)
        ),
        epoch=epoch,
        start_step=start_step,
        recipe=recipe,
    )


class Pipeline:
    """Every device of a plan on one MemoryHub; `frames` records what each device was delivered."""

    def __init__(self, plan: Plan, corpus: Corpus, config: WorkerConfig = WorkerConfig(), devices=None):
        self.plan = plan
        self.hub = MemoryHub()
        self.transports = {d: MemoryTransport(d, self.hub) for d in plan.devices}
        self.frames: list[tuple[str, FrameHeader, int]] = []
        for device, transport in self.transports.items():
            transport.start()
            transport.deliver = self._recording(device, transport.deliver)
        self.workers = {
            d: StageWorker(plan, d, self.transports[d], corpus if plan.position(d)[0] == 0 else None, config)
            for d in (devices or plan.devices)
        }

    def _recording(self, device: str, deliver: Callable) -> Callable:
        def recording(header, payload, authenticated=None):
            self.frames.append((device, header, len(payload)))
            return deliver(header, payload, authenticated)

        return recording

    def run(self, action: Callable[[StageWorker], object]) -> dict[str, object]:
        """`action(worker)` for every worker, each in its own thread; the first error is raised here."""
        devices = list(self.workers)
        return dict(zip(devices, results([lambda d=d: action(self.workers[d]) for d in devices], JOIN_S)))

    def compute(self) -> dict[str, object]:
        return self.run(lambda worker: worker.compute())

    def last(self, lane: int = 0) -> str:
        return self.plan.lanes[lane][-1]

    def lane_workers(self, lane: int = 0) -> list[StageWorker]:
        return [self.workers[d] for d in self.plan.lanes[lane]]


def whole_model(corpus: Corpus, lane: int, lane_batch: int, seed: int = 0):
    """The loss and gradients of the uncut model on one lane's batch of its plan's first step (from data position 0:
    the lane's slice is the lane-th `lane_batch` windows of the order)."""
    model = build_stage(SPEC, 0, SPEC.layers, seed)
    batch = corpus.batch(lane * lane_batch, lane_batch, SEQ, seed=seed)
    loss = model.loss(model(torch.from_numpy(batch.tokens)), torch.from_numpy(batch.labels))
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_lane_matches(pipeline: Pipeline, results, reference, lane: int = 0, tolerance: float = 1e-5) -> None:
    loss, grads = reference
    assert results[pipeline.last(lane)].loss == pytest.approx(loss, rel=tolerance)
    seen = set()
    for worker in pipeline.lane_workers(lane):
        for name, parameter in worker.model.named_parameters():
            assert parameter.grad is not None, name
            assert relative(parameter.grad, grads[name]) < tolerance, name
            seen.add(name)
    assert seen == set(grads)


# -- the pipeline computes the whole model ---------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("lane_batch, micro_batch", [(2, 2), (4, 2), (5, 2)], ids=["M1", "M2", "uneven-2-2-1"])
def test_pipeline_loss_and_gradients_equal_the_whole_model(corpus, stages, lane_batch, micro_batch):
    plan = make_plan(stages, lane_batch=lane_batch, micro_batch=micro_batch)
    assert sum(plan.micro_batch_sizes(0)) == lane_batch
    pipeline = Pipeline(plan, corpus)
    results = pipeline.compute()
    assert all(results[d].loss is None for d in plan.devices if d != pipeline.last())
    assert results[pipeline.last()].sequences == lane_batch
    assert_lane_matches(pipeline, results, whole_model(corpus, 0, lane_batch))
    assert not any(t.inbox.misbehaving for t in pipeline.transports.values())


def test_two_lanes_read_their_own_batches(corpus):
    plan = make_plan(2, lanes=2, lane_batch=3, micro_batch=2, start_step=4)
    pipeline = Pipeline(plan, corpus)
    results = pipeline.compute()
    references = [whole_model(corpus, lane, 3) for lane in range(2)]
    for lane in range(2):
        assert_lane_matches(pipeline, results, references[lane], lane)
    # ... and not the other lane's: its batch gives another loss and other gradients.
    losses = [results[pipeline.last(lane)].loss for lane in range(2)]
    assert abs(losses[0] - losses[1]) > 1e-4 * losses[0]
    head = [pipeline.workers[pipeline.last(lane)].model.head.weight.grad.clone() for lane in range(2)]
    assert relative(head[0], references[1][1]["head.weight"]) > 0.1
    assert relative(head[1], references[0][1]["head.weight"]) > 0.1
    # The lanes' frames stayed within their lane (a stage check's frames, asked at random, cross to the group).
    for device, header, _ in pipeline.frames:
        if header.kind not in CHECK_KINDS:
            assert plan.position(device)[1] == plan.position(header.sender)[1], header.kind

    # The same lane, step and data position replay the same batch; the swarm's next windows are another.
    replay = Pipeline(plan, corpus)
    replayed = replay.compute()
    assert [replayed[pipeline.last(lane)].loss for lane in range(2)] == pytest.approx(losses, rel=1e-6)
    for lane in range(2):
        assert relative(replay.workers[pipeline.last(lane)].model.head.weight.grad, head[lane]) < 1e-6
    later = Pipeline(replace(plan, data_position=plan.rows_per_step), corpus)
    later.compute()
    assert relative(later.workers[pipeline.last(0)].model.head.weight.grad, head[0]) > 0.1


def test_training_lowers_the_loss(corpus):
    plan = make_plan(2, lane_batch=4, micro_batch=2, recipe=Recipe(lr=1e-3))
    pipeline = Pipeline(plan, corpus)
    steps = 15
    results = pipeline.run(lambda worker: [worker.train_step() for _ in range(steps)])
    losses = [r.loss for r in results[pipeline.last()]]
    assert [r.step for r in results[pipeline.last()]] == list(range(steps))
    assert all(worker.step == steps for worker in pipeline.workers.values())
    assert all(math.isfinite(loss) for loss in losses)
    # Bytes drawn uniformly would cost ln(256) = 5.5 nats; a model that learned anything does better.
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5


# -- what a peer accepts -----------------------------------------------------------------------------


@pytest.fixture
def middle() -> StageWorker:
    """Stage 1 of 3 in lane 0 of 2, at step 5 of plan epoch 2, micro-batches of 2, 2 and 1 sequences."""
    plan = make_plan(3, lanes=2, lane_batch=5, micro_batch=2, start_step=5, epoch=2)
    return StageWorker(plan, "s1l0", MemoryTransport("s1l0", MemoryHub()), None, WorkerConfig())


def header(kind="activation", sender="s0l0", step=5, micro=0, epoch=2, dtype=None, shape=None) -> FrameHeader:
    rows = 1 if micro == 2 else 2
    if shape is None:
        shape = (rows, SEQ) if kind == "labels" else (rows, SEQ, HIDDEN)
    dtype = dtype or ("int64" if kind == "labels" else "fp32")
    return FrameHeader(kind=kind, dtype=dtype, shape=shape, sender=sender, step=step, micro=micro, epoch=epoch)


GOOD = {
    "activation": header(),
    "labels": header("labels"),
    "gradient": header("gradient", sender="s2l0"),
    "next step": header(step=6),
    "last micro-batch": header(micro=2),
    "last micro-batch labels": header("labels", micro=2),
}

REFUSED = {
    "unknown sender": (header(sender="mallory"), "mallory is not a neighbour of s1l0"),
    "same stage, other lane": (header(sender="s0l1"), "s0l1 is not a neighbour"),
    "itself": (header(sender="s1l0"), "s1l0 is not a neighbour"),
    "gradient from the previous peer": (header("gradient"), "gradient is not expected from s0l0"),
    "activation from the next peer": (header(sender="s2l0"), "activation is not expected from s2l0"),
    "labels from the next peer": (header("labels", sender="s2l0"), "labels is not expected from s2l0"),
    "older epoch": (header(epoch=1), "plan epoch 1, this peer runs epoch 2"),
    "newer epoch": (header(epoch=3), "plan epoch 3"),
    "past step": (header(step=4), "step 4 is not 5 or the next"),
    "step too far ahead": (header(step=7), "step 7 is not 5 or the next"),
    "micro-batch out of range": (header(micro=3), "micro-batch 3 of 3"),
    "wrong hidden size": (header(shape=(2, SEQ, HIDDEN // 2)), "expected fp32\\[2, 64, 64\\]"),
    "full rows for the short micro-batch": (header(micro=2, shape=(2, SEQ, HIDDEN)), "expected fp32\\[1, 64, 64\\]"),
    "wrong sequence length": (header(shape=(2, SEQ + 1, HIDDEN)), "activation is fp32\\[2, 65, 64\\]"),
    "wrong dtype": (header(dtype="bf16"), "activation is bf16\\[2, 64, 64\\], expected fp32"),
    "labels of the wrong dtype": (header("labels", dtype="int32"), "labels is int32\\[2, 64\\], expected int64"),
    "labels shaped as activations": (header("labels", shape=(2, SEQ, HIDDEN)), "expected int64\\[2, 64\\]"),
    "gradient of the wrong shape": (header("gradient", sender="s2l0", shape=(2, SEQ)), "gradient is fp32\\[2, 64\\]"),
}


@pytest.mark.parametrize("name", GOOD)
def test_accept_takes_what_the_plan_implies(middle, name):
    assert middle.accept(GOOD[name]) is None


@pytest.mark.parametrize("name", REFUSED)
def test_accept_refuses_with_a_reason(middle, name):
    frame, reason = REFUSED[name]
    refusal = middle.accept(frame)
    assert refusal is not None and re.search(reason, refusal), refusal


def frame_of(tensor: torch.Tensor, kind: str, sender: str, *, step=0, micro=0, epoch=0):
    """An honestly encoded frame (correct size and checksum) for whatever it claims."""
    dtype, payload = encode(tensor, "raw")
    head = FrameHeader(kind=kind, dtype=dtype, shape=tuple(tensor.shape), sender=sender, step=step, micro=micro,
                       epoch=epoch, checksum=checksum(payload))
    return head, bytes(payload)


def test_bad_frames_are_refused_counted_and_the_step_still_completes(corpus):
    plan = make_plan(2, lane_batch=4, micro_batch=2, epoch=1)
    pipeline = Pipeline(plan, corpus)
    first, last = pipeline.transports["s0l0"], pipeline.transports["s1l0"]
    act, lab = torch.randn(2, SEQ, HIDDEN), torch.randint(0, 256, (2, SEQ))
    poisoned = act.clone()
    poisoned[1, 3, 5] = float("nan")
    flipped_header, flipped = frame_of(act, "activation", "s0l0", micro=1, epoch=1)
    flipped = bytearray(flipped)
    flipped[100] ^= 1
    bad_for_last = [
        frame_of(act[:, :, :32].contiguous(), "activation", "s0l0", epoch=1),
        frame_of(act.to(torch.bfloat16), "activation", "s0l0", epoch=1),
        frame_of(act, "gradient", "s0l0", epoch=1),
        frame_of(act, "activation", "s0l0", step=2, epoch=1),
        frame_of(act, "activation", "s0l0", micro=2, epoch=1),
        frame_of(lab.int(), "labels", "s0l0", epoch=1),
        frame_of(poisoned, "activation", "s0l0", epoch=1),  # passes the policy, fails the payload check
        (flipped_header, flipped),  # likewise: the checksum
    ]
    for head, payload in bad_for_last:
        assert last.deliver(head, payload) is False
    # another plan's frame is refused but not held against its sender: neighbours switch plans a moment apart
    assert last.deliver(*frame_of(act, "activation", "s0l0", epoch=0)) is False
    assert last.inbox.late == 1
    assert last.deliver(*frame_of(act, "activation", "mallory", epoch=1)) is False
    assert first.deliver(*frame_of(act[:1], "gradient", "s1l0", epoch=1)) is False
    assert first.deliver(*frame_of(act, "activation", "s1l0", epoch=1)) is False

    assert last.inbox.misbehaving == {"s0l0": len(bad_for_last), "mallory": 1}
    assert first.inbox.misbehaving == {"s1l0": 2}
    assert len(last.inbox.rejections) == len(bad_for_last) + 1
    assert any("NaN" in reason for _, reason in last.inbox.rejections)
    assert any("checksum" in reason for _, reason in last.inbox.rejections)

    # Nothing bad was kept: the step runs on the honest frames and computes the whole model's numbers.
    results = pipeline.compute()
    assert_lane_matches(pipeline, results, whole_model(corpus, 0, 4))
    assert last.inbox.misbehaving == {"s0l0": len(bad_for_last), "mallory": 1}
    assert first.inbox.misbehaving == {"s1l0": 2}


@pytest.mark.parametrize("waiting", ["s0l0", "s1l0"], ids=["for a gradient", "for an activation"])
def test_a_silent_neighbour_raises_a_timeout_instead_of_hanging(corpus, waiting):
    plan = make_plan(2, lane_batch=4, micro_batch=2)
    pipeline = Pipeline(plan, corpus, WorkerConfig(timeout_s=0.5), devices=[waiting])
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match="within 0.5 s"):
        pipeline.workers[waiting].compute()
    assert time.monotonic() - started < 10.0  # a hang guard, not a timing


def test_a_neighbour_that_is_still_fetching_its_state_is_waited_for_past_the_deadline(corpus):
    plan = make_plan(2, lane_batch=4, micro_batch=2)
    pipeline = Pipeline(plan, corpus, WorkerConfig(timeout_s=0.3))
    asked: list[str] = []
    pipeline.workers["s1l0"].patience = lambda sender: asked.append(sender) or True  # it announces fetching

    def arriving_late(worker: StageWorker):
        if worker.device_id == "s0l0":
            time.sleep(1.0)  # more than three of its neighbour's deadlines: it downloads its stage first
        return worker.compute()

    results = pipeline.run(arriving_late)
    assert_lane_matches(pipeline, results, whole_model(corpus, 0, 4))
    assert len(asked) >= 2 and set(asked) == {"s0l0"}  # the deadline passed, and the lane waited on


def test_bf16_plan_runs_on_the_cpu(corpus):
    plan = make_plan(2, lane_batch=4, micro_batch=2, dtype="bf16")
    pipeline = Pipeline(plan, corpus)
    results = pipeline.compute()
    loss = results[pipeline.last()].loss
    assert math.isfinite(loss)
    assert loss == pytest.approx(whole_model(corpus, 0, 4)[0], rel=0.05)
    sent = [(h.kind, h.dtype) for _, h, _ in pipeline.frames]
    assert ("activation", "bf16") in sent and ("gradient", "bf16") in sent and ("labels", "int64") in sent
    assert all(parameter.grad is not None and bool(torch.isfinite(parameter.grad).all())
               for worker in pipeline.workers.values() for parameter in worker.model.parameters())


def test_fp16_plan_is_refused_with_the_way_out(corpus):
    plan = make_plan(2, lane_batch=4, micro_batch=2, dtype="fp16")
    with pytest.raises(ValueError, match="fp16 would need loss scaling.*bf16 or fp32"):
        StageWorker(plan, "s0l0", MemoryTransport("s0l0", MemoryHub()), corpus, WorkerConfig())


@pytest.mark.parametrize("forward, backward, tolerance", [
    ("fp16", "fp16", 0.01), ("bf16", "bf16", 0.02), ("int8", "int8", 0.02), ("int4", "int8", 0.05), ("raw", "int4", 1e-6),
])
def test_compressed_activations_and_gradients_give_a_close_loss(corpus, forward, backward, tolerance):
    plan = make_plan(2, lane_batch=4, micro_batch=2).with_codecs(forward, backward)
    pipeline = Pipeline(plan, corpus, WorkerConfig())
    results = pipeline.compute()
    loss, grads = whole_model(corpus, 0, 4)
    assert results[pipeline.last()].loss == pytest.approx(loss, rel=tolerance)
    if forward != "raw":
        assert results[pipeline.last()].loss != loss  # the forward codec really rounded something
    for worker in pipeline.workers.values():
        for name, parameter in worker.model.named_parameters():
            assert relative(parameter.grad, grads[name]) < 0.2, name

    kinds = {"activation": 0, "gradient": 0, "labels": 0}
    for _, head, size in pipeline.frames:
        kinds[head.kind] += 1
        if head.kind == "labels":
            assert (head.codec, head.dtype, size) == ("raw", "int64", head.numel * 8)
        else:
            codec = forward if head.kind == "activation" else backward  # each direction in the plan's codec
            assert (head.codec, head.dtype) == (codec, "fp32")
            assert size == payload_bytes("fp32", head.shape, codec) <= head.numel * 4
    assert kinds == {"activation": 2, "gradient": 2, "labels": 2}


def test_a_download_enters_at_the_donors_step_or_where_the_plan_says(corpus):
    pipeline = Pipeline(make_plan(1, lanes=3, start_step=7), corpus)
    donor = pipeline.workers["s0l0"]
    donor.step = donor.sync.step = 30  # the group went on; a joiner takes its weights
    with torch.no_grad():
        donor.flat.data.add_(1.0)
    rejoined, entering = pipeline.workers["s0l1"], pipeline.workers["s0l2"]
    assert rejoined.fetch_state(["s0l0"], timeout_s=10).step == 30
    assert rejoined.step == rejoined.sync.step == 30  # a rejoining peer of a fixed plan enters at the group's step
    download = entering.fetch_state(["s0l0"], timeout_s=10, enter_at=7)
    assert download.step == 30 and entering.step == entering.sync.step == 7  # a peer entering a plan: at its start
    assert torch.equal(entering.flat.data, donor.flat.data)


def test_validation_runs_forward_only_through_the_pipeline_at_the_plans_steps(corpus):
    """eval_every 2, 3 held-out sequences in micro-batches of 2 and 1: the last stage reports, at steps 0 and 2,
    the whole model's loss on the held-out batch; nobody sends a gradient for it."""
    plan = make_plan(2, lane_batch=4, recipe=Recipe(eval_every=2, eval_batch=3))
    assert plan.eval_sizes == (2, 1)
    pipeline = Pipeline(plan, corpus)
    reports = [pipeline.run(lambda worker: worker.train_step()) for _ in range(3)]
    last = pipeline.last()
    assert [r[last].val_loss is not None for r in reports] == [True, False, True]
    assert all(r[d].val_loss is None for r in reports for d in plan.devices if d != last)
    model = build_stage(SPEC, 0, SPEC.layers)
    held_out = corpus.validation_batch(3, SEQ)
    with torch.no_grad():
        expected = model.loss(model(torch.from_numpy(held_out.tokens)), torch.from_numpy(held_out.labels)).item()
    assert reports[0][last].val_loss == pytest.approx(expected, rel=1e-5)  # before any update: the initial model
    assert reports[2][last].val_loss != reports[0][last].val_loss  # trained two steps since
    micros = {(h.kind, h.micro) for _, h, _ in pipeline.frames if h.step in (0, 2) and h.kind in ("activation", "gradient")}
    assert ("activation", 2) in micros and ("activation", 3) in micros
    assert not any(kind == "gradient" and micro >= 2 for kind, micro in micros)



def test_a_peer_far_behind_its_group_downloads_the_groups_state_instead_of_mixing_its_own(corpus):
    """A peer stopped for a while (cut off, its machine asleep) comes back `STALE_STEPS` or more behind: it
    takes the group's parameters and step, where mixing its stale ones would drag the group back (and robust
    mixing would take them for poison)."""
    from dataclasses import replace as replaced

    from hetpeer.peer.pipeline.worker import STALE_STEPS

    base = make_plan(1, lanes=2, recipe=Recipe(mix_deadline_s=0.05))
    plan = replaced(base, stages=(replaced(base.stages[0], sync="gossip"),))
    config = WorkerConfig(timeout_s=10.0)
    pipeline = Pipeline(plan, corpus, config)
    ahead, behind = pipeline.workers["s0l0"], pipeline.workers["s0l1"]
    for _ in range(STALE_STEPS + 4):  # s0l1 is stopped: s0l0 trains on, leaving it out after each deadline
        ahead.train_step()
    assert behind.step == 0
    behind.train_step()
    assert behind.step == ahead.step, "it entered at the group's step"
    assert torch.equal(behind.sync.flat.data, ahead.sync.flat.data), "with the group's parameters, not its own"
