"""A division by a spread that is 0 (fixes-s35): told from a count of nothing, its eps added, and each verdict checked
by hand (tests/fixes_s35_cases.py; the suggested edit written in, 12 steps of the user's loop).

Was: ``mean / std`` of values all equal read as "a sum over nothing divided by a count of nothing ... divide a sum by
count.clamp_min(1)" (a one-element 0 / 0 of finite operands is the same fact for both), and the eps trial clamped the
std, every value replaced, "verified ... the NaN is hidden, not fixed". Now the op's run reads what made the divisor
(its autograd node, or the loss code's recorded op: localize/ops/divisor.py) and the cause says a std, variance or norm
of 0; where it is 0 everywhere the trial adds eps to it (``std + eps``, as users write it: the quotient still depends on
it) and the edit says so. A trial whose backward started from ones (no loss code kept) and gave every parameter a
zero gradient said "no trained parameter gets any gradient ... hidden" of a z-score, whose centring maps ones to 0
though any real loss trains it: such a step is probed again from a seeded random direction (fixes/probe.py).
"""

from __future__ import annotations

import ast
import random
from typing import Any

import numpy
import pytest
from fixes_s30_cases import mse
from fixes_s35_cases import CASES, LOSSES
from test_fixes_s29 import _same, _state  # (the user's state, read bit for bit)
from test_fixes_s33 import _trial

import nan_magic
from nan_magic.records import Report
from nan_magic.render.edits import suggested_edit

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}
#: incident -> the spread its divisor is.
SPREADS = {"sharpe-holiday": "std", "zscore-zero-head": "std", "hand-rms-padding": "norm", "sharpe-root-var": "std",
           "dead-unit": "norm", "repeated-sample": "variance", "stuck-row": "std"}
_NO_NODE = pytest.mark.xfail(strict=True, reason=(
    "a std of the data inside a module (x.std(-1) of a batch no parameter went into) has no autograd node, so the "
    "cause reads 'divided by zero' and its hint names both readings ('if the divisor is a std ... add eps; if it is "
    "a count, clamp it to >= 1'); the trial clamps it (0 in one row of six) and is verified, and by hand it trains. "
    "Telling it needs the divisor's maker without autograd: a per-op record the op tracer does not keep"))
#: incidents whose producer runs inside a module (the others' in the model's forward too, but the Sharpe heads'
#: divisor is a 0-d std, read in full mode as a count of nothing: see _FULL).
_FULL = pytest.mark.xfail(strict=True, reason=(
    "mode='full' finds the producer by replaying the module's call under no_grad (localize/replay/module_run.py): the "
    "divisor has no autograd node there and no recorded op names its maker, so the cause reads as before ('a count "
    "of nothing' for a 0-d std, 'divided by zero' for a row's) and the trial clamps it; a grad-enabled module replay "
    "at the event is not done"))


def run(name: str, mode: str, **options: Any) -> tuple[Report, dict[str, Any]]:
    model, opt, loop, data = CASES[name]()
    random.seed(1)
    numpy.random.seed(1)
    try:
        with nan_magic.watch(model, opt, **MODES[mode], **options):
            loop()
    except nan_magic.NonFiniteError as error:
        return error.report, _state(model, opt, data)
    raise AssertionError(f"{name} ({mode}): no event")


def by_hand(name: str) -> list[float]:
    """The incident with the edit written in (``fixed``), 12 steps: each step's loss; every gradient finite."""
    model, opt, _loop, data = CASES[name](fixed=True, steps=0)
    loss_of = LOSSES.get(name, mse)
    losses = []
    for _step in range(12):
        opt.zero_grad()
        loss = loss_of(model, data)
        loss.backward()
        assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None), name
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(SPREADS))
def test_a_division_by_a_spread_of_zero_says_the_spread_not_a_count(name: str, mode: str, request: Any) -> None:
    if mode == "full":
        request.applymarker(_FULL)
    elif name == "stuck-row":
        request.applymarker(_NO_NODE)
    report, _state_after = run(name, mode)
    assert report.cause is not None and (report.cause.label, report.cause.reading) == (
        "division-by-zero", "spread-zero"), report.cause
    text = " ".join(report.to_text().split())
    assert f"divided by a {SPREADS[name]} of 0" in text and "count.clamp_min(1)" not in text, text[:600]
    assert f"the divisor is the output of a {SPREADS[name]} (its autograd node or recorded op), not a count" in text


