"""The fix trials audited as a reviewer would (fixes-s33): 13 incidents (tests/fixes_s33_cases.py) where a remedy
could come out finite and be wrong or useless, each in the default, deferred, per-call (``mode="full"``), traced
(``ops=True``) and traced-deferred watch.

A trial verified is one whose remedy, applied by hand (the suggested edit) to a fresh copy of the same model and
batch, gives the trial's loss and trains on finite for 12 steps; a remedy that cannot help is never verified; the
user's model, optimizer, gradients, BatchNorm statistics, generators and data after the trials are bit for bit those
of a run that tried none (``fixes=False``); each trial takes under 5 s. One verdict was false and is fixed: a square
(``x ** 2``, ``x.pow(2)``) that overflowed bfloat16 on a large negative operand read "eps: the operand of pow clamped
to at least 0.00781 -> verified" and suggested ``.clamp_min(0.0078).pow(2)``, which replaces -1e30 by 0.0078: a whole
power has no domain to clamp into. The std of a batch of one taken with correction=0 read "verified" and no more,
where every gradient is 0 and nothing ever trains by hand: it now says so. One stays false (strict xfail): the only
sample of a class left out at step 0.
"""

from __future__ import annotations

import ast
import random
from typing import Any

import numpy
import pytest
import torch
from fixes_s33_cases import CASES
from test_fixes_s29 import _same, _state  # (the user's state, read bit for bit)

import nan_magic
from nan_magic.records import FixTrial, Report
from nan_magic.render.edits import suggested_edit

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]  # (conftest.py: small models, torch on one thread)

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}

#: incident -> the one trial kind verified (the others never are).
VERIFIED = {
    "guarded-mean": "eps",  # (x / count.clamp_min(eps), the user's torch.where after it: the same training)
    "nan-input-adam": "skip-batch",  # (no lr trial: the NaN is the data's)
    "eval-batchnorm-log": "eps",  # (BatchNorm in eval mode: its running statistics untouched by the trials)
    "dropout-sqrt": "eps",  # (dropout: the replay draws the step's own mask, the user's generator untouched)
    "helper-scope": "eps",  # (the clamp in the helper, where its operand p is in scope)
    "half-exp-12": "float32",  # (exp(12) overflows float16, not float32)
    "std-of-one": "stable",  # (std(correction=0) of one sample: verified, and said that nothing trains)
}
#: incidents no remedy fixes: float32 of an exp(100) or a 1e60 (inf in float32 too), a square of -1e30, a NaN in
#: Adam's second moment (no trial: the parameters were already NaN), log(1 + sum exp) (the max-subtracted form
#: changes its value).
NONE = ("half-exp-still-inf", "bf16-pow", "negative-square", "adam-state-nan", "null-class")
#: (incident, mode): the skip-batch trial judged on the model's outputs alone (the event came before the loss code)
#: reads "verified", where the user's per-class mean of the class whose only sample was left out is 0 / 0.
ONLY_POSITIVE_FALSE = {("only-positive-bad", mode) for mode in ("default", "full", "ops", "ops-defer")}


def run(name: str, mode: str, **options: Any) -> tuple[Report, dict[str, Any]]:
    model, opt, loop, data = CASES[name]()
    random.seed(1)
    numpy.random.seed(1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode], **options):
        loop()
    return caught.value.report, _state(model, opt, data)


def _trial(report: Report, kind: str) -> FixTrial:
    found = [trial for trial in report.fixes if trial.kind == kind]
    assert found, (kind, [trial.kind for trial in report.fixes], [note.text for note in report.note_facts])
    return found[0]


def _by_hand(name: str) -> list[float]:
    """The incident with the suggested edit written in, 12 steps: each step's loss."""
    model, opt, _loop, data = CASES[name](fixed=True, steps=0)
    losses = []
    for step in range(12):
        if name == "nan-input-adam":
            batch, targets = (data["x"] if step >= 3 else data["x"].nan_to_num()), data["y"]
            keep = torch.isfinite(batch).flatten(1).all(1)
            loss = torch.nn.functional.mse_loss(model(batch[keep]), targets[keep])
        else:
            loss = _loss_of(name)(model, data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(bool(parameter.isfinite().all()) for parameter in model.parameters())
    return losses  # (std-of-one: the same loss at every step)


def _loss_of(name: str) -> Any:
    from fixes_s30_cases import mse
    from fixes_s33_cases import guarded_loss
    return guarded_loss if name == "guarded-mean" else mse


_FALSE_SKIP = pytest.mark.xfail(strict=True, reason=(
    "the bad sample is the only one of its class: leaving it out is judged on the model's outputs alone where the "
    "event came before the loss code (step 0, ops mode), and reads 'verified'; by hand the user's per-class mean is "
    "0 / 0. Judging skip-batch only with a loss would unverify every step-0 and ops-mode bad-batch row (24 tests "
    "say they are verified): a product decision"))


@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(name, mode, marks=[_FALSE_SKIP] if (name, mode) in ONLY_POSITIVE_FALSE else [])
    for name in CASES for mode in MODES])
