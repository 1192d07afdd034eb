"""Loss code that spans two model calls of one training step: its op and line are still named.

``p = model(x).softmax(-1)``; an entropy of ``p``; then ``loss = ce(model(x), y) - bonus``: the NaN is
made by ``p.log()`` before the second call, and the recorder of the code outside the models
(localize/outside/recorder.py) keeps that code's records across the call (``goes_on``).
"""

from __future__ import annotations

import pytest
import torch
from faults import marked_line
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic.records import Phase


def _entropy_bonus_run(defer: bool, steps: int = 6) -> nan_magic.NonFiniteError | None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with nan_magic.watch(model, opt, defer=defer):
            for step in range(steps):
                x = torch.randn(8, 4) * (1 if step < 2 else 300)  # large logits: the softmax underflows to 0
                p = torch.softmax(model(x), -1)
                entropy = -(p * p.log()).sum(-1).mean()  # producer: entropy
                loss = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)) - 0.01 * entropy
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error
    return None


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_nan_made_before_the_steps_second_model_call_is_named_at_its_op_and_line(defer: bool) -> None:
    error = _entropy_bonus_run(defer)
    assert error is not None
    report = error.report
    assert (report.phase, report.module, report.step) == (Phase.FORWARD, None, 2)
    assert report.op == "aten.log.default"
    assert report.source.lineno == marked_line("entropy", where=_entropy_bonus_run)
    assert report.cause.label == "log-domain"
    eps = next(trial for trial in report.fixes if trial.kind == "eps")
    assert eps.finite is True and eps.fact("loss_from") == "loss code"


def test_an_evaluation_loop_with_gradients_on_does_not_spend_the_loss_codes_budget() -> None:
    """Many model calls with grad enabled and no backward: the kept records stay few, and nothing goes unrecorded."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt) as watch:
        for _step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            for _batch in range(100):  # validation without torch.no_grad(): a metric of 6 ops a batch
                out = model(torch.randn(8, 4))
                metric = ((out.argmax(-1) == 0).float().mean() + out.abs().mean()) * 0.5
        loss = torch.sqrt(model(torch.randn(8, 4)).mean() - 1e3)  # producer: after-eval
        loss.backward()
    assert metric.isfinite()
    assert "loss" not in watch.outside.untraced
    report = raised.value.report
    assert report.op == "aten.sqrt.default" and report.source.lineno == marked_line(
        "after-eval", where=test_an_evaluation_loop_with_gradients_on_does_not_spend_the_loss_codes_budget)


def test_two_model_calls_a_step_raise_no_false_alarm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nan_magic.watch(model, opt) as watch:
        for _ in range(20):
            a, b = torch.randn(16, 4), torch.randn(16, 4)
            za = F.normalize(model(a), dim=-1)
            zb = F.normalize(model(b), dim=-1)
            loss = -(za * zb).sum(-1).mean() + 0.1 * za.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert watch.report is None and watch.events == []
