"""A stage's parameters and gradients as views into two flat vectors, so that mixing, all-reduce and
Adam are a handful of vector operations and a frame is a slice of one buffer."""

from __future__ import annotations

import torch
from torch import nn


class FlatParams:
    def __init__(self, module: nn.Module) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters")
        device = params[0].device
        self.size = sum(p.numel() for p in params)
        self.data = torch.empty(self.size, device=device)
        self.grad = torch.zeros(self.size, device=device)
        offset = 0
        for p in params:
            n = p.numel()
            self.data[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.data[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)  # autograd accumulates into it in place
            offset += n

    def zero_grad(self) -> None:
        self.grad.zero_()
