"""Adam on one flat vector per stage: local AdamW, and the update of decentralized Adam and AccumAdam.

Decentralized Adam (Wang et al., ICLR 2025), peer i at step t (1-based), gradient g taken at x_i(t):

    x_half = sum_j W_ij(t) x_j(t)                      (mixing: done by the caller, `group.py`)
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2     (moments are local and never sent)
    x_i(t+1) = x_half - lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd x_half)

Weight decay (wd) applies to weight matrices only: biases, norm gains and embedding tables take none
(`flat.decays`), as in common GPT-2 training practice and in the authors' GPT-2 experiment.

Before the step, the stage's gradient is scaled to at most `clip_norm` in L2 norm (the recipe's clipping: a
stage clips its own gradient, the group's mean one where it all-reduces). With W = I this is AdamW exactly (a test holds it to torch.optim.AdamW). AccumAdam (same paper, for the
variance of small local batches) keeps persistent moments M, V that change only at the end of each
window of A steps, from the window's mean gradient gbar: M = b1 M + (1 - b1) gbar,
V = b2 V + (1 - b2) gbar^2. Every step still moves the parameters, with m = b1 M + (1 - b1) g and
v = b2 V + (1 - b2) g^2 (M, V as they were before this step's window closed) and bias correction by
k = ceil(t / A) in place of t. A = 1 is plain decentralized Adam.

A gossip peer's second moment v is that of its own lane's gradients, whose variance is n times that of the
group's mean gradient, which is what all-reduce's Adam divides by: so the group's mean step is smaller than
all-reduce's where noise dominates (docs/gossip.md measures the cost). The recipe's `second_moment` chooses
how a peer of a gossip group of n estimates it:

- `lane`: from its own gradients, as Wang et al. publish it;
- `group`: scaled to the group's mean gradient, v' = m^2 + max(v - m^2, 0) / n (bias-corrected moments): the
  lane's variance about the mean direction, divided by n;
- `window`: from the mean of its last n gradients (a window that closes at the steps divisible by n), whose
  variance is the group mean's: at step t with j gradients of the open window summing to G, the step divides
  by v' = b2^j V + (1 - b2^j) (G / j)^2, bias-corrected by 1 - b2^t, and V takes v' when the window closes
  (so v forgets at b2 a step, as plain Adam's). A group size that changes mid-window only shifts one window.

With n = 1 (all-reduce and outer-step groups, whose steps are not a lane's alone between syncs: outer steps
train apart like a single Adam) every choice is plain Adam.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from hetpeer.protocol.recipe import SECOND_MOMENTS, Recipe


@dataclass(frozen=True, slots=True)
class AdamConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    accumulate: int = 1  # AccumAdam's window A; 1 = Adam
    warmup_steps: int = 0  # the learning rate rises linearly from lr / warmup_steps to lr over these steps
    decay_steps: int | None = None  # then falls on a cosine to min_lr_ratio x lr at this step (None: stays at lr)
    min_lr_ratio: float = 0.1
    clip_norm: float = 0.0  # the gradient is scaled to at most this L2 norm before the step (0: never)
    second_moment: str = "lane"  # how a gossip peer estimates v (`SECOND_MOMENTS`, above)

    @staticmethod
    def of(recipe: Recipe) -> "AdamConfig":
        """The optimizer the organizer's recipe asks for."""
        return AdamConfig(lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, weight_decay=recipe.weight_decay,
                          accumulate=recipe.accumulate, warmup_steps=recipe.warmup_steps,
                          decay_steps=recipe.decay_steps or None, min_lr_ratio=recipe.min_lr_ratio, clip_norm=recipe.clip_norm,
                          second_moment=recipe.second_moment)

    @property
    def windowed(self) -> bool:
        """Whether the state keeps a window's gradient sum (AccumAdam, or v from a window's mean)."""
        return self.accumulate > 1 or self.second_moment == "window"

    def __post_init__(self) -> None:
        numbers = (self.lr, self.eps, self.weight_decay)
        if not all(math.isfinite(v) for v in numbers) or not self.lr > 0 or not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"lr and eps must be positive and weight_decay non-negative, all finite: {self}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be at least 1 step, got {self.accumulate}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a whole number of steps >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps <= self.warmup_steps):
            raise ValueError(f"decay_steps must be a whole number of steps past the warmup ({self.warmup_steps}), got {self.decay_steps}")
        if not math.isfinite(self.clip_norm) or self.clip_norm < 0:
            raise ValueError(f"clip_norm must be a finite number >= 0 (0: no clipping), got {self.clip_norm}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.second_moment not in SECOND_MOMENTS:
            raise ValueError(f"second_moment must be one of {', '.join(SECOND_MOMENTS)}, got {self.second_moment!r}")
        if self.accumulate > 1 and self.second_moment != "lane":
            raise ValueError(f"AccumAdam (accumulate {self.accumulate}) keeps its own second moment: second_moment must be lane")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based): linear warmup, then a cosine decay to
        min_lr_ratio x lr at decay_steps, constant after."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay_steps is None:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done)))


