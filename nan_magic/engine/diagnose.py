"""The likely cause of an event, with its evidence and a concrete fix.

:func:`diagnose` runs the checklist of people who debug non-finite training
runs on the evidence a :class:`Report` carries: the producer's op, the dtype,
the phase, the statistics of the producer's inputs and output, the autograd
node and the optimizer the watch named (fields, never read back from the
notes), the batch of the failing step and the history of earlier steps.
When the evidence does not single out one cause the label is
``"unclassified"`` and the hint gives the facts, never a confident guess.

Labels (exact strings: tests, renderers and users rely on them)
----------------------------------------------------------------
``half-precision-overflow``
    A float16/bfloat16 op made ±inf from finite inputs (a matmul, a product,
    a sum, a quotient without a zero divisor, optimizer state), and no
    op-specific rule below explains it.
``exp-overflow``
    ``exp``/``exp2``/``expm1``/``sinh``/``cosh`` made +inf: its input passed
    ``log(finfo.max)`` (11.09 in float16, 88.72 in float32); or the backward
    of such an op.
``division-by-zero``
    A division whose divisor held zeros, or that made NaN (from finite values
    only 0/0 does); ``rsqrt`` of zeros; a std/var over N elements with
    ``N - correction == 0``; the backward of a norm or std at zero. Covers a
    zero variance or norm.
``log-domain``
    ``log``/``log2``/``log10`` of zeros (-inf) or negatives (NaN), ``log1p``
    of values <= -1; the backward of a log at 0.
``sqrt-domain``
    ``sqrt``/``rsqrt`` of negatives; the backward of ``sqrt`` at 0, and of
    ``acos``/``asin`` at ±1 (whose derivatives are 1/sqrt(1 - x²)).
``pow-domain``
    ``pow`` of a negative base with a fractional exponent (NaN), of zero with
    a negative exponent (inf, with the base's zeros seen); its backward at 0.
``masked-softmax``
    A softmax or attention op made NaN where a whole row of its input was
    -inf: an input held -inf, or the NaN fill whole rows.
``learning-rate-too-high``
    The loss or gradient norm of the earlier steps grew at least
    :data:`DIVERGENCE_FACTOR`-fold over its median, rising on each of the last
    :data:`DIVERGENCE_RISES` steps, and the event is an overflow or has no
    op-specific cause: the overflow is the divergence arriving.
``optimizer-eps-underflow``
    Phase ``optimizer``, a float16 parameter, and an optimizer that divides by
    ``sqrt(v) + eps`` (Adam family, RMSprop, Adagrad, Adadelta, or an
    ``addcdiv``/``div`` op in the step): eps = 1e-8 rounds to 0 in float16.
``bad-input-data``
    Phase ``data`` (the batch already held the values), or an overflow in a
    step whose batch held ``|x| >`` :data:`~nan_magic.engine.early.EXTREME_INPUT`.
``empty-reduction``
    ``mean`` or a mean-reduced loss (``nll_loss``, ``mse_loss``, …) made NaN
    from finite inputs, or a one-element 0/0: an average over an empty
    selection, e.g. a loss whose every target is ``ignore_index``.
``parameter-already-nonfinite``
    A module read a parameter or buffer that already held non-finite values.
``grad-scaler-collapse``
    Set by the watch (``optim.py``) when a GradScaler's scale keeps
    collapsing; :func:`diagnose` is only called where no cause is set.
``unclassified``
    No rule matches, or more than one reading fits; the hint says which.
    Benign events (a GradScaler skip, a deliberate infinity) are not
    diagnosed: their hint starts with ``benign:``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import statistics
from collections.abc import Callable

import torch

from nan_magic.engine.early import EXTREME_INPUT
from nan_magic.locations import name_location
from nan_magic.records import Cause, Phase, Report, StepSummary, TensorStats, module_label

__all__ = ["DIVERGENCE_FACTOR", "DIVERGENCE_RISES", "LABELS", "diagnose"]

#: Every label :func:`diagnose` (or the watch) can give.
LABELS = (
    "half-precision-overflow",
    "exp-overflow",
    "division-by-zero",
    "log-domain",
    "sqrt-domain",
    "pow-domain",
    "masked-softmax",
    "learning-rate-too-high",
    "optimizer-eps-underflow",
    "bad-input-data",
    "empty-reduction",
    "parameter-already-nonfinite",
    "grad-scaler-collapse",
    "unclassified",
)

#: Growth of the loss (or gradient norm) over the median of the earlier steps
#: that counts as divergence. Healthy runs move their loss within a few-fold;
#: a too-high learning rate multiplies it every step.
DIVERGENCE_FACTOR = 10.0
#: ... and it must have risen on each of this many last steps: one bad batch
#: spikes once, a diverging run keeps climbing.
DIVERGENCE_RISES = 3

_HALF = ("float16", "bfloat16")
_EPS_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop",
})
_EPS_OPS = frozenset({"addcdiv", "div", "foreach_addcdiv", "foreach_div", "fused_adam", "fused_adamw"})
_MATMUL_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "einsum",
    "convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution", "cudnn_convolution",
})
_SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "safe_softmax"})
_MEAN_OPS = frozenset({
    "mean", "nanmean", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
})
_CORRECTED_OPS = frozenset({"std", "var", "std_mean", "var_mean"})
#: Where a backward turns a finite gradient non-finite: the checklist to give
#: when the op is unknown.
_DERIVATIVE_POLES = (
    "derivatives are infinite for sqrt, pow(x, p<1) and norms at 0, log and 1/x at 0, acos/asin at ±1"
)


def diagnose(report: Report) -> Cause:
    """The likely cause of ``report``'s event, with its evidence and a fix.

    Parameters
    ----------
    report
        A report without a cause (the watch sets ``grad-scaler-collapse``
        itself and does not call this then).

    Returns
    -------
    Cause
        One of :data:`LABELS`, a hint naming the tensor, parameter or module
        concerned with its numbers, and the evidence lines behind it.
    """
    if report.benign:
        return Cause(
            "unclassified",
            f"benign: the program handles {report.tensor} of {_where(report)} ({_counts(report)}: a GradScaler skip "
            "or a deliberate infinity); nothing to fix unless it keeps coming back",
            report.notes or (f"{report.tensor}: {_counts(report)}",),
        )
    cause = _with_absorbed(report, _local_cause(report))
    growth = _growth(report.history)
    if cause.label in ("half-precision-overflow", "exp-overflow", "unclassified"):
        # These readings describe how the value overflowed, not why the
        # values were that large: an extreme batch or a diverging run is the
        # cause upstream, when the evidence shows one.
        extreme = _extreme_batch(report)
        if extreme is not None:
            return _bad_batch(report, cause, *extreme)
        if growth is not None:
            return _learning_rate(report, cause, growth)
    if growth is not None:
        return dataclasses.replace(cause, evidence=(*cause.evidence, growth))
    return cause


def _with_absorbed(report: Report, cause: Cause) -> Cause:
    """Say so where the producer read a forward infinity that no boundary saw (PRODUCT.md: event)."""
    absorbed = report.absorbed
    if absorbed is None:
        return cause
    source = absorbed.source
    where = f" at {name_location(source.filename, source.lineno)}" if source is not None else ""
    counts = _counts_phrase(absorbed.nan, absorbed.posinf, absorbed.neginf)
    line = (
        f"absorbed in forward: {absorbed.op}{where} (in {module_label(absorbed.module)}) made {counts} that no "
        "module output "
        "kept (torch.where or a saturating function discarded it); its backward multiplied it by a zero gradient"
    )
    hint = (
        f"{cause.hint}; the infinity came from {absorbed.op}{where}, absorbed in forward: compute that branch "
        "on clamped inputs (e.g. exp(x.clamp(max=...)) inside torch.where) so that it stays finite"
    )
    return dataclasses.replace(cause, hint=hint, evidence=(line, *cause.evidence))


def _local_cause(report: Report) -> Cause:
    """The cause the event itself shows, before looking upstream."""
    if report.phase == Phase.DATA:
        return _bad_data(report)
    if report.phase == Phase.OPTIMIZER:
        return _optimizer(report)
    if report.tensor.startswith("parameter "):
        return _parameter(report)
    if report.phase == Phase.BACKWARD:
        return _backward(report)
    return _forward(report)


# -- data, parameters, optimizer -----------------------------------------------------


def _bad_data(report: Report) -> Cause:
    where = f" (first at index {report.first_bad_index})" if report.first_bad_index else ""
    hint = (
        f"{report.tensor} entering {report.model or 'the model'} already held {_counts(report)} of "
        f"{report.numel}{where}: the batch was bad before the model ran; check the loader and preprocessing "
        "(a standardisation by a zero std, a log of a zero feature, a corrupt record)"
    )
    evidence = [f"phase data: {report.tensor} held {_counts(report)} before any watched module ran"]
    evidence += [
        f"earlier warning at step {warning.step}: {warning.message}"
        for warning in report.warnings
        if warning.kind in ("extreme-input", "constant-feature")
    ]
    return Cause("bad-input-data", hint, tuple(evidence))


def _parameter(report: Report) -> Cause:
    name = report.tensor.removeprefix("parameter ")
    hint = (
        f"{name} already held {_counts(report)} when {_where(report)} read it: it became non-finite before "
        "this forward and not in a watched optimizer step (a checkpoint load, a manual edit, an unwatched "
        "optimizer); reload it from a good checkpoint and find what wrote it"
    )
    return Cause("parameter-already-nonfinite", hint, (f"{report.tensor}: {_counts(report)} of {report.numel}",))


def _optimizer(report: Report) -> Cause:
    optimizer = report.optimizer
    subject = report.tensor.removeprefix("parameter ")
    infinite = report.posinf + report.neginf
    facts = (f"phase optimizer: the {optimizer or 'optimizer'} step made {subject} {_counts(report)}",
             f"dtype {report.dtype}")
    if report.tensor.startswith("state ") and infinite and report.dtype in _HALF:
        return Cause(
            "half-precision-overflow",
            f"{subject} overflowed {report.dtype} (max {_fmt(_limit(report.dtype))}) in the "
            f"{optimizer or 'optimizer'} step, e.g. a squared gradient above the limit: keep optimizer state "
            "in float32 (float32 master weights under torch.autocast)",
            facts,
        )
    divides = optimizer is not None and (optimizer in _EPS_OPTIMIZERS or "adam" in optimizer.lower())
    eps = report.optimizer_eps
    # An eps float16 holds (1e-3) does not vanish: such a step overflows, or fails otherwise.
    eps_vanishes = eps is None or float(torch.tensor(eps, dtype=torch.float16)) == 0.0
    if report.dtype == "float16" and eps_vanishes and (divides or _op_base(report.op) in _EPS_OPS):
        shown = _fmt(eps) if eps is not None else "1e-8 (the default)"
        return Cause(
            "optimizer-eps-underflow",
            f"the {optimizer or 'optimizer'} step divides by sqrt(v) + eps, and eps = {shown} rounds to 0 in "
            f"float16 (smallest positive 6e-8): where a gradient of {subject} is 0 that is 0/0, giving "
            f"{_counts(report)}; keep float32 master weights (float32 parameters under torch.autocast with a "
            "GradScaler) or use eps >= 1e-4 in float16",
            (*facts, f"float16 cannot hold eps = {shown}"),
        )
    if infinite and report.dtype in _HALF:
        return Cause(
            "half-precision-overflow",
            f"the {optimizer or 'optimizer'} update of {subject} overflowed {report.dtype} "
            f"(max {_fmt(_limit(report.dtype))}): keep float32 master weights",
            facts,
        )
    return _unclassified(
        report,
        f"the {optimizer or 'optimizer'} step made {subject} {_counts(report)} from finite gradients in "
        f"{report.dtype}; no rule of the checklist matches",
        facts,
    )


# -- backward ---------------------------------------------------------------------------


def _backward(report: Report) -> Cause:
    node = report.autograd_node
    rule = _NODE_RULES.get(_node_function(node)) if node else None
    if rule is not None:
        return rule(report)
    if report.posinf + report.neginf and report.dtype in _HALF:
        return _half_overflow(report)
    if report.tensor.startswith("gradient of "):
        return _unclassified(
            report,
            f"{report.tensor} was {_counts(report)} when the optimizer was about to step; the backward that "
            "computed it was not watched (or code after it changed it)",
            (f"{report.tensor}: {_counts(report)}",),
        )
    if node is not None:
        detail = f"in the backward of {node} ({report.op} at {_line(report)})"
    elif report.op is not None:
        detail = f"in {report.op}"
    else:
        detail = "(the op is unknown: rerun with ops=True, %%nantrace --ops, to name it)"
    return _unclassified(
        report,
        f"the backward of {_where(report)} turned a finite gradient into {_counts(report)} in {report.tensor} "
        f"{detail}; {_DERIVATIVE_POLES}",
        (f"phase backward: {report.tensor} {_counts(report)} of {report.numel}",),
    )


def _node_cause(label: str, derivative: str, fix: str) -> Callable[[Report], Cause]:
    """A rule for a backward through a function whose derivative has a pole."""

    def rule(report: Report) -> Cause:
        zeros = _zeros_phrase(report)
        return Cause(
            label,
            f"{derivative} at {_line(report)}{zeros}: its backward gave {_counts(report)} ({report.op}); {fix}",
            (f"autograd node {report.autograd_node}", f"{report.tensor}: {_counts(report)}"),
        )

    return rule


_NODE_RULES: dict[str, Callable[[Report], Cause]] = {
    "sqrt": _node_cause(
        "sqrt-domain", "the derivative of sqrt, 1/(2·sqrt(x)), is infinite at x = 0, reached by sqrt",
        "add eps inside the sqrt (torch.sqrt(x + 1e-12)) or clamp x to >= eps",
    ),
    "acos": _node_cause(
        "sqrt-domain", "the derivative of acos, -1/sqrt(1 - x²), is infinite at x = ±1, reached by acos",
        "clamp to [-1 + 1e-7, 1 - 1e-7] (a clamp to [-1, 1] still lets ±1 through)",
    ),
    "asin": _node_cause(
        "sqrt-domain", "the derivative of asin, 1/sqrt(1 - x²), is infinite at x = ±1, reached by asin",
        "clamp to [-1 + 1e-7, 1 - 1e-7] (a clamp to [-1, 1] still lets ±1 through)",
    ),
    "log": _node_cause(
        "log-domain", "the derivative of log, 1/x, is infinite at x = 0, reached by log",
        "clamp to eps before the log (x.clamp_min(1e-12)) or use log_softmax",
    ),
    "div": _node_cause(
        "division-by-zero", "the derivative of a/b, -a/b², is infinite at b = 0, reached by a division",
        "add eps to the divisor or clamp it (b.clamp_min(1e-12))",
    ),
    "pow": _node_cause(
        "pow-domain", "the derivative of x**p for p < 1 is infinite at x = 0, reached by pow",
        "add eps to the base (x + 1e-12) ** p or clamp it",
    ),
    "norm": _node_cause(
        "division-by-zero", "the derivative of a norm, x/‖x‖, divides by 0 at a zero vector, reached by a norm",
        "add eps inside (torch.sqrt((x**2).sum(-1) + 1e-12)) or clamp the norm",
    ),
    "std": _node_cause(
        "division-by-zero", "the derivative of std divides by the std, 0 at a constant input, reached by std",
        "add eps inside (torch.sqrt(x.var() + 1e-5))",
    ),
    "exp": _node_cause(
        "exp-overflow", "the derivative of exp is exp(x), which overflows for large x, reached by exp",
        "subtract the max first (logsumexp) or clamp the input",
    ),
}
_NODE_RULES.update({
    "rsqrt": _NODE_RULES["sqrt"], "log2": _NODE_RULES["log"], "log10": _NODE_RULES["log"],
    "log1p": _NODE_RULES["log"], "reciprocal": _NODE_RULES["div"], "linalgvectornorm": _NODE_RULES["norm"],
    "cdist": _NODE_RULES["norm"], "var": _NODE_RULES["std"], "stdmean": _NODE_RULES["std"],
})


# -- forward ------------------------------------------------------------------------------


def _forward(report: Report) -> Cause:
    base = _op_base(report.op)
    if base is None:
        return _loss(report) if report.tensor == "loss" else _unknown_op(report)
    if base in _SOFTMAX_OPS or base.startswith("scaled_dot_product"):
        return _softmax(report)
    carried = [(name, stats) for name, stats in _op_inputs(report) if stats.nonfinite]
    if carried or not report.inputs_finite:
        return _carried(report, carried)
    rule = _OP_RULES.get(base)
    return rule(report) if rule is not None else _overflow(report)


def _log(report: Report) -> Cause:
    zeros, negatives = report.neginf, report.nan
    if not zeros + negatives:
        return _overflow(report)
    base = _op_base(report.op)
    bad = f"{negatives} values <= -1" if base == "log1p" else f"{zeros} zeros and {negatives} negatives"
    return Cause(
        "log-domain",
        f"{base} got {bad} in {_input_named(report, zeros, negatives)}: -inf from zeros, NaN from negatives; clamp "
        "to eps first (x.clamp_min(1e-12)), or use log_softmax / logsumexp for log-probabilities",
        (f"{report.op} made {report.neginf} -inf and {report.nan} nan from finite inputs", *_input_lines(report)),
    )


def _sqrt(report: Report) -> Cause:
    if not report.nan:
        return _overflow(report)
    return Cause(
        "sqrt-domain",
        f"sqrt got {report.nan} negatives in {_input_named(report, 0, report.nan)}: clamp to >= 0 first "
        "(x.clamp_min(0)), or compute the value so it cannot go negative (a variance as ((x - mean)**2).mean())",
        (f"{report.op} made {report.nan} nan from finite inputs", *_input_lines(report)),
    )


def _rsqrt(report: Report) -> Cause:
    zeros = report.posinf + report.neginf
    if report.nan:
        return _sqrt(report)
    if not zeros:
        return _overflow(report)
    return Cause(
        "division-by-zero",
        f"rsqrt got {zeros} zeros in {_input_named(report, zeros, 0)}: 1/sqrt(0) is inf; if it is a variance, add eps "
        "inside (torch.rsqrt(var + 1e-5))",
        (f"{report.op} made {zeros} inf from finite inputs", *_input_lines(report)),
    )


def _pow(report: Report) -> Cause:
    facts = (f"{report.op} made {_counts(report)} from finite inputs", *_input_lines(report))
    if report.nan:
        return Cause(
            "pow-domain",
            f"pow got a negative base with a fractional exponent in {_input_named(report, 0, report.nan)} "
            f"({report.nan} NaN): clamp the base to >= 0 (x.clamp_min(0) ** p) or use x.sign() * x.abs() ** p",
            facts,
        )
    base = _named_input(report, "self")
    if base is not None and base.zeros:
        return Cause(
            "pow-domain",
            f"pow raised {base.zeros} zeros of `self` of {report.op} in {_where(report)} to a negative power "
            f"({report.posinf + report.neginf} inf): add eps to the base ((x + 1e-12) ** p)",
            facts,
        )
    if base is not None:
        return _overflow(report)
    return _unclassified(
        report,
        f"pow in {_where(report)} made {_counts(report)}: zero to a negative power or an overflow of "
        f"{report.dtype}; the base is not known here (rerun with ops=True)",
        facts,
    )


def _exp(report: Report) -> Cause:
    if not report.posinf:
        return _overflow(report)
    threshold = math.log(_limit(report.dtype))
    inputs = [(name, stats) for name, stats in _op_inputs(report) if stats.max is not None]
    reached = "".join(f", {_short_label(name)} reached {_fmt(stats.max)}" for name, stats in inputs)
    return Cause(
        "exp-overflow",
        f"{report.op} in {_where(report)} overflowed {report.dtype} in {report.posinf} elements: exp(x) is inf for "
        f"x > {threshold:.4g}{reached}; subtract the row max first (softmax / logsumexp do), clamp the input, "
        "or compute it in float32",
        (f"{report.op} made {report.posinf} +inf from finite inputs", *_input_lines(report)),
    )


def _division(report: Report) -> Cause:
    base = _op_base(report.op)
    divisor = _named_input(report, "self" if base == "reciprocal" else "other")
    facts = (f"{report.op} made {report.nan} NaN (0/0) and {report.posinf + report.neginf} inf (x/0)",
             *_input_lines(report), *_constant_inputs(report))
    if divisor is not None and not divisor.zeros:
        return _overflow(report)
    numerator = _named_input(report, "self") if base != "reciprocal" else None
    if report.numel == 1 and report.nan and numerator is not None and numerator.absmax == 0:
        return _empty(report, "a sum over nothing divided by a count of nothing (0/0)")
    if divisor is None and not report.nan and report.dtype in _HALF:
        return _unclassified(
            report,
            f"{report.op} in {_where(report)} made {_counts(report)} in {report.dtype}: a zero divisor or a quotient "
            f"above {_fmt(_limit(report.dtype))}; the divisor is not known here (rerun with ops=True)",
            facts,
        )
    results = [f"{count} {what}" for count, what in ((report.nan, "NaN (0/0)"),
                                                       (report.posinf + report.neginf, "inf (x/0)")) if count]
    constant = "".join(f"; {line}" for line in _constant_inputs(report)) if divisor is None else ""
    return Cause(
        "division-by-zero",
        f"{report.op} in {_where(report)} divided by zero{_divisor_phrase(divisor)}, giving {' and '.join(results)}"
        f"{constant}; if the divisor is a std, variance or norm add eps (x / (std + 1e-5), "
        "x / norm.clamp_min(1e-12)); if it is a count, clamp it to >= 1",
        facts,
    )


def _mean(report: Report) -> Cause:
    if report.nan and not report.posinf + report.neginf:
        return _empty(report, "an average over zero elements (0/0)")
    return _overflow(report)


def _corrected(report: Report) -> Cause:
    if not report.nan:
        return _overflow(report)
    shapes = [(name, stats.shape) for name, stats in _op_inputs(report) if stats.shape]
    shape = f" ({shapes[0][0]} has shape {shapes[0][1]})" if shapes else ""
    return Cause(
        "division-by-zero",
        f"{report.op} in {_where(report)} gave {report.nan} NaN: with correction=1 (the default) a std or variance "
        f"over N = 1 element divides by N - 1 = 0{shape}; pass correction=0, or use batches of more than one row",
        (f"{report.op} made {report.nan} nan from finite inputs", *_input_lines(report)),
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


def _softmax(report: Report) -> Cause:
    masked = [(name, stats) for name, stats in _op_inputs(report) if stats.neginf]
    overflowing = [name for name, stats in _op_inputs(report) if stats.posinf]
    row = report.output_stats.shape[-1] if report.output_stats and report.output_stats.shape else 0
    whole_rows = bool(row) and report.nan % row == 0
    if report.nan and not overflowing and (masked or whole_rows):
        rows = f"{report.nan // row} row(s) of {row} positions" if whole_rows else "rows"
        evidence = [f"{report.op} made {report.nan} NaN ({rows})"]
        evidence += [f"{_input_label(report, name)} held {stats.neginf} -inf (masked positions)"
                     for name, stats in masked]
        return Cause(
            "masked-softmax",
            f"{rows} of {report.op} in {_where(report)} had every position masked to -inf, and a softmax over "
            "nothing is NaN: keep at least one position unmasked per row (e.g. the query's own), mask with "
            "torch.finfo(dtype).min instead of -inf, or zero fully masked rows after the softmax",
            tuple(evidence),
        )
    if report.posinf + report.neginf and report.dtype in _HALF:
        return _half_overflow(report)
    return _unclassified(
        report,
        f"{report.op} in {_where(report)} made {_counts(report)}"
        + (f", with +inf in {', '.join(overflowing)}" if overflowing else "")
        + "; the NaN do not fill whole masked rows",
        tuple(_input_lines(report)),
    )


def _carried(report: Report, carried: list[tuple[str, TensorStats]]) -> Cause:
    """An op that made a new kind from values already non-finite (inf·0, inf - inf)."""
    held = "; ".join(f"{_input_label(report, name)} held {_stats_counts(stats)}" for name, stats in carried)
    return _unclassified(
        report,
        f"{report.op} in {_where(report)} made {_counts(report)} from inputs already non-finite "
        f"({held or 'see the inputs'}): inf·0 and inf - inf are NaN; find where that input became non-finite "
        "(a parameter already non-finite, a deliberate infinity upstream)",
        tuple(_input_lines(report)),
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
    return _unclassified(
        report,
        f"the loss was {_counts(report)}{finite}: {readings}; rerun with "
        "ops=True (%%nantrace --ops) to name the op",
        (f"loss: {_counts(report)}", f"inputs finite: {report.inputs_finite}"),
    )


def _unknown_op(report: Report) -> Cause:
    """The op is unknown (no replay, or it stayed finite): read the module's inputs carefully."""
    overflow = bool(report.posinf + report.neginf) and report.dtype in _HALF
    others: list[str] = []
    zeros = [name for name, stats in report.input_stats if stats.zeros]
    if zeros:
        others.append(f"a division by zero or a log of zero ({', '.join(zeros)} held zeros)")
    negatives = [name for name, stats in report.input_stats if stats.negatives]
    if report.nan and negatives:
        others.append(f"a log, sqrt or pow of a negative ({', '.join(negatives)} held negatives)")
    if overflow and not others:
        return _half_overflow(report)
    readings = [f"an overflow of {report.dtype} (max {_fmt(_limit(report.dtype))})"] * overflow + others
    return _unclassified(
        report,
        f"{_where(report)} made {_counts(report)} in {report.tensor}"
        + (f"; readings that fit: {'; '.join(readings)}" if readings else "")
        + "; the op is unknown: rerun with ops=True (%%nantrace --ops) to name it",
        tuple(_input_lines(report)),
    )


