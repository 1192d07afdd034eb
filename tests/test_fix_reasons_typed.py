"""A fix trial's reason is data: its kind and the values it rests on (a Note); render/words/fix_reasons.py writes it.

``FixTrial.untried`` was an English sentence the fix trials wrote (issue 25, item 5). It is now the sentence of
``FixTrial.reason``, with the same words a user saw; a scene written before keeps its sentence and shows it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_fixes import LogOf, _make, _train, _trial

import nan_magic
from nan_magic.fixes.loss import unjudged
from nan_magic.plain import from_plain, to_plain
from nan_magic.records import FixTrial, Note, Phase, Report
from nan_magic.scene.dump import SCENE_VERSION

#: Each reason with varying words, as its Note and the sentence the trials wrote before reasons were data.
_SAID_BEFORE = [
    (Note.of("time-budget", seconds=2.0), "the time budget (2 s) was spent"),
    (Note.of("time-budget", seconds=0.3141), "the time budget (0.31 s) was spent"),
    (Note.of("scale-at-most-one", scale=0.5), "the scale (0.5) is 1 or less: there is no lower one to try"),
    (Note.of("lr-not-finite", lr=float("nan")), "the learning rate is nan: a tenth of it is too"),
    (Note.of("optimizer-not-rebuilt", problem="'params'"), "the optimizer could not be rebuilt on copies ('params')"),
    (Note.of("loss-code-not-rerun", reason=Note("no-loss-code-recorded").pair),
     "the loss code could not be run again: none was recorded"),
    (Note.of("loss-code-not-rerun", reason=Note("loss-code-untraced").pair),
     "the loss code could not be run again: the loss code ran more ops a step than the watch records"),
    (Note.of("outputs-unknown", grads=1, paths=2), "the last step's loss code read 1 tensors that required "
     "gradients, and the model call returned 2: which output each was is not known"),
    (Note.of("another-model-nonfinite", model="Generator"), "the loss code read the non-finite output of another "
     "model's call (Generator), which the trial does not replay on its outputs"),
    (Note.of("loss-code-raised", error="RuntimeError"), "the loss code raised RuntimeError on the replayed outputs"),
    (Note.of("hand-backward", function="LogFn"), "the loss code calls LogFn, a custom autograd.Function: the trial "
     "runs again the ops its forward ran, whose derivative is torch's, not LogFn.backward's, so its backward is not "
     "the step's: the trial cannot tell"),
    (Note.of("fused-declined", why="written", form="log_softmax"), "the softmax the line takes the log of (or its "
     "input) was written in place after it was computed, so log_softmax of its input is no longer the line's value: "
     "fusing it would change what the line computes"),
    (Note.of("fused-declined", why="differs", form=None), "the fused form of the value's input is not the line's own "
     "value where that is finite: fusing it would change what the line computes"),
    (Note.of("max-does-not-cancel", moved="output", name="output[0]", change=0.123456, every=False),
     "it changes what the line computes: exp(x - max) is exp(x) / exp(max), and the max does not cancel here (the exp "
     "is not normalised by its own sum, as a softmax's is): with the exp multiplied by 8 or 16 the model's output "
     "output[0] moved by 0.123; a log of the exp's sum needs the max added back (torch.logsumexp), a ratio or a "
     "scale has no max to take out: clamp the exponent"),
    (Note.of("max-does-not-cancel", moved="buffer", name="norm.mean", change=2.0, every=True),
     "it changes what the line computes: exp(x - max) is exp(x) / exp(max), and the max does not cancel here in at "
     "least one of the modules that run the line (an edit of it changes each one's use; the max cancels only out of "
     "an exp normalised by its own sum, as a softmax's is): with the exp multiplied by 8 or 16 the buffer norm.mean "
     "moved by 2; a log of the exp's sum needs the max added back (torch.logsumexp), a ratio or a scale has no max "
     "to take out: clamp the exponent"),
    (Note.of("weight-decay-too-high", decay=5.0), "at a tenth of the learning rate, lr * weight_decay is still 5: "
     "the decay alone multiplies each parameter by -4 a step, and the run diverges again (the weight decay is the "
     "setting to lower)"),
    (Note.of("no-state-before-update", step=1), "no state was kept after step 1, before the previous update (fewer "
     "than two optimizer steps ended finite): there is no update to redo"),
    (Note.of("kept-state-lacks", step=3, parameter="0.weight"), "the state kept after step 3 does not hold 0.weight"),
    (Note.of("gradients-overwritten", step=4, judged=5), "the gradients of step 4 are gone: the step was judged at "
     "step 5, whose backward wrote non-finite ones over them (made from the non-finite parameters; a watch with "
     "defer=False judges each step at once and keeps them)"),
    (Note.of("float32-refused", error="RuntimeError", message="expected scalar type Half", dtype=None),
     "the code after the producer's line refused its float32 result (RuntimeError: expected scalar type Half): it "
     "meets tensors still in half precision there, so the line cannot be computed in float32 alone; that code would "
     "need float32 too (or autocast over the region)"),
    (Note("no-last-good-state"), "no last good state was kept (%%nantrace --keep-last-good, %nanwatch on "
     "--keep-last-good or watch(..., keep_last_good=True) keeps the state the step is redone from)"),
]


@pytest.mark.parametrize(("reason", "words"), _SAID_BEFORE, ids=[note.kind for note, _ in _SAID_BEFORE])
def test_a_reason_reads_as_the_trials_wrote_it(reason: Note, words: str) -> None:
    trial = FixTrial("lr", reason=reason)
    assert trial.untried == words
    assert from_plain(FixTrial, to_plain(trial)) == trial  # (a scene keeps it as plain data)


def test_a_loss_not_computed_reads_inside_the_trials_line() -> None:
    # step_facts keeps why the loss code did not run as the reason's pair; its outcome line says its words.
    trial = FixTrial("eps", finite=True, facts=(("stepped", True), ("backward_from", "ones"), (
        "loss_not_computed", Note("ops-mode-loss-code").pair)))
    text = _text(trial)
    assert ("loss not computed: ops mode traces the loss code as it runs, and keeps no record of it to run again (a "
            "watch without the op tracer records it, so that its trials can run it again) (the backward started from "
            "ones into the model's outputs)") in text


def test_a_reason_of_a_later_version_reads_as_its_kind_and_never_raises() -> None:
    trial = FixTrial("eps", reason=Note.of("from-a-later-version", budget=3))
    assert trial.untried == "from-a-later-version: budget 3"
    assert "not tried: from-a-later-version" in _text(trial)


@pytest.mark.parametrize("reason", [Note("time-budget"), Note.of("time-budget", budget="two"),
                                    Note.of("fixes-no-loss-code", reason=("nothing-to-change", "not facts"))],
                         ids=["value-missing", "value-mistyped", "nested-reason-malformed"])
def test_a_known_reason_whose_values_are_not_its_words_reads_as_found_and_never_raises(reason: Note) -> None:
    trial = FixTrial("eps", reason=reason)
    assert trial.untried is not None and trial.untried.startswith(reason.kind)
    assert f"not tried: {reason.kind}" in _text(trial)
    report = Report(Phase.FORWARD, "fc", "Linear", 3, 1, 0, 0, 4, fixes=(trial,))
    assert json.loads(report.to_json())["fixes"][0]["untried"].startswith(reason.kind)


def test_a_real_trial_keeps_its_reason_as_a_kind_and_the_same_words() -> None:
    report = _train(_make(LogOf))
    stable = _trial(report, "stable")
    assert stable.finite is None and stable.reason == Note("nothing-to-change")
    assert stable.untried == "it found nothing to change at the producer's line"
    assert "stable: the log of a softmax" in report.to_text() and (
        "-> not tried: it found nothing to change at the producer's line") in report.to_text()


def test_a_judge_that_cannot_tell_says_so_as_a_kind() -> None:
    assert unjudged(None, None, "ones", deliberate=True) == Note("deliberate-infinities")
    assert unjudged(Note("loss-code-untraced"), "loss", "model") is None  # (no loss code ran: its verdict stands)


def test_a_version_7_scene_whose_reasons_were_sentences_still_shows_them(tmp_path) -> None:
    report = _train(_make(LogOf), dump=str(tmp_path))
    assert report is not None and report.scene is not None
    data = torch.load(report.scene, weights_only=True)
    plain = dict(data["report"])
    # As version 7 wrote a trial: its reason the sentence itself, and a loss not computed as its words.
    old_trial = {key: value for key, value in to_plain(_trial(report, "stable")).items() if key != "reason"}
    old_trial.update(untried="it found nothing {as written} to change", facts=(
        *old_trial["facts"], ("loss_not_computed", "a reason {as written} then")))
    plain["fixes"] = (old_trial,)
    data["version"], data["report"] = 7, plain
    old = tmp_path / "version_7_scene.pt"
    torch.save(data, old)
    (trial,) = nan_magic.load_scene(old).report.fixes
    assert trial.reason == Note.of("said", text="it found nothing {as written} to change")
    assert trial.untried == "it found nothing {as written} to change"
    assert "-> not tried: it found nothing {as written} to change" in _text(trial)
    finite = dataclasses.replace(trial, reason=None, finite=True)
    assert "loss not computed: a reason {as written} then" in _text(finite)


def test_the_json_report_keeps_the_reason_and_its_words() -> None:
    # (a reader of the JSON without nan_magic read the sentence as ``untried``: it still does)
    report = Report(Phase.FORWARD, "fc", "Linear", 3, 1, 0, 0, 4, fixes=(
        FixTrial("lr", reason=Note.of("kept-state-lacks", step=1, parameter="fc.weight")),))
    (fix,) = json.loads(report.to_json())["fixes"]
    assert fix["reason"] == {"kind": "kept-state-lacks", "facts": [["step", 1], ["parameter", "fc.weight"]]}
    assert fix["untried"] == "the state kept after step 1 does not hold fc.weight"


def _text(trial: FixTrial) -> str:
    return Report(Phase.FORWARD, "fc", "Linear", 3, 1, 0, 0, 4, fixes=(trial,)).to_text()


def test_a_scene_of_a_newer_version_opens_with_one_warning_that_says_so(tmp_path) -> None:
    report = _train(_make(LogOf), dump=str(tmp_path))
    assert report is not None and report.scene is not None
    data = torch.load(report.scene, weights_only=True)
    data["version"] += 1
    newer = tmp_path / "newer_scene.pt"
    torch.save(data, newer)
    said = rf"written by a newer nan_magic \(scene version {SCENE_VERSION + 1}; this one reads up to {SCENE_VERSION}\)"
    with pytest.warns(UserWarning, match=said):
        scene = nan_magic.load_scene(newer)
    assert scene.report.step == report.step and scene.report.op == report.op
