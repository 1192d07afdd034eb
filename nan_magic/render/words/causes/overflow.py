"""The sentences of an overflow: an op that passed its dtype's largest finite value, and the signs that show it.

explain/overflow.py gives the dtype's max (``limit``), whether the op is a
matmul or an attention kernel, and the signs of the overflow as plain
tuples ``(kind, *numbers)``; each kind is written here.
"""

from __future__ import annotations

from typing import Any

from nan_magic.plain import from_plain
from nan_magic.records import Cause, Report, TensorRef, TensorRole, module_label
from nan_magic.render.words.causes.forward_ops import mask_phrase
from nan_magic.render.words.causes.phrases import (
    Reading,
    counts,
    counts_phrase,
    event_of,
    fmt,
    input_label,
    input_lines,
    inputs_or_counts,
    on_event,
    short_label,
    what,
    where,
)
from nan_magic.render.words.counted import counted
from nan_magic.tensor_refs import op_function

__all__ = ["OVERFLOW_READINGS"]

#: The attention kernel already scales by d**-0.5: what is left is the size of q and k themselves.
_ATTENTION_FIX = (
    "normalise q and k (QK-norm: a LayerNorm or RMSNorm on each) and find what grew them (the q/k projection "
    "weights: a learning rate too high, no gradient clipping)"
)


#: Ops that make a range of values from its end points (a number past the dtype's max is no mask value there).
_RANGES = ("arange", "linspace", "logspace", "range")


def _half_hint(event: Report, cause: Cause) -> str:
    fix = "compute it in float32 (cast its inputs, or keep it out of torch.autocast) or scale the inputs down"
    number = cause.fact("number")
    if number is not None and op_function(event.op or "") in _RANGES:
        # Positions or a grid made in the model's float16 (``torch.arange(seq_len, dtype=x.dtype)``): no mask value.
        fix = (f"it was asked for values up to {input_label(event, number[0])}, {fmt(number[1])}, past that max: "
               f"those past it are inf in {event.dtype}; make the range in float32 and cast what is computed from "
               "it (sinusoidal angles, a normalised grid) to the model's dtype")
    elif number is not None:
        fix = (f"the number it was given as {input_label(event, number[0])}, {fmt(number[1])}, is past that max and "
               f"becomes {'-' if number[1] < 0 else '+'}inf in {event.dtype}: use torch.finfo(dtype).min (or .max) "
               "for a mask value, or a number within the dtype's range")
    elif cause.fact("matmul"):
        fix += " (for attention, scale q by d**-0.5 before q·kᵀ)"
    elif cause.fact("attention"):
        fix += f" ({_ATTENTION_FIX})"
    infinite = event.posinf + event.neginf
    made = f"in {counted(infinite, 'element')}" if infinite else f"({counts(event)}: inf - inf inside the op)"
    return f"{what(event)} overflowed {event.dtype} (max {fmt(cause.fact('limit'))}) {made}{_reached(event)}; {fix}"


def _half_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (*_signs(cause), f"dtype {event.dtype}, finite limit {fmt(cause.fact('limit'))}",
            f"{event.tensor}: {counts(event)}", *input_lines(event))


def _wide_hint(event: Report, cause: Cause) -> str:
    limit = cause.fact("limit")
    far = cause.fact("far_operand")
    if far is not None:
        ref, operand, largest = far
        fix = (
            f"{short_label(event, from_plain(TensorRef, ref))} = {fmt(operand)} is {fmt(operand / largest)}x the "
            f"largest output the model made in this step ({fmt(largest)}), so the model did not grow it: find where "
            "that value comes from (a target or label in the batch that is corrupt or not normalised, a constant in "
            "the loss code) and fix or bound it there; the learning rate is not the cause"
        )
    elif cause.fact("attention"):
        fix = f"the scores q·kᵀ passed it: {_ATTENTION_FIX}"
    else:
        fix = (
            f"values this large are not a precision problem ({event.dtype} already holds {fmt(limit)}): find "
            "what grew them (a parameter or activation growing each step: lower the learning rate, clip "
            "gradients; inputs that are not normalised) and normalise or clip before this op"
        )
    if cause.fact("matmul") and far is None:
        fix += " (for attention, scale q by d**-0.5 before q·kᵀ and normalise q and k)"
    return (f"{what(event)} made {counts(event)}: it overflowed {event.dtype} (max {fmt(limit)}){_reached(event)}; "
            f"{fix}")