def _overflow(report: Report) -> Cause:
    if report.posinf + report.neginf and report.dtype in _HALF:
        return _half_overflow(report)
    largest = max((stats.absmax for _name, stats in _op_inputs(report) if stats.absmax is not None), default=None)
    size = f"; its inputs reached |x| = {_fmt(largest)}" if largest is not None else ""
    return _unclassified(
        report,
        f"{report.op or 'the op'} in {_where(report)} made {_counts(report)} in {report.tensor} from finite "
        f"{report.dtype} inputs{size}; no rule of the checklist matches",
        tuple(_input_lines(report)),
    )


def _half_overflow(report: Report) -> Cause:
    limit = _limit(report.dtype)
    inputs = [(name, stats.absmax) for name, stats in _op_inputs(report) if stats.absmax is not None]
    reached = ", ".join(f"{_fmt(absmax)} ({_short_label(name)})" for name, absmax in inputs)
    fix = "compute it in float32 (cast its inputs, or keep it out of torch.autocast) or scale the inputs down"
    if _op_base(report.op) in _MATMUL_OPS:
        fix += " (for attention, scale q by d**-0.5 before q·kᵀ)"
    return Cause(
        "half-precision-overflow",
        f"{_what(report)} overflowed {report.dtype} (max {_fmt(limit)}) in {report.posinf + report.neginf} elements"
        + (f"; its inputs reached |x| = {reached}" if reached else "") + f"; {fix}",
        (f"dtype {report.dtype}, finite limit {_fmt(limit)}", f"{report.tensor}: {_counts(report)}",
         *_input_lines(report)),
    )


