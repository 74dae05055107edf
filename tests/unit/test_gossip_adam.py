"""Decentralized Adam and AccumAdam against an independent numpy reference written from the equations
(adam.py's docstring; Wang et al., ICLR 2025):

    x_half = sum_j W_ij(t) x_j(t)
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2               (A = 1)
    m = b1 M + (1 - b1) g,  v = b2 V + (1 - b2) g^2               (AccumAdam: M, V change once a window,
    M = b1 M + (1 - b1) gbar, V = b2 V + (1 - b2) gbar^2           from the window's mean gradient gbar)
    x(t+1) = x_half - lr (m / (1 - b1^k) / (sqrt(v / (1 - b2^k)) + eps) + wd x_half),  k = ceil(t / A)

and the second moments scaled to a group of n (second_moment "group": the bias-corrected v' = m^2 +
max(v - m^2, 0) / n; "window": v from the mean of the gradients of a window of n steps, b2^j V + (1 - b2^j) mean^2
over the j gradients of the open window)

on a toy problem: 4 peers, each with its own quadratic f_i(x) = 0.5 ||A_i x - b_i||^2. First the update
alone (`adam_update` with the real mixing matrices, driven by hand), then the same numbers through the
networked path: four `GroupSync`s over `MemoryTransport`s, parameters travelling as frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from in_threads import results
from hetpeer.peer.gossip.adam import AdamConfig, AdamState, adam_update
from hetpeer.peer.gossip.flat import FlatParams
from hetpeer.peer.gossip.group import GroupSync, SyncConfig
from hetpeer.peer.gossip.topology import mixing_matrix
from hetpeer.peer.transport import MemoryHub, MemoryTransport
from hetpeer.protocol.plan import Plan, StagePlan

PEERS, DIM, ROWS = 4, 10, 12
JOIN_S = 30.0  # a hang guard for the threads, not a timing


# -- the toy problem and the reference ---------------------------------------------------------------


@dataclass
class Toy:
    """Peer i minimises 0.5 ||A_i x - b_i||^2; the group minimises the sum."""

    a: np.ndarray  # (peers, rows, dim)
    b: np.ndarray  # (peers, rows)
    x0: np.ndarray  # (peers, dim): each peer starts somewhere else

    @staticmethod
    def make(seed: int = 0) -> "Toy":
        rng = np.random.default_rng(seed)
        return Toy(
            a=rng.normal(size=(PEERS, ROWS, DIM)) / math.sqrt(ROWS),
            b=rng.normal(size=(PEERS, ROWS)),
            x0=rng.normal(size=(PEERS, DIM)),
        )

    def grads(self, x: np.ndarray) -> np.ndarray:
        """Each peer's gradient at its own parameters: A_i^T (A_i x_i - b_i)."""
        residual = np.einsum("prd,pd->pr", self.a, x) - self.b
        return np.einsum("prd,pr->pd", self.a, residual)

    def loss(self, x: np.ndarray) -> float:
        """The group's objective at the peers' mean."""
        mean = x.mean(axis=0)
        return float(sum(0.5 * np.sum((self.a[i] @ mean - self.b[i]) ** 2) for i in range(PEERS)))