def _wide_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"dtype {event.dtype}, finite limit {fmt(cause.fact('limit'))}", *_signs(cause), *input_lines(event))


def _reached(event: Report) -> str:
    """``; its inputs reached |x| = 20 (`x`), 60 (`self.weight`)``: the op's operands in schema order, by the names
    the line gives them (else the schema's, ```self```, ```mat2```)."""
    inputs = [(ref, stats.absmax) for ref, stats in event.op_inputs if stats.absmax is not None]
    reached = ", ".join(f"{fmt(absmax)} ({short_label(event, ref)})" for ref, absmax in inputs)
    return f"; its inputs reached |x| = {reached}" if reached else ""


def _signs(cause: Cause) -> tuple[str, ...]:
    return tuple(_sign(cause, kind, *numbers) for kind, *numbers in cause.fact("signs", ()))


def _sign(cause: Cause, kind: str, *numbers: Any) -> str:
    event, limit = event_of(cause), cause.fact("limit")
    if kind == "arithmetic":
        return f"{numbers[0]} of finite operands makes inf (or inf - inf = NaN in a sum) only past {fmt(limit)}"
    if kind == "pow":
        return f"pow of a base without zeros makes inf only past {fmt(limit)}"
    if kind == "near":
        ref, absmax, near = numbers
        return (f"{_operand(event, ref)} reached |x| = {fmt(absmax)}, within {fmt(1 / near)}x of the "
                f"{event.dtype} max")
    if kind == "output-near":
        return f"the finite values of {event.tensor} reached |x| = {fmt(numbers[0])}, near the max"
    if kind == "square":
        ref, absmax, root = numbers
        return f"{_operand(event, ref)} reached |x| = {fmt(absmax)} > sqrt(max) = {fmt(root)}: its square overflows"
    if kind == "product":
        return f"the product of its largest operands, {fmt(numbers[0])} · {fmt(numbers[1])}, passes the max"
    if kind == "scores":
        query, key, dim, bound = numbers
        return (f"q·kᵀ·scale can reach |q|max · |k|max · sqrt(d) = {fmt(query)} · {fmt(key)} · sqrt({dim}) = "
                f"{fmt(bound)}, past the {event.dtype} max {fmt(limit)}: scores of +inf and -inf in a row make "
                "inf - inf = NaN in the softmax")
    if kind == "mask":
        return f"also: {mask_phrase(event, numbers[0])}; if NaN remain once q and k are small, look for such a row"
    raise ValueError(f"an overflow sign of an unknown kind {kind!r}")


def _operand(event: Report, ref: object) -> str:
    return short_label(event, from_plain(TensorRef, ref))


def _unmatched_hint(event: Report, cause: Cause) -> str:
    largest = max((stats.absmax for _ref, stats in event.op_inputs if stats.absmax is not None), default=None)
    size = f"; its inputs reached |x| = {fmt(largest)}" if largest is not None else ""
    return (
        f"{event.op or 'the op'} in {where(event)} made {counts(event)} in {event.tensor} from finite "
        f"{event.dtype} inputs{size}; no rule of the checklist matches"
    )


def _opens_with_the_loss(event: Report) -> bool:
    return event.tensor.role is TensorRole.LOSS and event.op is None


