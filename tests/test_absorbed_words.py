"""What the likely cause says of a value torch.where discarded in forward whose backward still runs through it.

A ``torch.where(z > 0, z.sqrt(), 0)`` makes NaN in forward where ``z < 0`` (an input outside sqrt's domain, not
its pole at 0), and the ``0 · nan`` of its backward is the event. The hint must say that, with the NaN count the
forward made and a fix for that op (sqrt computed on clamped inputs inside the where; an eps added inside does
not help a negative input); an overflowing ``exp`` branch says +inf and a clamp of the exponent.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.errors.exceptions import NonFiniteError


class WhereSqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x)
        return torch.where(z > 0, z.sqrt(), torch.zeros_like(z))  # the discarded sqrt of a negative


class WhereExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x) * 100.0
        return torch.where(z < 50, z.exp(), z)  # the discarded exp of a large value


def _hint(model: nn.Module, x: torch.Tensor, defer: bool) -> tuple[str, int]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        loss = model(x).mean()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert report.cause is not None and report.absorbed is not None
    forward_count = report.absorbed.nan + report.absorbed.posinf + report.absorbed.neginf
    return report.cause.hint, forward_count


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_discarded_sqrt_of_negatives_is_a_domain_error_not_the_pole(defer: bool) -> None:
    torch.manual_seed(0)
    model, x = WhereSqrt(), torch.randn(32, 8)
    negatives = int((model.fc(x) < 0).sum())
    hint, made = _hint(model, x, defer)
    assert made == negatives > 0
    assert hint.startswith("sqrt at ") and "read inputs outside its domain in forward" in hint, hint
    assert f"the {made} nan came from aten.sqrt.default" in hint, hint
    assert "x.clamp_min(1e-12).sqrt() inside the torch.where" in hint, hint
    assert "infinite at x = 0" not in hint and "add eps inside the sqrt" not in hint, hint


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_discarded_overflowing_exp_says_inf_and_clamps_the_exponent(defer: bool) -> None:
    torch.manual_seed(0)
    model, x = WhereExp(), torch.randn(32, 8)
    hint, made = _hint(model, x, defer)
    assert made > 0
    assert f"the {made} +inf came from aten.exp.default" in hint, hint
    assert "x.clamp(max=80).exp() inside the torch.where" in hint, hint
    assert "0 · inf is nan" in hint, hint