# -- upstream causes ------------------------------------------------------------------------


def _extreme_batch(report: Report) -> tuple[str, float] | None:
    """The batch entering the model in the failing step, when it held ``|x| > EXTREME_INPUT``."""
    for layer in report.layers:
        absmax = layer.stats.absmax
        if layer.phase == Phase.DATA and absmax is not None and absmax > EXTREME_INPUT:
            return layer.tensor, absmax
    return None


def _bad_batch(report: Report, downstream: Cause, tensor: str, absmax: float) -> Cause:
    return Cause(
        "bad-input-data",
        f"{tensor} entering {report.model or 'the model'} reached |x| = {_fmt(absmax)} (> {_fmt(EXTREME_INPUT)}) in "
        f"this step, and {_what(report)} then became {_counts(report)}: normalise or clip the "
        "inputs (standardise features, log-scale heavy-tailed ones) before the model",
        (f"batch {tensor}: |x| up to {_fmt(absmax)}", f"then: {downstream.label}: {downstream.hint}"),
    )


def _growth(history: tuple[StepSummary, ...]) -> str | None:
    """Evidence that the loss or gradient norm was diverging before the event, or None."""
    for field, label in (("loss", "loss"), ("grad_norm", "gradient norm")):
        series = [(entry.step, abs(value)) for entry in history
                  if (value := getattr(entry, field)) is not None and math.isfinite(value)]
        if len(series) <= DIVERGENCE_RISES + 1:
            continue
        recent = [value for _step, value in series[-DIVERGENCE_RISES - 1:]]
        median = statistics.median(value for _step, value in series[:-1])
        (first, _), (last_step, last) = series[0], series[-1]
        if all(b > a for a, b in itertools.pairwise(recent)) and median > 0 and last >= DIVERGENCE_FACTOR * median:
            return (
                f"the {label} rose to {_fmt(last)} at step {last_step}, {_fmt(last / median)}x its median "
                f"{_fmt(median)} since step {first}, rising on each of the last {DIVERGENCE_RISES} steps"
            )
    return None


