"""Regressions found by session 29's reviews of merged work, each asserting what the user reads."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.render.text import render_text


@pytest.mark.parametrize(("function", "threshold"), [
    ("exp", math.log(torch.finfo(torch.float32).max)),
    ("expm1", math.log(torch.finfo(torch.float32).max)),
    ("exp2", math.log2(torch.finfo(torch.float32).max)),
    ("sinh", math.log(2 * torch.finfo(torch.float32).max)),
    ("cosh", math.log(2 * torch.finfo(torch.float32).max)),
])
def test_an_exp_like_overflow_names_its_function_and_its_own_threshold(function: str, threshold: float) -> None:
    # Every exp-like op said "exp(x) is inf for x > 88.72": exp2 overflows past 128, sinh and cosh past 89.4.
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.mul_(100)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, ops=True):
        y = getattr(model(torch.randn(4, 3) * 10), function)()
        (y / y.sum()).mean().backward()
    report = caught.value.report
    assert report.op == f"aten.{function}.default"
    assert report.cause is not None and report.cause.label == "exp-overflow"
    assert report.cause.fact("threshold") == pytest.approx(threshold)
    x = "|x|" if function in ("sinh", "cosh") else "x"
    assert f"{function}(x) is inf for {x} > {threshold:.4g}" in " ".join(render_text(report).split())


@pytest.mark.parametrize("options", [{"defer": True}, {"ops": True, "defer": True}], ids=["defer", "ops-defer"])
def test_a_rate_computed_from_a_constant_tensor_is_not_set_at_the_constants_line(options: dict) -> None:
    # (review of defer-s29: the deferred check took the one tensor-valued name on the ``group["lr"] = ...`` line for
    # the rate the loop rebinds each step, and named ``base_lr = torch.tensor(0.01)``, a finite constant, with %debug
    # there: a name only counts where the line stores it as it is)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.01))
    base_lr = torch.tensor(0.01)
    constant_line = test_a_rate_computed_from_a_constant_tensor_is_not_set_at_the_constants_line.__code__.co_firstlineno
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(6):
            warm = float("nan") if step == 2 else 1.0
            opt.param_groups[0]["lr"] = base_lr * warm
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step) == ("optimizer", 2)
    assert report.source is None or "base_lr = torch.tensor" not in (report.source.line or "")
    assert report.source is None or report.source.lineno != constant_line + 7
