"""Robust exact averaging (`exact.py`) in every mode that averages exactly: every member takes the same
CenteredClip of every member's contribution, so a minority moves it a bounded way and the honest members stay
equal; the reports that follow; what a pair can still do; and the plain butterfly it replaces by default. Groups
run in one process over MemoryTransport; the poisoner poisons every frame it sends its group, as
benchmarks/poison_peer.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetpeer.peer.gossip.exact import APART_AFTER, CHANGE_ROUNDS, OUTLIER_ROUNDS, centered_clip
from hetpeer.peer.gossip.group import SyncConfig
from hetpeer.protocol.frame import FrameHeader
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe
from test_gossip_group import Group, ok

ROBUST = SyncConfig(allreduce_timeout_s=10, clip=2.0, chunk_bytes=4 * 1500)  # chunks of 1,500: several a vector
SIZE = 4001  # chunks of 1,500 or so: large enough that honest distances concentrate, as a model's do
POISONS = {"scale": lambda x: x * 100.0, "flip": lambda x: -x * 100.0,
           # the same noise to every member (sending each its own would be equivocation: tested apart)
           "random": lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(x.numel()), dtype=x.dtype)
           * 100 * x.norm() / x.numel() ** 0.5}


def noisy_gradients(rng: np.random.Generator, n: int, signal: np.ndarray, noise: float = 1.0) -> np.ndarray:
    """Each lane's gradient: the shared signal plus its own batch's noise."""
    return (signal + noise * rng.normal(size=(n, len(signal)))).astype(np.float32)


def poison_sends(group: Group, device: str, poison) -> None:
    """`device` sends its group `poison` of every allreduce frame; a `poison` of two arguments is given the
    receiver too (to send different members different things)."""
    transport = group.transports[device]
    honest = transport.send
    receiver = poison.__code__.co_argcount == 2

    def send(to, kind, tensor, **options):
        if kind == "allreduce":
            tensor = poison(tensor, to) if receiver else poison(tensor)
            options["copy"] = True
        honest(to, kind, tensor, **options)

    transport.send = send


def same_start(n: int, seed: int) -> np.ndarray:
    return np.stack([np.random.default_rng(seed).normal(size=SIZE).astype(np.float32)] * n)


# -- the aggregation ------------------------------------------------------------------------------------------


def test_centered_clip_of_honest_contributions_is_their_exact_weighted_mean():
    rng = np.random.default_rng(0)
    contributions = torch.from_numpy(noisy_gradients(rng, 4, rng.normal(size=1000)))
    weights = torch.tensor([1.0, 2.0, 3.0, 2.0])
    result = centered_clip(contributions, weights, clip=2.0)
    torch.testing.assert_close(result.mean, (weights / weights.sum()) @ contributions)
    assert result.scales == (1.0,) * 4 and not any(result.far)


@pytest.mark.parametrize("n", [3, 4, 5, 7])
@pytest.mark.parametrize("poison", POISONS)
def test_a_minority_moves_centered_clip_at_most_its_weight_over_the_honest_weight_times_the_radius(n, poison):
    rng = np.random.default_rng(n)
    honest = torch.from_numpy(noisy_gradients(rng, n, rng.normal(size=1000)))
    bad = (n - 1) // 2  # the most a group of n tolerates: fewer than half
    contributions = honest.clone()
    for k in range(bad):
        contributions[k] = POISONS[poison](honest[k])
    result = centered_clip(contributions, torch.ones(n), clip=2.0)
    honest_mean = honest[bad:].mean(dim=0)
    # at the fixed point the honest differences (all within the radius) balance the liars' clipped ones: the liars
    # move it from the honest mean at most their weight over the honest weight, times the radius
    assert float((result.mean - honest_mean).norm()) <= bad / (n - bad) * result.radius * 1.01
    assert result.radius < 4 * float((honest - honest.mean(dim=0)).norm(dim=1).max())  # the radius is honest-sized
    assert all(result.far[:bad]) and not any(result.far[bad:])
    plain = contributions.mean(dim=0)
    assert float((plain - honest_mean).norm()) > 10 * float((result.mean - honest_mean).norm())


def test_in_a_pair_the_smaller_contribution_is_the_centre_and_the_other_counts_within_clip_times_its_norm():
    small, large = torch.tensor([1.0, 0.0]), torch.tensor([-100.0, 0.0])
    for order in ([small, large], [large, small]):  # the same answer whoever sent which
        result = centered_clip(torch.stack(order), torch.ones(2), clip=2.0)
        torch.testing.assert_close(result.mean, torch.tensor([0.0, 0.0]))  # small + (2 |small| toward large) / 2
    assert centered_clip(torch.stack([small, large]), torch.ones(2), clip=2.0).far == (False, True)
    near = centered_clip(torch.stack([small, torch.tensor([0.0, 1.0])]), torch.ones(2), clip=2.0)
    torch.testing.assert_close(near.mean, torch.tensor([0.5, 0.5]))  # within the radius: the plain mean


# -- in a group ---------------------------------------------------------------------------------------------------


def honest_run(n: int, steps: int, seed: int, config: SyncConfig = ROBUST) -> tuple[Group, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=SIZE) * 0.3
    group = Group(n, sync="allreduce", size=SIZE, config=config, x0=same_start(n, seed))
    return group, [noisy_gradients(rng, n, signal) for _ in range(steps)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_an_honest_robust_group_takes_the_exact_mean_and_nobody_is_clipped(n):
    group, grads = honest_run(n, 5, seed=n)
    for t, g in enumerate(grads):
        reports = ok(group.step(t, g))
        for device, sync in group.syncs.items():
            torch.testing.assert_close(sync.flat.grad, torch.from_numpy(g.astype(np.float64).mean(axis=0)).float(),
                                       rtol=1e-5, atol=1e-6)
            assert reports[device].clipped == 0 and reports[device].mixed == n - 1
    first = group.syncs["p0"].flat.data
    assert all(torch.equal(sync.flat.data, first) for sync in group.syncs.values())
    assert all(sync.outliers() == {} for sync in group.syncs.values())
    # every member sent its whole gradient to every other, in chunks
    frames = [h for d, h, _, accepted in group.frames if h.kind == "allreduce" and h.step == 0 and accepted]
    assert sum(h.numel for h in frames) == n * (n - 1) * SIZE and max(h.numel for h in frames) == 1500


def test_a_lane_whose_gradient_is_far_larger_is_clipped_alike_by_all_and_not_reported_for_it():
    group, grads = honest_run(4, OUTLIER_ROUNDS, seed=1)
    for t, g in enumerate(grads):
        if t % 2 == 0:
            g[2] *= 30.0  # a batch of rare text, now and then
        reports = ok(group.step(t, g))
        assert all(r.clipped == (1 if t % 2 == 0 else 0) for r in reports.values()), t
        first = group.syncs["p0"].flat.data
        assert all(torch.equal(sync.flat.data, first) for sync in group.syncs.values()), "the members must stay equal"
    assert all(sync.outliers() == {} for sync in group.syncs.values())


@pytest.mark.parametrize("poison", POISONS)
def test_a_poisoner_of_four_barely_moves_the_others_step_and_all_of_them_report_it(poison):
    group, grads = honest_run(4, OUTLIER_ROUNDS, seed=7)
    poison_sends(group, "p3", POISONS[poison])
    for t, g in enumerate(grads):
        reports = ok(group.step(t, g))
        honest = g[:3].astype(np.float64)
        spread = float(np.median(np.linalg.norm(honest - honest.mean(axis=0), axis=1)))
        for device in ("p0", "p1", "p2"):
            assert reports[device].clipped >= 1
            taken = group.syncs[device].flat.grad.double().numpy()
            assert np.linalg.norm(taken - honest.mean(axis=0)) < spread, f"{device} step {t}: the poison moved it"
        members = [group.syncs[d].flat.data for d in ("p0", "p1", "p2")]
        assert all(torch.equal(x, members[0]) for x in members), "the honest members must stay equal"
        if t < OUTLIER_ROUNDS - 1:
            assert group.syncs["p0"].outliers() == {}, "far a few rounds is not yet an outlier"
    for device in ("p0", "p1", "p2"):
        assert set(group.syncs[device].outliers()) == {"p3"}, device


@pytest.mark.parametrize("lie", ["sign-flipped", "random"])
def test_a_member_whose_gradient_stands_apart_from_the_others_is_reported_though_never_far(lie):
    """p3 sends its honest gradient sign-flipped, or a random vector as large: within the radius, so clipping never
    sees it, but its running cosine with the others' mean is the honest lanes' negated, or about 0; after APART_AFTER
    exchanges it stands apart from the group, and OUTLIER_ROUNDS later is reported. The honest run beside it: nobody,
    over as many exchanges."""
    rounds = APART_AFTER + OUTLIER_ROUNDS
    flipped, grads = honest_run(4, rounds, seed=4)
    honest, _ = honest_run(4, rounds, seed=4)
    poison_sends(flipped, "p3", (lambda x: -x) if lie == "sign-flipped" else
                 (lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(int(x.sum() * 1e3) % 2**31),
                                        dtype=x.dtype) * x.norm() / x.numel() ** 0.5))
    for t, g in enumerate(grads):
        ok(flipped.step(t, g))
        ok(honest.step(t, g))
        if t == rounds - 3:  # apart from exchange APART_AFTER on (t = APART_AFTER - 1), far OUTLIER_ROUNDS in a row
            assert flipped.syncs["p0"].outliers() == {}, "reported before it stood apart long enough"
    for device in ("p0", "p1", "p2"):
        assert set(flipped.syncs[device].outliers()) == {"p3"}, device
    assert all(sync.outliers() == {} for sync in honest.syncs.values())


def test_a_member_that_sends_each_member_something_else_moves_each_only_within_the_bound():
    """Equivocation: p3 sends p0 its gradient x100 and the others its gradient flipped x100. The honest members'
    results differ (they averaged different things), each by no more than the bound from the honest mean."""
    group, grads = honest_run(4, 2, seed=9)
    poison_sends(group, "p3", lambda x, to: x * 100.0 if to == "p0" else -x * 100.0)
    for t, g in enumerate(grads):
        ok(group.step(t, g))
        honest = g[:3].astype(np.float64)
        spread = float(np.median(np.linalg.norm(honest - honest.mean(axis=0), axis=1)))
        for device in ("p0", "p1", "p2"):
            taken = group.syncs[device].flat.grad.double().numpy()
            assert np.linalg.norm(taken - honest.mean(axis=0)) < spread, (device, t)


def test_in_a_pair_the_honest_members_step_is_bounded_by_the_smaller_contribution():
    rng = np.random.default_rng(11)
    group = Group(2, sync="allreduce", size=SIZE, config=ROBUST, x0=same_start(2, 11))
    poison_sends(group, "p1", lambda x: -x * 1000.0)
    for t in range(3):
        g = noisy_gradients(rng, 2, rng.normal(size=SIZE) * 0.3)
        ok(group.step(t, g))
        for part, mine in zip(group.syncs["p0"].flat.grad.split(1500), torch.from_numpy(g[0]).split(1500)):
            # p0's is the smaller contribution: the step lies within its norm of it, never against it
            assert float((part - mine).norm()) <= float(mine.norm()) * (1 + 1e-5)
            assert float(part @ mine) >= 0.0


def test_without_clip_the_butterfly_is_the_plain_mean_and_the_poison_goes_through():
    """What the defence is measured against: `robust=0` in the recipe."""
    group, grads = honest_run(4, 1, seed=5, config=SyncConfig(allreduce_timeout_s=10))
    poison_sends(group, "p3", POISONS["scale"])
    ok(group.step(0, grads[0]))
    honest_mean = torch.from_numpy(grads[0][:3].mean(axis=0))
    assert float((group.syncs["p0"].flat.grad - honest_mean).norm()) > 10 * float(honest_mean.norm())


def outer_group(poison=None, config: SyncConfig = ROBUST) -> Group:
    """Four members from the same point, outer steps every step from step 0 (H = 1), p3 poisoning what it sends."""
    devices = tuple(f"p{i}" for i in range(4))
    plan = Plan("time", "tiny", 4, 4, 1, 1, "fp32", (StagePlan(0, 0, 4, devices, "outer", outer_every=1),),
                recipe=Recipe(outer_after=0))
    group = Group(4, plan=plan, size=SIZE, config=config, x0=same_start(4, 1))
    if poison is not None:
        poison_sends(group, "p3", poison)
    return group


def test_outer_steps_average_the_changes_robustly_and_report_the_poisoner():
    """The same gradients in three groups that take outer steps: all honest, p3 poisoning its change with the
    defence, and without it. Defended, the honest members stay equal, near the honest run, and report p3."""
    rng = np.random.default_rng(2)
    signal = rng.normal(size=SIZE) * 0.3
    grads = [noisy_gradients(rng, 4, signal) for _ in range(CHANGE_ROUNDS)]  # reported after as many outer steps
    runs = {"honest": outer_group(), "defended": outer_group(POISONS["flip"]),
            "undefended": outer_group(POISONS["flip"], SyncConfig(allreduce_timeout_s=10))}
    for group in runs.values():
        for t, g in enumerate(grads):
            ok(group.step(t, g))
    honest = [runs["defended"].syncs[d] for d in ("p0", "p1", "p2")]
    assert all(torch.equal(s.flat.data, honest[0].flat.data) for s in honest)
    assert all(set(s.outliers()) == {"p3"} for s in honest)
    reference = runs["honest"].syncs["p0"].flat.data
    off = {name: float((group.syncs["p0"].flat.data - reference).norm()) for name, group in runs.items()}
    travelled = float((reference - torch.from_numpy(same_start(1, 1)[0])).norm())
    # each clipped change moves the fixed point a third of an honest distance at most (1 of 4: see above), which
    # noise this strong (3x the signal, H = 1) makes as large as the mean change itself; undefended, 50x
    assert off["undefended"] > 50 * travelled, off
    assert off["defended"] < 0.03 * off["undefended"], off


def test_a_robust_member_takes_each_members_chunks_of_the_whole_vector_and_refuses_the_rest():
    group = Group(3, sync="allreduce", size=SIZE, config=ROBUST)  # chunks of 1,500, 1,500 and 1,001
    p1 = group.syncs["p1"]

    def frame(sender: str, micro: int, numel: int) -> FrameHeader:
        return FrameHeader(kind="allreduce", dtype="fp32", shape=(numel,), sender=sender, step=0, micro=micro, epoch=0)

    assert p1.accept(frame("p0", 0, 1500)) is None and p1.accept(frame("p2", 2, 1001)) is None
    assert p1.accept(frame("p2", 3, 1001)) == "allreduce chunk 3 does not exist"
    assert "expected fp32[1001]" in p1.accept(frame("p0", 2, 1500))
    assert "not another member" in p1.accept(frame("p1", 0, 1500))
