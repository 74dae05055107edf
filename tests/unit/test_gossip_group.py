"""A group's averaging in one process over MemoryTransport: exact all-reduce, gossip that leaves a dead or
lying neighbour out instead of waiting or mixing garbage, robust mixing, what a peer refuses, a change of
membership, and compressed parameter frames. (State download has its own tests: test_gossip_state.py.)"""

from __future__ import annotations

import collections
import math
import re
import time
from typing import Callable

import numpy as np
import pytest
import torch

from in_threads import outcomes
from hetpeer.peer.gossip.adam import AdamConfig, AdamState, adam_update
from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.group import AHEAD_STEPS, OUTLIER_ROUNDS, SUSPECT_WAIT_S, GroupSync, SyncConfig
from hetpeer.peer.gossip.topology import mixing_matrix
from hetpeer.peer.transport import MemoryHub, MemoryTransport, TransportTimeout
from hetpeer.peer.transport.codec import checksum, encode
from hetpeer.peer.transport.inbox import Late
from hetpeer.protocol.frame import FrameHeader, payload_bytes
from hetpeer.protocol.plan import Plan, StagePlan

JOIN_S = 30.0  # a hang guard for the threads, not a timing
NO_DECAY = AdamConfig(lr=1e-2, weight_decay=0.0)  # with a zero gradient the Adam step is exactly zero


def one_group_plan(devices, sync: str = "gossip", *, epoch: int = 0, start_step: int = 0, standby=()) -> Plan:
    stage = StagePlan(0, 0, 4, tuple(devices), sync)
    return Plan("time", "tiny", 4, len(devices), 1, 1, "fp32", (stage,), standby=tuple(standby), epoch=epoch,
                start_step=start_step)


def run_all(actions: list[Callable[[], object]]) -> list[object]:
    """Each action in its own thread; what each returned or raised, in order."""
    return outcomes(actions, JOIN_S)


class Group:
    """n GroupSyncs p0..p{n-1} on one hub, each over a Linear(size - 1, 1) flattened (size parameters).
    `frames` records every frame delivered: (receiver, header, payload bytes, accepted)."""

    def __init__(self, n: int, *, sync: str = "gossip", config: SyncConfig = SyncConfig(), adam: AdamConfig = NO_DECAY,
                 size: int = 10, x0: np.ndarray | None = None, plan: Plan | None = None) -> None:
        self.devices = tuple(f"p{i}" for i in range(n))
        self.plan = plan or one_group_plan(self.devices, sync)
        self.hub = MemoryHub()
        self.transports: dict[str, MemoryTransport] = {}
        self.syncs: dict[str, GroupSync] = {}
        self.frames: list[tuple[str, FrameHeader, int, bool]] = []
        for i, device in enumerate(self.devices):
            transport = MemoryTransport(device, self.hub)
            transport.start()
            transport.deliver = self._recording(device, transport.deliver)
            flat = FlatParams(torch.nn.Linear(size - 1, 1))
            if x0 is not None:
                flat.data.copy_(torch.from_numpy(np.asarray(x0[i], dtype=np.float32)))
            sync_i = GroupSync(self.plan, device, transport, flat, adam, config)
            transport.set_policy(sync_i.accept)
            self.transports[device], self.syncs[device] = transport, sync_i

    def _recording(self, device: str, deliver: Callable) -> Callable:
        def recording(header, payload, authenticated=None):
            accepted = deliver(header, payload, authenticated)
            self.frames.append((device, header, len(payload), accepted))
            return accepted

        return recording

    def x(self, devices=None) -> np.ndarray:
        return np.stack([self.syncs[d].flat.data.double().numpy() for d in (devices or self.devices)])

    def step(self, t: int, grads: np.ndarray | None = None, members=None) -> dict[str, object]:
        """begin(t) on every member (in order), then finish(t) on all at once; the reports (or errors)."""
        members = members or self.devices
        for k, device in enumerate(members):
            flat = self.syncs[device].flat
            if grads is None:
                flat.zero_grad()
            else:
                flat.grad.copy_(torch.from_numpy(grads[k].astype(np.float32)))
        for device in members:
            self.syncs[device].begin(t)
        outcomes = run_all([lambda d=d: self.syncs[d].finish(t) for d in members])
        return dict(zip(members, outcomes))


