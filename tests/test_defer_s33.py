"""The deferred watch (what a GPU runs) names what the immediate one names: round 33.

Every incident row of tests/contract/defer_s33.py: the deferred report names the module, op, line, phase, step and
cause the immediate one names, and ``%debug`` opens at the same line (ops=True likewise with defer=True).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, all_cases, defer_s33

import nan_magic
from nan_magic import NonFiniteError


def _line(pointer: Any) -> tuple[str, int] | None:
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def _seen(case: Case, options: dict[str, Any]) -> dict[str, Any]:
    """What a user reads off the row's report: where, what, why, and where %debug opens."""
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    report = caught.value.report
    return {"module": report.module, "op": report.op, "source": _line(report.source), "phase": report.phase,
            "step": report.step, "cause": None if report.cause is None else report.cause.label,
            "debug": _line(report.debug_frame)}


INCIDENTS = [pytest.param(case, id=case.name, marks=case.marks) for case in defer_s33.CASES
             if case.expect is not None]


@pytest.mark.parametrize("case", INCIDENTS)
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_deferred_report_and_debug_line_are_the_immediate_ones(case: Case, ops: bool) -> None:
    base = {"ops": True} if ops else {}
    now, late = _seen(case, base), _seen(case, {**base, "defer": True})
    assert now["op"] is not None and now["source"] is not None and now["debug"] is not None, now
    assert late == now


def test_the_helper_rows_line_is_the_helpers_file() -> None:
    """The loss made in another file's helper: the line named is that file's, deferred as immediate."""
    case = next(c for c in defer_s33.CASES if c.name == "defer_s33_loss_in_a_helper_of_another_file")
    late = _seen(case, {"defer": True})
    assert late["source"] is not None and late["source"][0] == "defer_s33_losses.py", late
    assert late["debug"] == late["source"], late


# ---------------------------------------------------------------- a backward op's operands read alike, node or none
# (defer-s38: read only where the node's own formula divides by nothing, a matmul's: explain/diagnose._LINEAR; a
# node whose formula divides, acosh's or hypot's, keeps its reading: test_review_s33_defer_user.py.)
def test_a_division_by_a_zero_norm_in_a_double_backward_is_read_alike_immediate_and_deferred() -> None:
    """Hutchinson's trace (``autograd.grad(..., create_graph=True)``) through ``F.normalize`` of a black image: the
    division by its zero norm makes the NaN. The immediate watch's live trace names the node it ran under
    (``MmBackward0``, no pole) and read nothing of the operands: 'unclassified'; the deferred check's replay names no
    node and read them: 'division-by-zero'. Both now read the operands: the `other` held a zero."""
    case = next(c for c in all_cases() if c.name == "hunt_s28_hutchinson_trace_through_f_normalize_of_a_black_image")
    for ops in (False, True):
        base = {"ops": True} if ops else {}
        now, late = _seen(case, base), _seen(case, {**base, "defer": True})
        assert now["cause"] == "division-by-zero" and late == now, (now, late)


# ---------------------------------------------------------------- a jagged batch's NaN counted at the deferred check
def _report_of(case: Case, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    return caught.value.report


@pytest.mark.parametrize("ops", [False, True])
def test_a_jagged_batchs_nan_is_counted_and_drawn_at_the_deferred_check(ops: bool) -> None:
    """A missing reading stored as NaN in a jagged nested-tensor batch: the immediate watch counts it (1 nan of 27)
    and draws the batch's histogram. The deferred check read the batch a step later through ``values()``, a new
    view made for the read and gone by then: 'nan among 27 values, not counted', no histogram. It now reads the
    jagged tensor's own buffer, alive as long as the call's kept arguments hold the batch."""
    case = next(c for c in all_cases() if c.name == "hunt_s30_nan_in_a_jagged_nested_tensor_batch")
    base = {"ops": True} if ops else {}
    now, late = _report_of(case, base), _report_of(case, {**base, "defer": True})
    assert (now.nan, now.numel) == (1, 27) and (late.nan, late.numel) == (1, 27), late.to_text()
    assert [s.tensor for s in late.samples] == [s.tensor for s in now.samples] and late.samples, late.to_text()
    assert "not counted" not in late.to_text()
