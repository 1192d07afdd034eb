"""Defects found by the session-30 reviews of merged work, each with the test that shows it fixed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.lin(x), -1))  # producer: log(0) where a probability underflowed


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.teacher = Teacher()


def _distill(mode: str) -> nan_magic.Report:
    torch.manual_seed(0)
    pair = Pair()
    with torch.no_grad():
        pair.teacher.lin.weight.mul_(300)
    opt = torch.optim.SGD(pair.student.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(pair, opt, **MODES[mode]):
        for _ in range(2):
            opt.zero_grad()
            with torch.no_grad():
                target = pair.teacher(x)
            loss = ((pair.student(x) - torch.exp(-target)) ** 2).mean()
            loss.backward()
            opt.step()
    return caught.value.report


def _by_hand(stable: bool) -> bool:
    """The step with the remedy applied by hand at the teacher's line: is its loss finite?"""
    torch.manual_seed(0)
    pair = Pair()
    with torch.no_grad():
        pair.teacher.lin.weight.mul_(300)
    x = torch.randn(8, 4)
    with torch.no_grad():
        logits = pair.teacher.lin(x)
        target = F.log_softmax(logits, -1) if stable else torch.log(torch.softmax(logits, -1).clamp_min(1.2e-7))
    return bool(torch.isfinite(((pair.student(x) - torch.exp(-target)) ** 2).mean()))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_teacher_under_no_grad_is_not_a_validation_batch(mode: str) -> None:
    """Was (fixes-s30): a distillation teacher called under no_grad inside a training step was taken for a
    validation batch: the trials replayed its forward alone and said "verified: the step came out finite ... the
    call ran under no_grad (validation or inference)" for log_softmax, whose step by hand has an inf loss (the
    deferred mode, which keeps the step's loss code, had said so before). Now the loss code, where kept, judges
    the trial; where none was kept (the step stopped at the teacher), only the call's output is said finite."""
    assert (_by_hand(stable=True), _by_hand(stable=False)) == (False, True)
    report = _distill(mode)
    assert report.module.endswith("teacher")
    text = " ".join(str(report).split())
    assert "validation or inference" not in text
    stable = [trial for trial in report.fixes if trial.kind == "stable"]
    assert stable, [trial.kind for trial in report.fixes]
    if stable[0].fact("backward_from") == "no-grad":
        assert "verified: the call's output came out finite" in text
        assert "verified: the step came out finite" not in text
    else:  # the step's loss code was kept: the trial ran it, as by hand
        assert stable[0].finite is False and stable[0].failed == "loss"
    if mode == "defer":
        # Judged by the step's loss code, with no backward through the teacher (its step never runs one): s31.
        assert stable[0].fact("backward_from") == "no-grad-loss"