def ok(reports: dict[str, object]) -> dict[str, object]:
    for device, report in reports.items():
        if isinstance(report, BaseException):
            raise report
    return reports


def consensus(x: np.ndarray) -> float:
    """Mean distance of a peer's parameters to the group's mean, relative to the mean's norm."""
    mean = x.mean(axis=0)
    return float(np.mean(np.linalg.norm(x - mean, axis=1)) / np.linalg.norm(mean))


def frame_of(tensor: torch.Tensor, kind: str, sender: str, *, step: int = 0, micro: int = 0, epoch: int = 0,
             codec: str = "raw") -> tuple[FrameHeader, bytes]:
    """An honestly encoded frame (right size and checksum) for whatever it claims."""
    dtype, payload = encode(tensor, codec)
    header = FrameHeader(kind=kind, dtype=dtype, shape=tuple(tensor.shape), sender=sender, step=step, micro=micro,
                         epoch=epoch, codec=codec, checksum=checksum(payload))
    return header, bytes(payload)


class Quadratics:
    """Peer i minimises 0.5 ||A_i x - b_i||^2 (a different problem per peer)."""

    def __init__(self, peers: int, dim: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.normal(size=(peers, dim + 2, dim)) / math.sqrt(dim + 2)
        self.b = rng.normal(size=(peers, dim + 2))
        self.x0 = rng.normal(size=(peers, dim))

    def grads(self, x: np.ndarray) -> np.ndarray:
        return np.einsum("prd,pr->pd", self.a, np.einsum("prd,pd->pr", self.a, x) - self.b)

    def loss(self, x: np.ndarray) -> float:
        mean = x.mean(axis=0)
        return float(sum(0.5 * np.sum((a @ mean - b) ** 2) for a, b in zip(self.a, self.b)))


# -- all-reduce ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_gives_every_member_the_adam_step_of_the_mean_gradient(n):
    rng = np.random.default_rng(n)
    size = 40  # not a multiple of 3: the parts are uneven
    x0 = rng.normal(size=size).astype(np.float32)
    adam = AdamConfig(lr=1e-2, weight_decay=0.1)
    group = Group(n, sync="allreduce", adam=adam, size=size, x0=np.stack([x0] * n), config=SyncConfig(allreduce_timeout_s=10))
    reference, state = torch.from_numpy(x0.copy()), AdamState(size)
    for t in range(3):
        grads = rng.normal(size=(n, size)).astype(np.float32)
        reports = ok(group.step(t, grads))
        mean = torch.from_numpy(grads.astype(np.float64).mean(axis=0)).float()
        adam_update(reference, mean, state, adam, group.syncs["p0"].flat.decay_ranges)  # the bias takes no decay
        first = group.syncs["p0"].flat.data
        for device, sync in group.syncs.items():
            assert torch.equal(sync.flat.data, first), f"{device} differs from p0 at step {t}"
            torch.testing.assert_close(sync.flat.grad, mean, rtol=1e-5, atol=1e-6)
            assert (reports[device].mode, reports[device].mixed, reports[device].left_out) == ("allreduce", n - 1, ())
        torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-6, msg=f"step {t}")
        # a butterfly: 2 (n - 1) messages to each peer a step, n - 1 contributions to its part and n - 1 owners' results, each 1/n of the gradient
        frames = [(d, h) for d, h, _, accepted in group.frames if h.kind == "allreduce" and h.step == t and accepted]
        assert collections.Counter(d for d, _ in frames) == {d: 2 * (n - 1) for d in group.devices}
        assert all(h.numel in (size // n, size // n + 1) for _, h in frames)
    assert not any(t.inbox.misbehaving for t in group.transports.values())


def test_allreduce_weighs_lanes_of_unlike_shares_by_them():
    """Lanes taking 1, 2 and 5 of a step's 8 sequences: the mean every member steps on is the whole batch's gradient,
    each lane's own (its batch's mean) weighted by its share."""
    rng = np.random.default_rng(5)
    size, shares = 12, np.array([1, 2, 5])
    devices = ("p0", "p1", "p2")
    plan = Plan("time", "tiny", 4, 8, 1, 5, "fp32", (StagePlan(0, 0, 4, devices, "allreduce"),), lane_batches=tuple(shares))
    group = Group(3, plan=plan, size=size, config=SyncConfig(allreduce_timeout_s=10))
    grads = rng.normal(size=(3, size)).astype(np.float32)
    ok(group.step(0, grads))
    expected = torch.from_numpy((shares @ grads.astype(np.float64) / shares.sum()).astype(np.float32))
    for sync in group.syncs.values():
        torch.testing.assert_close(sync.flat.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sync", ["allreduce", "gossip"])
def test_an_allreduce_group_measures_the_gradient_noise_scale_and_a_gossip_group_does_not(sync):
    """Each lane's gradient is G + its own noise: a lane's squared norm averages |G|^2 + tr(S) / b, the mean's
    |G|^2 + tr(S) / (n b), and the meter's ratio is tr(S) / |G|^2 in the units of b (`noise.py`, by hand here)."""
    n, size, sigma = 4, 400, 0.5
    rng = np.random.default_rng(0)
    g = rng.normal(size=size).astype(np.float32) * 0.2
    group = Group(n, sync=sync, size=size, config=SyncConfig(allreduce_timeout_s=10))
    for t in range(40):
        ok(group.step(t, g + sigma * rng.normal(size=(n, size)).astype(np.float32)))
    # one lane's noise, of variance sigma^2 per coordinate, is tr(S) / b with b = 1: B_simple = size sigma^2 / |G|^2
    expected = size * sigma**2 / float(np.square(g.astype(np.float64)).sum())
    for sync_ in group.syncs.values():
        found = sync_.noise.estimate(1, n)
        if sync == "gossip":
            assert found is None  # its lanes never see the mean gradient
        else:
            assert found == pytest.approx(expected, rel=0.25)


def test_allreduce_with_a_member_missing_times_out_instead_of_hanging():
    group = Group(3, sync="allreduce", config=SyncConfig(allreduce_timeout_s=0.3))
    reports = group.step(0, members=("p0", "p1"))
    for device in ("p0", "p1"):
        assert isinstance(reports[device], TransportTimeout), reports[device]


def test_allreduce_waits_past_the_mix_deadline_for_a_member_that_comes_late():
    """A member entering the plan from standby may start its step a little before the others finish the
    old plan: all-reduce cannot leave it out, and must not give up after the gossip deadline."""
    group = Group(2, sync="allreduce", config=SyncConfig(deadline_s=0.05, allreduce_timeout_s=30))
    for sync in group.syncs.values():
        sync.flat.zero_grad()
        sync.begin(0)

    def late() -> object:
        time.sleep(0.5)  # ten mix deadlines
        return group.syncs["p1"].finish(0)

    reports = run_all([lambda: group.syncs["p0"].finish(0), late])
    assert not any(isinstance(r, BaseException) for r in reports), reports


# -- gossip ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_begin_sends_the_parameters_to_the_rounds_outgoing_neighbour_at_once_with_overlap(overlap):
    rng = np.random.default_rng(2)
    group = Group(4, config=SyncConfig(topology="one-peer-exp", chunk_bytes=16, overlap=overlap), x0=rng.normal(size=(4, 10)))
    sync = group.syncs["p0"]
    sync.begin(1)  # round 1 of 4: shift 2, so p0's parameters are mixed in by p2
    sent = [(d, h) for d, h, _, _ in group.frames]
    if not overlap:  # sent only once the gradient is ready, in finish
        assert sent == [] and sync.sent is None
        reports = ok(group.step(1))
        assert all(r.mixed == 1 and r.left_out == () for r in reports.values())
        assert len([h for _, h, _, accepted in group.frames if h.kind == "params" and accepted]) == 4 * 3
        return
    assert [(d, h.kind, h.step, h.micro, h.shape) for d, h in sent] == [
        ("p2", "params", 1, 0, (4,)), ("p2", "params", 1, 1, (4,)), ("p2", "params", 1, 2, (2,))
    ]
    assert sync.sent == 1
    parts = [group.transports["p2"].recv("params", "p0", 1, c, 1.0) for c in range(3)]
    assert torch.equal(torch.cat(parts), sync.flat.data)
    sync.begin(1)  # already sent: not again
    assert len(group.frames) == 3


# -- gossip with a dead neighbour -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["silent", "unplugged"])
def test_a_dead_neighbour_is_left_out_with_renormalised_weights_and_not_waited_for_again(how):
    deadline = 0.3
    rng = np.random.default_rng(3)
    x0 = rng.normal(size=(4, 10))
    group = Group(4, config=SyncConfig(topology="complete", deadline_s=deadline), x0=x0)
    alive = ("p0", "p1", "p2")
    waits: dict[str, list[tuple[str, float]]] = {d: [] for d in group.devices}  # (sender, timeout asked)
    for device in group.devices:
        transport = group.transports[device]

        def recv(kind, sender, step, micro, timeout_s, _recv=transport.recv, _device=device):
            if kind == "params":
                waits[_device].append((sender, timeout_s))
            return _recv(kind, sender, step, micro, timeout_s)

        transport.recv = recv
    if how == "unplugged":
        group.hub.unplug("p3")
    members = group.devices if how == "unplugged" else alive  # an unplugged peer runs on, cut off

    reports = ok(group.step(0, members=members))
    expected = x0[:3].astype(np.float32).astype(np.float64).mean(axis=0)  # w = 1/4 each, renormalised to 1/3
    for device in alive:
        assert (reports[device].left_out, reports[device].mixed) == (("p3",), 2)
        np.testing.assert_allclose(group.x([device])[0], expected, rtol=1e-6, atol=1e-6)
        assert group.syncs[device].left_out == {"p3": 1}
        first_wait = [timeout for sender, timeout in waits[device] if sender == "p3"]
        assert len(first_wait) == 1 and SUSPECT_WAIT_S < first_wait[0] <= deadline  # the full deadline, once
    if how == "unplugged":
        assert reports["p3"].left_out == alive and reports["p3"].mixed == 0
        np.testing.assert_allclose(group.x(["p3"])[0], x0[3], rtol=1e-6)  # nothing came: its own point

    for device in group.devices:
        waits[device].clear()
    for t in range(1, 10):
        reports = ok(group.step(t, members=members))
        assert all(reports[d].left_out == ("p3",) for d in alive)
    for device in alive:
        assert group.syncs[device].left_out == {"p3": 10}
        later = [timeout for sender, timeout in waits[device] if sender == "p3"]
        assert len(later) == 9 and max(later) <= SUSPECT_WAIT_S  # a moment, not another deadline
        np.testing.assert_allclose(group.x([device])[0], expected, rtol=1e-6, atol=1e-6)

    if how == "silent":  # it comes back: heard from again, it gets the full deadline and is mixed in
        for device in group.devices:
            waits[device].clear()
        group.syncs["p3"].begin(10)
        reports = ok(group.step(10, members=("p3",) + alive))
        assert all(r.left_out == () and r.mixed == 3 for r in reports.values())
        for device in alive:
            assert [t for s, t in waits[device] if s == "p3"][0] > SUSPECT_WAIT_S
            assert group.syncs[device].left_out == {"p3": 10}
        mean = (3 * expected + x0[3]) / 4
        np.testing.assert_allclose(group.x(), np.stack([mean] * 4), rtol=1e-6, atol=1e-6)


def test_a_dead_neighbour_in_one_peer_exp_leaves_the_peer_at_its_own_point():
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=0.2), x0=np.eye(4, 10))
    reports = ok(group.step(0, members=("p0", "p1", "p2")))  # round 0: i mixes with i - 1; p0's is p3
    assert reports["p0"].left_out == ("p3",) and reports["p0"].mixed == 0
    np.testing.assert_array_equal(group.x(["p0"])[0], np.eye(4, 10)[0])
    assert reports["p1"].left_out == () and reports["p1"].mixed == 1
    np.testing.assert_allclose(group.x(["p1"])[0], (np.eye(4, 10)[0] + np.eye(4, 10)[1]) / 2)


# -- what a peer refuses ------------------------------------------------------------------------------------


@pytest.fixture
def member() -> GroupSync:
    """p1 of a gossip group p0..p3 at step 5 of plan epoch 2: 10 parameters in chunks of 4 (4, 4, 2);
    all-reduce parts of 3, 3, 2, 2."""
    plan = one_group_plan(("p0", "p1", "p2", "p3"), epoch=2, start_step=5)
    transport = MemoryTransport("p1", MemoryHub())
    sync = GroupSync(plan, "p1", transport, FlatParams(torch.nn.Linear(9, 1)), NO_DECAY, SyncConfig(chunk_bytes=16))
    transport.set_policy(sync.accept)
    return sync


def head(kind="params", sender="p0", step=5, micro=0, epoch=2, dtype="fp32", shape=(4,), codec="raw") -> FrameHeader:
    return FrameHeader(kind=kind, dtype=dtype, shape=shape, sender=sender, step=step, micro=micro, epoch=epoch, codec=codec)


ACCEPTED = {
    "params": head(),
    "params from another neighbour": head(sender="p3"),
    "params a step ahead": head(step=6),
    f"params {AHEAD_STEPS} steps ahead": head(step=5 + AHEAD_STEPS),
    "last, shorter chunk": head(micro=2, shape=(2,)),
    "params in bf16": head(codec="bf16"),
    "params in int8": head(codec="int8"),
    "a contribution to this member's part": head("allreduce", shape=(3,)),
    "a contribution from another member": head("allreduce", sender="p3", shape=(3,)),
    "an owner's result of its part": head("allreduce", sender="p3", shape=(2,), micro=1),
}

REFUSED = {
    "a stranger": (head(sender="mallory"), "mallory is not another member of p1's group"),
    "itself": (head(sender="p1"), "p1 is not another member"),
    "chunk index past the end": (head(micro=3), "params chunk 3 does not exist"),
    "wrong shape": (head(shape=(5,)), r"params chunk 0 is fp32\[5\], expected fp32\[4\]"),
    "full-size last chunk": (head(micro=2, shape=(4,)), r"expected fp32\[2\]"),
    "two dimensions": (head(shape=(2, 2)), r"fp32\[2, 2\], expected fp32\[4\]"),
    "wrong dtype": (head(dtype="bf16"), r"params chunk 0 is bf16\[4\], expected fp32\[4\]"),
    "integer params": (head(dtype="int64"), r"is int64\[4\]"),
    "a result the size of another part": (head("allreduce", sender="p2", shape=(3,), micro=1), r"expected fp32\[2\]"),
    "allreduce round past the end": (head("allreduce", shape=(3,), micro=2), "allreduce round 2 does not exist"),
    "allreduce share of the wrong size": (head("allreduce", shape=(2,)), r"expected fp32\[3\]"),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_accept_takes_what_the_group_should_send(member, name):
    assert member.accept(ACCEPTED[name]) is None


@pytest.mark.parametrize("name", REFUSED)
def test_accept_refuses_with_a_reason_that_is_someones_fault(member, name):
    frame, reason = REFUSED[name]
    refusal = member.accept(frame)
    assert refusal is not None and not isinstance(refusal, Late), refusal
    assert re.search(reason, refusal), refusal


@pytest.mark.parametrize("epoch", [1, 3])
def test_frames_of_another_plan_epoch_are_late_not_someones_fault(member, epoch):
    """A member switches plans a moment before or after this peer: its frames are dropped, not held against it."""
    refusal = member.accept(head(epoch=epoch))
    assert isinstance(refusal, Late) and f"plan epoch {epoch}, this peer runs epoch 2" in refusal


@pytest.mark.parametrize("kind", ["params", "allreduce"])
def test_frames_of_a_finished_step_or_far_ahead_are_late_and_ahead_is_recorded(member, kind):
    shape = (4,) if kind == "params" else (3,)
    done = member.accept(head(kind, step=4, shape=shape))
    assert isinstance(done, Late) and "step 4 is done (this peer is at 5)" in done
    assert member.ahead is None
    far = member.accept(head(kind, step=6 + AHEAD_STEPS, shape=shape))
    assert isinstance(far, Late) and "far ahead" in far
    assert member.ahead == 6 + AHEAD_STEPS
    member.accept(head(kind, step=7 + AHEAD_STEPS, shape=shape))
    member.accept(head(kind, step=6 + AHEAD_STEPS, shape=shape))
    assert member.ahead == 7 + AHEAD_STEPS  # the furthest seen


def test_refused_frames_are_counted_against_their_sender_and_late_ones_are_not(member):
    transport = member.transport
    chunk = torch.ones(4)
    refused = [
        frame_of(chunk, "params", "mallory", step=5, epoch=2),
        frame_of(chunk, "params", "p0", step=5, micro=3, epoch=2),
        frame_of(torch.ones(5), "params", "p0", step=5, epoch=2),
        frame_of(chunk.to(torch.bfloat16), "params", "p0", step=5, epoch=2),
        frame_of(torch.ones(2, 2), "params", "p2", step=5, epoch=2),
    ]
    for header, payload in refused:
        assert transport.deliver(header, payload) is False
    late = [frame_of(chunk, "params", "p0", step=4, epoch=2), frame_of(chunk, "params", "p3", step=99, epoch=2),
            frame_of(chunk, "params", "p0", step=5, epoch=1)]
    for header, payload in late:
        assert transport.deliver(header, payload) is False
    assert transport.inbox.misbehaving == {"mallory": 1, "p0": 3, "p2": 1}
    assert transport.inbox.late == 3
    assert member.ahead == 99
    good = frame_of(chunk * 3, "params", "p0", step=5, epoch=2)
    assert transport.deliver(*good) is True
    assert torch.equal(transport.recv("params", "p0", 5, 0, 1.0), chunk * 3)


@pytest.mark.parametrize(
    "bad, codec", [(float("nan"), "raw"), (float("inf"), "raw"), (-float("inf"), "raw"), (float("nan"), "bf16")]
)
def test_non_finite_parameters_are_never_mixed(bad, codec):
    """p1 (silent otherwise) sends three chunks of which the middle one holds one bad value: the frame is
    refused by the payload check and counted, and p0 leaves p1 out entirely instead of mixing two chunks."""
    x0 = np.stack([np.arange(10.0), np.arange(10.0) + 100])
    group = Group(2, config=SyncConfig(deadline_s=0.3, chunk_bytes=16, codec=codec), x0=x0)
    poisoned = torch.from_numpy(x0[1]).float()
    poisoned[5] = bad
    transport = group.transports["p0"]
    delivered = [
        transport.deliver(*frame_of(part, "params", "p1", step=0, micro=c, codec=codec))
        for c, part in enumerate(poisoned.split(4))
    ]
    assert delivered == [True, False, True]
    assert transport.inbox.misbehaving == {"p1": 1}
    assert "NaN or infinite" in transport.inbox.rejections[-1][1]
    report = ok(group.step(0, members=("p0",)))["p0"]
    assert report.left_out == ("p1",) and report.mixed == 0
    np.testing.assert_array_equal(group.x(["p0"])[0], x0[0])
    assert group.syncs["p0"].left_out == {"p1": 1}


# -- robust mixing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 1.0, 3.0])
def test_clipping_bounds_how_far_a_poisoned_neighbour_moves_a_peer(clip):
    rng = np.random.default_rng(4)
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=10, clip=clip), x0=rng.normal(size=(4, 10)))
    for t in range(6):  # honest rounds: the peers drift apart a little between mixings (local steps)
        for sync in group.syncs.values():
            sync.flat.data.add_(torch.from_numpy(rng.normal(scale=0.1, size=10)).float())
        ok(group.step(t))
    receiver, poisoner = group.syncs["p0"], group.syncs["p3"]
    assert mixing_matrix("one-peer-exp", 4, 6)[0, 3] == 0.5  # round 6: p0 mixes in p3 with weight 1/2
    typical = receiver.typical_distance
    assert typical is not None and typical > 0
    poisoner.flat.data.add_(1e3)
    before = receiver.flat.data.clone()
    distance = float((poisoner.flat.data - before).norm())
    report = ok(group.step(6))["p0"]
    moved = float((receiver.flat.data - before).norm())
    assert report.mixed == 1
    if clip is None:
        assert report.clipped == 0
        assert moved == pytest.approx(0.5 * distance, rel=1e-5)  # half way to the poisoned point
        assert moved > 1e3
    else:
        assert report.clipped == 1
        assert 0 < moved <= clip * typical * 0.5 * (1 + 1e-5)
        assert moved == pytest.approx(clip * typical * 0.5, rel=1e-4)  # it moves towards it by the bound, no less


