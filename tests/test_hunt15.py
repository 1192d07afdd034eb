"""What hunt15's incidents show beyond the contract's columns: the line of an absorbed forward value, and the
counts of an op whose output the code wrote in place afterwards (tests/contract/hunt15.py holds the cases)."""

from __future__ import annotations

import os

import pytest
from contract import hunt15, source_line
from watching import FIVE_MODES, raised

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


def _case(name: str) -> hunt15.Case:
    return next(case for case in hunt15.CASES if case.name == name)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_the_absorbed_exp_of_the_loss_code_is_named_at_its_own_line(options: dict) -> None:
    """PPO's ratio: the exp's inf, discarded by the clipped term in forward, is named at the exp's line, not at the
    loop's ``loss.backward()`` (immediate: the loss code's backward replay ran inside the user's backward) or at
    ``opt.step()`` (deferred)."""
    case = _case("hunt15_ppo_ratio_exp_overflow_behind_the_clip")
    scenario = case.build()
    report = raised(scenario.run, *scenario.targets, **options)
    filename, line = source_line(case, "ppo ratio")
    assert report.absorbed is not None and report.absorbed.op == "aten.exp.default"
    assert report.absorbed.source is not None
    assert (os.path.basename(report.absorbed.source.filename), report.absorbed.source.lineno) == (
        os.path.basename(filename), line)
    assert f"absorbed in forward: aten.exp.default at tests/contract/hunt15.py:{line}" in report.to_text()


@pytest.mark.parametrize("options", FIVE_MODES)
def test_an_exp_whose_output_was_normalised_in_place_keeps_its_own_counts(options: dict) -> None:
    """SwAV's Sinkhorn: ``q = exp(s / eps)`` made 4 +inf; ``q /= q.sum()`` then made every element NaN in place.
    The report counts what the exp made, and reads it as an overflow (ops mode copied the tensor as it was at the
    check: 18 nan, unclassified)."""
    scenario = _case("hunt15_swav_sinkhorn_exp_under_no_grad").build()
    report = raised(scenario.run, *scenario.targets, **options)
    assert report.op == "aten.exp.default"
    assert (report.nan, report.posinf, report.neginf, report.numel) == (0, 4, 0, 18)
    assert report.cause is not None and report.cause.label == "exp-overflow"
