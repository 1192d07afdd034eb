"""The review of fixes-s35 (a division by a std, variance or norm of 0): what it got wrong, each a user's case.

Was: (1) the eps trial added eps to a spread of 0 wherever it was 0 everywhere, and said "verified" with no warning
even where the numerator was not 0 (x / 0: ``mse / y.var()`` of equal targets, a Sharpe ratio of equal non-zero
returns): ``x / (var + 1.2e-7)`` is x * 8e6, and by hand the loss went 9e7, 5e18, 3e29, inf, nan. Now only a centred
0 / 0 gets eps added; x / 0 is clamped as before, "hidden, not fixed", and the hint says an eps does not fix it.
(2) the loss code's count of nothing read as a spread (``mask.sum().sqrt()``, ``mask.norm(p=1)``, std_mean's mean);
(3) in a model, std_mean's / var_mean's mean (their second output, the same autograd node) read as a std; now a
spread is a std or variance (their first output), a 2-norm, sqrt of a variance or of a mean or sum of squares.
(4) the hint's eps (1e-5) was not the edit's (1.2e-07); a probe's overflowed gradient read as "has a gradient".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fixes_s30_cases import fit
from torch import nn

import nan_magic
from nan_magic.records import Report

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "ops": {"ops": True},
                                    "ops-defer": {"ops": True, "defer": True}}


def watched(built: tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]], mode: str) -> Report:
    model, opt, loop = built
    try:
        with nan_magic.watch(model, opt, **MODES[mode], keep_last_good=True):
            loop()
    except nan_magic.NonFiniteError as error:
        return error.report
    raise AssertionError(f"{mode}: no event")


# ---------------------------------------------------------------- (2) the loss code's counts are not spreads
def masked_loss(divisor: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A masked squared error over a batch with no valid target (mask all 0), divided by a count of it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y, mask = torch.randn(6, 4), torch.randn(6), torch.zeros(6)

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            err = (model(x).squeeze(-1) - y) ** 2
            if divisor == "sqrt":
                loss = (err * mask).sum() / mask.sum().sqrt()
            elif divisor == "norm1":
                loss = (err * mask).sum() / mask.norm(p=1)
            else:  # (std_mean's second output: the mask's mean, the fraction of valid targets)
                loss = (err * mask).mean() / torch.std_mean(mask)[1]
            loss.backward()
            opt.step()
    return model, opt, loop


@pytest.mark.parametrize("mode", ["default", "defer"])
@pytest.mark.parametrize("divisor", ["sqrt", "norm1", "std_mean-mean"])
def test_a_count_of_nothing_in_loss_code_is_not_a_spread(divisor: str, mode: str) -> None:
    """Was: "divided by a norm of 0 ... the values it measures were all 0 ... add eps" (std_mean's mean: "a std")."""
    report = watched(masked_loss(divisor), mode)
    assert report.cause is not None and report.cause.reading == "empty-quotient", report.cause
    text = report.to_text()
    assert "count.clamp_min(1)" in text and "divided by a norm of 0" not in text and "a std of 0" not in text


# ---------------------------------------------------------------- (3) in a model: only a spread's own output
class DividedBy(nn.Module):
    """Dead ReLUs (every unit 0) divided by a reduction of them: 0 / 0 where the reduction is 0."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.out, self.kind = nn.Linear(4, 6), nn.Linear(6, 1), kind
        nn.init.constant_(self.lin.bias, -100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if self.kind == "std_mean-mean":
            divisor = torch.std_mean(h, dim=-1, keepdim=True)[1]
        elif self.kind == "var_mean-mean":
            divisor = torch.var_mean(h, dim=-1, keepdim=True)[1]
        elif self.kind == "sqrt-mean":  # (the root of a gate's mean: not of squares)
            divisor = torch.sqrt(h.mean(-1, keepdim=True))
        elif self.kind == "norm0":  # (the number of active units)
            divisor = h.norm(p=0, dim=-1, keepdim=True)
        else:  # (std_mean's first output: a std, as before)
            divisor = torch.std_mean(h, dim=-1, keepdim=True)[0]
        return self.out(h / divisor)


@pytest.mark.parametrize("kind", ["std_mean-mean", "var_mean-mean", "sqrt-mean", "norm0", "std_mean-std"])
def test_only_a_spreads_own_output_reads_as_a_spread_in_a_model(kind: str) -> None:
    """Was: ``h / std_mean(h)[1]`` (a mean) "divided by a std of 0"; ``h / h.norm(p=0)`` a norm."""
    torch.manual_seed(0)
    model, opt, loop, _data = fit(DividedBy(kind), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)
    report = watched((model, opt, loop), "default")
    assert report.cause is not None
    assert (report.cause.reading == "spread-zero") is (kind == "std_mean-std"), report.cause
    if kind == "std_mean-std":
        assert "divided by a std of 0" in report.to_text()
