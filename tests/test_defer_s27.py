"""The deferred mode (``defer=True``, every GPU user's) says what the immediate one says, row by row (defer-s27).

scripts/defer_diff.py runs every incident row of the contract in both modes and lists where the reports differ;
these hold the differences fixed: the fix trials of a backward judged after another backward (they replayed the
last loss's code, finite, and tried nothing), and %debug's frame for a model call's output, a batch, or data the loss
code read, judged at ``opt.step()`` (it opened there, not at the loop's line that called the model or backward).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from contract import Case, all_cases
from contract import defer27 as rows

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Report

_ROWS = {case.name: case for case in all_cases()}


def _report(case: Case, **options: object) -> Report:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    return caught.value.report


def _fixes(report: Report) -> list[tuple[str, bool | None]]:
    return [(trial.kind, trial.finite) for trial in report.fixes]


@pytest.mark.parametrize(("name", "fixes"), [
    # ``l1.backward(retain_graph=True); l2.backward()``, l1's backward 0 / 0: the trials replay l1's code.
    ("defer22_two_backward_passes_nan_in_the_first", [("eps", True)]),
    ("defer22_two_backward_passes_nan_in_the_first_counted", [("eps", True)]),
    # SAM's second forward at ``w + e``, judged after the loop restored ``w``: the trials start from ``w + e``. The
    # clamp of ``log(scale)`` is not a fix (fixes-s32, frozen): every value the line reads is the parameter pushed
    # below 0, so the clamp passes ``scale`` no gradient; applied by hand over 20 SAM steps, the scale's gradient is
    # 0 at step 0 and it is thrown to 8e18 at step 1 (test_fixes_s32_review.py's by-hand run). Was ("eps", True).
    ("hunt26_sam_second_forward_log_of_a_scale_pushed_below_0", [("stable", None), ("eps", None)]),
])
def test_the_deferred_check_tries_the_fixes_the_immediate_one_does(name: str, fixes: list[object]) -> None:
    now, late = _report(_ROWS[name]), _report(_ROWS[name], defer=True)
    assert _fixes(now) == fixes
    assert _fixes(late) == _fixes(now), [note.kind for note in late.note_facts]


@pytest.mark.parametrize("name", [
    "gaps20_keras_max_norm_once_over_the_limit_of_a_zero_row",  # a forward event no replay frame holds
    "hunt14_max_pool_over_a_fully_padded_sequence",
    "gaps21_forward_first_writes_its_input_at_the_failing_step",  # the replayed call's own, not the step's last
    "hunt16_fused_relu_rnn_overflows_on_a_long_sequence",  # a model all torch's code: its ops' frame is the loop's
    "defer27_batch_buffer_repaired_before_the_step_ends",  # a batch: its data call is not the model's
    "hunt19_where_masked_mse_over_nan_coded_missing_targets",  # data the loss code read: at loss.backward()
    "hunt16_class_weight_of_a_class_absent_from_the_training_set",
])
def test_a_value_judged_at_the_check_opens_where_it_is_judged_at_once(name: str) -> None:
    """%debug opens at the loop's line that called the model (or backward, for data the loss code read), as where
    the value is judged as the call returns (or backward starts), not at ``opt.step()`` where the check ran."""
    now, late = _report(_ROWS[name]), _report(_ROWS[name], defer=True)
    assert now.debug_frame is not None and late.debug_frame is not None
    where = [(os.path.basename(frame.filename), frame.lineno) for frame in (now.debug_frame, late.debug_frame)]
    assert where[1] == where[0]


def _warned_run(**options: object) -> tuple[list[tuple[object, ...]], list[str]]:
    scenario = rows._plain({1: 1, 2: 1}, "both")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(*scenario.targets, on_detect="warn", **options) as w:
            scenario.run()
    events = [(e.phase.value, e.module, e.step, e.op, e.benign, e.follows is not None) for e in w.events]
    return events, [str(warning.message).splitlines()[0] for warning in caught if "non-finite" in str(warning.message)]


def test_a_warn_loop_deferred_has_the_immediate_loops_events_in_order() -> None:
    """``on_detect="warn"``: the run goes on; deferred, each step's events come at its check, in the order and with
    the steps the immediate mode gives (step 1's RMS norm first, its op named; what followed it, marked so)."""
    now, late = _warned_run(), _warned_run(defer=True)
    assert late == now
    events, said = now
    assert events[0] == ("forward", "0", 1, "aten.div.Tensor", False, False)
    assert all(follows for *_, follows in events[1:])
    assert [step for _, _, step, *_ in events] == sorted(step for _, _, step, *_ in events)
    assert len(said) >= 2 and "step 1" in said[0] and "steps 2 to 3" in said[-1], said


# What reading a step late cannot give: each a strict xfail, with why (scripts/defer_diff.py lists them).
_OVERWRITTEN = ("the deferred check reads the batch at opt.step(), after the loop overwrote it in place (the next "
                "micro-batch copied into a static buffer, nan_to_num_ repairing it): its probe kept only that it was "
                "not finite, so no counts, no histogram, and skip-batch finds no sample to leave out; keeping the "
                "values would cost a copy of every batch every step")
_CARRIED = ("at the loop's last step an optimizer step's result is judged as the watch is left, after the function "
            "running the loop returned: %debug opens where that check runs (the watch's exit), not at opt.step(), "
            "because holding a function's frame for it would keep its locals (the batch, the logits) alive into the "
            "next step on every step (step_checks.py holds only a cell's or a script's top-level frame, whose "
            "locals are its globals)")
_RETURNED = ("the helper that called the model (a loss_of lambda) has returned by the check: its frame is gone, and "
             "%debug opens where the step was judged (docs/how-it-watches.md: a helper, deferred)")


@pytest.mark.parametrize("name", [
    pytest.param("hunt19_static_input_buffer_nan_in_the_first_micro_batch",
                 marks=pytest.mark.xfail(strict=True, reason=_OVERWRITTEN)),
    pytest.param("defer27_batch_buffer_repaired_before_the_step_ends",
                 marks=pytest.mark.xfail(strict=True, reason=_OVERWRITTEN)),
])
def test_a_batch_overwritten_before_the_check_is_counted(name: str) -> None:
    now, late = _report(_ROWS[name]), _report(_ROWS[name], defer=True)
    assert (late.nan, bool(late.samples), _fixes(late)) == (now.nan, bool(now.samples), _fixes(now))


@pytest.mark.parametrize("name", [
    # (An optimizer step's carried result: the step's line in the loop's frame where it still runs: round 30.)
    "hunt24_two_optimizers_by_name_adam_eps0_over_a_zero_gradient_norm",
    pytest.param("hunt24_aux_head_switched_on_at_the_last_step_adam_eps0",
                 marks=pytest.mark.xfail(strict=True, reason=_CARRIED)),
    pytest.param("holdout_spectral_norm_of_a_zero_init_layer", marks=pytest.mark.xfail(strict=True, reason=_RETURNED)),
])
def test_debug_opens_where_it_does_judged_at_once(name: str) -> None:
    now, late = _report(_ROWS[name]), _report(_ROWS[name], defer=True)
    assert late.debug_frame is not None and now.debug_frame is not None
    assert (late.debug_frame.filename, late.debug_frame.lineno) == (now.debug_frame.filename, now.debug_frame.lineno)