@dataclass
class Reference:
    """One peer's (Accum)Adam state in float64, kept apart from the code under test."""

    dim: int
    m: np.ndarray = field(init=False)
    v: np.ndarray = field(init=False)
    window: np.ndarray = field(init=False)
    t: int = 0
    recent: list = field(default_factory=list)  # the open window's gradients (second_moment window)

    def __post_init__(self) -> None:
        self.m, self.v, self.window = np.zeros(self.dim), np.zeros(self.dim), np.zeros(self.dim)

    def step(self, x_half: np.ndarray, g: np.ndarray, config: AdamConfig) -> np.ndarray:
        b1, b2 = config.betas
        a = config.accumulate
        self.t += 1
        k = math.ceil(self.t / a)
        if config.second_moment != "lane":
            return self.group_step(x_half, g, config)
        m = b1 * self.m + (1 - b1) * g  # from the moments as they stood before this step
        v = b2 * self.v + (1 - b2) * g * g
        if a == 1:
            self.m, self.v = m, v
        else:
            self.window = self.window + g
            if self.t % a == 0:  # the window closes: the persistent moments take its mean gradient
                mean = self.window / a
                self.m = b1 * self.m + (1 - b1) * mean
                self.v = b2 * self.v + (1 - b2) * mean * mean
                self.window = np.zeros(self.dim)
        m_hat, v_hat = m / (1 - b1**k), v / (1 - b2**k)
        return x_half - config.lr * (m_hat / (np.sqrt(v_hat) + config.eps) + config.weight_decay * x_half)

    def group_step(self, x_half: np.ndarray, g: np.ndarray, config: AdamConfig) -> np.ndarray:
        b1, b2 = config.betas
        self.m = b1 * self.m + (1 - b1) * g
        m_hat = self.m / (1 - b1**self.t)
        if config.second_moment == "group":
            self.v = b2 * self.v + (1 - b2) * g * g
            v_hat = m_hat**2 + np.maximum(self.v / (1 - b2**self.t) - m_hat**2, 0) / PEERS
        else:
            self.recent.append(g)
            j = len(self.recent)
            v = b2**j * self.v + (1 - b2**j) * np.mean(self.recent, axis=0) ** 2
            if j == PEERS:
                self.v, self.recent = v, []
            v_hat = v / (1 - b2**self.t)
        return x_half - config.lr * (m_hat / (np.sqrt(v_hat) + config.eps) + config.weight_decay * x_half)


def reference_run(toy: Toy, topology: str | None, config: AdamConfig, steps: int, start_step: int = 0) -> list[np.ndarray]:
    """The peers' parameters before step 0 and after every step; topology None: no mixing (W = I)."""
    x = toy.x0.copy()
    peers = [Reference(DIM) for _ in range(PEERS)]
    trajectory = [x.copy()]
    for t in range(start_step, start_step + steps):
        g = toy.grads(x)
        w = np.eye(PEERS) if topology is None else mixing_matrix(topology, PEERS, t)
        x_half = w @ x
        x = np.stack([peers[i].step(x_half[i], g[i], config) for i in range(PEERS)])
        trajectory.append(x.copy())
    return trajectory


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CONFIGS = {
    "DAdam": AdamConfig(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    "AccumAdam-3": AdamConfig(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, accumulate=3),
    "DAdam-other-betas": AdamConfig(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
    "DAdam-v-group": AdamConfig(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, second_moment="group"),
    "DAdam-v-window": AdamConfig(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, second_moment="window"),
}


# -- the update, driven by hand ---------------------------------------------------------------------------


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # AdamState's moments follow the default dtype
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("topology", ["one-peer-exp", "ring", "alternating-exp-ring", "complete", None])
@pytest.mark.parametrize("name", CONFIGS)
def test_adam_update_after_the_real_mixing_matrix_follows_the_equations(float64, name, topology):
    config, toy, steps = CONFIGS[name], Toy.make(1), 24
    reference = reference_run(toy, topology, config, steps)
    x = torch.from_numpy(toy.x0.copy())
    states = [AdamState(DIM) for _ in range(PEERS)]
    for t in range(steps):
        g = torch.from_numpy(toy.grads(x.numpy()))
        w = torch.eye(PEERS, dtype=torch.float64) if topology is None else torch.from_numpy(mixing_matrix(topology, PEERS, t))
        x_half = w @ x
        for i in range(PEERS):
            adam_update(x_half[i], g[i], states[i], config, peers=PEERS)  # in place, from the mixed point
        x = x_half
        assert relative(x.numpy(), reference[t + 1]) < 1e-9, f"step {t}"
        assert all(state.step == t + 1 for state in states)
    # The test can tell the variants apart: the reference moved, and AccumAdam and the group's moments are not Adam.
    assert relative(reference[-1], reference[0]) > 0.1
    if config.accumulate > 1 or config.second_moment != "lane":
        plain = reference_run(toy, topology, AdamConfig(lr=config.lr, betas=config.betas, eps=config.eps,
                                                        weight_decay=config.weight_decay), steps)
        assert relative(reference[-1], plain[-1]) > 1e-3


def test_accumadam_moments_change_only_when_a_window_closes(float64):
    config = AdamConfig(lr=0.01, betas=(0.9, 0.95), weight_decay=0.0, accumulate=3)
    state = AdamState(2)
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5]), torch.tensor([-1.0, 1.0]), torch.tensor([2.0, 2.0])]
    x = torch.zeros(2)
    for g in grads[:2]:
        adam_update(x, g, state, config)
        assert torch.equal(state.m, torch.zeros(2)) and torch.equal(state.v, torch.zeros(2))
    adam_update(x, grads[2], state, config)  # t = 3 closes the first window
    mean = (grads[0] + grads[1] + grads[2]) / 3
    torch.testing.assert_close(state.m, 0.1 * mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.v, 0.05 * mean * mean, rtol=1e-12, atol=0)
    assert torch.equal(state.window, torch.zeros(2))
    adam_update(x, grads[3], state, config)
    torch.testing.assert_close(state.window, grads[3], rtol=0, atol=0)
    torch.testing.assert_close(state.m, 0.1 * mean, rtol=1e-12, atol=0)


