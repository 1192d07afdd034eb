"""Cases for tests/test_fix_truth_s43.py: logits masked with -inf beside a log of 0, and custom
autograd.Functions on and off a loss's gradient path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
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


class MaskedLogits(nn.Module):
    """Logits with the illegal entries -inf (``how``: masked_fill, where, or an additive bias); the last logit is
    a log of ``p``, which is exactly 0 (``two_logs``: the one before it too, on a line of its own)."""

    def __init__(self, how: str, two_logs: bool = False) -> None:
        super().__init__()
        self.how, self.two_logs, self.offset = how, two_logs, 0.0
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        p = torch.relu(logits[:, 4:]) * 0.0 + self.offset  # (offset 1: no log of 0, a healthy step)
        last = p.log()  # the producer
        before = logits[:, 3:4]
        if self.two_logs:
            before = (torch.relu(logits[:, 3:4]) * 0.0).log()  # a second log of 0, not remedied with the first
        logits = torch.cat([logits[:, :3], before, last], -1)
        if self.how == "fill":
            return logits.masked_fill(~legal, float("-inf"))
        if self.how == "where":
            return torch.where(legal, logits, float("-inf"))
        return logits + torch.zeros(legal.shape).masked_fill(~legal, float("-inf"))


def masked_scenario(how: str, two_logs: bool = False, entropy: bool = False, zero_from: int = 0) -> Any:
    """``entropy``: the loss adds an entropy bonus, ``p * logp``, 0 * -inf at the masked entries (NaN);
    ``zero_from``: the step from which the log reads its 0 (the steps before it are healthy)."""
    from contract import Scenario

    torch.manual_seed(0)
    model = MaskedLogits(how, two_logs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    legal = torch.ones(4, 5, dtype=torch.bool)
    legal[:, 1] = False  # the -inf a mask puts in every row; the log's column stays legal

    def run() -> None:
        for step in range(3):
            model.offset = 1.0 if step < zero_from else 0.0
            out = model(x, legal)
            if entropy:
                logp = F.log_softmax(out, -1)
                loss = F.nll_loss(logp, torch.zeros(4, dtype=torch.long)) + 0.01 * (logp.exp() * logp).sum(-1).mean()
            else:
                loss = torch.where(legal, out, 0.0).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)
