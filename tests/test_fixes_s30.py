"""The fix trials audited as a demanding user would (fixes-s30): 18 new incidents of different causes
(tests/fixes_s30_cases.py), each in the default, deferred, per-call (``mode="full"``) and traced (``ops=True``) watch.

Each verdict is checked against the remedy applied by hand to a fresh copy of the same model and batch (its loss, and
whether the step came out finite), a remedy that cannot help is never verified, and the user's model, optimizer,
gradients, generators and data after the trials are compared bit for bit with a run that tried none
(``fixes=False``).
"""

from __future__ import annotations

from typing import Any

import pytest
from fixes_s30_cases import INCIDENTS, Incident
from test_fixes_s29 import _same, _state  # (the user's state, read bit for bit)

import nan_magic
from nan_magic.records import FixTrial, Report

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),  # (conftest.py: small models, torch on one thread)
              pytest.mark.filterwarnings("ignore:std\\(\\)")]  # (torch warns of a std of one sample)

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}}

#: (incident, mode) -> why the trial of its kind is not run there (a note says so), where it is honestly not.
NOT_RUN = {
    ("focal-of-zero", "ops"): "fixes-no-loss-code",  # (ops mode keeps no record of the loss code to run again)
    ("empty-mask", "ops"): "fixes-no-loss-code",
    ("empty-class", "ops"): "fixes-no-data-code",  # (1 / the counts the loop took of the targets: data code)
}


def run(incident: Incident, mode: str, **options: Any) -> tuple[Report, dict[str, Any]]:
    import random

    import numpy

    model, opt, loop, data = incident.build()
    random.seed(1)
    numpy.random.seed(1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode], **options):
        loop()
    return caught.value.report, _state(model, opt, data)


def trial_of(report: Report, kind: str) -> FixTrial:
    found = [trial for trial in report.fixes if trial.kind == kind]
    assert found, (kind, [trial.kind for trial in report.fixes], [note.text for note in report.note_facts])
    return found[0]


def _untouched(name: str, mode: str, state: dict[str, Any]) -> None:
    _untried, untried_state = run(INCIDENTS[name], mode, fixes=False)
    assert untried_state.keys() == state.keys()
    assert [key for key in state if not _same(state[key], untried_state[key])] == []


#: The incidents with tests of their own.
OWN_TESTS = ("half-matmul", "validation-nan")
WITH_REMEDY = [name for name, incident in INCIDENTS.items()
               if incident.kind is not None and incident.by_hand and name not in OWN_TESTS]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", WITH_REMEDY)
def test_the_verdict_is_the_remedy_by_hand_and_the_user_state_is_untouched(name: str, mode: str) -> None:
    incident = INCIDENTS[name]
    assert incident.kind is not None and incident.by_hand is not None
    report, state = run(incident, mode)
    if (name, mode) in NOT_RUN:
        assert NOT_RUN[name, mode] in [note.kind for note in report.note_facts]
        assert not any(trial.finite for trial in report.fixes)
    else:
        trial = trial_of(report, incident.kind)
        loss, finite = incident.by_hand()
        assert finite, f"{name}: the remedy by hand"
        assert trial.finite is True, (name, mode, trial, [note.text for note in report.note_facts])
        if trial.loss is not None:  # (a forward event's replay stops before the loss code in some modes: it says so)
            assert trial.loss == pytest.approx(loss, rel=1e-5)
        if incident.change is not None or trial.output_change is not None:
            assert trial.output_change == pytest.approx(incident.change, abs=1e-3)
        assert "verified" in str(report) and "verified" in report.to_html()
        assert trial.seconds < 5.0
    _untouched(name, mode, state)


WITHOUT_REMEDY = [name for name, incident in INCIDENTS.items()
                  if (incident.kind is None or not incident.by_hand) and name not in OWN_TESTS]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", WITHOUT_REMEDY)
