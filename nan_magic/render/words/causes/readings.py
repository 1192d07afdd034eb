"""The sentences of a cause: its hint (with the fix) and its evidence, written from its kind and numbers.

The diagnosis (``nan_magic.explain``) returns a :class:`Cause` holding its
kind (``label``), which reading of that kind (``reading``) and the plain
values it rests on (``facts``); each reading has one template here.
"""

from __future__ import annotations

import math

from nan_magic.locations import name_location
from nan_magic.plain import from_plain
from nan_magic.records import Cause, TensorRef, module_label
from nan_magic.render.words.causes.forward_ops import OP_READINGS
from nan_magic.render.words.causes.overflow import OVERFLOW_READINGS
from nan_magic.render.words.causes.phrases import Reading, counts, counts_phrase, event_of, fmt, what
from nan_magic.render.words.causes.without_op_rule import STEP_READINGS
from nan_magic.render.words.counted import counted
from nan_magic.render.words.lr_words import scheduler_words
from nan_magic.render.words.names import subject_label
from nan_magic.tensor_refs import op_function

__all__ = ["cause_evidence", "cause_hint", "hint_opens_sentence"]


def cause_hint(cause: Cause) -> str:
    """The one-line explanation of ``cause`` with its fix, lower case at its start."""
    hint = _reading(cause).hint(cause)
    absorbed = cause.fact("absorbed")
    if absorbed is not None:
        op, filename, lineno, _module, nan, posinf, neginf = absorbed
        made = counts_phrase(nan, posinf, neginf)
        hint += (
            f"; the {made} came from {op}{_at(filename, lineno)}, absorbed in forward (the branch torch.where "
            f"discarded still has a backward, and 0 · {'nan' if nan else 'inf'} is nan): compute that branch on "
            f"inputs where it is defined ({_safe_branch(op)} inside the torch.where) so that it stays finite"
        )
    return hint


#: The discarded branch computed on safe inputs, by the absorbed op's name (aten.<name>.<overload>).
_SAFE_BRANCHES = {
    "sqrt": "x.clamp_min(1e-12).sqrt()", "rsqrt": "x.clamp_min(1e-12).rsqrt()", "log": "x.clamp_min(1e-12).log()",
    "log2": "x.clamp_min(1e-12).log2()", "log10": "x.clamp_min(1e-12).log10()",
    "log1p": "x.clamp_min(-1 + 1e-6).log1p()", "exp": "x.clamp(max=80).exp()", "expm1": "x.clamp(max=80).expm1()",
    "pow": "x.clamp_min(1e-12) ** p", "div": "a / torch.where(b == 0, 1, b)",
    "reciprocal": "torch.where(x == 0, 1, x).reciprocal()",
    "acos": "x.clamp(-1 + 1e-7, 1 - 1e-7).acos()", "asin": "x.clamp(-1 + 1e-7, 1 - 1e-7).asin()",
    "atanh": "x.clamp(-1 + 1e-7, 1 - 1e-7).atanh()",
}


def _safe_branch(op: str) -> str:
    return _SAFE_BRANCHES.get(op_function(op), "the op's input masked to a safe value, e.g. torch.where(mask, x, 1)")


def cause_evidence(cause: Cause) -> tuple[str, ...]:
    """The facts ``cause`` rests on, one line each."""
    lines = _reading(cause).evidence(cause)
    absorbed = cause.fact("absorbed")
    if absorbed is not None:
        op, filename, lineno, module, nan, posinf, neginf = absorbed
        lines = (
            f"absorbed in forward: {op}{_at(filename, lineno)} (in {module_label(module)}) made "
            f"{counts_phrase(nan, posinf, neginf)} that no module output kept (torch.where or a saturating function "
            "discarded it); its backward multiplied it by a zero gradient",
            *lines,
        )
    rising = cause.fact("rising")
    if rising is not None:
        lines = (*lines, _growth(rising))
    return lines


def hint_opens_sentence(cause: Cause) -> bool:
    """Whether the hint starts with a common word, to be capitalised where it starts a sentence."""
    sentence = _reading(cause).sentence
    return sentence if isinstance(sentence, bool) else sentence(cause)