class AdamState:
    """The optimizer state of one stage: moments (and a window's gradient sum), flat, plus the step count. The
    window exists only where the config needs one (`AdamConfig.windowed`): plain Adam holds 4 bytes a parameter less."""

    def __init__(self, size: int, device: str | torch.device = "cpu", windowed: bool = False) -> None:
        self.m = torch.zeros(size, device=device)
        self.v = torch.zeros(size, device=device)
        self.window = torch.zeros(size, device=device) if windowed else None  # sum of this window's gradients
        self.step = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.m, self.v) if self.window is None else (self.m, self.v, self.window)


@torch.no_grad()
def adam_update(
    x: torch.Tensor, grad: torch.Tensor, state: AdamState, config: AdamConfig,
    decay_ranges: Sequence[tuple[int, int]] | None = None, clip_apart: Sequence[tuple[int, int]] = (), peers: int = 1,
) -> None:
    """Move x (the mixed point, changed in place) by one (Accum)Adam step with `grad` (clipped first, in place,
    where the config says: `clip_gradient`, with `clip_apart`); weight decay applies to the [start, end)
    `decay_ranges` of x (`FlatParams.decay_ranges`), or to all of it when None. `peers` is the gossip group's
    size, which the config's `second_moment` scales by (1: plain Adam).

    Plain Adam runs as torch's fused AdamW kernel over views of the flat vectors (one pass over memory
    where the unfused update takes ten; what torch.optim.AdamW(fused=True) runs), AccumAdam and the second
    moments of a group as tensor operations."""
    b1, b2 = config.betas
    if config.clip_norm:
        clip_gradient(grad, config.clip_norm, clip_apart)
    state.step += 1
    t, window = state.step, config.accumulate
    lr = config.lr_at(t)
    if window == 1 and (config.second_moment == "lane" or peers == 1):
        _fused_adamw(x, grad, state, config, lr, decay_ranges)
        return
    if window == 1:
        _group_adamw(x, grad, state, config, lr, decay_ranges, peers)
        return
    if state.window is None:
        state.window = torch.zeros_like(state.m)
    m = state.m * b1 + grad * (1 - b1)
    v = state.v * b2 + grad * grad * (1 - b2)
    k = math.ceil(t / window)
    state.window.add_(grad)
    if t % window == 0:
        mean = state.window / window
        state.m.mul_(b1).add_(mean, alpha=1 - b1)
        state.v.mul_(b2).addcmul_(mean, mean, value=1 - b2)
        state.window.zero_()
    denominator = v.sqrt().div_(math.sqrt(1 - b2**k)).add_(config.eps)
    _decay(x, lr * config.weight_decay, decay_ranges)
    x.addcdiv_(m, denominator, value=-lr / (1 - b1**k))