def _running_hint(cause: Cause) -> str:
    """A running statistic (optimizer/running_stats.py) past its dtype's max: what that says of the inputs."""
    statistic, dtype, limit, bound = (cause.fact(key) for key in ("statistic", "dtype", "limit", "bound"))
    what_made_it = (
        f"a running variance passes it only when a batch's variance does: inputs spread over more than "
        f"{fmt(bound)} (the square root of the max) reached this module" if "var" in statistic else
        f"a running mean passes it only with inputs of about {fmt(bound)} (the max itself)")
    when = ("in this step's forward" if cause.fact("read_before") else
            "in this step's forward, or before the watch began (it was non-finite at the first read)")
    return (
        f"the running statistic {statistic} of {module_label(cause.fact('module'), cause.fact('module_type'))} "
        f"overflowed {dtype} (max {fmt(limit)}) {when}, while training went on with the batch's own statistics: "
        f"{what_made_it}. In eval() it normalises by it (x / inf = 0: outputs that are "
        "the module's bias), or makes NaN. Find what made its inputs that large (an unnormalised batch, a layer "
        "before it that blew up), then reset_running_stats() or reload the statistics from a checkpoint"
    )


def _running_evidence(cause: Cause) -> tuple[str, ...]:
    """A running statistic's evidence: the buffer's (:func:`_buffer_evidence`), and the module's momentum."""
    momentum = cause.fact("momentum")
    return (*_buffer_evidence(cause), *(() if momentum is None else (f"momentum {fmt(momentum)}",)))


def _buffer_hint(cause: Cause) -> str:
    """A buffer of the user's that a forward writes (optimizer/running_stats.py), read non-finite at a step."""
    counts_of = counts_phrase(cause.fact("nan", 0), cause.fact("posinf", 0), cause.fact("neginf", 0))
    when = "this step's forward wrote it" if cause.fact("read_before") else (
        "it was non-finite at the first read: this step's forward wrote it, or it was so before the watch began")
    return (
        f"the buffer {cause.fact('statistic')} of {module_label(cause.fact('module'), cause.fact('module_type'))} "
        f"held {counts_of} at the optimizer step ({when}), while the module's outputs stayed finite: state it keeps "
        f"that no output shows (a running average) passed {cause.fact('dtype')}'s max {fmt(cause.fact('limit'))} or "
        "was computed from a non-finite value; find what made its inputs that large, and reset the buffer"
    )


def _buffer_evidence(cause: Cause) -> tuple[str, ...]:
    counts_of = counts_phrase(cause.fact("nan", 0), cause.fact("posinf", 0), cause.fact("neginf", 0))
    lines = [f"buffer {cause.fact('statistic')}: {counts_of} of {counted(cause.fact('numel'), 'element')}",
             "finite at the optimizer's previous step" if cause.fact("read_before") else
             "non-finite at the watch's first read (the first optimizer step): it may have been so before"]
    lines += [f"{name}: |x| up to {fmt(value)}" for name, value in cause.fact("siblings", ())]
    return tuple(lines)


def _exp_made(event: Report, cause: Cause) -> int:
    """The +inf the exp itself made (explain/forward.py's ``made``): the event's tensor may hold what later ops made of
    them (a custom Function's backward ``e / e.sum()``: NaN). A scene from before 0.29 has only the event's."""
    return int(cause.fact("made", event.posinf))


def _exp_hint(event: Report, cause: Cause) -> str:
    inputs = [(ref, stats) for ref, stats in event.op_inputs if stats.max is not None]
    reached = "".join(f", {short_label(event, ref)} reached {fmt(stats.max)}" for ref, stats in inputs)
    function = _exp_function(event)
    return (
        f"{event.op} in {where(event)} overflowed {event.dtype} in {counted(_exp_made(event, cause), 'element')}: "
        f"{function}(x) is inf for {'|x|' if function in ('sinh', 'cosh') else 'x'} > {cause.fact('threshold'):.4g}"
        f"{reached}; where the exp is normalised by its own sum (a softmax) or "
        "its sum is logged, subtract the row max first (softmax / logsumexp do); an exp used as a value (a "
        "probability ratio exp(logp - old_logp), a scale) has no max to take out: clamp its input "
        "(x.clamp(max=20)) or compute it in float32"
    )


