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
