"""The deferred watch (what a GPU runs) names what the immediate one names: round 34.

Every incident row of tests/contract/defer_s34.py: the deferred report names the module, op, line, phase, step and
cause the immediate one names, and ``%debug`` opens at the same line (ops=True likewise with defer=True).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, defer_s34

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


INCIDENTS = [pytest.param(case, id=case.name, marks=case.marks) for case in defer_s34.CASES
             if case.expect is not None]


@pytest.mark.parametrize("case", INCIDENTS)
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_deferred_report_and_debug_line_are_the_immediate_ones(case: Case, ops: bool) -> None:
    base = {"ops": True} if ops else {}
    now, late = _seen(case, base), _seen(case, {**base, "defer": True})
    assert now["op"] is not None and now["source"] is not None and now["debug"] is not None, now
    assert now["debug"] == now["source"], now
    assert late == now