def warmup_cosine(done: int) -> float:
    """3 steps of warmup, then a cosine to 0.2 at step 9, written out here; LambdaLR's argument is the steps done."""
    t = done + 1
    if t <= 3:
        return t / 3
    return 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - 3) / 6)))


@pytest.mark.parametrize(
    "lr, betas, eps, weight_decay, schedule",
    [(1e-2, (0.9, 0.95), 1e-8, 0.1, {}), (3e-3, (0.8, 0.999), 1e-6, 0.0, {}), (5e-2, (0.0, 0.9), 1e-8, 0.5, {}),
     (2e-2, (0.9, 0.95), 1e-8, 0.1, dict(warmup_steps=3, decay_steps=9, min_lr_ratio=0.2))],
    ids=["default-betas", "other-betas", "no-momentum", "warmup-and-cosine"],
)
def test_without_mixing_it_is_torch_adamw(lr, betas, eps, weight_decay, schedule):
    """With a schedule: torch's AdamW under a LambdaLR of the same curve (`warmup_cosine`), step for step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin.load_state_dict(model.state_dict())
    flat = FlatParams(twin)
    state = AdamState(flat.size)
    config = AdamConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **schedule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    rate = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine if schedule else lambda done: 1.0)
    generator = torch.Generator().manual_seed(1)
    steps = 12 if schedule else 8  # past the decay's end
    for step in range(steps):
        inputs, targets = torch.randn(16, 5, generator=generator), torch.randn(16, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        rate.step()
        flat.zero_grad()
        torch.nn.functional.mse_loss(twin(inputs), targets).backward()
        adam_update(flat.data, flat.grad, state, config)
        expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(flat.data, expected, rtol=1e-5, atol=1e-7, msg=f"step {step}")
        for p, q in zip(model.parameters(), twin.parameters()):  # the module's views moved with the flat vector
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-7)
    assert state.step == steps


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0], ids=["always-clipped", "sometimes", "never-reached"])
def test_clipping_is_torch_clip_grad_norm_before_adamw(clip):
    """The recipe's clip_norm: the stage's gradient scaled as torch.nn.utils.clip_grad_norm_ scales a module's,
    then AdamW, step for step (and the clipped gradient is what the moments saw)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    twin.load_state_dict(model.state_dict())
    flat, config = FlatParams(twin), AdamConfig(lr=1e-2, clip_norm=clip)
    state = AdamState(flat.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(1)
    norms = []
    for step in range(8):
        inputs, targets = torch.randn(16, 5, generator=generator), 3 * torch.randn(16, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        flat.zero_grad()
        torch.nn.functional.mse_loss(twin(inputs), targets).backward()
        adam_update(flat.data, flat.grad, state, config)
        torch.testing.assert_close(flat.grad, torch.cat([p.grad.reshape(-1) for p in model.parameters()]), rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(flat.data, torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                                   rtol=1e-5, atol=1e-7, msg=f"step {step}")
    if clip == 0.05:
        assert min(norms) > clip  # the case clips every step, or it tests nothing


def test_ranges_clipped_apart_are_each_scaled_by_their_own_norm_and_the_rest_together():
    """A tied matrix (`clip_apart`) is clipped as torch clips it alone; the rest of the stage as torch clips the rest."""
    from hetpeer.peer.gossip.adam import clip_gradient

    generator = torch.Generator().manual_seed(2)
    grad = torch.randn(30, generator=generator) * 4
    apart, rest = grad[10:20].clone().requires_grad_(), torch.cat([grad[:10], grad[20:]]).clone().requires_grad_()
    apart.grad, rest.grad = apart.detach().clone(), rest.detach().clone()
    torch.nn.utils.clip_grad_norm_([apart], 1.0)
    torch.nn.utils.clip_grad_norm_([rest], 1.0)
    clip_gradient(grad, 1.0, [(10, 20)])
    torch.testing.assert_close(grad[10:20], apart.grad)
    torch.testing.assert_close(torch.cat([grad[:10], grad[20:]]), rest.grad)


def test_the_schedule_warms_up_decays_and_holds():
    config = AdamConfig(lr=2e-2, warmup_steps=3, decay_steps=9, min_lr_ratio=0.2)
    assert [config.lr_at(t) for t in (1, 3, 9, 40)] == pytest.approx([2e-2 / 3, 2e-2, 4e-3, 4e-3])
    assert AdamConfig(lr=2e-2).lr_at(1000) == 2e-2


def test_decay_ranges_are_torch_adamw_with_a_no_decay_group():
    """Biases and embedding tables take no weight decay: torch's AdamW with two parameter groups, step for step."""
    torch.manual_seed(0)

    def build():
        return torch.nn.ModuleDict({"embed": torch.nn.Embedding(7, 4), "out": torch.nn.Linear(4, 3)})

    model, twin = build(), build()
    twin.load_state_dict(model.state_dict())
    flat = FlatParams(twin)
    assert flat.decay_ranges == ((28, 40),)  # embed.weight [0, 28) no; out.weight [28, 40) yes; out.bias no
    config = AdamConfig(lr=5e-2, weight_decay=0.5)
    decayed = [model["out"].weight]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.5},
                                   {"params": [model["embed"].weight, model["out"].bias], "weight_decay": 0.0}],
                                  lr=5e-2, betas=config.betas, eps=config.eps)
    state = AdamState(flat.size)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        ids, targets = torch.randint(0, 7, (16,), generator=generator), torch.randn(16, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model["out"](model["embed"](ids)), targets).backward()
        optimizer.step()
        flat.zero_grad()
        torch.nn.functional.mse_loss(twin["out"](twin["embed"](ids)), targets).backward()
        adam_update(flat.data, flat.grad, state, config, flat.decay_ranges)
        for name, p in model.named_parameters():
            torch.testing.assert_close(dict(twin.named_parameters())[name].detach(), p.detach(), rtol=1e-5, atol=1e-7,
                                       msg=f"{name} at step {step}")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=0.0), "lr and eps must be positive"),
        (dict(clip_norm=-1.0), "clip_norm must be a finite number >= 0"),
        (dict(lr=-1e-3), "lr and eps must be positive"),
        (dict(eps=0.0), "lr and eps must be positive"),
        (dict(weight_decay=-0.1), "weight_decay non-negative"),
        (dict(lr=float("nan")), "lr and eps must be positive"),
        (dict(betas=(1.0, 0.9)), r"betas must be in \[0, 1\), got \(1.0, 0.9\)"),
        (dict(betas=(0.9, -0.1)), "betas must be in"),
        (dict(betas=(float("nan"), 0.9)), "betas must be in"),
        (dict(accumulate=0), "accumulate must be at least 1 step, got 0"),
        (dict(warmup_steps=-1), "warmup_steps must be a whole number of steps >= 0, got -1"),
        (dict(warmup_steps=10, decay_steps=10), r"decay_steps must be a whole number of steps past the warmup \(10\), got 10"),
        (dict(min_lr_ratio=1.5), r"min_lr_ratio must be in \[0, 1\], got 1.5"),
        (dict(second_moment="mean"), "second_moment must be one of lane, group, window, got 'mean'"),
        (dict(accumulate=4, second_moment="group"), r"AccumAdam \(accumulate 4\) keeps its own second moment"),
    ],
)
def test_adam_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(weight_decay=float("nan")), dict(lr=float("inf")), dict(betas=(0.9,)), dict(accumulate=2.5)],
    ids=["nan-weight-decay", "infinite-lr", "one-beta", "fractional-window"],
)
def test_adam_config_rejects_values_that_break_the_update(kwargs):
    """Each of these passes AdamConfig's checks today and then breaks `adam_update`: NaN weight decay or an
    infinite lr turn the parameters into NaN or infinity on the first step; a single beta passes the range
    check and fails to unpack inside the update; with A = 2.5 the window closes only every 5 steps
    (t % 2.5 == 0) and its "mean" is the sum of 5 gradients divided by 2.5."""
    with pytest.raises(ValueError):
        AdamConfig(**kwargs)