class Standardised(nn.Module):
    def __init__(self, positional: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.positional = positional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.positional:
            return h / (1 + h.std(0, True))  # producer: N - 1 = 0 for a batch of one
        return h / (1 + h.std(0, unbiased=True))  # producer: N - 1 = 0 for a batch of one


@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
@pytest.mark.parametrize("mode", ["default", "defer", "ops"])
def test_a_std_that_says_unbiased_gets_the_correction_trial(mode: str, positional: bool) -> None:
    """Was (fixes-s30): ``h.std(0, unbiased=True)`` over a batch of one got "the std taken with correction=0 -> not
    tried: it found nothing to change at the producer's line", the line holding that std. Now it is rerun with
    ``unbiased=False`` (the same choice as correction=0) and verified, as by hand."""
    torch.manual_seed(0)
    model = Standardised(positional)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(1, 4), torch.randn(1, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    report = caught.value.report
    trial = next(trial for trial in report.fixes if trial.fact("form") == "correction=0")
    assert trial.finite is True and not trial.untried, trial
    by_hand = model.lin(x)
    assert torch.isfinite(by_hand / (1 + by_hand.std(0, unbiased=False))).all()
    assert "correction=0" in " ".join(str(report).split())


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # (torch warns of a std of one sample)
@pytest.mark.parametrize("mode", ["default", "defer", "full"])
def test_targets_standardised_over_one_sample_get_the_correction_trial(mode: str) -> None:
    """Was (fixes-s30): targets standardised in the loop before the model call, over a batch of one (``y.std()``,
    N - 1 = 0), read by the loss alone: "no fix was tried: ... did not enter through a model call's arguments",
    where the cause says to pass correction=0. Now the loss code is run from that line with correction=0, and the
    trial's loss is the one the remedy gives by hand."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, raw = torch.randn(1, 4), torch.rand(1, 1)
    with torch.no_grad():
        by_hand = float(F.mse_loss(model(x), (raw - raw.mean()) / (raw.std(correction=0) + 1e-8)))
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for _ in range(2):
            y = (raw - raw.mean()) / (raw.std() + 1e-8)  # producer: the std of one sample
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    report = caught.value.report
    assert (report.phase.value, report.module, report.step) == ("data", None, 0)
    trial = next(trial for trial in report.fixes if trial.fact("form") == "correction=0")
    assert trial.finite is True and trial.loss == pytest.approx(by_hand, rel=1e-5)


class ThirdPartyAdam(torch.optim.Adam):
    """An optimizer the bounded-step rule does not know: its step's result is carried to the next check."""


@pytest.mark.parametrize("mode", ["defer", "ops-defer"])
def test_a_train_step_helpers_locals_do_not_outlive_it(mode: str) -> None:
    """Was (defer-s30): the deferred check held the frame of the function that called ``opt.step()`` until the next
    step's check, for %debug: a ``train_step`` helper's locals (its logits, its batch) stayed alive through the next
    step's forward, one step's activations more at the peak. Now only a cell's or a script's top-level frame is held
    (its locals are its globals); a function's is looked for among the running frames at the check."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 100))
    opt = ThirdPartyAdam(model.parameters(), lr=1e-3)
    alive: list[weakref.ref[torch.Tensor]] = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x)
        alive.append(weakref.ref(logits))
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    counts = []
    with nan_magic.watch(model, opt, **MODES[mode]):
        for _ in range(3):
            train_step(torch.randn(8, 16), torch.randint(0, 100, (8,)))
            gc.collect()
            counts.append(sum(ref() is not None for ref in alive))
    assert counts == [0, 0, 0]


class LogOfSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.lin(x), -1))  # producer: log(0) on the validation batch


@pytest.mark.parametrize("mode", ["default", "keep-last-good"])
def test_a_validation_batch_after_training_is_replayed_forward_only_with_the_last_steps_loss_code_kept(
        mode: str) -> None:
    """Was (review of the no_grad rule): with ``keep_last_good``, the last training step's loss code is kept, and a
    validation batch under no_grad took it for its own: its trials ran that loss, a backward and an SGD step ("the
    step came out finite, loss 1.63e6 (the last step's loss code ...)") on a call that trains nothing."""
    torch.manual_seed(0)
    model = LogOfSoftmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    options = {"keep_last_good": True} if mode == "keep-last-good" else {}
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if step == 1:
                with torch.no_grad():
                    model(x * 3000)  # the validation batch: no loss, backward or step
    report = caught.value.report
    assert report.fixes
    for trial in report.fixes:
        assert trial.fact("backward_from") == "no-grad" and not trial.fact("stepped") and trial.loss is None, trial
    assert "the step came out finite" not in " ".join(str(report).split())


@pytest.mark.parametrize(("call", "edit"), [("h.std(0, unbiased=True)", "h.std(0, correction=0)"),
                                            ("h.std(0, True)", "h.std(0, False)"),
                                            ("h.std(0, True, True)", "h.std(0, False, True)")])
def test_the_correction_edit_of_a_std_that_says_unbiased_runs(call: str, edit: str) -> None:
    """Was: ``h.std(0, True, correction=0)``, which torch refuses (the flag and the keyword together)."""
    from nan_magic import FixTrial, SourcePointer
    from nan_magic.render.edits import suggested_edit

    trial = FixTrial("stable", source=SourcePointer("train.py", 3, "forward", f"s = {call}"),
                     facts=(("function", "std"), ("form", "correction=0")), finite=True)
    assert suggested_edit(trial) == f"train.py:3: s = {edit}"
    assert torch.isfinite(eval(edit, {"h": torch.randn(1, 4)})).all()  # (it runs, and is finite for one sample)
