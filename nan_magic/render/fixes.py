"""The "Fixes tried" section: each remedy's one line, its outcome and the section's title.

A trial's facts are plain values (records.FixTrial); the sentences are written here, the edit a verified one
stands for in render/edits.py.
"""

from __future__ import annotations

from nan_magic.fix_records import AFTER_THE_LOSS, BOUNDED_FUNCTIONS, SHIFTED_FUNCTIONS, UNIT_FUNCTIONS
from nan_magic.records import FixTrial, Report
from nan_magic.render.edits import suggested_edit
from nan_magic.render.words.causes.phrases import fmt
from nan_magic.render.words.counted import counted, ordinal
from nan_magic.render.words.fix_reasons import reason_words
from nan_magic.render.words.fix_verdicts import diverged_words, frozen_words, milliseconds, off_scale_words

__all__ = ["fix_description", "fix_lines", "fixes_text", "fixes_title"]

#: Where a replayed backward started without the loss (fixes/step.py), as the outcome says it.
_STARTS = {"ones": " (the backward started from ones into the model's outputs)",
           "output-gradient": " (the backward started from the gradient the step held for the model's outputs)"}


def fix_description(trial: FixTrial) -> str:
    """What the remedy changed, in one line."""
    if trial.fact("every_use"):  # (fixes/remedies/every_use.py: the same tensor clamped at its other uses too)
        inside = "the division" if trial.fact("function") in ("div", "reciprocal") else f"the {trial.fact('function')}"
        return (f"{_changed(trial)} at every use of that tensor on the line, as clamping it once where it enters the "
                f"line does (clamped inside {inside} alone, the step stayed non-finite)")
    if trial.fact("modules") == "every":  # (fixes/step.py, replay_at_line)
        return (f"{_changed(trial)}, at its line in every module that runs it, as an edit of the line does (in the "
                "producing module alone the step stayed non-finite)")
    return _changed(trial)