# -- the same equations through GroupSync over the in-memory transport --------------------------------------


def one_group_plan(devices: tuple[str, ...], sync: str = "gossip") -> Plan:
    stage = StagePlan(0, 0, 4, devices, sync)
    return Plan("time", "tiny", 4, len(devices), 1, 1, "fp32", (stage,))


class Group:
    """One GroupSync per peer on a shared hub; each holds a Linear(4, 2) (10 parameters) as a flat vector."""

    def __init__(self, adam: AdamConfig, sync: SyncConfig, x0: np.ndarray) -> None:
        self.devices = tuple(f"p{i}" for i in range(len(x0)))
        self.plan = one_group_plan(self.devices)
        hub = MemoryHub()
        self.syncs: list[GroupSync] = []
        for i, device in enumerate(self.devices):
            transport = MemoryTransport(device, hub)
            transport.start()
            flat = FlatParams(torch.nn.Linear(4, 2))
            assert flat.size == DIM
            flat.decay_ranges = ((0, DIM),)  # the equations decay every parameter; the rule is tested on its own
            flat.data.copy_(torch.from_numpy(x0[i]))
            sync_i = GroupSync(self.plan, device, transport, flat, adam, sync)
            transport.set_policy(sync_i.accept)
            self.syncs.append(sync_i)

    def x(self) -> np.ndarray:
        return np.stack([s.flat.data.double().numpy() for s in self.syncs])

    def step(self, t: int, grads: np.ndarray) -> list:
        for s, g in zip(self.syncs, grads):
            s.flat.grad.copy_(torch.from_numpy(g))
        for s in self.syncs:
            s.begin(t)
        return run_all([lambda s=s: s.finish(t) for s in self.syncs])