def _reading(cause: Cause) -> Reading:
    reading = _READINGS.get(cause.reading)
    if reading is None:
        raise ValueError(f"a cause {cause.label!r} has an unknown reading {cause.reading!r}")
    return reading


def _subject(cause: Cause) -> str:
    """The parameter or state tensor an optimizer reading is about (an older scene's: its words, as written)."""
    subject = cause.fact("subject")
    return subject if isinstance(subject, str) else subject_label(from_plain(TensorRef, subject))


def _counts(cause: Cause) -> str:
    return counts_phrase(cause.fact("nan", 0), cause.fact("posinf", 0), cause.fact("neginf", 0))


def _at(filename: str | None, lineno: int | None) -> str:
    return f" at {name_location(filename, lineno)}" if filename is not None and lineno is not None else ""


def _then(cause: Cause) -> str:
    """The reading the cause led to downstream, stored as its plain (label, reading, facts)."""
    label, reading, facts = cause.fact("then")
    downstream = Cause(label, reading, tuple(tuple(pair) for pair in facts))
    return f"then: {label}: {cause_hint(downstream)}"


def _growth(growth: tuple[str, float, int, float, float, int, int]) -> str:
    label, last, last_step, factor, median, first, rises = growth
    if rises == 1:
        return f"the {label} rose to {fmt(last)} at step {last_step}, {fmt(factor)}x its {fmt(median)} at step {first}"
    return (
        f"the {label} rose to {fmt(last)} at step {last_step}, {fmt(factor)}x its median {fmt(median)} since step "
        f"{first}, rising on each of the last {counted(rises, 'step')}"
    )


# -- upstream of the producer: an extreme batch, a diverging run (explain/diagnose.py) --


def _extreme_batch_hint(cause: Cause) -> str:
    event = event_of(cause)
    return (
        f"{_batch(cause)} entering {event.model or 'the model'} reached |x| = "
        f"{fmt(cause.fact('absmax'))} (> {fmt(cause.fact('bound'))}) in this step, and {what(event)} then became "
        f"{counts(event)}: normalise or clip the inputs (standardise features, log-scale heavy-tailed ones) before "
        "the model"
    )


def _batch(cause: Cause) -> TensorRef:
    """The batch tensor that held the extreme values (``input[0]``)."""
    return from_plain(TensorRef, cause.fact("batch"))


def _diverging_hint(cause: Cause) -> str:
    event = event_of(cause)
    decay = cause.fact("decay")
    if decay is not None:
        lr, weight_decay = decay
        return (
            f"{_growth(cause.fact('growth'))}; then {what(event)} became {counts(event)} in {event.phase} step "
            f"{event.step}: the optimizer's weight_decay={fmt(weight_decay)} with lr={fmt(lr)} multiplies the weights "
            f"by 1 - lr * weight_decay = {fmt(1 - lr * weight_decay)} at each step on its own: lower weight_decay "
            "(values from 1e-4 to 1e-1 are usual)"
        )
    return (
        f"{_growth(cause.fact('growth'))}; then {what(event)} became {counts(event)} in {event.phase} step "
        f"{event.step}: lower the learning rate (e.g. 10x), add warm-up, or clip gradients "
        "(torch.nn.utils.clip_grad_norm_)"
    )


# -- the optimizer step (explain/optimizer.py) --------------------------------------


def _step_facts(cause: Cause) -> tuple[str, ...]:
    lines = [
        f"phase optimizer: the {cause.fact('optimizer')} step made {_subject(cause)} {_counts(cause)}",
        f"dtype {cause.fact('dtype')}",
    ]
    lines += [f"{name} = {fmt(cause.fact(name))}" for name in ("lr", "eps") if cause.fact(name) is not None]
    return tuple(lines)