def test_a_steady_poisoner_widens_the_clipping_bound_only_slowly():
    rng = np.random.default_rng(9)
    clip = 3.0
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=10, clip=clip), x0=rng.normal(size=(4, 10)))
    for t in range(4):  # honest rounds set the typical distance
        ok(group.step(t))
    receiver = group.syncs["p0"]
    start = receiver.typical_distance
    for t in range(4, 24):  # from now on p3 and p1 (p0's partners) send points far away, every round
        for poisoner in ("p1", "p3"):
            group.syncs[poisoner].flat.data.copy_(receiver.flat.data + 1e3)
        ok(group.step(t))
    # each round may raise it by at most 5% (the cap on what feeds the running scale): 20 rounds, under 2.7x
    assert receiver.typical_distance <= start * 1.05**20 * (1 + 1e-6)
    assert receiver.typical_distance < 3 * start


def test_robust_mixing_still_mixes_peers_that_start_from_the_same_parameters():
    """Every lane builds its stage from the same seed, so a group starts with identical parameters and the
    first round's distances are all 0. Robust mixing must not take 0 as the typical distance for good:
    with honest neighbours, clipping at 2x the typical distance still brings the peers together."""
    problem = Quadratics(4, 10, seed=5)
    start = np.stack([problem.x0[0]] * 4)
    adam = AdamConfig(lr=0.05, weight_decay=0.0)
    runs = {}
    for name, sync, clip in [("plain", "gossip", None), ("robust", "gossip", 2.0), ("alone", "none", None)]:
        group = Group(4, sync=sync, adam=adam, x0=start, config=SyncConfig(topology="one-peer-exp", deadline_s=10, clip=clip))
        for t in range(12):
            ok(group.step(t, problem.grads(group.x())))
        runs[name] = group
    assert consensus(runs["plain"].x()) < 0.5 * consensus(runs["alone"].x())  # mixing does bring them together
    assert consensus(runs["robust"].x()) < 0.5 * consensus(runs["alone"].x())
    assert runs["robust"].syncs["p0"].typical_distance > 0


