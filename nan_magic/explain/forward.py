"""The diagnosis of a forward event: the producing op's rule (log, sqrt, exp, division, softmax, ...).

:func:`forward_cause` picks the rule by the op (diagnose.py calls it for
phase ``forward``); each rule reads the op's inputs as the report holds them
and says why the op made a non-finite value and what to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nan_magic.explain.attention import logsumexp_cause, softmax_cause
from nan_magic.explain.cause_text import (
    HALF,
    constant_inputs,
    counts,
    divisor_phrase,
    dtype_max,
    empty,
    fmt,
    input_label,
    input_lines,
    input_named,
    legacy_cause,
    named_input,
    op_base,
    op_inputs,
    rerun_for_op,
    short_label,
    stats_counts,
    unclassified,
    where,
)
from nan_magic.explain.overflow import (
    attention_op,
    half_overflow,
    overflow,
    wide_overflow,
    wide_overflow_facts,
)
from nan_magic.records import Cause, Report, TensorRef, TensorRole, TensorStats

__all__ = ["forward_cause"]

_SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "safe_softmax"})
_MEAN_OPS = frozenset({
    "mean", "nanmean", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
})
_CORRECTED_OPS = frozenset({"std", "var", "std_mean", "var_mean"})


def forward_cause(report: Report) -> Cause:
    base = op_base(report.op)
    if base is None:
        return _loss(report) if report.tensor.role is TensorRole.LOSS else _unknown_op(report)
    if base in _SOFTMAX_OPS or attention_op(base):
        return softmax_cause(report)
    masked = logsumexp_cause(report) if base == "logsumexp" else None
    if masked is not None:
        return masked
    carried = [(name, stats) for name, stats in op_inputs(report) if stats.nonfinite]
    if carried or not report.inputs_finite:
        return _carried(report, carried)
    rule = _OP_RULES.get(base)
    return rule(report) if rule is not None else overflow(report)


def _log(report: Report) -> Cause:
    zeros, negatives = report.neginf, report.nan
    if not zeros + negatives:
        return overflow(report)
    base = op_base(report.op)
    bad = f"{negatives} values <= -1" if base == "log1p" else f"{zeros} zeros and {negatives} negatives"
    return legacy_cause(
        "log-domain",
        f"{base} got {bad} in {input_named(report, zeros, negatives)}: -inf from zeros, NaN from negatives; clamp "
        "to eps first (x.clamp_min(1e-12)), or use log_softmax / logsumexp for log-probabilities",
        (f"{report.op} made {report.neginf} -inf and {report.nan} nan from finite inputs", *input_lines(report)),
    )


def _sqrt(report: Report) -> Cause:
    if not report.nan:
        return overflow(report)
    return legacy_cause(
        "sqrt-domain",
        f"sqrt got {report.nan} negatives in {input_named(report, 0, report.nan)}: clamp to >= 0 first "
        "(x.clamp_min(0)), or compute the value so it cannot go negative (a variance as ((x - mean)**2).mean())",
        (f"{report.op} made {report.nan} nan from finite inputs", *input_lines(report)),
    )


def _rsqrt(report: Report) -> Cause:
    zeros = report.posinf + report.neginf
    if report.nan:
        return _sqrt(report)
    if not zeros:
        return overflow(report)
    return legacy_cause(
        "division-by-zero",
        f"rsqrt got {zeros} zeros in {input_named(report, zeros, 0)}: 1/sqrt(0) is inf; if it is a variance, add eps "
        "inside (torch.rsqrt(var + 1e-5))",
        (f"{report.op} made {zeros} inf from finite inputs", *input_lines(report)),
    )


def _pow(report: Report) -> Cause:
    facts = (f"{report.op} made {counts(report)} from finite inputs", *input_lines(report))
    if report.nan:
        return legacy_cause(
            "pow-domain",
            f"pow got a negative base with a fractional exponent in {input_named(report, 0, report.nan)} "
            f"({report.nan} NaN): clamp the base to >= 0 (x.clamp_min(0) ** p) or use x.sign() * x.abs() ** p",
            facts,
        )
    base = named_input(report, "self")
    if base is not None and base.zeros:
        return legacy_cause(
            "pow-domain",
            f"pow raised {base.zeros} zeros of `self` of {report.op} in {where(report)} to a negative power "
            f"({report.posinf + report.neginf} inf): add eps to the base ((x + 1e-12) ** p)",
            facts,
        )
    if base is not None:
        return overflow(report)
    return unclassified(
        report,
        f"pow in {where(report)} made {counts(report)}: zero to a negative power or an overflow of "
        f"{report.dtype}; the base is not known here: {rerun_for_op(report)}",
        facts,
    )


def _exp(report: Report) -> Cause:
    if not report.posinf:
        return overflow(report)
    threshold = math.log(dtype_max(report.dtype))
    inputs = [(name, stats) for name, stats in op_inputs(report) if stats.max is not None]
    reached = "".join(f", {short_label(name)} reached {fmt(stats.max)}" for name, stats in inputs)
    return legacy_cause(
        "exp-overflow",
        f"{report.op} in {where(report)} overflowed {report.dtype} in {report.posinf} elements: exp(x) is inf for "
        f"x > {threshold:.4g}{reached}; subtract the row max first (softmax / logsumexp do), clamp the input, "
        "or compute it in float32",
        (f"{report.op} made {report.posinf} +inf from finite inputs", *input_lines(report)),
    )


def _division(report: Report) -> Cause:
    base = op_base(report.op)
    divisor = named_input(report, "self" if base == "reciprocal" else "other")
    facts = (f"{report.op} made {report.nan} NaN (0/0) and {report.posinf + report.neginf} inf (x/0)",
             *input_lines(report), *constant_inputs(report))
    if divisor is not None and not divisor.zeros:
        return overflow(report)
    numerator = named_input(report, "self") if base != "reciprocal" else None
    if report.numel == 1 and report.nan and numerator is not None and numerator.absmax == 0:
        return empty(report, "a sum over nothing divided by a count of nothing (0/0)")
    if divisor is None and not report.nan and report.dtype in HALF:
        return unclassified(
            report,
            f"{report.op} in {where(report)} made {counts(report)} in {report.dtype}: a zero divisor or a quotient "
            f"above {fmt(dtype_max(report.dtype))}; the divisor is not known here: {rerun_for_op(report)}",
            facts,
        )
    results = [f"{count} {what}" for count, what in ((report.nan, "NaN (0/0)"),
                                                       (report.posinf + report.neginf, "inf (x/0)")) if count]
    constant = "".join(f"; {line}" for line in constant_inputs(report)) if divisor is None else ""
    return legacy_cause(
        "division-by-zero",
        f"{report.op} in {where(report)} divided by zero{divisor_phrase(divisor)}, giving {' and '.join(results)}"
        f"{constant}; if the divisor is a std, variance or norm add eps (x / (std + 1e-5), "
        "x / norm.clamp_min(1e-12)); if it is a count, clamp it to >= 1",
        facts,
    )


def _mean(report: Report) -> Cause:
    if report.nan and not report.posinf + report.neginf:
        return empty(report, "an average over zero elements (0/0)")
    return overflow(report)


def _corrected(report: Report) -> Cause:
    if not report.nan:
        return overflow(report)
    shapes = [(name, stats.shape) for name, stats in op_inputs(report) if stats.shape]
    shape = f" ({shapes[0][0]} has shape {shapes[0][1]})" if shapes else ""
    return legacy_cause(
        "division-by-zero",
        f"{report.op} in {where(report)} gave {report.nan} NaN: with correction=1 (the default) a std or variance "
        f"over N = 1 element divides by N - 1 = 0{shape}; pass correction=0, or use batches of more than one row",
        (f"{report.op} made {report.nan} nan from finite inputs", *input_lines(report)),
    )


_OP_RULES: dict[str, Callable[[Report], Cause]] = {
    **dict.fromkeys(("log", "log2", "log10", "log1p"), _log),
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    **dict.fromkeys(("pow", "float_power"), _pow),
    **dict.fromkeys(("exp", "exp2", "expm1", "sinh", "cosh"), _exp),
    **dict.fromkeys(("div", "true_divide", "floor_divide", "reciprocal", "fmod", "remainder"), _division),
    **dict.fromkeys(_MEAN_OPS, _mean),
    **dict.fromkeys(_CORRECTED_OPS, _corrected),
}


def _carried(report: Report, carried: list[tuple[TensorRef, TensorStats]]) -> Cause:
    """An op that made a new kind from values already non-finite (inf·0, inf - inf)."""
    held = "; ".join(f"{input_label(report, name)} held {stats_counts(stats)}" for name, stats in carried)
    return unclassified(
        report,
        f"{report.op} in {where(report)} made {counts(report)} from inputs already non-finite "
        f"({held or 'see the inputs'}): inf·0 and inf - inf are NaN; find where that input became non-finite "
        "(a parameter already non-finite, a deliberate infinity upstream)",
        tuple(input_lines(report)),
    )


def _loss(report: Report) -> Cause:
    finite = " while every watched module output was finite" if report.inputs_finite else ""
    if report.nan and not report.posinf + report.neginf:
        readings = (
            "a mean over an empty selection (every target ignore_index, an empty mask: 0/0), or a domain "
            "error in the loss code (log or sqrt of a negative, 0·log(0))"
        )
    else:
        readings = "a log of a zero probability (-log 0), or an overflow in the loss code (exp, a huge square)"
    return unclassified(
        report,
        f"the loss was {counts(report)}{finite}: {readings}; {rerun_for_op(report)}",
        (f"loss: {counts(report)}", f"inputs finite: {report.inputs_finite}"),
    )


def _unknown_op(report: Report) -> Cause:
    """The op is unknown (no replay, or it stayed finite): read the module's inputs carefully."""
    infinite = bool(report.posinf + report.neginf)
    # float32 overflows only with values near its max: a reading only where the inputs or output show them.
    wide = wide_overflow_facts(report) if infinite and report.dtype not in HALF else []
    overflows = infinite and (report.dtype in HALF or bool(wide))
    others: list[str] = []
    zeros = [str(name) for name, stats in report.input_stats if stats.zeros]
    if zeros:
        others.append(f"a division by zero or a log of zero ({', '.join(zeros)} held zeros)")
    negatives = [str(name) for name, stats in report.input_stats if stats.negatives]
    if report.nan and negatives:
        others.append(f"a log, sqrt or pow of a negative ({', '.join(negatives)} held negatives)")
    if overflows and not others:
        return half_overflow(report) if report.dtype in HALF else wide_overflow(report, wide)
    readings = [f"an overflow of {report.dtype} (max {fmt(dtype_max(report.dtype))})"] * overflows + others
    return unclassified(
        report,
        f"{where(report)} made {counts(report)} in {report.tensor}"
        + (f"; readings that fit: {'; '.join(readings)}" if readings else "")
        + f"; the op is unknown: {rerun_for_op(report)}",
        tuple(input_lines(report)),
    )