def _lr_hint(cause: Cause) -> str:
    lr, limit, dtype = cause.fact("lr"), cause.fact("limit"), cause.fact("dtype")
    if not math.isfinite(lr):  # a NaN or infinite lr makes every update non-finite, whatever the gradient
        what = f"{'NaN' if lr != lr else 'infinite'}, so every update lr · g is non-finite"
    elif lr >= limit:
        what = f"itself past the {dtype} max {fmt(limit)}, so an update of lr · g is non-finite for any |g| >= 1"
    else:
        what = (f"within {fmt(limit / lr)}x of the {dtype} max {fmt(limit)}, so an update of lr · g is non-finite "
                f"for any |g| >= {fmt(limit / lr)}")
    return (
        f"the {cause.fact('optimizer')} step made {_subject(cause)} {_counts(cause)} at step "
        f"{cause.fact('step')}: its learning rate lr = {fmt(lr)} is {what}; use a learning rate in the usual range "
        "(1e-5 to 1e-1), check how it is computed (a scheduler, a scaling rule)"
    )


def _lr_set_hint(cause: Cause) -> str:
    lr, name = cause.fact("lr"), cause.fact("name")
    what = ("not a number (0/0, inf - inf or 0 * inf in its formula)" if lr != lr
            else "infinite (a division by zero or an overflow in its formula)")
    return (
        f"the learning rate lr = {fmt(lr)} that the loop set before the {cause.fact('optimizer')} step comes from "
        f"{name}, set at line {cause.fact('line')}: {name} is {what}, so every update lr · g is non-finite and the "
        f"step made {_subject(cause)} {_counts(cause)} at step {cause.fact('step')}; find where its formula "
        "divides by zero or reads an inf (a warmup or decay over 0 steps, a ratio of zero norms) and keep it finite"
    )


def _lr_nonfinite_hint(cause: Cause) -> str:
    """A NaN or infinite rate no line of the loop was found to set: the scheduler's step that wrote it, or where
    nothing told, that it is not known (a rate given to the optimizer, a config's, a checkpoint's)."""
    lr = cause.fact("lr")
    what = "not a number" if lr != lr else "infinite"
    initial = cause.fact("initial_lr")
    if cause.reading == "optimizer-lr-scheduled" and initial is not None and not math.isfinite(initial):
        by = scheduler_words(cause.fact("scheduler"), cause.fact("last_epoch"), initial)
        where = (f", written by {by}: the rate it was built from is {fmt(initial)} already; give the scheduler a "
                 "finite rate (a max_lr, a range test's suggestion) and check where that number came from")
    elif cause.reading == "optimizer-lr-scheduled":
        by = scheduler_words(cause.fact("scheduler"), cause.fact("last_epoch"), initial)
        where = (f", written by {by}; find where its formula divides by zero or grows past the float max (a warm-up "
                 "or decay over 0 steps, a range test's factor compounded too long) and keep it finite")
    elif cause.fact("stored_line") is not None:
        text = cause.fact("stored_text")
        where = (f"; no name holds it, and no torch learning-rate scheduler's formula made it: the loop's code has one "
                 f"line that writes a group's \"lr\", line {cause.fact('stored_line')}{f' ({text})' if text else ''}"
                 ", where to look first (whether it ran before this step is not known: the rate may also have come "
                 "from a helper or the optimizer's own settings); keep it finite")
    else:
        where = ("; where it was set is not known (no torch learning-rate scheduler's formula made it, and no name in "
                 "the loop's code holds it): look for what writes its param_groups' \"lr\" (the rate given to the "
                 "optimizer, a helper, a config, a loaded checkpoint) and keep it finite")
    return (f"the {cause.fact('optimizer')} step made {_subject(cause)} {_counts(cause)} at step {cause.fact('step')}: "
            f"its learning rate lr = {fmt(lr)} is {what}, not a rate too high, so every update lr · g is non-finite "
            f"whatever the gradient{where}")


