"""The deferred mode (``defer=True``, every GPU user's) says what the immediate one says, row by row (defer-s27).

scripts/defer_diff.py runs every incident row of the contract in both modes and lists where the reports differ;
these hold the differences fixed: the fix trials of a backward judged after another backward (they replayed the
last loss's code, finite, and tried nothing), and %debug's frame for a model call's output, a batch, or data the loss
code read, judged at ``opt.step()`` (it opened there, not at the loop's line that called the model or backward).
"""

from __future__ import annotations

import os

import pytest
import torch
from contract import Case, all_cases

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


@pytest.mark.parametrize("name", ["defer22_two_backward_passes_nan_in_the_first",
                                  "defer22_two_backward_passes_nan_in_the_first_counted"])
def test_a_backward_judged_after_another_tries_the_fixes_on_its_own_loss(name: str) -> None:
    """``l1.backward(retain_graph=True); l2.backward()``, l1's backward 0 / 0: the trials replay l1's code."""
    now, late = _report(_ROWS[name]), _report(_ROWS[name], defer=True)
    assert _fixes(now) == [("eps", True)]
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