def _learning_rate(report: Report, downstream: Cause, growth: str) -> Cause:
    return Cause(
        "learning-rate-too-high",
        f"{growth}; then {_what(report)} became {_counts(report)} in {report.phase} step "
        f"{report.step}: lower the learning rate (e.g. 10x), add warm-up, or clip gradients "
        "(torch.nn.utils.clip_grad_norm_)",
        (growth, f"then: {downstream.label}: {downstream.hint}"),
    )


# -- evidence helpers ----------------------------------------------------------------------


def _unclassified(report: Report, facts: str, evidence: tuple[str, ...]) -> Cause:
    return Cause("unclassified", facts, evidence or (f"{report.tensor}: {_counts(report)}",))


def _empty(report: Report, how: str) -> Cause:
    return Cause(
        "empty-reduction",
        f"{report.op} in {_where(report)} gave {report.nan} NaN from finite inputs: {how}, e.g. a loss whose every "
        "target is ignore_index or a masked mean with an empty mask; skip such batches (if mask.any()) or divide "
        "a sum by count.clamp_min(1)",
        (f"{report.op} made {report.nan} NaN and no inf from finite inputs", *_input_lines(report)),
    )


def _op_base(op: str | None) -> str | None:
    """``"aten._softmax.default"`` → ``"softmax"``; ``"aten.div_.Tensor"`` → ``"div"``."""
    if op is None:
        return None
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name.strip("_")


