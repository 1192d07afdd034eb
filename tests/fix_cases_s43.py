"""Cases for tests/test_fix_truth_s43.py: custom autograd.Functions on and off a loss's gradient path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _inner_log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p)  # the producer, in a helper the Function's forward calls


class LogViaHelper(torch.autograd.Function):
    """log by a helper its forward calls; its backward by hand ``grad / p``."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return _inner_log(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return grad / p


class LogNewStyle(torch.autograd.Function):
    """The torch >= 2.0 form: ``forward`` without ``ctx``, and ``setup_context``."""

    @staticmethod
    def forward(p: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.log(p)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        return grad / p


class Sharpen(torch.autograd.Function):
    """A metric's rounding (its forward runs ops of the loss code), identity backward."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor) -> torch.Tensor:
        return (p * 10).round() / 10

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def metric_loop(grad: bool) -> Any:
    """A log of a softmax that underflows to 0 at step 1, beside a metric made by :class:`Sharpen` that the loss
    does not read: under ``no_grad`` (``grad=False``), or with grad on and its output only kept in a list."""
    from contract import Scenario

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 4) for _ in range(3)]
    xs[1][0] = torch.tensor([2000.0, -2000.0, 2000.0, -2000.0])
    metrics: list[torch.Tensor] = []
    sharpen: Callable[[torch.Tensor], torch.Tensor] = Sharpen.apply  # type: ignore[assignment]

    def run() -> None:
        for step in range(3):
            p = model(xs[step]).softmax(-1)
            with torch.enable_grad() if grad else torch.no_grad():
                metrics.append(sharpen(p).sum())
            loss = -torch.log(p).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)