# -- membership change ----------------------------------------------------------------------------------


def test_a_new_plan_with_three_of_the_four_mixes_over_three_and_refuses_the_one_removed():
    rng = np.random.default_rng(7)
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=10), x0=rng.normal(size=(4, 10)))
    for t in range(2):
        ok(group.step(t))
    # p1 leaves; the others keep their lane order, so p2 and p3 move to positions 1 and 2
    new = one_group_plan(("p0", "p2", "p3"), epoch=1, start_step=2, standby=("p1",))
    remaining = ("p0", "p2", "p3")
    for device in remaining:
        group.syncs[device].set_plan(new)
    assert [group.syncs[d].index for d in remaining] == [0, 1, 2]
    assert all(group.syncs[d].members == remaining for d in remaining)
    for t in range(2, 5):
        before = group.x(remaining)
        reports = ok(group.step(t, members=remaining))
        w = mixing_matrix("one-peer-exp", 3, t)
        np.testing.assert_allclose(group.x(remaining), w @ before, rtol=1e-6, atol=1e-6, err_msg=f"step {t}")
        assert all(r.left_out == () and r.mixed == 1 for r in reports.values())
    # p1, still on the old plan, sends its parameters to its old neighbours: refused as a stranger
    group.frames.clear()
    group.syncs["p1"].begin(5)
    from_p1 = [(d, h, accepted) for d, h, _, accepted in group.frames if h.sender == "p1"]
    assert from_p1 and not any(accepted for _, _, accepted in from_p1)
    for device, _, _ in from_p1:
        assert any(s == "p1" and "p1 is not another member of" in reason
                   for s, reason in group.transports[device].inbox.rejections)
    # and a frame of the old epoch from a member is dropped as late (it may not have switched yet), not counted
    inbox = group.transports["p2"].inbox
    late, misbehaving = inbox.late, dict(inbox.misbehaving)
    header, payload = frame_of(torch.zeros(10), "params", "p0", step=5, epoch=0)
    assert group.transports["p2"].deliver(header, payload) is False
    assert inbox.late == late + 1 and inbox.misbehaving == misbehaving