def _node_function(node: str) -> str:
    """The forward function of an autograd node: ``"SqrtBackward0"`` → ``"sqrt"``, ``"DivBackward1"`` → ``"div"``."""
    return node.rstrip("0123456789").removesuffix("Backward").lower()


def _where(report: Report) -> str:
    if report.module is None:
        if report.source is not None:
            return f"the code at {name_location(report.source.filename, report.source.lineno)}"
        return "code outside the watched modules"
    return module_label(report.module, report.module_type)


def _what(report: Report) -> str:
    """The bad tensor with its op and module: ``output of aten.mm.default in 1 (HalfMatmul)``."""
    if report.tensor == "loss" and report.op is None:
        return "the loss"
    if report.op is None or report.op in report.tensor:
        return f"{report.tensor} of {_where(report)}" if report.op is None else f"{report.tensor} in {_where(report)}"
    return f"{report.tensor} of {report.op} in {_where(report)}"


def _line(report: Report) -> str:
    """The forward line a backward op came from, with its text where known."""
    source = report.source
    if source is None:
        return _where(report)
    text = f" `{source.line.strip()}`" if source.line else ""
    return f"{name_location(source.filename, source.lineno)}{text}"


def _is_module_input(name: str) -> bool:
    return name.startswith(("input", "kwargs"))