def run_all(actions) -> list:
    return results(actions, JOIN_S)


@pytest.mark.parametrize("topology", ["one-peer-exp", "ring"])
@pytest.mark.parametrize("name", ["DAdam", "AccumAdam-3", "DAdam-v-group", "DAdam-v-window"])
def test_groupsync_over_the_transport_follows_the_equations(name, topology):
    config, toy, steps = CONFIGS[name], Toy.make(2), 10
    reference = reference_run(toy, topology, config, steps)
    # 16-byte chunks: the 10 parameters travel as 3 frames (4 + 4 + 2) to each neighbour
    group = Group(config, SyncConfig(topology=topology, deadline_s=10.0, chunk_bytes=16), toy.x0.astype(np.float32))
    np.testing.assert_array_equal(group.x(), toy.x0.astype(np.float32))
    for t in range(steps):
        reports = group.step(t, toy.grads(group.x()))
        for report in reports:
            assert (report.mode, report.mixed, report.left_out, report.clipped) == ("gossip", 1, (), 0)
        assert relative(group.x(), reference[t + 1]) < 1e-5, f"step {t}"  # float32 against float64
    assert relative(reference[-1], reference[0]) > 0.1
    assert all(s.state.step == steps for s in group.syncs)
    assert all(not s.transport.inbox.misbehaving for s in group.syncs)
    assert toy.loss(reference[-1]) < toy.loss(reference[0])


@pytest.mark.parametrize("second_moment", ["group", "window"])
def test_a_group_s_second_moment_takes_the_mean_gradient_s_step_where_noise_dominates(second_moment):
    """Where a lane's gradient is mostly noise (mean 0.1, noise 1 on every coordinate), plain Adam's step along
    the mean is about mean / sqrt(mean^2 + noise^2) of lr; one that divides by a group of 16's second moment takes
    about mean / sqrt(mean^2 + noise^2 / 16): some 3 times more. With n = 1 it is plain Adam exactly."""
    generator = torch.Generator().manual_seed(0)
    grads = [0.1 + torch.randn(4000, generator=generator) for _ in range(64)]

    def drift(config: AdamConfig, peers: int) -> float:
        x, state = torch.zeros(4000), AdamState(4000, windowed=config.windowed)
        for g in grads:
            adam_update(x, g.clone(), state, config, peers=peers)
        return float(-x.mean())

    plain = drift(AdamConfig(lr=1e-2, weight_decay=0.0), 16)
    scaled = AdamConfig(lr=1e-2, weight_decay=0.0, second_moment=second_moment)
    assert drift(scaled, 16) > 2 * plain > 0
    assert drift(scaled, 1) == pytest.approx(plain, rel=1e-6)
