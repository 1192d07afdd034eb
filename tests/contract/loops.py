"""Training loops the contract tables share: plain SGD over a batch function, and random batches."""

from __future__ import annotations

import torch
from torch import nn

from contract import Scenario


def sgd_loop(model: nn.Module, batch, loss_fn, steps: int = 4, lr: float = 0.01, opt=None) -> Scenario:
    """SGD (or ``opt``) on ``loss_fn(model(*batch(step)), step)``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr) if opt is None else opt

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            loss = loss_fn(model(*batch(step)), step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def loader_loop(model: nn.Module, loader, loss_fn, lr: float = 0.01) -> Scenario:
    """SGD on ``loss_fn(model(x), y)`` for each ``(x, y)`` a ``DataLoader`` gives."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def batches(*shape: int, steps: int = 4) -> list[torch.Tensor]:
    return [torch.randn(*shape) for _ in range(steps)]