def _lr_nonfinite_evidence(cause: Cause) -> tuple[str, ...]:
    lr = cause.fact("lr")
    lines = (*_step_facts(cause), f"lr {fmt(lr)} is {'not a number' if lr != lr else 'infinite'}")
    if cause.fact("stored_line") is not None:
        return (*lines, f"the loop's one line that writes a group's \"lr\": line {cause.fact('stored_line')}")
    if cause.reading == "optimizer-lr-scheduled":
        return (*lines, "set by " + scheduler_words(cause.fact("scheduler"), cause.fact("last_epoch"),
                                                    cause.fact("initial_lr")))
    return lines


def _lr_evidence(cause: Cause) -> tuple[str, ...]:
    lr, limit, dtype = cause.fact("lr"), cause.fact("limit"), cause.fact("dtype")
    if lr >= limit:
        last = f"lr {fmt(lr)} >= {dtype} max {fmt(limit)}"
    elif lr == lr:
        last = f"lr {fmt(lr)} >= {dtype} max {fmt(limit)} / {cause.fact('margin'):g}"
    else:
        last = f"lr {fmt(lr)} is not a number"
    return (*_step_facts(cause), last)


def _wide_state_overflow_hint(cause: Cause) -> str:
    scaled = cause.fact("loss_scaled")
    if scaled is not None:
        loss, step, outputs, batch, earlier, earlier_loss = scaled
        before = f" ({fmt(earlier_loss)} at step {earlier})" if earlier is not None else ""
        return (
            f"{_subject(cause)} overflowed {cause.fact('dtype')} (max {fmt(cause.fact('limit'))}) in the "
            f"{cause.fact('optimizer')} step while its parameter stayed finite, from gradients of about 1e19 or "
            f"more: the loss was {fmt(loss)} in step {step}{before} while the model's outputs stayed within "
            f"{fmt(outputs)}{f' and its batch within {fmt(batch)}' if batch else ''}, so the loss's own code after "
            "the model made it (and "
            "the gradients) this large: a division by a near-zero number (a noise schedule's alpha_bar.sqrt(), a "
            "std, a count), a weight or a scale; find that term and bound it (clamp the divisor), clipping the "
            "gradients only hides it"
        )
    return (
        f"{_subject(cause)} overflowed {cause.fact('dtype')} (max {fmt(cause.fact('limit'))}) in the "
        f"{cause.fact('optimizer')} step while its parameter stayed finite: a state that squares the gradient "
        "passes the max only with finite gradients of about 1e19 or more; that parameter's update is 0 from now on "
        "(a division by inf); clip the gradients (torch.nn.utils.clip_grad_norm_) and find what made them this large "
        "(a loss scaled up, a learning rate, an input far out of range)"
    )


def _state_overflow_hint(cause: Cause) -> str:
    return (
        f"{_subject(cause)} overflowed {cause.fact('dtype')} (max {fmt(cause.fact('limit'))}) in the "
        f"{cause.fact('optimizer')} step, e.g. a squared gradient above the limit: keep optimizer state in float32 "
        "(float32 master weights under torch.autocast)"
    )


def _update_overflow_hint(cause: Cause) -> str:
    return (
        f"the {cause.fact('optimizer')} update of {_subject(cause)} overflowed {cause.fact('dtype')} "
        f"(max {fmt(cause.fact('limit'))}): keep float32 master weights"
    )


def _eps_zero(cause: Cause) -> str:
    subject = _subject(cause)
    return (
        f"where a gradient of {subject} is 0 (a parameter this batch did not use: an embedding row, a padded "
        f"position) that is 0/0, giving {_counts(cause)}"
    )


def _eps_shown(cause: Cause) -> str:
    eps = cause.fact("eps")
    return fmt(eps) if eps is not None else "1e-8 (the default)"


def _eps_zero_hint(cause: Cause) -> str:
    return (
        f"the {cause.fact('optimizer')} step divides by sqrt(v) + eps with eps = 0: {_eps_zero(cause)}; "
        f"use eps = {_default_eps_shown(cause)}"
    )


def _default_eps_shown(cause: Cause) -> str:
    default = cause.fact("default_eps")
    return f"{fmt(default)} (the default)" if default is not None else "1e-8 (Adam's default)"


