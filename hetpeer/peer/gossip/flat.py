"""A stage's parameters and gradients as views into two flat vectors, so that mixing, all-reduce and
Adam are a handful of vector operations and a frame is a slice of one buffer."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def decays(module: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """The weight-decay rule of common practice: matrices decay; biases, norm gains (fewer than 2
    dimensions) and embedding tables do not. A stage may refine it (`decays` of its own: a tied head)."""
    if hasattr(module, "decays"):
        return module.decays
    modules = dict(module.named_modules())
    return lambda name, param: param.dim() >= 2 and not isinstance(modules.get(name.rpartition(".")[0]), nn.Embedding)


class FlatParams:
    def __init__(self, module: nn.Module) -> None:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no trainable parameters")
        device = named[0][1].device
        self.size = sum(p.numel() for _, p in named)
        self.data = torch.empty(self.size, device=device)
        self.grad = torch.zeros(self.size, device=device)
        decayed = decays(module)
        ranges: list[tuple[int, int]] = []  # [start, end) of the decayed parameters, neighbours merged
        offset = 0
        for name, p in named:
            n = p.numel()
            self.data[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.data[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)  # autograd accumulates into it in place
            if decayed(name, p):
                if ranges and ranges[-1][1] == offset:
                    ranges[-1] = (ranges[-1][0], offset + n)
                else:
                    ranges.append((offset, offset + n))
            offset += n
        self.decay_ranges = tuple(ranges)
        self.clip_apart: tuple[tuple[int, int], ...] = ()  # ranges clipped on their own norm (`adam.clip_gradient`)

    def range_of(self, param: nn.Parameter) -> tuple[int, int]:
        """[start, end) of one of the module's parameters in the flat vectors."""
        start = param.data.storage_offset()
        if param.data.untyped_storage().data_ptr() != self.data.untyped_storage().data_ptr():
            raise ValueError("the parameter is not one of these flat parameters")
        return start, start + param.numel()

    def zero_grad(self) -> None:
        self.grad.zero_()
