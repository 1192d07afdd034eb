"""Why no remedy was tried at an event whose cause has one: the note the report carries instead of a silent nothing.

The trials change a producer's line (runner.py's candidates: a log, sqrt,
log1p, rsqrt, pow, division, acos, asin, atanh or logit; an exp; a softmax; a std or
variance of one element; a line in half precision), a model call's batch
(skip-batch), or an optimizer step (its learning rate, an Adam eps). An event
whose cause names a remedy of that table but whose producer none of them
reaches (an ``lgamma``, a division inside a hand-written optimizer, NaN targets read by
the loss code) would otherwise show no "Fixes tried" section and no word of
why: the note says which part of the table did not fit.
"""

from __future__ import annotations

import math

from nan_magic.records import Note, Phase, Report, TensorRole
from nan_magic.tensor_refs import op_function

__all__ = ["REMEDIED", "in_update_code", "none_fit", "update_code_note"]

#: The causes whose remedy is one a trial can make (issue 28's table): their events say why none was tried.
REMEDIED = frozenset({"division-by-zero", "log-domain", "sqrt-domain", "pow-domain", "exp-overflow",
                      "half-precision-overflow", "masked-softmax", "bad-input-data", "learning-rate-too-high",
                      "optimizer-eps-underflow", "grad-scaler-collapse", "empty-reduction"})


def none_fit(report: Report) -> Note | None:
    """The note for ``report``, whose producer no remedy fits, where its cause has one (else None: nothing to say)."""
    cause = report.cause.label if report.cause is not None else None
    if cause == "overflow" and report.phase == Phase.OPTIMIZER:
        # An optimizer state that squares the gradient overflowed (a diffusion loss of 1e27 at step 0): its cause
        # names clipping, which no trial makes; without the note the report had no word of fixes at all.
        return Note.of("fixes-optimizer-overflow", optimizer=report.optimizer or "optimizer")
    lr = report.optimizer_lr
    if report.phase == Phase.OPTIMIZER and lr is not None and not math.isfinite(lr) and not any(
            note.kind == "lr-made-by-loop" for note in report.note_facts):
        return Note.of("fixes-lr-nonfinite", lr=lr)  # (its cause, nonfinite-number, has no trial: say so)
    if cause not in REMEDIED:
        return None
    if any(note.kind == "lr-made-by-loop" for note in report.note_facts):  # (its op ran in the loop, not the step)
        return Note.of("fixes-update-code", op=report.op or "not named")
    if report.phase == Phase.OPTIMIZER:
        return _loop_write_note(report) or Note.of("fixes-optimizer-none", optimizer=report.optimizer or "optimizer",
                                                   cause=cause)
    if report.phase == Phase.DATA:
        return Note("fixes-batch-outside")
    return Note.of("fixes-none-fit", op=report.op or "not named")


def _loop_write_note(report: Report) -> Note | None:
    """Why no remedy was tried where the loop's own code, not an optimizer, wrote the parameter (an EMA teacher's
    update, a renormalisation by hand: localize/outside/loop_writes.py's notes), else None. The optimizer's trials
    (its learning rate, its eps) were never the remedy there, and saying they were contradicted the note above it."""
    kinds = {note.kind for note in report.note_facts}
    if "loop-wrote-after-step" in kinds:
        return Note.of("fixes-after-step-code", op=report.op or "not named")
    if "loop-wrote" in kinds:
        return update_code_note(report)
    return None


def in_update_code(report: Report) -> bool:
    """Whether the producer ran in the loop's code between ``backward()`` and the optimizer step (LARS's ``p.grad /=
    p.grad.norm()``, a clip by hand ``p.grad *= max_norm / total``): an op outside every module, no gradient formula
    (no autograd node), that wrote a parameter's gradient (localize/ops/origins.py's ``apply_op_finding``)."""
    return (report.phase == Phase.BACKWARD and report.module is None and report.autograd_node is None
            and report.op is not None and report.tensor.role is TensorRole.PARAMETER_GRADIENT)


def update_code_note(report: Report) -> Note:
    """Why no remedy was tried at a producer in the loop's update code (:func:`in_update_code`): the trials replay the
    step's forward, loss and backward, never the code after it; a division's eps is named, as not verified."""
    if op_function(report.op) in ("div", "reciprocal", "rsqrt"):
        return Note.of("fixes-update-divisor", op=report.op or "not named")
    return Note.of("fixes-update-code", op=report.op or "not named")
