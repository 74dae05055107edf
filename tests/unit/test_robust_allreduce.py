"""Robust all-reduce (`butterfly.py`) in every mode that averages exactly: CenteredClip at each part's owner, each
member's bound on what an owner hands back, the reports that follow, and what a pair can still do. Groups run in one
process over MemoryTransport; the poisoner poisons every frame it sends its group, as benchmarks/poison_peer.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetpeer.peer.gossip.butterfly import Verdict, centered_clip, judge
from hetpeer.peer.gossip.group import OUTLIER_ROUNDS, SyncConfig
from hetpeer.protocol.plan import Plan, StagePlan
from hetpeer.protocol.recipe import Recipe
from test_gossip_group import Group, ok

ROBUST = SyncConfig(allreduce_timeout_s=10, clip=2.0)
SIZE = 4001  # parts of about 1,000: large enough that honest distances concentrate, as a model's do
POISONS = {"scale": lambda x: x * 100.0, "flip": lambda x: -x * 100.0, "random": lambda x: torch.randn_like(x) * 100 * x.norm() / x.numel() ** 0.5}


def noisy_gradients(rng: np.random.Generator, n: int, signal: np.ndarray, noise: float = 1.0) -> np.ndarray:
    """Each lane's gradient: the shared signal plus its own batch's noise."""
    return (signal + noise * rng.normal(size=(n, len(signal)))).astype(np.float32)


def poison_sends(group: Group, device: str, poison) -> None:
    """`device` sends its group `poison` of every allreduce frame (contributions and the results of its part);
    a `poison` of two arguments is given the frame's round too (`butterfly.CONTRIBUTION`, `RESULT`)."""
    transport = group.transports[device]
    honest = transport.send
    rounds = poison.__code__.co_argcount == 2

    def send(to, kind, tensor, *, micro=0, **options):
        if kind == "allreduce":
            tensor = poison(tensor, micro) if rounds else poison(tensor)
        honest(to, kind, tensor, micro=micro, **options)

    transport.send = send


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
    signal = rng.normal(size=1000)
    honest = torch.from_numpy(noisy_gradients(rng, n, signal))
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


def test_in_a_pair_the_other_counts_only_within_clip_times_the_owners_own_norm():
    own, other = torch.tensor([1.0, 0.0]), torch.tensor([-100.0, 0.0])
    result = centered_clip(torch.stack([own, other]), torch.ones(2), clip=2.0, own=0)
    torch.testing.assert_close(result.mean, torch.tensor([0.0, 0.0]))  # own + (2 |own| toward the other) / 2
    assert result.far == (False, True)
    honest = centered_clip(torch.stack([own, torch.tensor([0.0, 1.0])]), torch.ones(2), clip=2.0, own=0)
    torch.testing.assert_close(honest.mean, torch.tensor([0.5, 0.5]))  # within the radius: the plain mean


def test_a_member_takes_a_result_near_its_own_contribution_that_holds_it_and_nothing_else():
    rng = np.random.default_rng(4)
    own, others = torch.from_numpy(rng.normal(size=1000)), torch.from_numpy(rng.normal(size=(3, 1000)))
    honest = (own + others.sum(dim=0)) / 4
    assert judge(honest, own, 0.25, 2.0) == Verdict(True, False)
    aside = others[0] - (others[0] @ own) / (own @ own) * own  # a direction orthogonal to its own contribution
    # every way of not being the mean of what was sent is refused, and the gross ones are marked far
    for name, result, far in [("scaled", honest * 100, True), ("flipped", -honest, True),
                              ("noise of its size", torch.randn(1000, dtype=torch.float64) * honest.norm() / 1000 ** 0.5, True),
                              ("the others' mean alone", others.mean(dim=0), True),
                              ("a little past the bound", own + aside * 1.2 * 2.0 * own.norm() / aside.norm(), False)]:
        verdict = judge(result, own, 0.25, 2.0)
        assert not verdict.taken and verdict.far == far, name
    assert judge(torch.zeros(3), torch.zeros(3), 0.5, 1.0).taken  # nothing to compare with


# -- in a group ---------------------------------------------------------------------------------------------------


def honest_run(n: int, steps: int, seed: int, config: SyncConfig = ROBUST) -> tuple[Group, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=SIZE) * 0.3
    x0 = rng.normal(size=SIZE).astype(np.float32)
    group = Group(n, sync="allreduce", size=SIZE, config=config, x0=np.stack([x0] * n))
    grads = [noisy_gradients(rng, n, signal) for _ in range(steps)]
    return group, grads