def _op_inputs(report: Report) -> list[tuple[str, TensorStats]]:
    """Input stats that are the op's own (ops mode names them by schema argument), else the module's."""
    own = [(name, stats) for name, stats in report.input_stats if not _is_module_input(name)]
    return own or list(report.input_stats)


def _named_input(report: Report, argument: str) -> TensorStats | None:
    """The op's input named ``argument`` (``"self"``, ``"other"``); its value before an in-place op."""
    for name, stats in report.input_stats:
        if name in (argument, f"{argument} (before)"):
            return stats
    return None


def _short_label(name: str) -> str:
    return name if _is_module_input(name) else f"`{name}`"


def _input_label(report: Report, name: str) -> str:
    if _is_module_input(name):
        return f"{name} of {_where(report)}"
    return f"`{name}` of {report.op} in {_where(report)}"


def _input_named(report: Report, zeros: int, negatives: int) -> str:
    """The input whose zeros and negatives the op's output accounts for, by name where the evidence says which.

    The module's own input is the name the user knows; the op's ``self`` is
    named when no module input matches (the op ran on an intermediate value).
    """
    matching = [
        name for name, stats in report.input_stats
        if (stats.zeros, stats.negatives) == (zeros, negatives) and not stats.nonfinite
    ]
    for name in sorted(matching, key=lambda name: not _is_module_input(name)):
        return _input_label(report, name)
    if _named_input(report, "self") is not None:
        return _input_label(report, "self")
    return f"the input of {report.op} in {_where(report)}"


