"""Fix trials at a producer outside every module: in the loss code (``torch.log(p)``) or the data code.

The loss code: the trial runs the step's recorded loss code again on the
replayed outputs (nan_magic/fixes/loss.py), with the remedy applied to its ops
at the producer's line (fixes/site.py ``InRecordedCode``). The data code: the batch
is made again by its recorded ops with the remedy, and the step replayed on it
(fixes/remedies/data_code.py). Each scenario has a ``fixed`` twin per remedy, written by
hand as the report's suggested edit: the test checks the trial is verified, the
edit is that line, and training with the twin goes on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from faults import marked_line
from torch import nn

import nan_magic
from nan_magic.records import FixTrial, Phase, Report
from nan_magic.render.edits import suggested_edit


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


def _report_of(model: nn.Module, step: Callable[[int], torch.Tensor], steps: int, **options: object) -> Report | None:
    """Train ``model`` by SGD on the loss ``step(index)`` computes; the report it stopped with, or None."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        with nan_magic.watch(model, opt, **options):
            for index in range(steps):
                loss = step(index)
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error.report
    return None


def _train(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int = 3,
           **options: object) -> Report | None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.bias.zero_()
    x = torch.randn(8, 4)
    x[0] = 0.0  # row 0 of the output is the bias: 0, as its target
    y = torch.randn(8, 4)
    y[0] = 0.0
    return _report_of(model, lambda _index: loss_fn(model(x), y), steps, **options)


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


class Standardise:
    """The data code standardises each feature by its std: a constant feature (a sensor stuck) is 0 / 0."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        if self.fixed == "eps":
            return (raw - raw.mean(0)) / raw.std(0).clamp_min(1.2e-07)
        return (raw - raw.mean(0)) / raw.std(0)  # producer: standardise


class LogFeature:
    """The data code log-scales a count feature: a count of 0 is -inf."""

    def __init__(self, fixed: str | None = None) -> None:
        self.fixed = fixed

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        if self.fixed == "eps":
            return torch.log(raw.abs().clamp_min(1.2e-07))
        return torch.log(raw.abs())  # producer: log-feature


def _train_on(prepare: Callable[[torch.Tensor], torch.Tensor], steps: int = 4, **options: object) -> Report | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    raw = torch.randn(32, 3)
    raw[16:24, 1] = 2.0  # batch 2: feature 1 constant (its std is 0), and 0 where abs() is logged below
    raw[16:24, 2] = 0.0
    return _report_of(model, lambda index: model(prepare(raw[index * 8:(index + 1) * 8])).pow(2).mean(), steps,
                      **options)


DATA = [(Standardise, "standardise"), (LogFeature, "log-feature")]


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize(("cls", "marker"), DATA, ids=[marker for _cls, marker in DATA])
def test_a_remedy_at_the_data_codes_line_remakes_the_batch_and_is_the_edit_that_lets_training_go_on(
        cls: type, marker: str, defer: bool) -> None:
    report = _train_on(cls(), defer=defer)
    assert report is not None
    assert report.phase == Phase.DATA and report.step == 2
    assert report.source is not None and report.source.lineno == marked_line(marker, where=cls)
    eps = _trial(report, "eps")
    assert eps.finite is True and eps.source == report.source, eps
    edit = suggested_edit(eps)
    assert edit is not None and edit.endswith(_fixed_line(cls, "eps")), (edit, _fixed_line(cls, "eps"))
    assert report.fixes[0] is eps  # verified first, before skip-batch (every sample holds the NaN here)
    assert _train_on(cls(fixed="eps"), defer=defer) is None


def test_a_bad_batch_no_recorded_code_made_gets_no_data_code_trial() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(8, 3) for _ in range(3)]
    batches[1][2, 0] = float("nan")  # loaded that way: no op of the loop made it
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt):
        for x in batches:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = raised.value.report
    assert report.phase == Phase.DATA and report.op is None
    assert [trial.kind for trial in report.fixes] == ["skip-batch"] and report.fixes[0].finite is True