def _changed(trial: FixTrial) -> str:
    if trial.kind == "eps" and trial.fact("new_eps") is not None:
        return (f"the {trial.fact('optimizer')} step redone{_redone_from(trial)} with eps {fmt(trial.fact('eps'))} "
                f"-> {fmt(trial.fact('new_eps'))} (the parameters' dtype holds it)")
    if trial.kind == "float32":
        regions = trial.fact("autocast") or ()
        region = f" with autocast ({', '.join(regions)}) off" if regions else ""
        dtype = trial.fact("dtype")
        if dtype in ("float32", "float64"):
            # The op itself already ran in float32 (autocast's float32 list, or float32 operands): what the trial
            # changes is the line's other calls, which autocast may have run in half and whose rounding it fed.
            return (f"the producer's line computed in float32{region}: the op already ran in {dtype}, so this "
                    "tries the line's other calls in float32")
        return f"the producer's line computed in float32{region} (it ran in {dtype or 'autocast'})"
    if trial.kind == "eps":
        function, eps = trial.fact("function"), trial.fact("eps")
        if trial.fact("form") == "count":
            return "its denominator clamped to at least 1 (it holds counts: integers, 0 where nothing was counted)"
        where = "its denominator" if function in ("div", "reciprocal") else f"the operand of {function}"
        how = {"zeros": "its zeros replaced by", "add": "plus"}.get(trial.fact("form"), "clamped to at least")
        if function in BOUNDED_FUNCTIONS:
            how = f"clamped into [{'' if function in UNIT_FUNCTIONS else '-1 + '}eps, 1 - eps], eps ="
        if function in SHIFTED_FUNCTIONS:
            how = "clamped to at least -1 + eps, eps ="
        if eps is None:  # not tried: no operand was met to read a dtype from
            return f"{where} {how} its dtype's machine eps"
        return f"{where} {how} {fmt(eps)} (the {trial.fact('dtype')} machine eps)"
    if trial.kind == "stable":
        if trial.fact("form") == "log_softmax":
            return "the log of the softmax fused into log_softmax"
        if trial.fact("form") == "logsigmoid(-x)":
            return ("log(1 - sigmoid(x)) computed as F.logsigmoid(-x) (as F.binary_cross_entropy_with_logits does), "
                    "where the sigmoid rounded to 1")
        if trial.fact("form") in ("logsigmoid", "log_ndtr"):
            return f"the log of the {'sigmoid' if trial.fact('form') == 'logsigmoid' else 'normal CDF'} fused into " \
                f"{trial.fact('form')}"
        if trial.fact("form") == "logdet":
            return "the log of the determinant fused into logdet (a sum of logs, where the product underflows)"
        if trial.fact("form") == "softplus":
            return "the log(1 + exp(x)) computed as F.softplus(x), where the exp overflowed"
        if trial.fact("form") == "correction=0":
            return (f"the {trial.fact('function')} taken with correction=0 (over one element it is 0, where "
                    "correction=1 divides by N - 1 = 0)")
        if trial.fact("function") == "exp":
            return "the exp max-subtracted (exp(x - x.amax(-1, keepdim=True)))"
        return ("the log of a softmax, sigmoid, normal CDF or determinant fused into log_softmax, logsigmoid, log_ndtr "
                "or logdet")
    if trial.kind == "lr" and trial.fact("redone") == "previous":
        if trial.fact("lr") is None:
            return "the previous update redone at a tenth of the learning rate, then this step"
        return (f"the previous update (from the state after step {trial.fact('from_step')}) redone at a tenth of "
                f"the learning rate ({fmt(trial.fact('lr'))} -> {fmt(trial.fact('new_lr'))}), then this step")
    if trial.kind == "scale":
        tried = ", ".join(fmt(scale) for scale in trial.fact("tried") or ())
        return f"the GradScaler's scale {fmt(trial.fact('scale'))} lowered (tried {tried or 'none'})"
    if trial.kind == "lr":
        rates = f" ({fmt(trial.fact('lr'))} -> {fmt(trial.fact('new_lr'))})" if trial.fact("lr") is not None else ""
        return (f"the {trial.fact('optimizer') or 'optimizer'} step redone{_redone_from(trial)} at a tenth of its "
                f"learning rate{rates}")
    if trial.kind == "skip-batch":
        if trial.fact("left_out") is None:  # not tried: no sample could be left out
            return "the batch without its samples holding non-finite values"
        indices = trial.fact("dropped") or ()
        rows = f"row{'s' if len(indices) != 1 else ''} {', '.join(str(index) for index in indices)}"
        return (f"the batch without its {trial.fact('left_out')} of {counted(trial.fact('batch'), 'sample')} holding "
                f"non-finite values ({rows})")
    if trial.kind == "mask" and trial.fact("weights_off"):
        return ("nn.MultiheadAttention called with need_weights=False (torch's fused attention gives a fully masked "
                "row 0 where the weights' softmax gives NaN)")
    if trial.kind == "mask":
        return "the fully masked rows' output made 0 instead of NaN"
    return trial.kind


def _redone_from(trial: FixTrial) -> str:
    """Where an optimizer step's redo started: nothing where it was not tried (no state was kept to start from)."""
    return "" if trial.fact("from_step") is None else f" from the state after step {trial.fact('from_step')}"


