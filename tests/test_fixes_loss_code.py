"""Fix trials at a producer in the loss code: the line outside every module that made the NaN (``torch.log(p)``).

The trial runs the step's recorded loss code again on the replayed outputs
(nan_magic/fixes/loss.py), with the remedy applied to its ops at the producer's
line (fixes/site.py ``InLossCode``). Each scenario's loss has a ``fixed`` twin per
remedy, written by hand as the report's suggested edit: the test checks the
trial is verified, the edit is that line, and training with the twin goes on.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from faults import marked_line
from torch import nn

import nan_magic
from nan_magic.records import FixTrial, Phase, Report
from nan_magic.render.fixes import suggested_edit


class LogSigmoid:
    """A hand-written binary log-likelihood: sigmoid underflows to 0 for a large negative logit."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fixed == "eps":
            return -torch.log(torch.sigmoid(out - 200).clamp_min(1.2e-07)).mean()
        if self.fixed == "stable":
            return -torch.nn.functional.logsigmoid(out - 200).mean()
        return -torch.log(torch.sigmoid(out - 200)).mean()  # producer: log-sigmoid


class LogSoftmax:
    """The log of a softmax whose small probabilities underflow to 0."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fixed == "stable":
            return -torch.log_softmax(out * 1000.0, -1).mean()
        return -torch.log(torch.softmax(out * 1000.0, -1)).mean()  # producer: log-softmax


class WeightedMean:
    """A mean weighted by per-sample weights that are all 0 in this batch: 0 / 0."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(out.shape[0])
        if self.fixed == "eps":
            return (out.pow(2).mean(-1) * w).sum() / w.sum().clamp_min(1.2e-07)
        return (out.pow(2).mean(-1) * w).sum() / w.sum()  # producer: weighted-mean


class Distance:
    """A Euclidean distance loss: sqrt of 0 where a prediction is exact, 0 * inf in its backward."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fixed == "eps":
            return torch.sqrt(((out - y) ** 2).sum(-1).clamp_min(1.2e-07)).mean()
        return torch.sqrt(((out - y) ** 2).sum(-1)).mean()  # producer: distance


def _train(loss_fn: object, steps: int = 3, **options: object) -> Report | None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    x[0] = 0.0  # row 0 of the output is the bias: 0, as its target
    y = torch.randn(8, 4)
    y[0] = 0.0
    try:
        with nan_magic.watch(model, opt, **options):
            for _ in range(steps):
                out = model(x)
                loss = loss_fn(out, y)  # type: ignore[operator]
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error.report
    return None


def _fixed_line(cls: type, kind: str) -> str:
    lines = inspect.getsource(cls.__call__).splitlines()
    return next(lines[index + 1].strip() for index, line in enumerate(lines) if f'self.fixed == "{kind}"' in line)


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


#: (the loss, the marker of its producer line, the phase, the remedies that must be verified)
SCENARIOS = [
    (LogSigmoid, "log-sigmoid", Phase.FORWARD, ("eps", "stable")),
    (LogSoftmax, "log-softmax", Phase.FORWARD, ("stable",)),
    (WeightedMean, "weighted-mean", Phase.FORWARD, ("eps",)),
    (Distance, "distance", Phase.BACKWARD, ("eps",)),
]


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize(("cls", "marker", "phase", "kinds"), SCENARIOS, ids=[s[1] for s in SCENARIOS])
def test_a_remedy_at_the_loss_codes_line_is_verified_and_is_the_edit_that_lets_training_go_on(
        cls: type, marker: str, phase: Phase, kinds: tuple[str, ...], defer: bool) -> None:
    report = _train(cls(), defer=defer)
    assert report is not None
    assert report.module is None and report.phase == phase and report.step == 0
    assert report.source is not None and report.source.lineno == marked_line(marker, where=cls)
    for kind in kinds:
        trial = _trial(report, kind)
        assert trial.finite is True, trial
        assert trial.module is None and trial.source == report.source and trial.loss is not None
        assert trial.fact("backward_from") == "loss" and trial.fact("stepped") is True
        edit = suggested_edit(trial)
        assert edit is not None and edit.endswith(_fixed_line(cls, kind)), (edit, _fixed_line(cls, kind))
        assert _train(cls(fixed=kind), steps=4, defer=defer) is None  # the edit by hand: training goes on
    assert report.fixes[0].finite is True  # verified first
    text = report.to_text()
    assert "verified" in text and "suggested edit (not applied)" in text


def test_a_loss_code_remedy_that_finds_nothing_at_the_line_is_not_called_verified() -> None:
    report = _train(LogSigmoid())
    assert report is not None
    # The log is of a sigmoid, not of a softmax: the stable trial changes the sigmoid's log (logsigmoid) ...
    assert _trial(report, "stable").fact("form") == "logsigmoid"
    # ... and a log of a plain tensor in the loss code is no softmax's or sigmoid's: stable finds nothing there.

    def plain_log(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -torch.log(out.abs() * 0).mean()

    report = _train(plain_log)
    assert report is not None and report.module is None
    stable = _trial(report, "stable")
    assert stable.finite is None and "nothing to change" in (stable.untried or "")
    assert _trial(report, "eps").finite is True


def test_a_model_that_returns_its_own_loss_is_remedied_in_the_loss_code_that_goes_on_from_it() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).pow(2).mean()

    model = WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt):
        loss = torch.log(model(torch.randn(4, 4)) * 0)  # producer: own-loss
        opt.zero_grad()
        loss.backward()
    report = raised.value.report
    assert report.module is None and report.source.lineno == marked_line("own-loss", where=WithLoss)
    eps = _trial(report, "eps")
    assert eps.finite is True and eps.fact("loss_from") == "loss code", eps