@pytest.mark.parametrize("n", [3, 4])
def test_an_honest_robust_group_takes_the_exact_mean_and_nobody_is_clipped(n):
    group, grads = honest_run(n, 5, seed=n)
    for t, g in enumerate(grads):
        reports = ok(group.step(t, g))
        for device, sync in group.syncs.items():
            torch.testing.assert_close(sync.flat.grad, torch.from_numpy(g.astype(np.float64).mean(axis=0)).float(),
                                       rtol=1e-5, atol=1e-6)
            assert reports[device].clipped == 0
    first = group.syncs["p0"].flat.data
    assert all(torch.equal(sync.flat.data, first) for sync in group.syncs.values())
    assert all(sync.outliers() == {} for sync in group.syncs.values())


@pytest.mark.parametrize("poison", POISONS)
def test_a_poisoner_of_four_barely_moves_the_others_step_and_all_of_them_report_it(poison):
    """p3 poisons its contributions (the owners' CenteredClip bounds them) and the result of the part it owns (each
    member's bound on it holds): the honest members' step stays near the honest mean, and all three report p3."""
    group, grads = honest_run(4, OUTLIER_ROUNDS + 1, seed=7)
    poison_sends(group, "p3", POISONS[poison])
    for t, g in enumerate(grads):
        reports = group.step(t, g)
        honest = g[:3].astype(np.float64)
        for device in ("p0", "p1", "p2"):
            assert reports[device].clipped >= 1
            taken = group.syncs[device].flat.grad.double().tensor_split(4)
            mine = torch.from_numpy(g[int(device[1])]).double().tensor_split(4)
            for j, (part, means, lanes) in enumerate(zip(taken, torch.from_numpy(honest.mean(axis=0)).tensor_split(4),
                                                          torch.from_numpy(honest).tensor_split(4, dim=1))):
                if j == 3:  # p3's own part: not taken; each member trains it on its own lane's gradient
                    assert torch.equal(part, mine[j]), f"{device} step {t} took p3's result"
                else:  # an honest owner's: within an honest lane's distance of the honest mean
                    spread = float((lanes - means).norm(dim=1).median())
                    assert float((part - means).norm()) < spread, f"{device} step {t} part {j}: the poison moved it"
        members = [group.syncs[d].flat.data for d in ("p0", "p1", "p2")]
        assert all(torch.equal(x.tensor_split(4)[0], members[0].tensor_split(4)[0]) for x in members)
    for device in ("p0", "p1", "p2"):
        assert set(group.syncs[device].outliers()) == {"p3"}, device


@pytest.mark.parametrize("lie", ["scaled", "noise of its size", "the others' mean without p0"])
def test_an_owner_that_hands_back_a_wrong_part_is_not_taken_and_is_reported_by_every_member(lie):
    """p3 contributes honestly but hands back a wrong result of the part it owns: scaled, noise as large as the
    true result, or (against p0) the mean of the others' contributions, leaving p0's out."""
    group, grads = honest_run(4, OUTLIER_ROUNDS, seed=3)
    transport = group.transports["p3"]
    honest = transport.send

    def send(to, kind, tensor, *, step, micro=0, **options):
        if kind == "allreduce" and micro == 1:
            if lie == "scaled":
                tensor = tensor * 100.0
            elif lie == "noise of its size":
                tensor = torch.randn_like(tensor) * tensor.norm() / tensor.numel() ** 0.5
            else:
                tensor = torch.from_numpy(grads[step][1:, :].mean(axis=0)).tensor_split(4)[3]
        honest(to, kind, tensor, step=step, micro=micro, **options)

    transport.send = send
    for t, g in enumerate(grads):
        own = {f"p{k}": torch.from_numpy(g[k]).tensor_split(4)[3] for k in range(3)}
        reports = ok(group.step(t, g))
        refused = ("p0", "p1", "p2") if lie != "the others' mean without p0" else ("p0",)
        for device in refused:
            assert torch.equal(group.syncs[device].flat.grad.tensor_split(4)[3], own[device]), (device, t)
            assert reports[device].clipped >= 1
        for device in set(own) - set(refused):  # it holds theirs: they take it
            assert not torch.equal(group.syncs[device].flat.grad.tensor_split(4)[3], own[device]), (device, t)
    if lie != "the others' mean without p0":  # gross lies are reported; that one, holding a third of p0's signal, is not
        for device in refused:
            assert set(group.syncs[device].outliers()) == {"p3"}, device


def test_in_a_pair_the_other_counts_only_within_clip_times_the_owners_own_norm():
    own, other = torch.tensor([1.0, 0.0]), torch.tensor([-100.0, 0.0])
    result = centered_clip(torch.stack([own, other]), torch.ones(2), clip=2.0, own=0)
    torch.testing.assert_close(result.mean, torch.tensor([0.0, 0.0]))  # own + (2 |own| toward the other) / 2
    assert result.far == (False, True)
    honest = centered_clip(torch.stack([own, torch.tensor([0.0, 1.0])]), torch.ones(2), clip=2.0, own=0)
    torch.testing.assert_close(honest.mean, torch.tensor([0.5, 0.5]))  # within the radius: the plain mean