def test_only_a_remedy_that_works_by_hand_is_verified_and_the_user_state_is_untouched(name: str, mode: str) -> None:
    options = {"keep_last_good": True}
    report, state = run(name, mode, **options)
    for trial in report.fixes:
        assert trial.finite is not True or trial.kind == VERIFIED.get(name), (name, mode, trial)
        assert trial.seconds < 5.0, trial
    if name in VERIFIED:
        trial = _trial(report, VERIFIED[name])
        assert trial.finite is True, (name, mode, trial, [note.text for note in report.note_facts])
        edit = suggested_edit(trial)
        assert edit is not None
        code = edit if name == "nan-input-adam" else edit.split(": ", 1)[1]
        ast.parse(code.split("  (")[0])  # (a line that runs: Python, whole)
        losses = _by_hand(name)
        assert all(numpy.isfinite(losses)) and (losses[-1] != losses[0]) is (trial.fact("no_gradient") is None)
        if trial.loss is not None:
            step = 3 if name == "nan-input-adam" else 0
            assert trial.loss == pytest.approx(losses[step], rel=1e-3), (trial.loss, losses)
    elif name in NONE or name == "only-positive-bad":
        assert not any(trial.finite for trial in report.fixes), report.fixes
        assert "suggested edit" not in report.to_text()
    _untried, untried_state = run(name, mode, fixes=False, **options)
    assert [key for key in state if not _same(state[key], untried_state[key])] == []


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["negative-square", "bf16-pow"])
def test_a_whole_power_that_overflowed_gets_no_clamp_of_its_operand(name: str, mode: str) -> None:
    """``(h * 0 - 1e30).pow(2)`` in bfloat16. Was: "eps: the operand of pow clamped to at least 0.00781 (the bfloat16
    machine eps) -> verified" with ``.clamp_min(0.0078).pow(2)`` suggested: -1e30 replaced by 0.0078. A whole power
    is defined everywhere: no clamp is tried (float32 is, and says it is still inf)."""
    report, _state_after = run(name, mode)
    assert not any(trial.finite for trial in report.fixes), report.fixes
    assert "clamp_min" not in report.to_text()
    assert _trial(report, "float32").finite is False


@pytest.mark.parametrize("mode", list(MODES))
def test_a_remedy_after_which_nothing_gets_a_gradient_says_so(mode: str) -> None:
    """``(h - h.mean(0)) / (h.std(0) + 1e-5)`` on a batch of one: the std divides by N - 1 = 0. Was: "stable: the std
    taken with correction=0 -> verified: the step came out finite" and nothing more; by hand (12 steps) the output is
    0 whatever h is, every gradient 0, the loss 1.147 at every step: nothing trains. Now the verdict says so, as a
    clamp that moved every value does (verified, listed after the others, "hidden, not fixed")."""
    report, _state_after = run("std-of-one", mode)
    trial = _trial(report, "stable")
    assert trial.finite is True and trial.fact("no_gradient") is True, trial
    text = " ".join(report.to_text().split())
    assert "but with it no trained parameter gets any gradient on this step (every one 0): finite because nothing " \
           "flows back" in text
    losses = _by_hand("std-of-one")
    assert len(set(losses)) == 1


@pytest.mark.parametrize("mode", ["default", "defer"])
@pytest.mark.parametrize("name", ["guarded-mean", "dropout-sqrt", "helper-scope"])
def test_a_remedy_that_trains_does_not_say_nothing_trains(name: str, mode: str) -> None:
    report, _state_after = run(name, mode)
    assert _trial(report, VERIFIED[name]).fact("no_gradient") is None
    assert "nothing flows back" not in report.to_text()
