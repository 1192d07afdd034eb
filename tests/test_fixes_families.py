"""The fix trials held honest across the incident families of the contract table (fixes23's sweep).

Each row is a contract case whose cause has a remedy. Its report's trial says verified or not; the row then
applies the trial's own suggested edit BY HAND to the case's source (the line written into the module's code,
the module run again from that code) and runs the same steps watched with ``fixes=False``: a verified remedy
must train on finite, one that is not must still fail, or the trial must say why it could not tell. Each in
the default and the deferred mode.

The sweep found the trials or their edits unfaithful in these ways, each a row here: an edit of the line's
first call only, where the trial changed every call of the line (``-torch.log(-torch.log(u))``); a float32
edit that left a tensor method's receiver (``logvar.exp()``) in float16; a trial of the producing module alone,
where the line runs in every layer (an attention helper, a repeated block) and the edit changes them all; a
trial that ran on the input the failing forward had already written in place, or on the NaN weights a
``functional_call`` had swapped in, or without the input's ``requires_grad`` that a reentrant checkpoint builds
its graph from; a failure that only the backward's stand-in for an uncomputed loss made, or a loss code's
recorded ``autograd.grad`` backward, or an optimizer that needs a closure, each said plainly.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from contract import (
    MODE_OPTIONS,
    Case,
    gaps16,
    gaps21,
    holdout_incidents,
    hunt14,
    hunt16,
    hunt17,
    hunt19,
    hunt20_runs,
    hunt21,
    hunt22,
)

import nan_magic
from nan_magic.fixes import runner
from nan_magic.records import FixTrial, Report
from nan_magic.render.edits import suggested_edit

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

MODES = ["default", "defer"]


def _case(module: types.ModuleType, name: str) -> Case:
    return next(case for case in module.CASES if case.name == name)


def _report(module: types.ModuleType, name: str, mode: str) -> Report:
    scenario = _case(module, name).build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(
            *scenario.targets, **MODE_OPTIONS[mode], **scenario.options):
        scenario.run()
    return caught.value.report


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


def _by_hand(module: types.ModuleType, name: str, trial: FixTrial, mode: str) -> Report | None:
    """The case run again from its module's source with ``trial``'s suggested edit written at its line, watched
    with the trials off: its report, or None where every step came out finite."""
    edit = suggested_edit(trial)
    assert edit is not None, trial
    found = re.match(r"^(?P<path>.+?):(?P<line>\d+): (?P<code>.*)$", edit)
    assert found is not None, edit
    source = Path(module.__file__ or "")
    assert source.name == Path(found["path"]).name, (edit, source)
    lines = source.read_text().splitlines()
    old = lines[int(found["line"]) - 1]
    indent = old[: len(old) - len(old.lstrip())]
    code = found["code"]
    if code.startswith("with ") and "): " in code:  # ``with torch.autocast(...): line``: the block on its own line
        head, body = code.split("): ", 1)
        code = f"{head}):\n{indent}    {body}"
    lines[int(found["line"]) - 1] = indent + code
    edited = types.ModuleType(module.__name__)
    edited.__file__ = str(source)
    exec(compile("\n".join(lines) + "\n", str(source), "exec"), edited.__dict__)
    scenario = _case(edited, name).build()
    try:
        with nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], **scenario.options, fixes=False) as watch:
            scenario.run()
    except nan_magic.NonFiniteError as error:
        return error.report
    return watch.report


#: (module, case, the remedy, whether it hides the NaN): the trial is verified (where every operand value was out of
#: the domain, ``moved_all`` says the remedy hides the NaN), and the edit by hand trains on.
VERIFIED = [
    # Every call of the line: the inner log's and the outer's.
    pytest.param(holdout_incidents, "holdout_gumbel_noise_log_of_zero", "eps", False, id="gumbel-both-logs"),
    # torch.log(p) ... torch.log(1 - p) on one line, under bfloat16 autocast.
    pytest.param(hunt16, "hunt16_bf16_autocast_log_of_one_minus_a_rounded_sigmoid", "eps", False,
                 id="bce-both-logs"),
    # An attention helper every layer calls: its softmax masked in both layers.
    pytest.param(hunt14, "hunt14_attention_helper_fully_masked_row", "mask", False, id="helper-every-layer"),
    # A block repeated, each given the parent's gain: sqrt(g * g) in both blocks (every gain 0: the clamp hides it).
    pytest.param(hunt22, "hunt22_parent_gain_passed_to_a_block_sqrt_backward_at_0", "eps", True,
                 id="block-every-copy"),
    # x /= x.norm(...) in the forward: the trial starts from the input as it was before the call wrote it.
    pytest.param(gaps21, "gaps21_forward_writes_its_input_from_step_1_blank_row_at_2", "eps", False,
                 id="input-written-in-place"),
    # MAML: the support call's trial with the model's own weights, not the query's NaN fast weights.
    pytest.param(hunt19, "hunt19_maml_inner_gradient_tiered", "eps", False, id="maml-functional-call"),
    # LBFGS: its step needs the closure the trial does not have; the step is judged without it, and says so (every
    # density 0: the clamp hides it).
    pytest.param(hunt17, "hunt17_lbfgs_closure_log_of_a_zero_density", "eps", True, id="lbfgs-closure"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("module", "name", "kind", "hides"), VERIFIED)
def test_a_verified_remedy_applied_by_hand_trains_on(module: types.ModuleType, name: str, kind: str, hides: bool,
                                                     mode: str) -> None:
    report = _report(module, name, mode)
    trial = _trial(report, kind)
    assert trial.finite is True and bool(trial.fact("moved_all")) == hides, trial
    assert _by_hand(module, name, trial, mode) is None


def test_a_trial_in_every_layer_says_so() -> None:
    report = _report(hunt14, "hunt14_attention_helper_fully_masked_row", "default")
    trial = _trial(report, "mask")
    assert trial.fact("modules") == "every"
    assert "at its line in every module that runs it, as an edit of the line does" in report.to_text()


def test_the_float32_edit_upcasts_the_tensor_a_method_is_called_on() -> None:
    report = _report(hunt21, "hunt21_autocast_float16_vae_exp_overflow", "defer")
    trial = _trial(report, "float32")
    assert trial.finite is True
    assert "logvar.float().exp()" in (suggested_edit(trial) or "")
    assert _by_hand(hunt21, "hunt21_autocast_float16_vae_exp_overflow", trial, "defer") is None


def test_a_backward_failure_from_a_stand_in_loss_says_the_trial_cannot_tell() -> None:
    """The default mode's forward event stops the step before its loss code: the VAE's own KL output stands for
    the loss (a millionth of it is the loss's term), and its float16 backward overflows. By hand the edit trains."""
    report = _report(hunt21, "hunt21_autocast_float16_vae_exp_overflow", "default")
    trial = _trial(report, "float32")
    assert trial.finite is False and trial.failed == "backward" and trial.fact("loss_code_not_run"), trial
    assert "the trial cannot tell whether the step with its own loss would be finite" in report.to_text()
    assert _by_hand(hunt21, "hunt21_autocast_float16_vae_exp_overflow", trial, "default") is None


@pytest.mark.parametrize("mode", MODES)
def test_a_reentrant_checkpoints_backward_is_tried_and_fails_as_by_hand(mode: str) -> None:
    """The block's input requires gradients again in the trial, and the block runs inline: sqrt's backward at 0
    is reached (before, the trial's backward skipped the block and said verified)."""
    report = _report(hunt16, "hunt16_reentrant_checkpoint_norm_of_a_blank_row", mode)
    trial = _trial(report, "eps")
    assert trial.finite is False and trial.failed == "backward", trial
    by_hand = _by_hand(hunt16, "hunt16_reentrant_checkpoint_norm_of_a_blank_row", trial, mode)
    assert by_hand is not None and by_hand.phase == "backward"


def test_a_loss_code_that_differentiates_cannot_tell() -> None:
    """R1 of log(sigmoid(D(x))): the loss code's autograd.grad backward is recorded as it ran (1 / 0), and runs so
    again: the trial's non-finite loss says nothing of the remedy, which by hand trains on."""
    report = _report(gaps16, "gaps16_r1_penalty_of_a_log_sigmoid", "defer")
    for kind in ("eps", "stable"):
        trial = _trial(report, kind)
        assert trial.finite is None and "the trial cannot tell" in (trial.untried or ""), trial
    assert _by_hand(gaps16, "gaps16_r1_penalty_of_a_log_sigmoid", _trial(report, "eps"), "defer") is None


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_step_that_needs_its_closure_is_left_out_and_said(mode: str) -> None:
    """LBFGS's step needs its closure, which the trial does not have: the trial is judged through the backward,
    and its line says no optimizer step was replayed (it raised TypeError before)."""
    report = _report(hunt17, "hunt17_lbfgs_closure_log_of_a_zero_density", mode)
    trial = _trial(report, "eps")
    assert trial.finite is True and trial.fact("stepped") is False and trial.error is None, trial
    assert "no optimizer step replayed" in report.to_text()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", ["eps", "group"])
def test_an_eps_set_in_a_group_mid_run_is_redone_as_it_ran_and_edited_where_it_is_set(change: str, mode: str) -> None:
    """The loop sets Adam's eps to 0 at step 3 (in every group, or in a group it adds). The redo starts from the
    last good state with the groups as the failing step ran them (it put back the old eps, and said the redo did
    not reproduce, or refused the added group); the edit goes where the group's eps is set: an eps given to the
    constructor, as the edit said before, changed nothing by hand."""
    scenario = hunt20_runs._changed_mid_run(change, 0.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(
            *scenario.targets, **MODE_OPTIONS[mode], keep_last_good=True):
        scenario.run()
    trial = _trial(caught.value.report, "eps")
    assert trial.finite is True and trial.fact("group_eps") is True, trial
    assert (suggested_edit(trial) or "").startswith("group['eps'] = 1.19e-7  (where your code sets a param group's eps")
    fixed = hunt20_runs._changed_mid_run(change, trial.fact("new_eps"))  # the edit, by hand
    with nan_magic.watch(*fixed.targets, **MODE_OPTIONS[mode], fixes=False) as watch:
        fixed.run()
    assert watch.report is None


@pytest.mark.parametrize("mode", MODES)
def test_a_lower_learning_rate_is_no_fix_where_the_weight_decay_alone_diverges(mode: str) -> None:
    """SGD with weight_decay=5e4 (a typo for 5e-4) diverges: redoing the previous update at a tenth of the
    learning rate made the failing step finite, but by hand at a tenth the run overflows two steps later (lr *
    weight_decay is still 500). The trial says the lower rate is no fix, and why."""
    scenario = hunt20_runs._weight_decay(5e4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(
            *scenario.targets, **MODE_OPTIONS[mode], keep_last_good=True):
        scenario.run()
    trial = _trial(caught.value.report, "lr")
    assert trial.finite is None and "lr * weight_decay is still 500" in (trial.untried or ""), trial
    fixed = hunt20_runs._weight_decay(5e4)  # the lower rate, by hand
    for group in fixed.targets[1].param_groups:
        group["lr"] /= 10
    with pytest.raises(nan_magic.NonFiniteError), nan_magic.watch(*fixed.targets, **MODE_OPTIONS[mode], fixes=False):
        fixed.run()


#: (module, case, the note's kind): a cause with a remedy, no trial: the report says why.
NO_TRIAL = [  # (a std of one sample, once here, gets correction=0 tried since fixes-s30: test_fixes_s30.py)
    pytest.param(hunt16, "hunt16_lars_trust_ratio_of_a_parameter_never_used", "fixes-optimizer-none", id="lars"),
    pytest.param(hunt19, "hunt19_nanmean_over_nan_coded_missing_targets", "fixes-batch-outside", id="nan-targets"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("module", "name", "kind"), NO_TRIAL)
def test_a_cause_with_a_remedy_and_no_trial_says_why(module: types.ModuleType, name: str, kind: str,
                                                     mode: str) -> None:
    report = _report(module, name, mode)
    assert not report.fixes
    assert kind in [note.kind for note in report.note_facts], report.note_facts
    assert "no fix was tried: " in report.to_text()


@pytest.fixture
def trials_counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every entry of the trials (runner.py's), counted."""
    calls: list[str] = []
    for name in ("fixes_for", "kept_fixes", "_optimizer_fixes", "try_fixes"):
        real = getattr(runner, name)

        def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(runner, name, counted)
    yield calls


#: The healthy twins of the families above.
TWINS = [
    pytest.param(hunt14, "hunt14_attention_helper_healthy", id="attention-helper"),
    pytest.param(hunt22, "hunt22_parent_gain_passed_to_a_block_abs_healthy", id="block-gain"),
    pytest.param(hunt19, "hunt19_maml_signed_root_with_eps_healthy", id="maml"),
    pytest.param(hunt21, "hunt21_autocast_vae_exp_in_float32_healthy", id="vae"),
    pytest.param(gaps21, "gaps21_forward_writes_its_input_from_step_1_healthy", id="input-written"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("module", "name"), TWINS)
def test_no_trial_runs_on_a_healthy_twin(module: types.ModuleType, name: str, mode: str,
                                         trials_counted: list[str]) -> None:
    scenario = _case(module, name).build()
    with nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], **scenario.options) as watch:
        scenario.run()
    assert watch.report is None and trials_counted == []
    # (The counter counts: the broken twin's trials pass through it.)
    if name.startswith("hunt22"):
        _report(hunt22, "hunt22_parent_gain_passed_to_a_block_sqrt_backward_at_0", mode)
        assert trials_counted
