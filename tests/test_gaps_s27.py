"""Known wrong answers left by session 26 (closing26's "Not done, plainly"), each as a test that failed before its
fix."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from test_prefetch26 import polyak_nan_lr_report
from torch import nn
from torch.nn import functional as F

import nan_magic

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True}}


def _line_of(function: object, marker: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if marker in line)


def _python_lr_loop(watch_options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = np.float64(0.0)  # a warmup of 0 steps, as numpy numbers (which divide 0 / 0 into NaN, not raise)
    with nan_magic.watch(model, opt, **watch_options):
        for step in range(3):
            done = np.float64(step - 1)
            lr = 0.1 * (done / warmup if step == 1 else 1.0)  # python-lr: 0/0 at step 1
            for group in opt.param_groups:
                group["lr"] = lr
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()


def _tensor_lr_loop(watch_options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, **watch_options):
        for step in range(3):
            kept = torch.tensor(float(step != 1))
            lr_t = 0.1 * kept / kept  # tensor-lr: 0/0 at step 1, made before the forward
            for group in opt.param_groups:
                group["lr"] = lr_t
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()


def _assert_set_at_its_line(report: nan_magic.Report, name: str, line: int) -> None:
    assert (report.phase, report.step, report.op) == ("optimizer", 1, None)
    assert report.cause is not None and (report.cause.label, report.cause.reading) == (
        "nonfinite-number", "optimizer-lr-set")
    assert report.source is not None and report.source.lineno == line
    assert f"the learning rate lr = nan that the loop set before the SGD step comes from {name}, set at line {line}: " \
           f"{name} is not a number" in report.cause.hint
    assert "is not a number" in report.cause.hint and "too high" not in report.cause.hint
    assert any(note.kind == "lr-set-by-loop" for note in report.note_facts)


@pytest.mark.parametrize("mode", MODES)
def test_a_learning_rate_computed_in_python_is_named_at_its_line(mode: str) -> None:
    """``lr = 0.1 * done / warmup`` (numpy, warmup 0) set in ``param_groups`` before backward: no op made the NaN, and
    the report read learning-rate-too-high (lr = nan) at the step's ``add_``. It says the rate is not a number now,
    names the loop's line that set it, and %debug opens there."""
    with pytest.raises(nan_magic.NonFiniteError) as caught, np.errstate(invalid="ignore"):
        _python_lr_loop(MODES[mode])
    line = _line_of(_python_lr_loop, "# python-lr")
    _assert_set_at_its_line(caught.value.report, "lr", line)
    assert caught.value.producer_frame is not None and caught.value.producer_position[1] == line


@pytest.mark.parametrize("mode", [*MODES, "ops-defer"])
def test_a_tensor_learning_rate_made_before_the_forward_is_named_at_its_line(mode: str) -> None:
    """``group["lr"] = lr_t``, a 0-dim tensor the loop made 0 / 0 before the model call: the records that reach the
    step do not hold its op, and the report read learning-rate-too-high. The tensor itself is the group's: the name
    bound to it in the loop's frame gives the line. Deferred (defer-s29), the step's result is read with the next
    step's transfer: the rate is the one the carried result kept of its step (StepResult.lrs), and the one name the
    loop stores into the group holding a tensor gives the line (it was unclassified, no line)."""
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _tensor_lr_loop(MODES.get(mode, {"ops": True, "defer": True}))
    _assert_set_at_its_line(caught.value.report, "lr_t", _line_of(_tensor_lr_loop, "# tensor-lr"))


@pytest.mark.parametrize("mode", MODES)
def test_a_division_that_made_the_learning_rate_counts_its_own_nan(mode: str) -> None:
    """The Polyak step size ``loss / |g|^2`` at 0 / 0, read with ``.item()`` into ``param_groups``: the division made 1
    NaN, the step then 32 in the parameter. The division-by-zero sentence and its evidence said 32 (the parameter's);
    they count the op's own output now."""
    report = polyak_nan_lr_report(MODES[mode])
    assert (report.op, report.nan, report.cause.label) == ("aten.div.Tensor", 32, "division-by-zero")
    assert "giving 1 NaN (0/0)" in report.cause.hint and "32 NaN" not in report.cause.hint
    assert "aten.div.Tensor made 1 NaN (0/0) and 0 inf (x/0)" in report.cause.evidence


def test_a_name_the_loop_only_read_the_rate_into_is_not_the_line_that_set_it() -> None:
    """A scheduler set the NaN rate (``LambdaLR`` over a schedule that reaches 0 / 0); the loop only read it back to
    log it (``lr = sched.get_last_lr()[0]``, the group's own float): that line did not set it and is not named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float("nan") if step == 2 else 1.0)
    logged = []
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for _step in range(4):
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            lr = sched.get_last_lr()[0]  # read to log, not set
            logged.append(lr)
    report = caught.value.report
    assert report.phase == "optimizer" and report.step == 2
    assert report.cause is not None and report.cause.reading != "optimizer-lr-set"
    assert report.source is None or "get_last_lr" not in (report.source.line or "")


def _item_lr_loop_beside_unreadable_tensors(watch_options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (A notebook's loop runs at top level: its locals are the user's globals, tensors nan_magic cannot read among
    # them.)
    probe = torch.empty((), device="meta")  # noqa: F841
    ragged = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])  # noqa: F841
    with nan_magic.watch(model, opt, **watch_options):
        for step in range(3):
            kept = torch.tensor(float(step != 1))
            lr_t = 0.1 * kept / kept  # item-lr: 0/0 at step 1, made before the forward
            for group in opt.param_groups:
                group["lr"] = lr_t.item()
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.parametrize("mode", ["default", "full"])
def test_the_rates_line_is_found_beside_tensors_that_cannot_be_read(mode: str) -> None:
    """The rate's name is looked for among the names the loop stores into ``group["lr"]`` only: a meta or nested
    tensor elsewhere in the frame was read as a candidate and raised (RuntimeError, NotImplementedError) in place of
    the report."""
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _item_lr_loop_beside_unreadable_tensors(MODES[mode])
    _assert_set_at_its_line(caught.value.report, "lr_t", _line_of(_item_lr_loop_beside_unreadable_tensors, "# item-lr"))
