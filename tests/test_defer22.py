"""The deferred mode's %debug frame on training loop shapes, held to the immediate mode's (defer22).

The contract table (tests/contract/defer22.py) holds what both modes say; here, where ``%debug`` opens and the
frames from the loop to the producer. A gradient the loss code's backward made non-finite is judged at once as
``loss.backward()`` runs, and the exception stops there; the deferred check judges it at ``opt.step()``, or
accumulating, at the next micro-batch's model call, and %debug opened there (hot/timing.py's Deferred notes where
backward was called). An exception of the user's loop that leaves the watch mid-step has the deferred check judge
what the step left pending at the exit, where the loop's frames are unwound: the traceback holds them
(errors/frames.py frames_running), and %debug opens at the model call, or in the loss helper at its line, as where
judged at once.
"""

from __future__ import annotations

import linecache

import pytest
import torch
from contract import MODE_OPTIONS, Case
from contract import defer22 as rows
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Report


def _report(case: Case, mode: str) -> Report:
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode]):
        scenario.run()
    return caught.value.report


def _where(report: Report) -> tuple[object, ...]:
    assert report.debug_frame is not None
    return ((report.debug_frame.function, report.debug_frame.lineno),
            tuple((frame.function, frame.lineno) for frame in report.frames[1:]))  # (the first: this file's caller)


#: The loss code's backward at a sqrt of 0: accumulating, a GAN's, over MAX_CALLS + 4 calls, in an LBFGS closure, and
#: in the first of two backward passes before the step (%debug at the first's line, not the second's).
BACKWARD_ROWS = [case for case in rows.CASES
                 if "backward_nan" in case.name or case.name == "defer22_two_backward_passes_nan_in_the_first"]


@pytest.mark.parametrize("case", BACKWARD_ROWS, ids=lambda case: case.name)
def test_loss_code_backward_opens_in_the_loss_helper_at_the_forward_line(case: Case) -> None:
    """The loss helper (``rows._loss``) has returned when backward runs; its frame is kept (its tensors are small) and
    %debug opens there, at the distance's line, in both timings (it opened at ``loss.backward()`` before round 25)."""
    immediate, deferred = _report(case, "default"), _report(case, "defer")
    assert _where(deferred) == _where(immediate)
    frame = deferred.debug_frame
    assert frame is not None and (frame.function, frame.lineno) == ("_loss", deferred.source.lineno)
    assert linecache.getline(frame.filename, frame.lineno).rstrip().endswith("# producer: distance")


def test_backward_rows_are_the_five_loop_shapes() -> None:
    assert len(BACKWARD_ROWS) == 5


def _left_mid_step(defer: bool, where: str) -> tuple[Report, BaseException | None]:
    """A plain loop whose own check raises ValueError in step 1, after a NaN the step made (in the model, or in
    the loss code's backward), before ``opt.step()``: the deferred check judges it only at the watch's exit."""
    torch.manual_seed(0)
    model = rows._net(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(6, 4) for _ in range(3)], [torch.randn(6, 2) for _ in range(3)]
    if where == "model":
        xs[1] = rows._zero_row(xs[1])

    def run() -> None:
        for step in range(3):
            out = model(xs[step])  # model call
            loss = rows._loss(out, ys[step], "grad", where == "grad" and step == 1, 0.0)  # loss call
            opt.zero_grad()
            loss.backward()
            if step == 1:
                raise ValueError("the loop's own check failed")
            opt.step()

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        run()
    return caught.value.report, caught.value.__cause__


@pytest.mark.parametrize("where", ["model", "grad"])
def test_an_exception_leaving_mid_step_opens_where_judged_at_once(where: str) -> None:
    immediate, _ = _left_mid_step(False, where)
    deferred, cause = _left_mid_step(True, where)
    assert isinstance(cause, ValueError)  # the deferred event explains the loop's exception, raised from it
    assert (deferred.phase, deferred.module, deferred.step, deferred.op) == (
        immediate.phase, immediate.module, immediate.step, immediate.op)
    assert _where(deferred) == _where(immediate)
    # The loop's line in the traceback: the model call (the RMS norm's 0 / 0), or the loss helper's call (the
    # distance's sqrt, whose helper frame %debug opens in).
    loop = deferred.frames[1]
    marker = "# model call" if where == "model" else "# loss call"
    assert linecache.getline(loop.filename, loop.lineno).rstrip().endswith(marker)


def test_the_watch_entered_again_after_an_exception_left_it_mid_step() -> None:
    """The watch left by the user's exception mid-step (a backward, no optimizer step), entered again on the same
    model and optimizer: the next incident is reported as the immediate mode reports it."""
    said = []
    for defer in (False, True):
        torch.manual_seed(0)
        model = rows._net(0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
        with pytest.raises(KeyboardInterrupt), nan_magic.watch(model, opt, defer=defer):
            for step in range(2):
                loss = F.mse_loss(model(xs[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                if step == 1:
                    raise KeyboardInterrupt
                opt.step()
        xs[2] = rows._zero_row(xs[2])
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
            for step in range(4):
                loss = F.mse_loss(model(xs[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                opt.step()
        report = caught.value.report
        said.append((report.phase, report.module, report.step, report.op, report.nan, _where(report)))
    assert said[0] == said[1]
    assert said[0][:5] == ("forward", "0", 2, "aten.div.Tensor", 4)


def _unstepped_tail(defer: bool) -> Report:
    """Accumulation over 4 micro-batches; the epoch's last 2 never reach opt.step(), the NaN in the last one."""
    torch.manual_seed(0)
    model = rows._net(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 4) for _ in range(6)]
    xs[5] = rows._zero_row(xs[5])

    def run() -> None:
        for i, x in enumerate(xs):
            (model(x).pow(2).mean() / 4).backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        run()
    return caught.value.report


def test_an_unstepped_accumulation_tail_judged_at_the_exit_opens_at_the_producer() -> None:
    immediate, deferred = _unstepped_tail(False), _unstepped_tail(True)
    assert (deferred.phase, deferred.module, deferred.step, deferred.op) == (
        immediate.phase, immediate.module, immediate.step, immediate.op) == ("forward", "0", 1, "aten.div.Tensor")
    assert immediate.debug_frame is not None
    assert deferred.debug_frame == immediate.debug_frame
    # Judged as the watch is left normally, no exception of the user's holds the loop's frames: the with statement's
    # stands for them (Watch._leave, frames.leaving_entry), then the producer's. The loop's own function (run) has
    # returned by then, its frame gone: the traceback cannot hold it.
    assert [frame.function for frame in deferred.frames] == ["_unstepped_tail", "forward"]
    assert deferred.frames[-1] == immediate.frames[-1]


@pytest.mark.parametrize("bad", [1, 6])
def test_gradients_into_calls_let_go_of_are_counted(bad: int) -> None:
    """2 * MAX_CALLS + 4 model calls a step, the loss code's backward 0 / 0 into call ``bad``'s output: the step replay
    keeps the last MAX_CALLS calls, the gradients into the others' outputs are held for the deferred check, which
    judges the step mid-backward as MAX_CALLS are held (call 6's gradient is judged there, call 1's at opt.step())."""
    said = []
    for mode in ("default", "defer"):
        scenario = rows._many_calls(0.0, "grad", 2 * rows.MAX_CALLS + 4, bad)
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode]):
            scenario.run()
        report = caught.value.report
        said.append((report.phase, report.step, report.tensor, report.nan, report.posinf, report.debug_frame))
    assert said[0] == said[1]
    assert said[1][:5] == ("backward", 1, rows.OUTPUT_GRADIENT, 2, 0)