def _outcome(trial: FixTrial, made: str = "NaN") -> str:
    """What the trial came to; ``made`` is what the producer made (an x/0 that made only infinities hid no NaN)."""
    if trial.finite is None and trial.fact("changes_value"):
        return f"not a fix, though the step came out finite: {trial.untried}"  # (fixes/remedies/stable.py)
    if trial.finite is None and trial.fact("frozen"):
        return frozen_words(trial.fact("frozen"), trial.loss, made, trial.fact("stepped"))
    if trial.finite is None and (trial.fact("diverged_before") or trial.fact("still_diverged")):
        return diverged_words(trial.fact("diverged_before"), trial.fact("still_diverged"), trial.loss)
    if trial.finite is None:
        return f"not tried: {trial.untried}"
    if not trial.finite:
        if trial.failed == "raised" and trial.error is not None:
            return f"the replay raised {trial.error[0]}: {trial.error[1]}"
        if trial.failed in AFTER_THE_LOSS and trial.fact("backward_from") == "ones" and trial.fact("before_loss_code"):
            # (The whole why, ``loss_not_computed``, stays in the trial's facts: the line says what the user needs.)
            return (f"still non-finite ({trial.failed}), but its backward started from ones into the model's outputs "
                    "(the failing step stopped before its loss code ran): the trial cannot tell whether the step "
                    "with its own loss would be finite")
        if trial.failed in AFTER_THE_LOSS and trial.fact("backward_from") == "ones":
            # A gradient of ones stands for a loss the trial could not compute: far larger than a mean loss's
            # (a float16 backward overflows on it), so a failure past the forward may be the stand-in's alone.
            why = reason_words(trial.fact("loss_not_computed")) or "none"
            return (f"still non-finite ({trial.failed}), but its backward started from ones into the model's outputs,"
                    f" standing for the loss (loss not computed: {why}): the "
                    "trial cannot tell whether the step with its own loss would be finite")
        if trial.failed in AFTER_THE_LOSS and trial.fact("loss_code_not_run"):
            return (f"still non-finite ({trial.failed}), but its backward started from the model's own scalar "
                    f"output, taken as the loss where the step's loss code did not run "
                    f"({reason_words(trial.fact('loss_code_not_run'))}): the trial cannot tell whether the step with "
                    "its own loss would be finite")
        if trial.failed == "next forward":
            return ("still non-finite a step later: the step came out finite, but the update it gave made the same "
                    "call's forward non-finite (the remedied line's gradient is too large to train on)")
        return f"still non-finite ({trial.failed or 'the step'})"
    # (A forward replayed alone proves the call's output finite, not a step the trial never ran.)
    backward_from, stand_in = trial.fact("backward_from"), model_only(trial)
    what = ("the call's output came out finite" if backward_from == "no-grad"
            else "the call's output and its step's loss came out finite" if backward_from == "no-grad-loss"
            else "its forward and a stand-in backward came out finite" if stand_in else "the step came out finite")
    verdict = ("finite but off the healthy scale, not verified as a fix" if trial.fact("off_scale")  # (scale_check.py)
               else "verified through the model only" if stand_in else "verified")
    parts = [f"{verdict}: {what}"]
    if trial.loss is not None:
        last = " (the last step's loss code and targets on this step's outputs)"
        parts.append(f"loss {fmt(trial.loss)}{last if trial.fact('loss_from') == 'last loss code' else ''}")
    elif trial.fact("loss_not_computed") and trial.fact("before_loss_code"):
        start = _STARTS.get(trial.fact("backward_from"), "")
        parts.append(f"no loss: the failing step stopped before its loss code ran{start}")
    elif trial.fact("loss_not_computed"):
        start = _STARTS.get(trial.fact("backward_from"), "")
        parts.append(f"loss not computed: {reason_words(trial.fact('loss_not_computed'))}{start}")
    if trial.output_change == 0:
        # "changed by at most 0" read as a hedge; a remedy in the loss code, or one that only replaces the NaN,
        # leaves every finite value of the model's output as it was.
        parts.append("the model's finite outputs unchanged")
    elif trial.output_change is not None:
        parts.append(f"the model's output changed by at most {fmt(trial.output_change)}")
    if trial.fact("moved_all"):
        what = "row was fully masked" if trial.kind == "mask" else "value of the operand was out of the domain"
        parts.append(f"but every {what} and was replaced: the output no longer depends on it (the {made} is hidden, "
                     "not fixed: look at why every value is there)")
    if trial.fact("over_eps") and not trial.fact("moved_all"):
        at, rest = trial.fact("over_eps")
        parts.append(f"but where the denominator was clamped the quotient is up to {fmt(at)} (at most {fmt(rest)} "
                     f"elsewhere): a non-zero value over 0 has no eps that fixes it, and values that large can "
                     f"outweigh the rest of the loss and its gradient (the {made} may be hidden, not fixed: look at "
                     "why the denominator is 0 there)")
    # (A quotient over eps is said with its own words below; the rest of what is off scale here.)
    off = [entry for entry in trial.fact("off_scale") or () if not (entry[0] == "op" and trial.fact("over_eps"))]
    if off:
        parts.append(off_scale_words(tuple(off), trial.fact("function") or trial.op, made, trial.kind))
    if trial.fact("inside"):
        many = trial.fact("inside") != 1
        parts.append(f"and it also moved {counted(trial.fact('inside'), 'value')} that {'were' if many else 'was'} "
                     f"inside the domain already, only nearer its edge than eps: it changes those healthy values too")
    if trial.fact("no_gradient"):
        parts.append(f"but with it no trained parameter gets any gradient on this step (every one 0): finite "
                     f"because nothing flows back (the {made} may be hidden, not fixed: look at why the result does "
                     "not depend on them)")
    if trial.fact("backward_from") == "no-grad":
        parts.append("its forward alone replayed: the call ran under no_grad and no loss code of its step was kept, "
                     "so no loss, backward or optimizer step")
    elif trial.fact("backward_from") == "no-grad-loss":
        parts.append("judged by its step's loss: the call ran under no_grad, so no backward or optimizer step runs "
                     "through it")
    elif not trial.fact("stepped"):
        parts.append("no optimizer step replayed")
    return ", ".join(parts)