def test_a_member_takes_a_result_near_its_own_contribution_that_holds_it_and_nothing_else():
    rng = np.random.default_rng(4)
    own, others = torch.from_numpy(rng.normal(size=1000)), torch.from_numpy(rng.normal(size=(3, 1000)))
    honest = (own + others.sum(dim=0)) / 4
    assert judge(honest, own, 0.25, 2.0) == Verdict(True, False)
    aside = others[0] - (others[0] @ own) / (own @ own) * own  # a direction orthogonal to its own contribution
    # every way of not being the mean of what was sent is refused, and the gross ones are marked far
    for name, result, far in [("scaled", honest * 100, True), ("flipped", -honest, True),
                              ("noise of its size", torch.randn(1000, dtype=torch.float64) * honest.norm() / 1000 ** 0.5, True),
                              ("the others' mean alone", others.mean(dim=0), True),
                              ("a little past the bound", own + aside * 1.2 * 2.0 * own.norm() / aside.norm(), False)]:
        verdict = judge(result, own, 0.25, 2.0)
        assert not verdict.taken and verdict.far == far, name
    assert judge(torch.zeros(3), torch.zeros(3), 0.5, 1.0).taken  # nothing to compare with


# -- in a group ---------------------------------------------------------------------------------------------------


def honest_run(n: int, steps: int, seed: int, config: SyncConfig = ROBUST) -> tuple[Group, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=SIZE) * 0.3
    x0 = rng.normal(size=SIZE).astype(np.float32)
    group = Group(n, sync="allreduce", size=SIZE, config=config, x0=np.stack([x0] * n))
    grads = [noisy_gradients(rng, n, signal) for _ in range(steps)]
    return group, grads


@pytest.mark.parametrize("n", [3, 4])
def test_an_honest_robust_group_takes_the_exact_mean_and_nobody_is_clipped(n):
    group, grads = honest_run(n, 5, seed=n)
    for t, g in enumerate(grads):
        reports = ok(group.step(t, g))
        for device, sync in group.syncs.items():
            torch.testing.assert_close(sync.flat.grad, torch.from_numpy(g.astype(np.float64).mean(axis=0)).float(),
                                       rtol=1e-5, atol=1e-6)
            assert reports[device].clipped == 0
    first = group.syncs["p0"].flat.data
    assert all(torch.equal(sync.flat.data, first) for sync in group.syncs.values())
    assert all(sync.outliers() == {} for sync in group.syncs.values())


@pytest.mark.parametrize("poison", POISONS)
def test_a_poisoner_of_four_barely_moves_the_others_step_and_all_of_them_report_it(poison):
    """p3 poisons its contributions (the owners' CenteredClip bounds them) and the result of the part it owns (each
    member's bound on it holds): the honest members' step stays near the honest mean, and all three report p3."""
    group, grads = honest_run(4, OUTLIER_ROUNDS + 1, seed=7)
    poison_sends(group, "p3", POISONS[poison])
    for t, g in enumerate(grads):
        reports = group.step(t, g)
        honest = g[:3].astype(np.float64)
        for device in ("p0", "p1", "p2"):
            assert reports[device].clipped >= 1
            taken = group.syncs[device].flat.grad.double().tensor_split(4)
            mine = torch.from_numpy(g[int(device[1])]).double().tensor_split(4)
            for j, (part, means, lanes) in enumerate(zip(taken, torch.from_numpy(honest.mean(axis=0)).tensor_split(4),
                                                          torch.from_numpy(honest).tensor_split(4, dim=1))):
                if j == 3:  # p3's own part: not taken; each member trains it on its own lane's gradient
                    assert torch.equal(part, mine[j]), f"{device} step {t} took p3's result"
                else:  # an honest owner's: within an honest lane's distance of the honest mean
                    spread = float((lanes - means).norm(dim=1).median())
                    assert float((part - means).norm()) < spread, f"{device} step {t} part {j}: the poison moved it"
        members = [group.syncs[d].flat.data for d in ("p0", "p1", "p2")]
        assert all(torch.equal(x.tensor_split(4)[0], members[0].tensor_split(4)[0]) for x in members)
    for device in ("p0", "p1", "p2"):
        assert set(group.syncs[device].outliers()) == {"p3"}, device