def _matrix_exp_hint(event: Report, cause: Cause) -> str:
    bound = cause.fact("bound")
    norm = "" if bound is None else (
        f"; A's largest |entry| is {fmt(cause.fact('largest'))} over {cause.fact('columns')} columns, so its largest "
        f"absolute row sum (a bound on its norm and eigenvalues) can reach {fmt(bound)}")
    wider = "" if event.dtype == "float64" else ", or compute it in float64, whose exponential overflows past about 709"
    return (
        f"{event.op} in {where(event)} overflowed {event.dtype}: the exponential of a matrix grows as e**norm(A), "
        f"not as e to its largest entry, and is inf once A's norm passes about {cause.fact('threshold'):.4g}{norm}; "
        "keep A's scale bounded before the exponential (cap the time step of a flow exp(A * dt), keep A stable: its "
        f"eigenvalues' real parts <= 0){wider}"
    )


def _matrix_exp_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.op} made {counts(event)} from finite inputs",
            *input_lines(event))


def _exp_function(event: Report) -> str:
    """Which of the exp-like functions overflowed (exp, exp2, expm1, sinh, cosh: explain/forward.py's ``_exp``)."""
    return op_function(event.op) if event.op is not None else "exp"


def _exp_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.op} made {_exp_made(event, cause)} +inf from finite inputs", *input_lines(event))


def _outside_hint(event: Report, cause: Cause) -> str:
    ref, operand = cause.fact("operand")
    largest, first_step, first, last_step, last = cause.fact("outputs")
    rose, value, step = cause.fact("growth")[:3]
    label = short_label(event, from_plain(TensorRef, ref))
    if cause.fact("divisor"):
        grown = (f"it divided by {label} = {fmt(operand)}; 1 / {label} = {fmt(1 / operand)} is "
                 f"{fmt(1 / operand / first)}x the model's outputs at step {first_step} ({fmt(first)})")
    else:
        grown = (f"{label} = {fmt(operand)} is {fmt(operand / largest)}x the largest output the model made through "
                 f"this step ({fmt(largest)})")
    return (
        f"{what(event)}, in the loop's code outside the model, made {counts(event)}: it overflowed {event.dtype}"
        f"{_reached(event)}; {grown}, and the {rose} rose to {fmt(value)} at step {step} with it while the model's "
        f"outputs went from {fmt(first)} at step {first_step} to {fmt(last)} at step {last_step}: {_outside_fix(cause)}"
    )


def _outside_fix(cause: Cause) -> str:
    if cause.fact("divisor"):
        return ("a divisor the loop computes itself (a temperature or scale it anneals each step) shrank, and dividing "
                "by it multiplies the loss and every gradient before it: the model's weights grew with it, so a lower "
                "learning rate will not stop it; give that divisor a floor (clamp(min=...)) or stop annealing it there")
    return ("a value the loop computes itself (a multiplier or loss weight it updates each step, a running product) "
            "grew past the dtype: the rise is that value's, not the model diverging, so a lower learning rate will "
            "not stop it; bound that value (clamp it to a cap) or update it additively or in log space (keep its "
            "logarithm, clamped, and exp() it where it is used)")


def _outside_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    largest, first_step, first, last_step, last = cause.fact("outputs")
    rose, value, step = cause.fact("growth")[:3]
    return (f"producer in the loop's code, outside any module, dtype {event.dtype}", *input_lines(event),
            f"the model's largest output {fmt(largest)}; from {fmt(first)} at step {first_step} to {fmt(last)} at "
            f"step {last_step}", f"the {rose} rose to {fmt(value)} at step {step}")


OVERFLOW_READINGS: dict[str, Reading] = {
    "outside-growth": on_event(_outside_hint, _outside_evidence, sentence=_opens_with_the_loss),
    "exp-overflow": on_event(_exp_hint, _exp_evidence, sentence=False),
    "matrix-exp-overflow": on_event(_matrix_exp_hint, _matrix_exp_evidence, sentence=False),
    "running-stats-overflow": Reading(_running_hint, _running_evidence),
    "buffer-overflow": Reading(_buffer_hint, _buffer_evidence),
    "half-overflow": on_event(_half_hint, _half_evidence, sentence=_opens_with_the_loss),
    "wide-overflow": on_event(_wide_hint, _wide_evidence, sentence=_opens_with_the_loss),
    "op-unmatched": on_event(_unmatched_hint, inputs_or_counts,
                            sentence=lambda event: event.op is None),
}