def fix_lines(report: Report) -> list[tuple[FixTrial, str, str | None]]:
    """``(trial, its line, the suggested edit or None)`` for each trial, verified ones first."""
    lines = []
    made = "NaN" if report.nan or not report.nonfinite else "inf"
    for trial in report.fixes:
        try:
            said = f"{trial.description} -> {_outcome(trial, made)}"
        except Exception:  # (a sentence never costs the user the report: the verdict alone)
            said = f"-> {'verified: the step came out finite' if trial.finite else 'not a fix'}"
        text = f"{trial.kind}: {said} ({milliseconds(trial.seconds)} ms)"
        edit = suggested_edit(trial) if trial.finite and not trial.fact("off_scale") else None
        lines.append((trial, text, edit))
    return lines


def model_only(trial: FixTrial) -> bool:
    """A finite trial with no loss, whose backward started from ones standing for it: the model's forward and that
    backward came out finite, not the step with its own loss (a loss code that reads the outputs may still go NaN)."""
    return bool(trial.finite) and trial.loss is None and trial.fact("backward_from") == "ones"


def fixes_title(report: Report) -> str:
    # (A trial verified through the model only is a tally of its own: the step with its loss was never run.)
    through_model = sum(1 for trial in report.fixes if model_only(trial) and not trial.fact("off_scale"))
    verified = sum(1 for trial in report.fixes if trial.finite and not trial.fact("off_scale")) - through_model
    off = sum(1 for trial in report.fixes if trial.finite and trial.fact("off_scale"))
    # (a later model call's event, a micro-batch's, a siamese pair's 2nd or another model's: the trials replay that
    # call alone, and step on its gradients alone)
    later = report.model_call if isinstance(report.model_call, int) else 0
    alone = f"'s {ordinal(later)} model call alone" if later else ""
    skipped = "the step's other model calls were not replayed; " if later else ""
    return (f"Fixes tried on a replay of step {report.step}{alone} ({skipped}on copies: your model, optimizer and "
            f"data are untouched): {verified} of {len(report.fixes)} verified"
            f"{f', {through_model} through the model only (no loss of its own computed)' if through_model else ''}"
            f"{f', {off} finite but off the healthy scale' if off else ''}")


def fixes_text(report: Report) -> str:
    """The section in plain text; empty where no remedy was tried."""
    if not report.fixes:
        return ""
    lines = [fixes_title(report)]
    for _trial, text, edit in fix_lines(report):
        lines.append(f"  {text}")
        if edit:
            lines.append(f"      suggested edit (not applied): {edit}")
    return "\n".join(lines)
