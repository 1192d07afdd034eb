"""Issue 28's done-when as one table: faults of different causes, each with a verified fix that, by hand, trains on.

Every row is a training loop whose loss code is outside the model, as a
notebook writes it (``loss = F.cross_entropy(model(x), y)``), run under the
watch in the default and the deferred mode. The report must give the row's
cause, list the row's remedy as verified without hiding the NaN, with the
loss it computed where the failing step's loss code ran before the event,
and suggest the edit the row's fixed code makes; that code, run by hand,
must train :data:`FURTHER` steps past the failing one, finite.

The negative rows: remedies that do not work are never marked verified and,
applied by hand, fail too; a remedy that only hides the NaN (every operand
value clamped, every row masked) says so, and by hand nothing is learned
through it; a remedy whose outputs are finite but whose loss is not fails at
the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import faults
import pytest
import torch
import torch.nn.functional as F
from test_fixes import (
    FixedGram,
    HalfDivide,
    HalfExp,
    HalfProduct,
    HandSoftmax,
    LogOf,
    LogSoftmax,
    MaskedAttention,
    Reciprocal,
    SqrtOf,
    _batch,
    _Fixable,
    _fixed_line,
    _make,
)
from test_fixes_steps import _demo, _scaled_run
from torch import nn

import nan_magic
from nan_magic.records import FixTrial, Note, Report
from nan_magic.render.edits import suggested_edit

#: Steps the fixed code must train past the failing one.
FURTHER = 5


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


def _watched(model: nn.Module, opt: torch.optim.Optimizer, step: Callable[[int], None], steps: int, defer: bool,
             **options: object) -> Report | None:
    try:
        with nan_magic.watch(model, opt, defer=defer, **options):
            for index in range(steps):
                step(index)
    except nan_magic.NonFiniteError as error:
        return error.report
    return None


class LogOfRelu(_Fixable):
    """log of a ReLU's output: its zeros are -inf, the rest finite."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.fixed:
            return torch.log(h.clamp_min(1.2e-07))
        return torch.log(h)


class SignedRoot(_Fixable):
    """A square root written as a power, of values of either sign."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.fixed:
            return h.clamp_min(1.2e-07) ** 0.5
        return h ** 0.5


def _classify(cls: type[nn.Module], loss_code: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
              ) -> Callable[[bool, bool, int], Report | None]:
    """A model of test_fixes trained with its output as class scores: the loss code outside the model."""
    loss_of = loss_code or (lambda out, y: F.cross_entropy(out.float(), y))

    def run(fixed: bool, defer: bool, steps: int) -> Report | None:
        model = _make(cls, fixed)
        x = _batch(model)
        y = torch.arange(x.shape[0]) % 4
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(_index: int) -> None:
            opt.zero_grad()
            loss = loss_of(model(x), y)
            loss.backward()
            opt.step()

        return _watched(model, opt, step, steps, defer)

    return run


def _bad_rows(fixed: bool, defer: bool, steps: int, every: bool = False) -> Report | None:
    """A batch with a NaN and an inf sample (every sample, ``every``); fixed: those rows left out, targets too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[2, 1], x[4, 0] = float("nan"), float("inf")
    if every:
        x[:, 3] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(_index: int) -> None:
        data, targets = x, y
        if fixed:
            keep = torch.isfinite(x).flatten(1).all(1)
            data, targets = x[keep], y[keep]
        opt.zero_grad()
        F.mse_loss(model(data), targets).backward()
        opt.step()

    return _watched(model, opt, step, steps, defer)