def test_a_remedy_that_cannot_help_is_never_verified_and_the_user_state_is_untouched(name: str, mode: str) -> None:
    """A NaN learning rate, a NaN in a validation batch, an RNN that overflows, a head dim of 0, a std of one sample,
    an inf target: whatever is tried, no trial says verified unless its replay came out finite, and the trials leave
    the user's state as a run without them."""
    incident = INCIDENTS[name]
    report, state = run(incident, mode)
    for trial in report.fixes:
        assert trial.finite is not True or trial.kind == incident.kind, (name, mode, trial)
        if trial.finite is None:
            assert trial.untried, trial
    _untouched(name, mode, state)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_validation_batch_under_no_grad_is_replayed_forward_only(mode: str) -> None:
    """Was: skip-batch on a NaN in a validation batch (``with torch.no_grad(): model(val)``) replayed a training step
    of it: a backward from ones into the outputs and an SGD step ("stepped"), and said "the backward started from
    ones". Now: its forward alone, as it ran, and the report says so."""
    report, state = run(INCIDENTS["validation-nan"], mode)
    assert (report.phase.value, report.step) == ("data", 2)
    trial = trial_of(report, "skip-batch")
    assert trial.finite is True and trial.fact("dropped") == (2,)
    assert trial.fact("backward_from") == "no-grad" and trial.fact("stepped") is False and trial.loss is None
    text = " ".join(str(report).split())
    assert "its forward alone replayed: the call ran under no_grad and no loss code of its step was kept" in text
    assert "verified: the call's output came out finite" in text and "the step came out finite" not in text
    assert "started from ones" not in text
    assert "its forward alone replayed" in " ".join(report.to_html().split())
    _untouched("validation-nan", mode, state)


@pytest.mark.parametrize("mode", list(MODES))
def test_float32_at_a_half_library_layer_is_tried_in_every_mode(mode: str) -> None:
    """``model.half()``, its last nn.Linear overflowing float16: the producer's line is the one that called the model.
    Was: in the deferred watch, "float32: not tried: it found nothing to change at the producer's line" (the trial
    looked for the line among the frames that waited on it, the loop's ``opt.step()`` there), where the other modes
    tried it. Now tried in every mode; the deferred watch, which has the step's loss, says what that loss's backward
    does (float16 gradients overflow), as by hand."""
    report, state = run(INCIDENTS["half-matmul"], mode)
    assert (report.module, report.op, report.dtype) == ("2", "aten.addmm.default", "float16")
    trial = trial_of(report, "float32")
    assert trial.untried is None, trial.untried
    if mode == "defer":
        loss, _finite = INCIDENTS["half-matmul"].by_hand()  # (the whole model in float32: the same loss)
        assert (trial.finite, trial.failed) == (False, "backward") and trial.loss == pytest.approx(loss, rel=1e-5)
    else:  # (no loss at step 0's forward event: the backward started from ones, and the text says so)
        assert trial.finite is True and trial.fact("backward_from") == "ones"
        assert "the backward started from ones" in " ".join(str(report).split())
    _untouched("half-matmul", mode, state)


def _layer_two_in_float32() -> tuple[float, bool]:
    """The trial's remedy by hand: the half model's last layer computed in float32, its inputs upcast."""
    import torch.nn.functional as F
    from fixes_s30_cases import hand_step

    model, opt, _run, data = INCIDENTS["half-matmul"].build()
    return hand_step(model, opt, lambda: F.mse_loss(F.linear(
        model[1](model[0](data["x"])).float(), model[2].weight.float(), model[2].bias.float()), data["y"].float()))


@pytest.mark.xfail(strict=True, reason=(
    "At a forward event of step 0 the default, per-call and traced watches have no loss code to run (none ran "
    "before): the float32 trial's backward starts from ones and comes out finite, so it reads 'verified', where the "
    "step's own loss (1.7e9) overflows the float16 gradients behind the upcast layer, by hand and in the deferred "
    "watch. The text says the backward started from ones; a stand-in loss of the outputs' scale is not done."))
def test_float32_at_a_half_layer_is_not_verified_where_the_real_loss_overflows() -> None:
    assert _layer_two_in_float32()[1] is False
    report, _state = run(INCIDENTS["half-matmul"], "default")
    assert trial_of(report, "float32").finite is not True


@pytest.mark.parametrize("mode", ["default", "defer", "full"])
def test_a_weight_of_one_over_an_empty_class_count_gets_its_clamp_verified(mode: str) -> None:
    """``weight = 1.0 / torch.bincount(y)`` before ``model(x)``, read by the loss alone: a data event (made before the
    model call) whose inf enters no model. Was: "no fix was tried: the non-finite values did not enter through a
    model call's arguments ..." (per-call: "no model call of the failing step was kept"). Now: the eps at that line,
    run again ahead of the loss code, verified with the loss of ``counts.clamp_min(eps)`` by hand. (The counts are
    floats, ``.float()``: whole on this step is no proof of counts, so eps, not 1; session 31's review.)"""
    report, _state = run(INCIDENTS["empty-class"], mode)
    assert (report.phase.value, report.op, report.module) == ("data", "aten.reciprocal.default", None)
    trial = trial_of(report, "eps")
    loss, finite = INCIDENTS["empty-class"].by_hand()
    assert finite and trial.finite is True and trial.loss == pytest.approx(loss, rel=1e-6)
    text = " ".join(str(report).split())
    assert "weight = 1.0 / counts.clamp_min(1.2e-07)" in text
    assert "did not enter through a model call's arguments" not in text


