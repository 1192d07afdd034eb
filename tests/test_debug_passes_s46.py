"""%debug after a producer in a loop of the user's own code: the recorded modes say which pass its locals are.

The loss code, update code or data code outside the models is recorded op by op and run again on copies at an
event: the frame that ran the producing op has run on. Where a loop ran that line again after the producing pass
(a loss summed over tasks, an EMA updated parameter by parameter), the frame's locals are the last pass's: ``%debug``
would show ``task == 2`` and a target with a spread beside a line that divided by a variance of 0. ``ops=True``
copies the locals as the producing line ends; the other modes say that theirs are a later pass's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from contract.hunt_s46b import _ema
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Report

RECORDED = ("default", "defer", "full")


def _multi_task(bad_task: int) -> tuple[tuple[Any, ...], Any]:
    """Three regression heads, each loss normalised by its targets' variance; at step 1 task ``bad_task``'s targets
    are constant (variance 0: ``inf``)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(5, 4) for _ in range(3)], [torch.randn(5, 3) for _ in range(3)]
    ys[1][:, bad_task] = 2.0

    def run() -> None:
        for step in range(3):
            out = model(xs[step])
            loss = torch.zeros(())
            for task in range(3):
                target = ys[step][:, task]
                loss = loss + F.mse_loss(out[:, task], target) / target.var()  # here: per task
            opt.zero_grad()
            loss.backward()
            opt.step()

    return (model, opt), run


def _report(targets: tuple[Any, ...], run: Any, mode: str) -> tuple[Report, Any]:
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **MODE_OPTIONS[mode]):
        run()
    tb = caught.value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    assert tb is not None
    return caught.value.report, tb.tb_frame


def _passes_note(report: Report) -> list[Any]:
    return [note for note in report.note_facts if note.kind == "frame-ran-on"]


def _line(marker: str) -> int:
    with open(__file__) as source:
        lines = source.read().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# here: {marker}"))


@pytest.mark.parametrize("mode", RECORDED)
def test_a_loss_summed_over_tasks_says_debug_shows_the_last_pass(mode: str) -> None:
    report, frame = _report(*_multi_task(0), mode)
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _line("per task")
    assert frame.f_locals["task"] == 2  # the frame ran on: its locals are the last pass's
    said = _passes_note(report)
    assert said and (said[0].fact("function"), said[0].fact("line"), said[0].fact("runs")) == (
        "run", _line("per task"), 2), report.to_text()
    assert "with the locals of its last pass" in report.to_text()


def test_ops_mode_stops_at_the_producing_pass_and_says_nothing_of_passes() -> None:
    report, frame = _report(*_multi_task(0), "ops")
    assert frame.f_locals["task"] == 0 and float(frame.f_locals["target"].var()) == 0.0
    assert not _passes_note(report)


@pytest.mark.parametrize("mode", RECORDED)
def test_the_last_pass_producing_is_not_said_to_be_a_later_one(mode: str) -> None:
    report, frame = _report(*_multi_task(2), mode)
    assert report.source is not None and report.source.lineno == _line("per task")
    assert frame.f_locals["task"] == 2 and float(frame.f_locals["target"].var()) == 0.0
    assert not _passes_note(report), report.to_text()


@pytest.mark.parametrize("mode", RECORDED)
def test_an_ema_updated_parameter_by_parameter_says_its_pass(mode: str) -> None:
    scenario = _ema(0)
    report, _frame = _report(scenario.targets, scenario.run, mode)
    assert (report.phase, report.module, report.step) == ("optimizer", "0", 1)
    said = _passes_note(report)
    assert said and (said[0].fact("function"), said[0].fact("runs")) == ("update", 3), report.to_text()



def _gaussian_nll() -> tuple[tuple[Any, ...], Any]:
    """A heteroscedastic regression whose predicted variance underflows to 0 at step 1: ``F.gaussian_nll_loss(eps=0)``
    runs its log, then its division and sum, all recorded at the one instruction of the loop that called it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(5, 4) for _ in range(3)], [torch.randn(5, 1) for _ in range(3)]

    def run() -> None:
        for step in range(3):
            out = model(xs[step])
            mean, var = out[:, :1], out[:, 1:].exp() * (0.0 if step == 1 else 1.0)
            loss = F.gaussian_nll_loss(mean, ys[step], var, eps=0.0)  # here: nll
            opt.zero_grad()
            loss.backward()
            opt.step()

    return (model, opt), run


@pytest.mark.parametrize("mode", RECORDED)
def test_the_ops_of_one_library_call_are_one_pass(mode: str) -> None:
    report, _frame = _report(*_gaussian_nll(), mode)
    assert (report.step, report.op) == (1, "aten.log.default")
    assert report.source is not None and report.source.lineno == _line("nll")
    assert not _passes_note(report), report.to_text()


def _per_feature_standardised() -> tuple[tuple[Any, ...], Any]:
    """The loop standardises each feature of the batch in place, one feature a pass; at step 1 feature 0 is constant
    (its std is 0: ``0 / 0``), and the passes for features 1 and 2 run after it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw, ys = [torch.randn(5, 3) for _ in range(3)], [torch.randn(5, 1) for _ in range(3)]
    raw[1][:, 0] = 4.0

    def run() -> None:
        for step in range(3):
            x = raw[step].clone()
            for j in range(3):
                x[:, j] = (x[:, j] - x[:, j].mean()) / x[:, j].std()  # here: per feature
            loss = F.mse_loss(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()

    return (model, opt), run


@pytest.mark.parametrize("mode", RECORDED)
def test_data_code_standardising_feature_by_feature_says_its_pass(mode: str) -> None:
    report, frame = _report(*_per_feature_standardised(), mode)
    assert (report.phase, report.step, report.op) == ("data", 1, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _line("per feature")
    assert frame.f_locals["j"] == 2
    said = _passes_note(report)
    assert said and (said[0].fact("line"), said[0].fact("runs")) == (_line("per feature"), 2), report.to_text()
