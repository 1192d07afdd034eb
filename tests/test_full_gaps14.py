"""mode="full" in both timings, for the hunt14 cases the per-call watch named without an op (fullgaps14).

A user's forward pre-hook that normalises a zeroed row (the call is replayed from what ``__call__`` got, so the
hook runs again), and a parameter whose own gradient alone goes bad (its owner's call replayed with gradients).
The contract table runs mode="full" immediately only; here the deferred check says the same.
"""

from __future__ import annotations

import pytest
from contract import Case, source_line
from contract.hunt14 import CASES

import nan_magic
from nan_magic import NonFiniteError

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]
NAMES = ["hunt14_user_pre_hook_normalises_a_zero_input", "hunt14_only_a_parameter_gradient_goes_bad"]


@pytest.mark.parametrize("timing", TIMINGS)
@pytest.mark.parametrize("name", NAMES)
def test_full_names_the_op_and_line(name: str, timing: dict[str, bool]) -> None:
    (case,) = [case for case in CASES if case.name == name]
    assert isinstance(case, Case) and case.expect is not None
    expect, scenario = case.expect, case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, mode="full", **timing,
                                                                  **scenario.options):
        scenario.run()
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.step, report.op) == (
        expect.phase, expect.module, expect.module_type, expect.step, expect.op), report.message
    assert expect.marker is not None and report.source is not None
    filename, line = source_line(case, expect.marker)
    assert (report.source.filename, report.source.lineno) == (filename, line), report.source
    # No remedy is tried in this mode, and the report says so.
    assert report.fixes == () and any(note.startswith("no fix was tried") for note in report.notes), report.notes