# -- compressed parameter frames ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_parameters_still_converge_and_travel_compressed(codec):
    problem, steps, size = Quadratics(4, 40, seed=8), 15, 41  # 41 = 40 + 1: Linear(40, 1); toy on the first 40
    adam = AdamConfig(lr=0.02, weight_decay=0.0)
    finals = {}
    for name in ("raw", codec):
        x0 = np.concatenate([problem.x0, np.zeros((4, 1))], axis=1)
        group = Group(4, adam=adam, size=size, x0=x0, config=SyncConfig(codec=name, chunk_bytes=64, deadline_s=10))
        start = consensus(group.x())
        for t in range(steps):
            grads = np.concatenate([problem.grads(group.x()[:, :40]), np.zeros((4, 1))], axis=1)
            ok(group.step(t, grads))
        x = group.x()
        assert consensus(x) < 0.1 * start, name
        assert problem.loss(x[:, :40]) < problem.loss(x0[:, :40]), name
        params = [(h, n) for _, h, n, accepted in group.frames if h.kind == "params"]
        assert params and all(accepted for _, h, _, accepted in group.frames if h.kind == "params")
        for header, n in params:
            assert header.codec == name and header.dtype == "fp32"
            assert n == payload_bytes("fp32", header.shape, name)
            assert (n < 4 * header.numel) == (name != "raw")
        finals[name] = x
    difference = np.linalg.norm(finals[codec] - finals["raw"]) / np.linalg.norm(finals["raw"])
    assert 0 < difference < 0.02  # the codec rounded something, and not much