def _eps_rounds_hint(cause: Cause) -> str:
    dtype = cause.fact("dtype")
    fix = ("keep float32 master weights (float32 parameters under torch.autocast with a GradScaler) or use "
           "eps >= 1e-4 in float16") if dtype == "float16" else f"use an eps that {dtype} holds"
    return (
        f"the {cause.fact('optimizer')} step divides by sqrt(v) + eps, and eps = {_eps_shown(cause)} rounds to 0 "
        f"in {dtype} (smallest positive {fmt(cause.fact('smallest'))}): {_eps_zero(cause)}; {fix}"
    )


def _step_unmatched_hint(cause: Cause) -> str:
    return (
        f"the {cause.fact('optimizer')} step made {_subject(cause)} {_counts(cause)} from finite gradients in "
        f"{cause.fact('dtype')}; no rule of the checklist matches"
    )


def _loop_write_hint(cause: Cause) -> str:
    return (
        f"the loop's own code (no optimizer) wrote {_subject(cause)} {_counts(cause)} in {cause.fact('dtype')}, "
        "after backward() or after the optimizer step; running that code's recorded ops again did not make it (a "
        "value they read was changed in place afterwards, or it ran where nothing records), so no op is named: "
        "rerun with ops=True (%%nantrace --ops) to name it"
    )


def _loop_write_facts(cause: Cause) -> tuple[str, ...]:
    return (f"phase optimizer: code outside any optimizer made {_subject(cause)} {_counts(cause)}",
            f"dtype {cause.fact('dtype')}")


# -- the GradScaler (hot/checks/optimizer/step_checks.py) ---------------------------------------------------


def _scaler_hint(cause: Cause) -> str:
    return (
        f"the GradScaler skipped {counted(cause.fact('skipped'), 'step')} in a row and its scale fell to "
        f"{cause.fact('scale'):g}: the gradients are non-finite at any scale; find the backward producer named here"
    )


def _scaler_evidence(cause: Cause) -> tuple[str, ...]:
    return (f"{cause.fact('skipped')} consecutive skipped steps", f"scale {cause.fact('scale'):g}")


_READINGS: dict[str, Reading] = {
    **STEP_READINGS,
    **OP_READINGS,
    **OVERFLOW_READINGS,
    "optimizer-lr": Reading(_lr_hint, _lr_evidence),
    "optimizer-lr-scheduled": Reading(_lr_nonfinite_hint, _lr_nonfinite_evidence),
    "optimizer-lr-nonfinite": Reading(_lr_nonfinite_hint, _lr_nonfinite_evidence),
    "optimizer-lr-set": Reading(_lr_set_hint, lambda cause: (
        *_step_facts(cause), f"from {cause.fact('name')}, set by the loop at line {cause.fact('line')}")),
    "optimizer-state-overflow": Reading(_state_overflow_hint, _step_facts, sentence=False),
    "optimizer-state-overflow-wide": Reading(_wide_state_overflow_hint, _step_facts, sentence=False),
    "optimizer-update-overflow": Reading(_update_overflow_hint, _step_facts),
    "optimizer-eps-zero": Reading(
        _eps_zero_hint, lambda cause: (*_step_facts(cause), "eps = 0: sqrt(v) + eps is 0 where v is 0")
    ),
    "optimizer-eps-rounds": Reading(
        _eps_rounds_hint,
        lambda cause: (*_step_facts(cause), f"{cause.fact('dtype')} cannot hold eps = {_eps_shown(cause)}"),
    ),
    "optimizer-unmatched": Reading(_step_unmatched_hint, _step_facts),
    "loop-write-unmatched": Reading(_loop_write_hint, _loop_write_facts),
    "extreme-batch": Reading(
        _extreme_batch_hint,
        lambda cause: (f"batch {_batch(cause)}: |x| up to {fmt(cause.fact('absmax'))}", _then(cause)),
        sentence=False,
    ),
    "diverging": Reading(_diverging_hint, lambda cause: (_growth(cause.fact("growth")), _then(cause))),
    "grad-scaler-collapse": Reading(_scaler_hint, _scaler_evidence),
}