def _input_lines(report: Report) -> list[str]:
    return [f"{_input_label(report, name)}: {_stats_phrase(stats)}" for name, stats in report.input_stats]


def _constant_inputs(report: Report) -> list[str]:
    """Module inputs that are constant: their variance and centred norm are exactly 0."""
    return [
        f"{_input_label(report, name)} is constant ({_fmt(stats.min)}): its variance and centred norm are 0"
        for name, stats in report.input_stats
        if _is_module_input(name) and stats.numel > 1 and stats.std == 0 and stats.min is not None
    ]


def _divisor_phrase(divisor: TensorStats | None) -> str:
    if divisor is None:
        return ""
    rows = ""
    if len(divisor.shape) > 1 and divisor.shape[-1] == 1:
        # A keepdim reduction over the last dim (a std, a norm): one value per row.
        rows = f", a per-row reduction that is 0 for {divisor.zeros} rows"
    return f" (`other` {divisor.shape} held {divisor.zeros} zeros of {divisor.numel}{rows})"


def _zeros_phrase(report: Report) -> str:
    zero_inputs = [(name, stats.zeros) for name, stats in report.input_stats if stats.zeros]
    return "".join(f" ({_input_label(report, name)} held {zeros} zeros)" for name, zeros in zero_inputs[:1])