def test_a_poisoner_heard_in_the_first_round_cannot_set_the_clipping_scale():
    rng = np.random.default_rng(5)
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=10, clip=2.0), x0=np.ones((4, 10)))
    group.syncs["p3"].flat.data.mul_(100.0)  # before any round: the first parameters p0 hears are poisoned
    before = group.syncs["p0"].flat.data.clone()
    ok(group.step(0))
    receiver = group.syncs["p0"]
    own_step = receiver.adam.lr * 10 ** 0.5  # the scale a peer starts from: an Adam step of lr on every coordinate
    assert receiver.typical_distance <= 1.5 * own_step
    assert float((receiver.flat.data - before).norm()) < 3 * own_step  # p3 was clipped, not half-way mixed in
    del rng


def test_outliers_are_neighbours_clipped_while_another_passes():
    group = Group(4, config=SyncConfig(topology="one-peer-exp", deadline_s=10, clip=2.0), x0=np.ones((4, 10)))
    group.syncs["p3"].flat.data.mul_(100.0)
    p0 = group.syncs["p0"]
    for t in range(8):
        group.syncs["p3"].flat.data.copy_(torch.full((10,), 100.0))  # it keeps sending the poison
        ok(group.step(t))
        if 0 < p0.clip_streaks["p3"] < OUTLIER_ROUNDS:
            assert p0.outliers() == {}, "far a round or two is not yet an outlier"
    assert p0.outliers() == {"p3": p0.clip_streaks["p3"]} and p0.clip_streaks["p3"] >= 3
    p2 = group.syncs["p2"]  # one-peer-exp over 4 peers: p2 hears p1 and p0, never p3
    assert p2.outliers() == {}
    t = next(t for t in range(8, 16) if mixing_matrix("one-peer-exp", 4, t)[0, 3] > 0)  # a round p0 hears only p3
    for earlier in range(8, t):
        ok(group.step(earlier))
    group.syncs["p3"].flat.data.copy_(torch.full((10,), 100.0))
    before = p0.flat.data.clone()
    assert ok(group.step(t))["p0"].clipped == 1
    assert torch.equal(p0.flat.data, before), "an outlier is left out of the mix, not clipped into it"