@pytest.mark.parametrize("mode", list(MODES))
def test_an_empty_masks_count_still_reads_as_a_count_of_nothing(mode: str) -> None:
    """``(h * mask).sum() / mask.sum()`` of an empty mask: a divisor no spread made (no autograd node) is a count."""
    report, _state_after = run("empty-mask-pool", mode)
    assert report.cause is not None and report.cause.reading == "empty-quotient", report.cause
    assert "count.clamp_min(1)" in report.to_text()


#: incident -> (verified, the edit's form and its divisor, whether the verdict says nothing trains); each by hand too.
VERDICTS = {
    # (no returns, ever: by hand the loss stays 1.0 and no gradient flows; the verdict says so)
    "sharpe-holiday": (True, "add", "(daily.std() + 1.2e-07)", True),
    # (the z-score's eps: by hand the loss moves and every gradient is finite; was: clamp, "hidden, not fixed", and
    # in the default and traced watches, whose backward starts from ones, "no trained parameter gets any gradient")
    "zscore-zero-head": (True, "add", "(p.std() + 1.2e-07)", False),
    # (every ReLU dead: the norm's eps makes the step finite; by hand the head's bias trains)
    "dead-unit": (True, "add", "(norm + 1.2e-07)", False),
    # (a batch of one sample repeated: the variance's eps makes the step finite; by hand the output is 0 whatever the
    # weights, as it is for any edit: see NO_SIGNAL)
    "repeated-sample": (True, "add", "(var + 1.2e-07)", False),
    # (0 in one row of six: clamped as F.normalize does; by hand it trains)
    "stuck-row": (True, "clamp_min", "std.clamp_min(1.2e-07)", False),
    # (sqrt of a point's squared distance to itself, 0: its backward 0 / 0; the operand clamped, by hand it trains)
    "pair-spread": (True, None, "torch.sqrt(squared.clamp_min(1.2e-07))", False),
    # (an RMS scale by rsqrt of a padding row: its operand clamped; by hand it trains)
    "rsqrt-padding": (True, None, "torch.rsqrt(ms.clamp_min(1.2e-07))", False),
    # (sqrt(...) + eps: the sqrt's backward at 0 is still 0 / 0; by hand sqrt(... + eps) is the fix, which the hint
    # says: no trial moves the eps inside the sqrt, so none is verified)
    "hand-rms-padding": (False, None, None, False),
    "sharpe-root-var": (False, None, None, False),
}


#: incidents whose batch carries nothing to learn, whatever the edit: the Sharpe heads' data hold no returns at any
#: step, and a batch of one sample repeated standardises to 0 whatever the weights. By hand their loss cannot move.
NO_SIGNAL = ("sharpe-holiday", "sharpe-root-var", "repeated-sample")


@pytest.mark.parametrize("mode", ["default", "defer", "ops", "ops-defer"])
@pytest.mark.parametrize("name", list(VERDICTS))
def test_the_eps_verdict_of_a_spread_is_the_one_that_holds_by_hand(name: str, mode: str) -> None:
    report, state = run(name, mode, keep_last_good=True)
    verified, form, divisor, stuck = VERDICTS[name]
    trial = _trial(report, "eps")
    assert trial.finite is verified, trial
    text = " ".join(report.to_text().split())
    if verified:
        assert trial.fact("form") == form and trial.fact("moved_all") is None, trial
        assert (trial.fact("no_gradient") is True) is stuck, trial
        edit = suggested_edit(trial)
        assert edit is not None and divisor in edit and f"suggested edit (not applied): {edit}" in text
        ast.parse(edit.split(": ", 1)[1].strip())
    else:  # (the hint says where the eps goes)
        assert "suggested edit" not in text and "sqrt(var + eps)" in text
    losses = by_hand(name)
    assert numpy.isfinite(losses).all() and (len(set(losses)) == 1) is (name in NO_SIGNAL), losses
    _untried, untried_state = run(name, mode, fixes=False, keep_last_good=True)
    assert [key for key in state if not _same(state[key], untried_state[key])] == []