def _stats_phrase(stats: TensorStats) -> str:
    parts = [f"{stats.dtype} {stats.shape}"]
    if stats.min is not None and stats.max is not None:
        parts.append(f"min {_fmt(stats.min)}, max {_fmt(stats.max)}")
    if stats.zeros is not None:
        parts.append(f"{stats.zeros} zeros, {stats.negatives} negatives")
    if stats.nonfinite:
        parts.append(_stats_counts(stats))
    return ", ".join(parts)


def _stats_counts(stats: TensorStats) -> str:
    return _counts_phrase(stats.nan or 0, stats.posinf or 0, stats.neginf or 0)


def _counts(report: Report) -> str:
    return _counts_phrase(report.nan, report.posinf, report.neginf)


def _counts_phrase(nan: int, posinf: int, neginf: int) -> str:
    parts = [f"{count} {kind}" for kind, count in (("nan", nan), ("+inf", posinf), ("-inf", neginf)) if count]
    return ", ".join(parts) or "non-finite"


def _limit(dtype: str | None) -> float:
    """Largest finite value of a floating dtype named like ``"float16"`` (float32's when unknown)."""
    found = getattr(torch, dtype or "", None)
    return torch.finfo(found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32).max


def _fmt(value: float | None) -> str:
    """``31000.0`` → ``"3.1e4"``; ``0.52`` → ``"0.52"``."""
    if value is None:
        return "?"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    text = f"{value:.3g}"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m.group(1) == '-' else ''}{m.group(2)}", text)
