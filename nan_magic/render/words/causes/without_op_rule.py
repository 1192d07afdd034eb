"""The sentences of a cause found without an op rule: the batch, a parameter, a backward, an unknown op.

explain/diagnose.py gives these readings for an event of phase data, a
parameter that was already non-finite, a backward through a function whose
derivative has a pole, and a module or loss whose op is not known.
"""

from __future__ import annotations

from nan_magic.records import Cause, Phase, Report, TensorRole
from nan_magic.render.words.causes.phrases import (
    Reading,
    counts,
    fmt,
    inputs_or_counts,
    line,
    on_event,
    rerun_for_op,
    where,
    zeros_phrase,
)

__all__ = ["STEP_READINGS"]

#: Each function whose derivative has a pole (explain/diagnose.py names it): the derivative, and the fix.
_POLES = {
    "sqrt": ("the derivative of sqrt, 1/(2·sqrt(x)), is infinite at x = 0, reached by sqrt",
             "add eps inside the sqrt (torch.sqrt(x + 1e-12)) or clamp x to >= eps"),
    "acos": ("the derivative of acos, -1/sqrt(1 - x²), is infinite at x = ±1, reached by acos",
             "clamp to [-1 + 1e-7, 1 - 1e-7] (a clamp to [-1, 1] still lets ±1 through)"),
    "asin": ("the derivative of asin, 1/sqrt(1 - x²), is infinite at x = ±1, reached by asin",
             "clamp to [-1 + 1e-7, 1 - 1e-7] (a clamp to [-1, 1] still lets ±1 through)"),
    "log": ("the derivative of log, 1/x, is infinite at x = 0, reached by log",
            "clamp to eps before the log (x.clamp_min(1e-12)) or use log_softmax"),
    "div": ("the derivative of a/b, -a/b², is infinite at b = 0, reached by a division",
            "add eps to the divisor or clamp it (b.clamp_min(1e-12))"),
    "pow": ("the derivative of x**p for p < 1 is infinite at x = 0, reached by pow",
            "add eps to the base (x + 1e-12) ** p or clamp it"),
    "norm": ("the derivative of a norm, x/‖x‖, divides by 0 at a zero vector, reached by a norm",
             "add eps inside (torch.sqrt((x**2).sum(-1) + 1e-12)) or clamp the norm"),
    "std": ("the derivative of std divides by the std, 0 at a constant input, reached by std",
            "add eps inside (torch.sqrt(x.var() + 1e-5))"),
    "exp": ("the derivative of exp is exp(x), which overflows for large x, reached by exp",
            "clamp its input (x.clamp(max=20): a probability ratio exp(logp - old_logp), a scale); only where the "
            "exp is normalised by its own sum (a softmax) or its sum is logged, subtract the max first (logsumexp)"),
    "eigh": ("the derivative of eigenvectors divides by the gaps between eigenvalues, 1/(λi - λj), infinite where "
             "two are equal (a repeated or degenerate eigenvalue: a zero or identity-like matrix), reached by eigh",
             "use only the eigenvalues where you can (their derivative has no pole), or break the tie: add a small "
             "distinct diagonal (a + 1e-6 · diag(arange(n)))"),
    "svd": ("the derivative of singular vectors divides by the gaps between squared singular values, "
            "1/(σi² - σj²), infinite where two are equal (a repeated singular value: a rank-deficient matrix), "
            "reached by svd",
            "use only the singular values (torch.linalg.svdvals) where you can, or add a small distinct diagonal"),
    "qr": ("the derivative of Q (and R) solves with R, whose diagonal holds a 0 where the matrix is rank deficient (a "
           "zeroed or repeated column: a pruned weight), reached by qr",
           "keep the matrix full rank (re-initialise zeroed columns, or add a small diagonal: a + 1e-6 · I); to keep "
           "a weight orthogonal, torch.nn.utils.parametrizations.orthogonal needs no QR of it"),
    "xlogy": ("the derivative of xlogy(x, y) = x·log(y) in y, x/y, is infinite at y = 0 (0/0 where x is 0 too: xlogy "
              "keeps the forward finite there, not its gradient), reached by xlogy",
              "compute x · log_softmax(logits) for an entropy, or clamp y to eps first (y.clamp_min(1e-12))"),
    "gamma": ("the derivative of a Gamma (or Dirichlet) sample in its concentration is not finite at a "
              "concentration of 0 (the Gamma function's pole), reached by rsample",
              "keep the concentration away from 0: softplus(x) + 1e-3 rather than a bare softplus or exp, which "
              "underflow to 0"),
}

