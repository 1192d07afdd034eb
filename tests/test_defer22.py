"""The deferred mode's %debug frame on training loop shapes, held to the immediate mode's (defer22).

The contract table (tests/contract/defer22.py) holds what both modes say; here, where ``%debug`` opens and the
frames from the loop to the producer. A gradient the loss code's backward made non-finite is judged at once as
``loss.backward()`` runs, and the exception stops there; the deferred check judges it at ``opt.step()``, or
accumulating, at the next micro-batch's model call, and %debug opened there (hot/timing.py's Deferred notes where
backward was called).
"""

from __future__ import annotations

import linecache

import pytest
from contract import MODE_OPTIONS, Case
from contract import defer22 as rows

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


#: The loss code's backward at a sqrt of 0: accumulating, a GAN's, over MAX_CALLS + 4 calls, in an LBFGS closure.
BACKWARD_ROWS = [case for case in rows.CASES if "backward_nan" in case.name]


@pytest.mark.parametrize("case", BACKWARD_ROWS, ids=lambda case: case.name)
def test_loss_code_backward_opens_where_backward_was_called(case: Case) -> None:
    immediate, deferred = _report(case, "default"), _report(case, "defer")
    assert _where(deferred) == _where(immediate)
    frame = deferred.debug_frame
    assert frame is not None and "backward()" in linecache.getline(frame.filename, frame.lineno)


def test_backward_rows_are_the_four_loop_shapes() -> None:
    assert len(BACKWARD_ROWS) == 4