@pytest.mark.parametrize("mode", list(MODES))
def test_an_inf_target_read_by_the_loss_alone_says_the_same_in_every_mode(mode: str) -> None:
    """An inf in the targets (no remedy the trials make: skip-batch leaves out a model call's samples). Was: the
    per-call and traced watches said "no model call of the failing step was kept to run again" (the steps' calls were
    kept); now every mode says what the tiered watch says: the values did not enter through a model call."""
    report, _state = run(INCIDENTS["bad-targets"], mode)
    assert report.fixes == ()
    kinds = [note.kind for note in report.note_facts]
    assert "fixes-batch-outside" in kinds and "fixes-no-call" not in kinds


@pytest.mark.parametrize("mode", list(MODES))
def test_a_std_over_one_sample_gets_correction_zero_verified(mode: str) -> None:
    """``h / (1 + h.std(0))`` on a batch of one: unbiased std, N - 1 = 0. Was: "no fix was tried: the producer's op
    (aten.std.correction) is not one a remedy changes", while the cause's own hint said "pass correction=0". Now
    that is tried, verified, and the edit written; the loss is the one of ``h.std(0, correction=0)`` by hand."""
    report, _state = run(INCIDENTS["one-sample-std"], mode)
    assert report.cause is not None and report.cause.reading == "corrected-one"
    trial = trial_of(report, "stable")
    loss, finite = INCIDENTS["one-sample-std"].by_hand()
    assert finite and trial.finite is True and trial.fact("form") == "correction=0"
    if trial.loss is not None:
        assert trial.loss == pytest.approx(loss, rel=1e-6)
    text = " ".join(str(report).split())
    assert "the std taken with correction=0" in text and "return h / (1 + h.std(0, correction=0))" in text
    assert "is not one a remedy changes" not in text


@pytest.mark.parametrize("mode", ["default", "defer", "full"])
def test_correction_zero_that_cannot_help_is_tried_and_not_finite(mode: str) -> None:
    """``(out - y) / out.std(0)`` in the loss code, a batch of one: correction=0 makes the std 0, and the division
    inf. By hand the loss is inf; the trial says so (not finite, at the loss), never verified."""
    report, _state = run(INCIDENTS["one-sample-std-loss"], mode)
    trial = trial_of(report, "stable")
    loss, finite = INCIDENTS["one-sample-std-loss"].by_hand()
    assert not finite and loss == float("inf")
    assert (trial.finite, trial.failed, trial.loss) == (False, "loss", loss)
    assert "still non-finite (loss)" in str(report)


def test_a_softplus_by_hand_gets_f_softplus_verified() -> None:
    """Was (a strict xfail): the stable trial subtracted the max, which changes what log(1 + exp(x)) computes (said,
    not verified); F.softplus(x), the form a person writes, was not tried. Now verified (fixes-s31)."""
    report, _state = run(INCIDENTS["exp-activation"], "default")
    assert INCIDENTS["exp-activation"].by_hand is not None and INCIDENTS["exp-activation"].by_hand()[1]
    assert any(trial.finite is True for trial in report.fixes)


@pytest.mark.xfail(strict=True, reason=(
    "model.half() with its last nn.Linear overflowing: the producer's line is the one that called the model, and "
    "the float32 trial upcast that layer's calls alone; the suggested edit casts the call's arguments "
    "(model(data['x'].float())), which by hand raises against the model's float16 weights. No edit of that line says "
    "the layer's upcast; none should be suggested, or model.float()"))
def test_the_float32_edit_at_a_half_models_call_line_runs_by_hand() -> None:
    from nan_magic.render.edits import suggested_edit

    report, _state = run(INCIDENTS["half-matmul"], "full")
    edit = suggested_edit(trial_of(report, "float32"))
    assert edit is None or "model(data['x'].float())" not in edit


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_the_ppo_advantage_std_of_a_batch_of_one_gets_its_healthy_twins_line(mode: str) -> None:
    """hunt15's PPO advantages standardised over a last mini-batch of one. Was: "no fix was tried: the producer's op
    (aten.std.correction) is not one a remedy changes" (test_fixes_families' NO_TRIAL). Now correction=0 is verified,
    and the edit is the healthy twin's own line."""
    from contract import hunt15
    from test_fixes_families import _report

    from nan_magic.render.edits import suggested_edit

    report = _report(hunt15, "hunt15_ppo_advantage_std_of_a_last_batch_of_one", mode)
    trial = trial_of(report, "stable")
    assert trial.finite is True and trial.fact("form") == "correction=0"
    edit = suggested_edit(trial)
    assert edit is not None and edit.endswith("adv = (adv - adv.mean()) / (adv.std(correction=0) + 1e-08)")