#: Where a backward turns a finite gradient non-finite: the checklist to give when the op is unknown.
_DERIVATIVE_POLES = (
    "derivatives are infinite for sqrt, pow(x, p<1) and norms at 0, log and 1/x at 0, acos/asin at ±1, "
    "eigenvectors and singular vectors at repeated values"
)


def _benign_hint(event: Report, cause: Cause) -> str:
    return (
        f"benign: the program handles {event.tensor} of {where(event)} ({counts(event)}: a GradScaler skip "
        "or a deliberate infinity); nothing to fix unless it keeps coming back"
    )


def _benign_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return event.notes or (f"{event.tensor}: {counts(event)}",)


def _handled_hint(event: Report, cause: Cause) -> str:
    steps, last = cause.fact("steps", 1), cause.fact("last_step")
    since = f"; so did {steps - 1} later steps' batches, the last at step {last}" if steps > 1 else ""
    return (
        f"benign: the batch carried {counts(event)} in {event.tensor} that "
        f"{event.model or event.module_type or 'the model'} handled (its outputs, the loss, the gradients and the "
        f"parameters stayed finite){since}; nothing to fix: a model that imputes its missing values does this"
    )


def _handled_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    first, last = event.step, cause.fact("last_step")
    return (
        f"{event.tensor} entering {event.model or event.module_type or 'the model'}: {counts(event)} of "
        f"{event.numel} at step {first}",
        f"handled in {cause.fact('steps', 1)} step(s)" + (f", steps {first} to {last}" if last != first else ""),
    )


def _bad_batch_hint(event: Report, cause: Cause) -> str:
    first = f" (first at index {event.first_bad_index})" if event.first_bad_index else ""
    if _given_gradient(event):  # out.backward(gradient): the loop computed it outside the graph
        return (
            f"the {event.tensor} already held {counts(event)} of {event.numel}{first}: check the code that computed "
            "it (advantages or returns normalised by a std of one sample, a gradient received from another stage)"
        )
    if event.module is None:  # no model's input: a tensor the loss code read (the targets, or a weight it was given)
        return (
            f"{event.tensor}, read by the code after the model call (the loss), already held {counts(event)} of "
            f"{event.numel}{first}: the data was bad before the loss read it; check how the targets and whatever "
            "else the loss is given were made (a missing label stored as NaN, a corrupt record, a class weight "
            "1 / count of a class with no sample)"
        )
    return (
        f"{event.tensor} entering {event.model or 'the model'} already held {counts(event)} of "
        f"{event.numel}{first}: the batch was bad before the model ran; check the loader and preprocessing "
        "(a standardisation by a zero std, a log of a zero feature, a corrupt record)"
    )


def _given_gradient(event: Report) -> bool:
    """Whether the event's tensor is a gradient the loop gave backward() (backward/gradient_checks.py's note)."""
    return any(note.kind == "given-gradient" for note in event.note_facts)


def _bad_batch_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    when = "when backward() was called with it" if _given_gradient(event) else "before any watched module ran"
    return (
        f"phase data: {event.tensor} held {counts(event)} {when}",
        *(f"earlier warning at step {warning.step}: {warning.message}" for warning in event.warnings
          if warning.kind in ("extreme-input", "constant-feature")),
    )


def _parameter_hint(event: Report, cause: Cause) -> str:
    # Read by a forward, or found after optimizer steps that cannot have made it (step_checks.py: phase data).
    seen = f"when {where(event)} read it" if event.phase != Phase.DATA else f"after step {event.step}"
    if event.tensor.role is TensorRole.BUFFER:
        # No optimizer writes a buffer, and none of the user's checkpoints holds a good one where the module's
        # constructor computed it (a noise schedule's log of its 0 at t = 0): where it was computed is the fix.
        return (
            f"{_held(event)} already held {counts(event)} {seen}: no watched step wrote it, so it was computed so "
            "before (in the module's __init__: a schedule's log of a 0, a division by a count of 0) or loaded or "
            "set by hand; find where it was computed and make it finite there, or reload it"
        )
    return (
        f"{_held(event)} already held {counts(event)} {seen}: it became non-finite outside every watched step "
        "(a checkpoint load, a manual edit, an unwatched optimizer); reload it from a good checkpoint and find "
        "what wrote it"
    )


def _held(event: Report) -> str:
    """The parameter or buffer by its name; optimizer state as ``state exp_avg_sq of fc.weight``."""
    return str(event.tensor) if event.tensor.role is TensorRole.OPTIMIZER_STATE else str(event.tensor.name)


