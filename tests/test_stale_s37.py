"""A non-finite tensor left from an earlier run, held by the user's frame, is never the step's data (stale-s37).

Under ``ops=True, defer=True`` (``%%nantrace --ops --defer``), a loss the loop made non-finite itself
(``out / zeros``) whose loss was a temporary (``(...).mean().backward()``) was reported as phase ``data``,
naming whatever non-finite tensor the calling frame held from an earlier run (``old``, ``_``, a notebook's
``loss``): the deferred check finds the temporary loss freed, and the op tracer's origin of it went unasked, so
the user's variables were searched for the loss code's data. Every other mode named ``aten.div.Tensor`` at the
loss line. A tensor built before the watch that the loop does read stays the step's data, in every mode.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn

import nan_magic
from nan_magic import NonFiniteError

MODES = [pytest.param(options, id=mode) for mode, options in MODE_OPTIONS.items()]


def marked_line(marker: str) -> int:
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.rstrip().endswith(f"# producer: {marker}"))


def parts() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A model, its optimizer, a batch, and a divisor whose odd columns are exactly 0 (inf or NaN on any kernel)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    divisor = (torch.arange(32).reshape(4, 8) % 2).float()
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(4, 8), divisor


def divide_in_the_loss(options: dict[str, Any]) -> nan_magic.NonFiniteError:
    """One step whose loss code divides by zero, its loss a temporary; the caller's frame holds what it holds."""
    model, opt, x, divisor = parts()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        weighted = out / divisor  # producer: divide
        opt.zero_grad()
        weighted.mean().backward()
        opt.step()
    return caught.value


def assert_the_division(error: NonFiniteError, line: int) -> None:
    report = error.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == line
    assert report.tensor.role.value != "input"


def earlier_run() -> torch.Tensor:
    """What an earlier failed run left: its non-finite result, detached (no grad_fn: it looks like data)."""
    model, _opt, x, divisor = parts()
    return (model(x) / divisor).detach()


@pytest.mark.parametrize("options", MODES)
def test_a_nan_the_caller_holds_from_an_earlier_run_is_not_the_data_of_a_loss_that_made_its_own(options) -> None:
    old = earlier_run()
    held = [old, torch.tensor(float("nan"))]  # (a list too: its items are named ``held[0]``)
    error = divide_in_the_loss(options)
    assert_the_division(error, marked_line("divide"))
    assert not old.isfinite().all() and len(held) == 2  # (held until the check)


@pytest.mark.parametrize("options", MODES)
def test_a_nan_in_the_frame_that_enters_the_watch_is_not_the_data_either(options) -> None:
    old = earlier_run()
    model, opt, x, divisor = parts()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        weighted = out / divisor  # producer: own frame
        opt.zero_grad()
        weighted.mean().backward()
        opt.step()
    assert_the_division(caught.value, marked_line("own frame"))
    assert not old.isfinite().all()


CELL = """\
out = model(x)
weighted = out / divisor
opt.zero_grad(); weighted.mean().backward(); opt.step()
"""


@pytest.mark.parametrize("options", MODES)
def test_a_nan_loss_left_in_a_notebooks_namespace_is_not_the_data(options) -> None:
    # A notebook's namespace after a first failed run: ``loss``, ``out`` and ``_`` hold its non-finite tensors, and
    # the cell runs at the namespace's top level (its frame's locals are the namespace).
    model, opt, x, divisor = parts()
    old = earlier_run()
    namespace: dict[str, Any] = {"model": model, "opt": opt, "x": x, "divisor": divisor, "loss": old.mean(),
                                 "out": old, "_": old[0], "nan_magic": nan_magic}
    code = compile("with nan_magic.watch(model, opt, **options):\n" + "".join(f"    {line}\n" for line in
                   CELL.splitlines()), "<cell-2>", "exec")
    namespace["options"] = options
    with pytest.raises(NonFiniteError) as caught:
        exec(code, namespace)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, "aten.div.Tensor")
    assert report.source is not None and (report.source.filename, report.source.lineno) == ("<cell-2>", 3)


