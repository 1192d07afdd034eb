"""``ops=True, defer=True`` (what ``ops=True`` gives on a GPU) opens %debug where ``ops=True`` does (defer-s28).

scripts/defer_diff.py --ops on d77c765: 13 rows' %debug frames differed. Two were defects of the deferred timing:

- a backward producer in the loss code (``distance = squared.sqrt()``), judged at the deferred check after the loop
  went back to the next micro-batch (or past ``loss.backward()``): %debug opened at ``loss.backward()``, not at the
  loss code's line (the tracer names no frame for a gradient formula; the line's frame was looked for only where the
  loop still stood at or past it);
- a forward or data event of a traced watch judged at ``opt.step()``: %debug opened there, not at the loop's line that
  called the model (the model's caller was taken from a step replay, which a traced watch does not run; the calls it
  keeps for the fix trials hold it too).
"""

from __future__ import annotations

import os

import pytest
import torch
from contract import Case, all_cases
from contract.defer22 import _net, _zero_row

import nan_magic
from nan_magic import NonFiniteError

_ROWS = {case.name: case for case in all_cases()}


def _where(case: Case, **options: object) -> tuple[tuple[str, int] | None, tuple[int, int] | None]:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    frame = caught.value.report.debug_frame
    return (None if frame is None else (os.path.basename(frame.filename), frame.lineno)), caught.value.producer_position


@pytest.mark.parametrize("name", [
    "hunt16_accumulation_sqrt_backward_in_micro_batch_3",  # checked at the next micro-batch's model call
    "hunt16_loop_skips_nonfinite_gradients_sqrt_backward",  # no opt.step(): checked at the next step's model call
    "hunt16_clip_grad_norm_error_if_nonfinite_after_a_sqrt_backward",  # clip raises: checked as the watch is left
])
def test_a_loss_codes_backward_producer_opens_at_its_line_traced_and_deferred(name: str) -> None:
    now, late = _where(_ROWS[name], ops=True), _where(_ROWS[name], ops=True, defer=True)
    assert now[0] is not None and late == now


@pytest.mark.parametrize("name", [
    "hunt20_resumed_parameter_holding_a_nan",  # a parameter already NaN, read by a submodule's call
    "hunt_s27_best_checkpoint_reloaded_mid_run_holding_a_nan",
    "defer27_batch_buffer_repaired_before_the_step_ends",  # the batch, judged at opt.step()
])
def test_a_traced_forward_event_judged_at_the_check_opens_at_the_model_call(name: str) -> None:
    now, late = _where(_ROWS[name], ops=True), _where(_ROWS[name], ops=True, defer=True)
    assert now[0] is not None and late[0] == now[0]


def test_a_traced_producer_in_a_returned_forward_opens_at_the_loops_model_call_deferred() -> None:
    """``ops=True`` stops inside the model (the parent's line that called the pool, its frame still running); judged
    at the check, that frame is gone: %debug opens at the loop's model call, as the tiered watch's does, not at
    ``opt.step()``."""
    case = _ROWS["hunt14_max_pool_over_a_fully_padded_sequence"]
    assert _where(case, ops=True, defer=True)[0] == _where(case)[0] == _where(case, defer=True)[0]


def _epochs(**options: object) -> tuple[object, ...]:
    """A watch entered again each epoch (``for epoch: with watch(...)``, as a Lightning-style loop's hooks do); the
    NaN in epoch 1's second step: each epoch's watch counts its own steps, and the deferred watch, whose check is left
    pending at each epoch's exit, names what the immediate one names."""
    torch.manual_seed(0)
    model = _net(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(5, 4) for _ in range(6)], [torch.randn(5, 2) for _ in range(6)]
    xs[3] = _zero_row(xs[3], 1)
    with pytest.raises(NonFiniteError) as caught:
        for epoch in range(3):
            with nan_magic.watch(model, opt, **options):
                for step in range(2):
                    loss = ((model(xs[2 * epoch + step]) - ys[2 * epoch + step]) ** 2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    report = caught.value.report
    frame = report.debug_frame
    return (report.phase, report.module, report.step, report.op, report.source and report.source.lineno,
            frame and frame.lineno, [(fix.kind, fix.finite) for fix in report.fixes])


def test_a_watch_entered_again_each_epoch_deferred_names_what_the_immediate_one_does() -> None:
    now = _epochs()
    assert now[:4] == ("forward", "0", 1, "aten.div.Tensor")
    assert _epochs(defer=True) == now
    assert _epochs(ops=True, defer=True)[:5] == _epochs(ops=True)[:5] == now[:5]


# The boundary tensor (a gradient into a module's output, or the loss) is freed by the deferred check and its probe
# kept only (min, max): the report described the op's output instead. The deferred tracer now keeps the counts of
# what an origin reached (defer-s35; localize/ops/origins.Origins.stats_by_ref), and names the boundary.
@pytest.mark.parametrize("name", ["gaps21_direct_child_backward_sqrt_of_zero", "loss_temporary_of_two_terms"])
def test_a_traced_deferred_report_names_the_boundary_tensor(name: str) -> None:
    def named(**options: object) -> str:
        torch.manual_seed(0)
        scenario = _ROWS[name].build()
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options,
                                                                     **scenario.options):
            scenario.run()
        return str(caught.value.report.tensor)
    assert named(ops=True, defer=True) == named(ops=True) == named()