def _pole_hint(event: Report, cause: Cause) -> str:
    function = cause.fact("function")
    derivative, fix = _POLES[function]
    absorbed = cause.fact("absorbed")
    if absorbed is not None and absorbed[4] and not absorbed[5] + absorbed[6]:
        # The forward made NaN only (a sqrt or log of a negative), not an infinity: its input was outside the
        # function's domain, which says nothing about the pole at 0; the absorbed sentence after this one gives the fix
        # (an eps added inside would not: the inputs are negative).
        return (f"{function} at {line(event)} read inputs outside its domain in forward, and its backward gave "
                f"{counts(event)} ({event.op})")
    return f"{derivative} at {line(event)}{zeros_phrase(event)}: its backward gave {counts(event)} ({event.op}); {fix}"


def _unwatched_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.tensor} was {counts(event)} when the optimizer was about to step; the backward that "
        "computed it was not watched (or code after it changed it)"
    )


def _backward_hint(event: Report, cause: Cause) -> str:
    if event.unlocated:
        return (f"a backward made a non-finite gradient that no check saw and no replay made again, so its producer "
                f"is unknown ({rerun_for_op(event)}); {_DERIVATIVE_POLES}")
    if event.autograd_node is not None:
        detail = f"in the backward of {event.autograd_node} ({event.op} at {line(event)})"
    elif event.op is not None:
        detail = f"in {event.op}"
    else:
        detail = f"(the op is unknown: {rerun_for_op(event)})"
    return (
        f"the backward of {where(event)} turned a finite gradient into {counts(event)} in {event.tensor} "
        f"{detail}; {_DERIVATIVE_POLES}"
    )


def _loss_hint(event: Report, cause: Cause) -> str:
    finite = ("" if not event.inputs_finite else " while every watched module output it read was finite (some "
              "it could not read)" if event.outputs_unread else " while every watched module output was finite")
    if event.nan and not event.posinf + event.neginf:
        readings = (
            "a mean over an empty selection (every target ignore_index, an empty mask: 0/0), or a domain "
            "error in the loss code (log or sqrt of a negative, 0·log(0))"
        )
    else:
        readings = "a log of a zero probability (-log 0), or an overflow in the loss code (exp, a huge square)"
    return f"the loss was {counts(event)}{finite}: {readings}; {rerun_for_op(event)}"


def _module_hint(event: Report, cause: Cause) -> str:
    readings = [f"an overflow of {event.dtype} (max {fmt(cause.fact('limit'))})"] * cause.fact("overflows")
    zeros = [str(ref) for ref, stats in event.input_stats if stats.zeros]
    if zeros:
        readings.append(f"a division by zero or a log of zero ({', '.join(zeros)} held zeros)")
    negatives = [str(ref) for ref, stats in event.input_stats if stats.negatives]
    if event.nan and negatives:
        readings.append(f"a log, sqrt or pow of a negative ({', '.join(negatives)} held negatives)")
    return (
        f"{where(event)} made {counts(event)} in {event.tensor}"
        + (f"; readings that fit: {'; '.join(readings)}" if readings else "")
        + f"; the op is unknown: {rerun_for_op(event)}"
    )


def _tensor_counts(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.tensor}: {counts(event)}",)


def _tensor_counts_of(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.tensor}: {counts(event)} of {event.numel}",)


STEP_READINGS: dict[str, Reading] = {
    "benign": on_event(_benign_hint, _benign_evidence, sentence=False),
    "bad-batch": on_event(_bad_batch_hint, _bad_batch_evidence, sentence=False),
    "handled-input": on_event(_handled_hint, _handled_evidence, sentence=False),
    "parameter-nonfinite": on_event(_parameter_hint, _tensor_counts_of, sentence=False),
    "derivative-pole": on_event(
        _pole_hint, lambda event, cause: (f"autograd node {event.autograd_node}", *_tensor_counts(event, cause))
    ),
    "gradient-unwatched": on_event(_unwatched_hint, _tensor_counts, sentence=False),
    "backward-unmatched": on_event(_backward_hint, lambda event, _cause: (
        () if event.unlocated else (f"phase backward: {event.tensor} {counts(event)} of {event.numel}",)
    )),
    "loss-unknown-op": on_event(_loss_hint, lambda event, _cause: (
        f"loss: {counts(event)}",
        f"inputs finite: {event.inputs_finite}" + (" (of the outputs read)" if event.outputs_unread else ""),
    )),
    "module-unknown-op": on_event(_module_hint, inputs_or_counts,
                                 sentence=lambda event: event.module is None and event.source is not None),
}