@pytest.mark.parametrize("options", MODES)
def test_a_nan_label_built_before_the_watch_and_read_by_the_loop_is_still_the_data(options) -> None:
    # The loop reads it: it is the step's data, beside a NaN left from an earlier run that the loop never read.
    old = earlier_run()
    model, opt, x, _divisor = parts()
    labels = torch.randn(4, 8)
    labels[1, 2] = float("nan")
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        opt.zero_grad()
        ((out - labels) ** 2).mean().backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 0, "labels")
    assert (report.nan, report.numel) == (1, 32)
    assert not old.isfinite().all()


@pytest.mark.parametrize("options", MODES)
def test_a_nan_the_caller_holds_that_the_loop_reads_is_the_data(options) -> None:
    # The same tensor as the first test's, held by the caller, but the loop reads it this time: then it is named,
    # as the loss line that read it names it (``given``; the caller's ``old`` is an outer frame's name).
    old = earlier_run()
    error = read_by_the_loss(options, old)
    report = error.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 0, "given")


def read_by_the_loss(options: dict[str, Any], given: torch.Tensor) -> NonFiniteError:
    model, opt, x, _divisor = parts()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        opt.zero_grad()
        (out * given).mean().backward()
        opt.step()
    return caught.value


def label_in_a_closure() -> Any:
    """A loss function whose NaN label no frame's locals show: only the op tracer (or the recorder) sees it read."""
    labels = torch.randn(4, 8)
    labels[1, 2] = float("nan")
    return lambda out: ((out - labels) ** 2).mean()  # producer: closure


@pytest.mark.parametrize("options", MODES)
def test_a_nan_label_in_a_closure_is_the_data_of_a_temporary_loss(options) -> None:
    # ops=True, defer=True said phase 'forward', tensor 'loss', no op or line here (nothing held), or named the NaN
    # the caller held: the deferred check never asked the tracer what the freed loss code read.
    old = earlier_run()
    model, opt, x, _divisor = parts()
    loss_fn = label_in_a_closure()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        opt.zero_grad()
        loss_fn(out).backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("data", None, 0, None)
    assert str(report.tensor) == "other of aten.sub.Tensor"
    assert report.source is not None and report.source.lineno == marked_line("closure")
    assert not old.isfinite().all()


MAGIC_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
divisor = (torch.arange(32).reshape(4, 8) % 2).float()
loss = (model(x) / divisor).detach().mean()  # what a first failed run left in the namespace
"""

MAGIC_CELL = """%%nantrace --ops --defer
out = model(x)
weighted = out / divisor
opt.zero_grad(); weighted.mean().backward(); opt.step()
"""


def test_the_magic_with_ops_and_defer_names_the_division_not_a_loss_left_in_the_namespace(ip) -> None:
    from IPython.utils.capture import capture_output

    ip.run_cell(MAGIC_SETUP)
    ip.user_ns.pop("_nan_report", None)
    try:
        with capture_output():
            result = ip.run_cell(MAGIC_CELL)
        assert isinstance(result.error_in_exec, NonFiniteError)
        report = ip.user_ns["_nan_report"]
        assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, "aten.div.Tensor")
        assert report.source is not None and report.source.line == "weighted = out / divisor"
        assert not ip.user_ns["loss"].isfinite()
    finally:
        ip.run_line_magic("nanwatch", "off")


def _train_with_labels(labels: torch.Tensor, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8), torch.randn(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(x)
        opt.zero_grad()
        ((out - labels) ** 2).mean().backward()
        opt.step()
    return caught.value.report


@pytest.mark.parametrize("options", MODES)
def test_a_label_held_by_two_frames_is_named_as_the_loss_codes_frame_names_it(options: dict[str, Any]) -> None:
    """Review of stale-s37: a NaN label the caller holds as ``y_all`` and the loss code's frame as ``labels`` was
    named ``y_all`` (the outermost frame's name overwrote the innermost's), though the line the user reads says
    ``labels``."""
    y_all = torch.randn(4, 8)
    y_all[1, 2] = float("nan")
    report = _train_with_labels(y_all, options)
    assert str(report.tensor) == "labels", str(report.tensor)