def test_an_owner_that_hands_back_a_poisoned_part_is_bounded_and_reported_by_every_member():
    group, grads = honest_run(4, OUTLIER_ROUNDS, seed=3)
    transport = group.transports["p3"]
    honest = transport.send

    def send(to, kind, tensor, *, micro=0, **options):  # honest contributions, poisoned results of its part
        honest(to, kind, tensor * 100.0 if kind == "allreduce" and micro == 1 else tensor, micro=micro, **options)

    transport.send = send
    for t, g in enumerate(grads):
        own = {f"p{k}": torch.from_numpy(g[k]).tensor_split(4)[3] for k in range(3)}
        ok(group.step(t, g))
        for device, mine in own.items():
            part = group.syncs[device].flat.grad.tensor_split(4)[3]
            assert float((part - mine).norm()) <= ROBUST.clip * float(mine.norm()) * (1 + 1e-5)
    for device in ("p0", "p1", "p2"):
        assert set(group.syncs[device].outliers()) == {"p3"}, device


def test_in_a_pair_the_honest_members_step_never_points_against_its_own_gradient():
    rng = np.random.default_rng(11)
    group = Group(2, sync="allreduce", size=SIZE, config=ROBUST)
    poison_sends(group, "p1", lambda x: -x * 1000.0)
    for t in range(3):
        g = noisy_gradients(rng, 2, rng.normal(size=SIZE) * 0.3)
        ok(group.step(t, g))
        for part, mine in zip(group.syncs["p0"].flat.grad.tensor_split(2), torch.from_numpy(g[0]).tensor_split(2)):
            assert float((part - mine).norm()) <= float(mine.norm()) * (1 + 1e-5)
            assert float(part @ mine) >= 0.0


def test_without_clip_the_butterfly_is_the_plain_mean_and_the_poison_goes_through():
    """What the defence is measured against: `robust=0` in the recipe."""
    group, grads = honest_run(4, 1, seed=5, config=SyncConfig(allreduce_timeout_s=10))
    poison_sends(group, "p3", POISONS["scale"])
    ok(group.step(0, grads[0]))
    honest_mean = torch.from_numpy(grads[0][:3].mean(axis=0))
    assert float((group.syncs["p0"].flat.grad - honest_mean).norm()) > 10 * float(honest_mean.norm())


def outer_group(poison=None, config: SyncConfig = ROBUST, results: bool = True) -> Group:
    """Four members from the same point, outer steps every step from step 0 (H = 1), p3 poisoning what it sends
    (with `results` False, only its contributions: as an owner it is honest)."""
    devices = tuple(f"p{i}" for i in range(4))
    plan = Plan("time", "tiny", 4, 4, 1, 1, "fp32", (StagePlan(0, 0, 4, devices, "outer", outer_every=1),),
                recipe=Recipe(outer_after=0))
    x0 = np.random.default_rng(1).normal(size=SIZE).astype(np.float32)
    group = Group(4, plan=plan, size=SIZE, config=config, x0=np.stack([x0] * 4))
    if poison is not None:
        poison_sends(group, "p3", lambda x, micro: poison(x) if results or micro == 0 else x)
    return group


def test_outer_steps_average_the_changes_robustly_and_report_the_poisoner():
    """The same gradients in four groups that take outer steps: all honest; p3 poisoning its change with the
    defence, as a contributor only and as the owner of a part too; and without the defence. Defended, a poisoning
    contributor moves the honest members a bounded way, a poisoning owner only within its members' bounds."""
    rng = np.random.default_rng(2)
    signal = rng.normal(size=SIZE) * 0.3
    grads = [noisy_gradients(rng, 4, signal) for _ in range(OUTLIER_ROUNDS + 1)]
    runs = {"honest": outer_group(), "contributor": outer_group(POISONS["flip"], results=False),
            "owner": outer_group(POISONS["flip"]), "undefended": outer_group(POISONS["flip"], SyncConfig(allreduce_timeout_s=10))}
    for group in runs.values():
        for t, g in enumerate(grads):
            ok(group.step(t, g))
    reference = runs["honest"].syncs["p0"].flat.data
    start = torch.from_numpy(np.random.default_rng(1).normal(size=SIZE).astype(np.float32))
    travelled = float((reference - start).norm())
    off = {name: float((group.syncs["p0"].flat.data - reference).norm()) for name, group in runs.items()}
    for name in ("contributor", "owner"):
        honest = [runs[name].syncs[d] for d in ("p0", "p1", "p2")]
        parts = range(4) if name == "contributor" else range(3)  # p3's own part: each bounds it by its own change
        assert all(torch.equal(s.flat.data.tensor_split(4)[j], honest[0].flat.data.tensor_split(4)[j]) for s in honest for j in parts)
        assert all(set(s.outliers()) == {"p3"} for s in honest), name
    # each clipped change moves the fixed point a third of an honest distance at most (1 of 4: see above), which
    # noise this strong (3x the signal, H = 1) makes as large as the mean change itself; the poison undefended, 50x
    assert off["undefended"] > 50 * travelled, off
    assert off["contributor"] < 0.03 * off["undefended"] and off["owner"] < 0.05 * off["undefended"], off
