"""The step counter (PRODUCT.md "step"): training iterations, whoever's optimizer, nested watches."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, bad_at: int | None = None) -> None:
    x = torch.randn(8, 4)
    for step in range(steps):
        shift = -100.0 if step == bad_at else 100.0
        loss = torch.log(model(x) + shift).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_nested_watch_over_the_same_model_keeps_the_outer_count() -> None:
    model, opt = _model_and_opt()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt) as outer:
        _train(model, opt, 2)
        with nan_magic.watch(model, opt) as inner:
            _train(model, opt, 3)
        assert inner.step == 3 and outer.step == 5
        _train(model, opt, 2, bad_at=1)
    assert caught.value.report.step == 6


def test_an_optimizer_not_passed_is_counted_beside_one_passed() -> None:
    model, opt = _model_and_opt()
    other = nn.Linear(4, 1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with nan_magic.watch(model, opt) as w:
        for _ in range(3):
            other(x).sum().backward()
            other_opt.step()  # never passed, steps three times: three iterations
    assert w.step == 3 and w.steps_taken == 3


def test_inference_steps_are_forward_calls_started() -> None:
    model, _opt = _model_and_opt()
    with torch.no_grad(), nan_magic.watch(model) as w:
        assert w.steps_taken == 0 and w.step == 0
        for _ in range(4):
            model(torch.randn(2, 4))
    assert (w.step, w.steps_taken) == (3, 4)


def test_history_names_each_inference_step_once() -> None:
    model, _opt = _model_and_opt()
    with torch.no_grad(), nan_magic.watch(model) as w:
        for _ in range(3):
            model(torch.randn(2, 4))
    assert [summary.step for summary in w.history] == [0, 1, 2]


def test_history_names_each_training_step_once() -> None:
    model, opt = _model_and_opt()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with nan_magic.watch(model) as w:
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [summary.step for summary in w.history] == [0, 1, 2]
