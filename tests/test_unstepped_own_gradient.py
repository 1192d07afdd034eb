"""A backward no optimizer step follows, whose only non-finite gradient is a parameter's own (review of hunt-b-s41).

``sqrt(|s|)`` at ``s = 0``: the gradient flowing through every module stays finite; only ``s.grad`` (0 / 0) is NaN.
A cell that runs ``loss.backward()`` and leaves ``opt.step()`` to the next (or inspects gradients) reads the
parameter gradients as the watch ends. The tiered watch did; ``mode="full"`` and ``ops=True`` took the per-module
backward checks for a read of them, and stayed silent while ``s.grad`` held NaN.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class RootScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s.abs().sqrt()


def _backward(scale: float, options: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RootScale(), nn.Linear(4, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with torch.no_grad():
        model[1].s.mul_(scale)
    with nan_magic.watch(model, **options):
        F.mse_loss(model(x), y).backward()
    return model


@pytest.mark.parametrize("mode", list(MODES))
def test_a_parameters_own_nan_gradient_is_named_as_the_watch_ends(mode: str) -> None:
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _backward(0.0, MODES[mode])
    report = caught.value.report
    assert (report.phase.value, report.module, report.module_type, report.op) == (
        "backward", "1", "RootScale", "aten.div.Tensor"), report.message


@pytest.mark.parametrize("mode", list(MODES))
def test_its_healthy_twin_is_silent_and_the_same(mode: str) -> None:
    watched = _backward(0.5, MODES[mode])
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), RootScale(), nn.Linear(4, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    with torch.no_grad():
        plain[1].s.mul_(0.5)
    F.mse_loss(plain(x), y).backward()
    for mine, theirs in zip(watched.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
