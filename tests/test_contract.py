"""The contract table (tests/contract/): each case, in each mode, says what it must say or nothing."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS, TIMED_LIKE, Case, all_cases, modes_of, source_line

import nan_magic
from nan_magic import NonFiniteError

CASES = all_cases()


def _params() -> list[Any]:
    return [
        pytest.param(case, mode, id=f"{case.name}-{mode}", marks=(*case.marks, *(
            pytest.mark.xfail(strict=True, reason=why) for gap, why in case.gaps if gap == mode)))
        for case in CASES
        for mode in modes_of(case)
    ]


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested results (NaN equal to NaN in the same place)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        try:
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
        return True
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize(("case", "mode"), _params())
def test_contract(case: Case, mode: str) -> None:
    options = MODE_OPTIONS[mode]
    mode = TIMED_LIKE.get(mode, mode)  # what it must say: ops-defer says what ops says
    if case.expect is None:
        expected = case.build().run()
        scenario = case.build()
        with nan_magic.watch(*scenario.targets, **options, **scenario.options) as w:
            got = scenario.run()
        assert w.report is None, f"false alarm: {w.report.message if w.report else ''}"
        assert same(got, expected), "the watched run computed something else"
        if case.benign is not None:
            assert sum(event.benign for event in w.events) == case.benign, [e.message for e in w.events]
        return
    expect = case.expect
    scenario = case.build()
    watch = nan_magic.watch(*scenario.targets, **options, **scenario.options)
    with pytest.raises(NonFiniteError) as caught, watch as w:
        scenario.run()
    report = caught.value.report
    seen = (report.phase, report.module, report.step)
    assert seen == (expect.phase, expect.module, expect.step), f"{report.message}"
    # A hint or note never suggests the mode already in use (nor one it implies: ops=True runs per-module too).
    suggestions = {"ops": ("ops=True", "--ops", 'mode="full"', "--full"), "full": ('mode="full"', "--full")}
    text = report.to_text()
    assert not [s for s in suggestions.get(mode, ()) if s in text], text
    if expect.module_type is not None:
        assert report.module_type == expect.module_type
    if expect.model is not None:
        assert report.model == expect.model, report.message
    if expect.tensor is not None:
        assert report.tensor == expect.tensor
    if expect.kinds is not None:
        kinds = {kind for kind, count in report.counts.items() if count}
        assert kinds == set(expect.kinds), report.counts
    if expect.cause is not None:
        assert report.cause is not None and report.cause.label == expect.cause, report.cause
    for says_mode, words in expect.says:
        if says_mode == mode:
            assert words in text, text
    if expect.benign_events is not None:
        benign = sum(event.benign for event in w.events)
        if mode in ("default", "defer"):
            # The tiered watch's boundary check notes each mask buffer of the model it finds in the failing
            # step's output at once, where the per-module watch notes those its children passed on.
            assert benign >= expect.benign_events
        else:
            assert benign == expect.benign_events
    if mode in expect.op_modes:
        assert report.op == expect.op, f"op {report.op!r}; {report.message}"
        if expect.marker is not None:
            filename, line = source_line(case, expect.marker)
            assert report.source is not None, "no source line"
            assert (os.path.basename(report.source.filename), report.source.lineno) == (
                os.path.basename(filename), line), report.source