def _diverging(fixed: bool, defer: bool, steps: int, lr: float = 100.0) -> Report | None:
    """float16 weights; step 1's loss is scaled by 1e3, so lr * gradient passes 65504 at lr 100 (the optimizer's
    update is the producer); fixed: lr at a tenth."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).half()
    opt = torch.optim.SGD(model.parameters(), lr=lr / 10 if fixed else lr)
    x, y = torch.ones(1, 4, dtype=torch.float16), torch.zeros(1, 1)

    def step(index: int) -> None:
        opt.zero_grad()
        (F.l1_loss(model(x).float(), y) * (1e3 if index == 1 else 1e-3)).backward()
        opt.step()

    return _watched(model, opt, step, steps, defer, keep_last_good=True)


def _unfrozen(fixed: bool, defer: bool, steps: int) -> Report | None:
    """A float16 embedding unfrozen at step 1: Adam's eps 1e-8 rounds to 0 and its untouched rows divide 0 by 0;
    fixed: eps 9.8e-4 (float16's machine eps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), eps=torch.finfo(torch.float16).eps if fixed else 1e-8)
    tokens, y = torch.tensor([1, 2]), torch.zeros(2, 1)

    def step(index: int) -> None:
        model[0].weight.requires_grad_(index > 0)
        opt.zero_grad()
        F.mse_loss(model(tokens).float(), y).backward()
        opt.step()

    return _watched(model, opt, step, steps, defer, keep_last_good=True)


def _autocast(fixed: bool, defer: bool, steps: int) -> Report | None:
    """A Gram matrix under float16 autocast (faults.autocast_overflow); fixed: computed in float32, autocast off."""
    model, opt, step = faults.autocast_overflow("cpu")
    if fixed:
        model[1] = FixedGram()
    return _watched(model, opt, lambda _index: step(), steps, defer)


def _lr_demo(fixed: bool, defer: bool, steps: int) -> Report | None:
    """The demo (examples/train_blowup.py): lr 2 diverges by step 9; fixed: lr 0.2."""
    return _demo(0.2 if fixed else 2.0, steps=steps, defer=defer)


def _scaler(fixed: bool, defer: bool, steps: int) -> Report | None:
    """A GradScaler from 2**40 collapses (its scaled gradients overflow float16); fixed: init_scale=2.0**18."""
    return _scaled_run(2.0**18 if fixed else 2.0**40, defer=defer, steps=steps)


@dataclass(frozen=True)
class Row:
    """A fault: its cause label, the remedy that must be verified, what its suggested edit holds, and its loop
    ``run(fixed, defer, steps)``."""

    name: str
    cause: str
    kind: str
    edit: str
    run: Callable[[bool, bool, int], Report | None]
    #: Why the deferred mode cannot verify it (the trial must say so instead), or None.
    not_deferred: str | None = None


ROWS = [
    Row("log of a ReLU's zeros", "log-domain", "eps", _fixed_line(LogOfRelu), _classify(LogOfRelu)),
    Row("sqrt of 0 (backward)", "sqrt-domain", "eps", _fixed_line(SqrtOf), _classify(SqrtOf)),
    Row("1 / x of exact zeros", "division-by-zero", "eps", _fixed_line(Reciprocal), _classify(Reciprocal)),
    Row("x ** 0.5 of negatives", "pow-domain", "eps", _fixed_line(SignedRoot), _classify(SignedRoot)),
    Row("float16 matmul past 65504", "half-precision-overflow", "float32", _fixed_line(HalfProduct),
        _classify(HalfProduct)),
    Row("autocast matmul past 65504", "half-precision-overflow", "float32", "torch.autocast('cpu', enabled=False)",
        _autocast),
    Row("hand-written softmax", "exp-overflow", "stable", _fixed_line(HandSoftmax), _classify(HandSoftmax)),
    Row("log of a softmax that underflows", "log-domain", "stable", _fixed_line(LogSoftmax), _classify(LogSoftmax)),
    Row("a fully masked attention row", "masked-softmax", "mask", _fixed_line(MaskedAttention),
        _classify(MaskedAttention)),
    Row("NaN and inf samples in the batch", "bad-input-data", "skip-batch", "x[keep]", _bad_rows),
    Row("a divergence seen in the forward", "learning-rate-too-high", "lr", "lr=0.2", _lr_demo),
    # The deferred check reads the update's result at the next step, whose gradients replaced the failing ones.
    Row("an update past float16's max", "learning-rate-too-high", "lr", "lr=10", _diverging,
        not_deferred="the redo does not reproduce it"),
    Row("Adam's eps rounded to 0 in float16", "optimizer-eps-underflow", "eps", "eps=0.000977", _unfrozen),
    Row("a GradScaler's scale too high", "grad-scaler-collapse", "scale", "init_scale=2.0**18", _scaler),
]


def test_the_table_holds_ten_causes() -> None:
    assert len({row.cause for row in ROWS}) >= 10


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_the_verified_fix_applied_by_hand_trains_on(row: Row, defer: bool) -> None:
    report = row.run(False, defer, 40)
    assert report is not None and report.cause is not None and report.cause.label == row.cause, report
    trial = _trial(report, row.kind)
    if defer and row.not_deferred:
        assert trial.finite is None and row.not_deferred in (trial.untried or ""), trial
        return
    assert trial.finite is True and trial.fact("moved_all") is None, trial
    assert report.fixes[0].finite is True and not report.fixes[0].fact("moved_all")  # verified first
    if report.phase != "optimizer" and (defer or report.phase == "backward"):
        # The failing step's loss code ran before the event: the trial's loss is the step's, computed again.
        assert trial.fact("loss_from") in ("loss code", "model") and trial.loss is not None, trial
    edit = suggested_edit(trial)
    assert edit is not None and row.edit in edit, (edit, row.edit)
    assert row.run(True, defer, report.step + 1 + FURTHER) is None  # the edit by hand: training goes on


# -- remedies that do not work, or only hide the NaN ---------------------------------------------------------------


class HalfExpUpcast(HalfExp):
    """HalfExp with the float32 edit by hand: exp(1000 * x) passes float32's max too."""

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * self.scale.float()


def test_a_float32_upcast_that_still_overflows_is_not_verified_and_fails_by_hand() -> None:
    report = _classify(HalfExp)(False, False, 3)
    assert report is not None
    assert _trial(report, "float32").finite is False and _trial(report, "float32").failed == "forward"
    assert _classify(HalfExpUpcast)(False, False, 3) is not None


def test_an_eps_too_small_is_not_verified_and_fails_by_hand() -> None:
    report = _classify(HalfDivide)(False, True, 3)
    assert report is not None and not any(trial.finite for trial in report.fixes)
    assert _trial(report, "eps").fact("eps") == torch.finfo(torch.float16).eps
    assert _classify(HalfDivide)(True, True, 3) is not None


def test_a_learning_rate_still_too_high_at_a_tenth_is_not_verified_and_fails_by_hand() -> None:
    report = _diverging(False, False, 3, lr=1000.0)
    assert report is not None and _trial(report, "lr").finite is False
    assert _diverging(False, False, 3, lr=100.0) is not None  # a tenth of 1000, by hand


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_skip_batch_where_every_sample_is_bad_is_not_tried_and_by_hand_nothing_is_left(defer: bool) -> None:
    report = _bad_rows(False, defer, 3, every=True)
    assert report is not None and report.phase == "data"
    trial = _trial(report, "skip-batch")
    assert trial.finite is None and "no sample could be left out" in (trial.untried or "")
    # What was not tried is described without the numbers of a trial that ran.
    assert trial.description == "the batch without its samples holding non-finite values"
    assert _bad_rows(True, defer, 3, every=True) is not None  # the edit by hand: an empty batch, a NaN loss


def test_an_eps_that_moves_every_value_says_it_hides_the_nan_and_by_hand_nothing_is_learned() -> None:
    report = _classify(LogOf)(False, False, 3)  # log(fc(x) - 10): every value below 0
    assert report is not None
    trial = _trial(report, "eps")
    assert trial.finite is True and trial.fact("moved_all") == 12
    assert "every value of the operand was out of the domain and was replaced" in report.to_text()
    torch.manual_seed(0)
    model = LogOf(fixed=True)
    before = model.fc.weight.detach().clone()
    x, y = _batch(model), torch.tensor([0, 1, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):  # the edit by hand: finite, but no gradient reaches fc through the clamp
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.equal(model.fc.weight, before)


def _log_of_norm(out: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    return -torch.log(out.abs().sum(-1)).mean()


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_remedy_whose_outputs_are_finite_but_whose_loss_is_not_fails_at_the_loss(defer: bool) -> None:
    # The masked row made 0 by the mask remedy: the loss code's log of its norm is -inf.
    report = _classify(MaskedAttention, _log_of_norm)(False, defer, 3)
    assert report is not None
    trial = _trial(report, "mask")
    if defer:  # the step's own loss code ran before the deferred check: the trial runs it
        assert trial.finite is False and trial.failed == "loss" and trial.loss == float("inf"), trial
        line = "mask: the fully masked rows' output made 0 instead of NaN -> still non-finite (loss)"
        assert line in report.to_text()
    else:  # the forward event stopped step 0 before its loss code: nothing says the loss fails
        assert trial.fact("loss_not_computed") is not None
    assert _classify(MaskedAttention, _log_of_norm)(True, defer, 3) is not None  # by hand: the loss is inf


# -- the loss the trials compute -----------------------------------------------------------------------------------


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_trials_loss_is_the_fixed_models_loss_on_the_failing_step(defer: bool) -> None:
    report = _classify(SqrtOf)(False, defer, 3)  # a backward event at step 0: the loss code ran
    assert report is not None and report.phase == "backward" and report.step == 0
    trial = _trial(report, "eps")
    assert trial.fact("loss_from") == "loss code" and trial.fact("backward_from") == "loss"
    fixed = _make(SqrtOf, fixed=True)
    x = _batch(fixed)
    assert trial.loss == pytest.approx(F.cross_entropy(fixed(x), torch.arange(3) % 4).item(), rel=1e-5)


def test_a_forward_event_at_the_first_step_says_why_no_loss_was_computed() -> None:
    report = _classify(LogOfRelu)(False, False, 3)
    assert report is not None and report.phase == "forward" and report.step == 0
    trial = _trial(report, "eps")
    assert trial.loss is None and trial.fact("backward_from") == "ones"
    # The line says what the user needs (polish-s27: it also said "and no earlier step ran backward() watched"); the
    # whole why stays in the trial's facts.
    assert ("no loss: the failing step stopped before its loss code ran (the backward started from ones into the "
            "model's outputs)") in report.to_text()
    assert trial.fact("loss_not_computed") == Note("no-earlier-backward").pair  # (a kind, never words: facts)
    assert Note.from_pair(trial.fact("loss_not_computed")).text == (
        "the forward failed before this step's loss code ran, and no earlier step ran backward() watched")


def test_skip_batch_drops_the_same_rows_from_the_loss_codes_targets() -> None:
    report = _bad_rows(False, True, 3)  # deferred: the step's loss code ran before the check
    assert report is not None
    trial = _trial(report, "skip-batch")
    assert trial.fact("loss_from") == "loss code"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    keep = torch.tensor([True, True, False, True, False, True])
    assert trial.loss == pytest.approx(F.mse_loss(model(x[keep]), y[keep]).item(), rel=1e-5)


class LogOfInput(_Fixable):
    """log of the batch itself: the second batch holds zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return torch.log(x.clamp_min(1.2e-07)) + self.fc(x)
        return torch.log(x) + self.fc(x)


def _two_batches(fixed: bool, keep: str | None) -> tuple[Report | None, list[torch.Tensor]]:
    """Step 0 on a positive batch, step 1 on one with zeros (a forward event); returns the batches and targets."""
    torch.manual_seed(0)
    model = LogOfInput(fixed)
    batches = [torch.rand(3, 4) + 0.5, torch.rand(3, 4).round(), torch.tensor([0, 1, 2]), torch.tensor([3, 2, 1])]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(index: int) -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(batches[index]), batches[2 + index])
        loss.backward()
        opt.step()

    return _watched(model, opt, step, 2, False, keep_last_good=keep), batches


def test_a_forward_event_after_the_first_step_runs_the_last_steps_loss_code_with_keep_last_good() -> None:
    report, (_x0, x1, y0, _y1) = _two_batches(False, "cpu")
    assert report is not None and report.phase == "forward" and report.step == 1
    trial = _trial(report, "eps")
    assert trial.finite is True and trial.fact("loss_from") == "last loss code"
    # Its loss is the last step's loss code, with the last step's targets, on this step's remedied outputs.
    torch.manual_seed(0)
    fixed = LogOfInput(fixed=True)
    opt = torch.optim.SGD(fixed.parameters(), lr=0.1)
    F.cross_entropy(fixed(_x0), y0).backward()
    opt.step()
    assert trial.loss == pytest.approx(F.cross_entropy(fixed(x1), y0).item(), rel=1e-5)
    assert "(the last step's loss code and targets on this step's outputs)" in report.to_text()
    without, _batches = _two_batches(False, None)
    assert without is not None and _trial(without, "eps").fact("loss_not_computed") == Note(
        "last-loss-code-not-kept").pair
    assert Note.from_pair(_trial(without, "eps").fact("loss_not_computed")).text == (
        "the forward failed before this step's loss code ran, and the last step's is kept only with keep_last_good")
    assert _two_batches(True, None)[0] is None  # the edit by hand


@pytest.mark.parametrize("keep", [None, "cpu"])
def test_the_last_steps_loss_code_keeps_none_of_its_tensors_past_its_backward(keep: str | None) -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    outputs: list[weakref.ref[torch.Tensor]] = []
    handles = [module.register_forward_hook(lambda _m, _a, out: outputs.append(weakref.ref(out))) for module in model]
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, keep_last_good=keep) as watch:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        del loss
        gc.collect()
        assert [ref() for ref in outputs] == [None] * 3
        assert (watch.outside.loss_code(watch.gradients.loss_key, True) is not None) == (keep is not None)
    for handle in handles:
        handle.remove()