def _group_adamw(
    x: torch.Tensor, grad: torch.Tensor, state: AdamState, config: AdamConfig, lr: float,
    decay_ranges: Sequence[tuple[int, int]] | None, peers: int,
) -> None:
    """One AdamW step (the step count already advanced) whose second moment is scaled to a gossip group of
    `peers` (`second_moment` group or window: the module's docstring)."""
    b1, b2 = config.betas
    t = state.step
    state.m.mul_(b1).add_(grad, alpha=1 - b1)
    m_hat = state.m / (1 - b1**t)
    if config.second_moment == "group":
        state.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        square = m_hat * m_hat
        v = (state.v / (1 - b2**t)).sub_(square).clamp_(min=0).div_(peers).add_(square)
    else:  # window
        if state.window is None:
            state.window = torch.zeros_like(state.m)
        state.window.add_(grad)
        j = (t - 1) % peers + 1  # gradients in the open window, this one included
        mean = state.window / j
        v = state.v * b2**j
        v.addcmul_(mean, mean, value=1 - b2**j)
        if j == peers:
            state.v.copy_(v)
            state.window.zero_()
        v.div_(1 - b2**t)
    _decay(x, lr * config.weight_decay, decay_ranges)
    x.addcdiv_(m_hat, v.sqrt_().add_(config.eps), value=-lr)


def _decay(x: torch.Tensor, amount: float, decay_ranges: Sequence[tuple[int, int]] | None) -> None:
    """Decoupled weight decay: x shrinks by `amount` (lr x weight decay) on its `decay_ranges` (all of it when None)."""
    shrink = 1 - amount
    if decay_ranges is None:
        x.mul_(shrink)
    elif shrink != 1:
        for start, end in decay_ranges:
            x[start:end].mul_(shrink)


def clip_gradient(grad: torch.Tensor, max_norm: float, apart: Sequence[tuple[int, int]] = ()) -> None:
    """Scale `grad` (in place) to at most `max_norm` in L2 norm, as torch's clip_grad_norm_ does over a module's
    gradients (the same 1e-6 guard), without reading the norm back to the host (no device sync). The [start, end)
    ranges `apart` are clipped each on its own norm, the rest together: a tied matrix whose copies at the two
    ends of a lane get the same gradient must take the same step, whatever else each stage holds."""
    def scale(norm: torch.Tensor) -> torch.Tensor:
        return (max_norm / (norm + 1e-6)).clamp(max=1.0)

    parts = [torch.linalg.vector_norm(grad[start:end].float()) for start, end in apart]
    total = torch.linalg.vector_norm(grad.float())
    rest = scale((total.square() - sum(p.square() for p in parts)).clamp(min=0).sqrt() if parts else total)
    grad.mul_(rest.to(grad.dtype))
    for (start, end), part in zip(apart, parts):
        grad[start:end].mul_((scale(part) / rest).to(grad.dtype))


def _fused_adamw(
    x: torch.Tensor, grad: torch.Tensor, state: AdamState, config: AdamConfig, lr: float,
    decay_ranges: Sequence[tuple[int, int]] | None,
) -> None:
    """One AdamW step (the step count already advanced) as torch's fused kernel, in two calls: the decayed
    ranges of x with weight decay, the rest without."""
    size = x.numel()
    decayed = [(0, size)] if decay_ranges is None else list(decay_ranges)
    kept, at = [], 0
    for start, end in decayed:
        if start > at:
            kept.append((at, start))
        at = end
    if at < size:
        kept.append((at, size))
    step = torch.tensor(float(state.step), device=x.device)
    for ranges, decay in ((decayed, config.weight_decay), (kept, 0.0)):
        if not ranges:
            continue
        views = [[tensor[start:end] for start, end in ranges] for tensor in (x, grad, state.m, state.v)]
        torch._fused_adamw_(
            *views, [], [step] * len(ranges), amsgrad=False, lr=lr, beta1=config.betas[0],
            beta2=config.betas[1], weight_decay=decay, eps=config.eps, maximize=False,
        )
