"""The diagnosis of a forward event: the producing op's rule (log, sqrt, exp, division, softmax, ...).

:func:`forward_cause` picks the rule by the op (diagnose.py calls it for
phase ``forward``); each rule reads the op's inputs as the report holds them
and says which reading of the event they show (render/words/causes/forward_ops.py writes it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nan_magic.explain.attention import (
    FUSED_ATTENTION_OPS,
    MAX_OPS,
    PICK_OPS,
    RESAMPLE_OPS,
    logsumexp_cause,
    masked_max_cause,
    masked_pick_cause,
    masked_resample_cause,
    masked_sum_cause,
    padded_cause,
    softmax_cause,
)
from nan_magic.explain.evidence import HALF, dtype_max, event_cause, op_made
from nan_magic.explain.overflow import attention_op, half_overflow, overflow, wide_overflow, wide_overflow_signs
from nan_magic.records import Cause, Report, TensorRole
from nan_magic.tensor_refs import op_function

__all__ = ["forward_cause"]

_SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "safe_softmax"})
_MEAN_OPS = frozenset({
    "mean", "nanmean", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
})
_CORRECTED_OPS = frozenset({"std", "var", "std_mean", "var_mean"})
_SUM_OPS = frozenset({"sum", "mean", "nansum", "nanmean"})
#: The norms that divide by ``sqrt(var + eps)`` with the eps their caller passed (a number in the report).
NORMALISATION_OPS = frozenset({
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm", "batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "instance_norm",
})


#: Solves and inverses, which divide by the matrix's pivots (a MultivariateNormal's ``log_prob`` solves by its
#: ``scale_tril``).
_SOLVE_OPS = frozenset({
    "linalg_solve_triangular", "triangular_solve", "linalg_solve", "linalg_solve_ex", "_linalg_solve_ex",
    "linalg_inv", "linalg_inv_ex", "inverse", "cholesky_solve", "cholesky_inverse", "linalg_lu_solve", "lu_solve",
})


def forward_cause(report: Report) -> Cause:
    base = op_function(report.op)
    if base is None:
        return _loss(report) if report.tensor.role is TensorRole.LOSS else _unknown_op(report)
    inside = next((note.fact("function") for note in report.note_facts if note.kind == "own-number"), None)
    if inside == "logdet" and report.nan:
        # torch.logdet's own NaN (localize/ops/called.py): where(sign == -1, nan, logabsdet), a negative determinant.
        return event_cause("log-domain", "logdet-negative", report)
    if base in _SOFTMAX_OPS or attention_op(base):
        return softmax_cause(report)
    masked = logsumexp_cause(report) if base == "logsumexp" else (
        masked_sum_cause(report) if base in _SUM_OPS else padded_cause(report) if base in FUSED_ATTENTION_OPS
        else masked_pick_cause(report) if base in PICK_OPS else masked_max_cause(report) if base in MAX_OPS
        else masked_resample_cause(report) if base in RESAMPLE_OPS else None)
    if masked is not None:
        return masked
    if (any(stats.nonfinite for _ref, stats in report.op_inputs) or not report.inputs_finite) and not (
            _overflow_beside_neginf(base, report)):
        # An op that made a new kind from values already non-finite (inf·0, inf - inf).
        return event_cause("unclassified", "carried", report)
    rule = _OP_RULES.get(base.removeprefix("foreach_"))  # (a foreach op: its function, on each tensor of a list)
    return rule(report) if rule is not None else overflow(report)


#: Functions that map -inf to a finite value (``exp(-inf)`` is 0): an input's -inf cannot make their +inf.
_FINITE_AT_NEGINF = frozenset({"exp", "exp2", "expm1"})


def _overflow_beside_neginf(base: str, report: Report) -> bool:
    """``exp`` of a tensor whose only non-finite values are -inf (a masked softmax written by hand, soft-DTW's
    border) that made +inf and no NaN: the +inf came from a finite element, an overflow, not a carried value."""
    return base in _FINITE_AT_NEGINF and bool(report.op_inputs) and report.nan == 0 and all(
        stats.nan == 0 and stats.posinf == 0 for _ref, stats in report.op_inputs)


def _log(report: Report) -> Cause:
    """A log of finite operands is -inf at 0 and NaN below it. ``xlogy(x, y)`` is ``x * log(y)``, ±inf where y = 0
    and x != 0 (a Beta's or Dirichlet's concentration below 1 at its support's edge), ``xlog1py`` the same at
    y = -1: only the infinities the op's run counted at that edge (the ``log-edge`` note) are a log of zero; y holds
    zeros on purpose in an entropy or a Poisson likelihood (paired with x = 0), so the rest is an overflow, and
    without the count a +inf is not called a zero."""
    base = op_function(report.op)
    zeros, negatives = report.neginf, report.nan
    if base in _X_LOG_OPS:
        edge = next((note.fact("count") for note in report.note_facts if note.kind == "log-edge"), None)
        zeros, base = edge if edge is not None else report.neginf, base.removeprefix("special_")
    if not zeros + negatives:
        return overflow(report)
    return event_cause("log-domain", "log-domain", report, base=base, zeros=zeros, negatives=negatives)


#: ``x * log(y)`` ops: their log's edge is read at the op's run (localize/ops/log_edge.py).
_X_LOG_OPS = frozenset({"xlogy", "special_xlogy", "special_xlog1py", "xlog1py"})


def _sqrt(report: Report) -> Cause:
    if not report.nan:
        return overflow(report)
    return event_cause("sqrt-domain", "sqrt-negative", report)


def _inverse_trig(report: Report) -> Cause:
    """acos/asin: NaN exactly for operands past [-1, 1] (a cosine that rounding pushed to 1.0000001)."""
    operand = report.operand("self")
    if not report.nan or operand is None or operand.min is None or operand.max is None:
        return overflow(report)
    return event_cause("sqrt-domain", "outside-unit", report, base=op_function(report.op), low=operand.min,
                       high=operand.max)


def _rsqrt(report: Report) -> Cause:
    if report.nan:
        return _sqrt(report)
    if not report.posinf + report.neginf:
        return overflow(report)
    return event_cause("division-by-zero", "rsqrt-zero", report)


def _pow(report: Report) -> Cause:
    if report.nan:
        return event_cause("pow-domain", "pow-negative-base", report)
    base = report.operand("self")
    if base is not None and base.zeros:
        return event_cause("pow-domain", "pow-zero-base", report, zeros=base.zeros)
    if base is not None or _finite_scalar_base(report):
        # A finite base (a tensor without zeros, or a Python number: ``gamma ** torch.arange(T)``) makes inf only
        # past the dtype's max: an overflow.
        return overflow(report)
    return event_cause("unclassified", "pow-unknown-base", report)


def _finite_scalar_base(report: Report) -> bool:
    """``pow.Scalar``'s base is a Python number, kept in ``report.numbers`` (not an operand): finite and not 0."""
    number = dict(report.numbers).get("self")
    return isinstance(number, (int, float)) and math.isfinite(number) and number != 0


def _exp(report: Report) -> Cause:
    made = op_made(report)[1]  # (a boundary that showed the event may hold the NaN later ops made of the +inf)
    if not made:
        return overflow(report)
    return event_cause("exp-overflow", "exp-overflow", report, threshold=_exp_threshold(report), made=made)


def _exp_threshold(report: Report) -> float:
    """The input past which the exp-like function overflows the dtype: 2**x past log2(max), sinh and cosh (e**x / 2)
    past log(2 max), exp and expm1 past log(max) (88.72 in float32)."""
    largest = dtype_max(report.dtype)
    function = op_function(report.op) if report.op is not None else "exp"
    if function == "exp2":
        return math.log2(largest)
    return math.log(2 * largest) if function in ("sinh", "cosh") else math.log(largest)


def _matrix_exp(report: Report) -> Cause:
    """``matrix_exp(A)`` of a finite matrix grows as ``e**||A||`` (its scaling and squaring makes inf, then NaN of
    inf - inf), not as e to its largest entry: a 3x3 of 33.5 everywhere has the eigenvalue 100.5 and overflows
    float32, whose exp overflows past 88.72. ``||exp(A)|| <= e**||A||``, so an overflow needs A's norm past
    log(max); the largest absolute row sum of A (at most its columns times its largest |entry|) bounds its norm and
    spectral radius from above. A finite matrix's exponential is finite in exact arithmetic: its overflow is this
    growth wherever the operand is not known or its bound is past log(max); an overflow like any other where the
    bound shows the norm below it."""
    threshold = math.log(dtype_max(report.dtype))
    operand = report.operand("self")
    if operand is None or operand.absmax is None or not operand.shape:
        return event_cause("exp-overflow", "matrix-exp-overflow", report, threshold=threshold)
    bound = operand.shape[-1] * operand.absmax  # the largest absolute row sum is at most n * max |a_ij|
    if bound <= threshold:
        return overflow(report)
    return event_cause("exp-overflow", "matrix-exp-overflow", report, threshold=threshold, bound=bound,
                       columns=operand.shape[-1], largest=operand.absmax)


def _bessel(report: Report) -> Cause:
    """i0/i1, the modified Bessel functions, grow as exp(|x|) / sqrt(2 pi |x|): inf once |x| passes about 92 in
    float32 (a von Mises likelihood's normaliser ``log(i0(kappa))`` of a confident kappa), as exp does past 88.7."""
    if not report.posinf + report.neginf:
        return overflow(report)
    return event_cause("exp-overflow", "bessel-overflow", report, base=op_function(report.op))


def _soft_margin(report: Report) -> Cause:
    """soft_margin_loss is ``log1p(exp(-y x))`` as written (aten's kernel): inf once ``-y x`` passes the exp's
    threshold (88.7 in float32), a logit confidently on the wrong side of its label, where ``softplus(-y x)`` is
    ``-y x`` itself."""
    if not report.posinf:
        return overflow(report)
    return event_cause("exp-overflow", "soft-margin-overflow", report, threshold=math.log(dtype_max(report.dtype)))


def _division(report: Report) -> Cause:
    reciprocal = op_function(report.op) == "reciprocal"
    divisor = report.operand("self" if reciprocal else "other")
    if divisor is not None and not divisor.zeros:
        return overflow(report)
    numerator = report.operand("self") if not reciprocal else None
    # A scalar NaN from finite operands and a zero divisor is 0 / 0 (x / 0 is ±inf): the numerator was a sum
    # over nothing, whether or not its copy is still known (ops mode's is often freed by the boundary).
    zero_numerator = numerator.absmax == 0 if numerator is not None else divisor is not None and bool(divisor.zeros)
    # A count of nothing is a tensor (``mask.sum()``) or a Python int (``len(selected)``); a Python float divisor of
    # 0.0 is a constant of the code (``half - downscale_freq_shift`` of a config), and 0 / 0.0 a division by it.
    constant = divisor is None and isinstance(dict(report.numbers).get("other"), float)
    spread = next((note.fact("spread") for note in report.note_facts if note.kind == "spread-divisor"), None)
    if spread is not None and not reciprocal:
        # 0 / 0 of a std, variance or norm of values all equal (localize/ops/divisor.py), not of a count of nothing.
        return event_cause("division-by-zero", "spread-zero", report, spread=spread)
    if report.numel == 1 and report.nan and not reciprocal and zero_numerator and not constant:
        return event_cause("empty-reduction", "empty-quotient", report)
    if divisor is None and not report.nan and report.dtype in HALF:
        return event_cause("unclassified", "division-unknown-divisor", report, limit=dtype_max(report.dtype))
    return event_cause("division-by-zero", "division-by-zero", report, divisor="self" if reciprocal else "other")


def _weight_norm(report: Report) -> Cause:
    """``g * v / ||v||`` per slice of ``v``: NaN where a slice (a pruned or zero-initialised row) is all zeros."""
    v = report.operand("v")
    if not report.nan or v is None or not v.zeros:
        return overflow(report)
    return event_cause("division-by-zero", "weight-norm-zero", report, zeros=v.zeros)


def _normalisation(report: Report) -> Cause:
    """layer/group/batch norm, ``(x - mean) * rsqrt(var + eps)``: with eps 0 a slice whose values are all equal (a
    group of one element, a constant row) has variance 0, and ``0 * rsqrt(0)`` is NaN."""
    if not report.nan or dict(report.numbers).get("eps") != 0:
        return overflow(report)
    return event_cause("division-by-zero", "norm-eps-zero", report)


def _mean(report: Report) -> Cause:
    if report.nan and not report.posinf + report.neginf:
        return event_cause("empty-reduction", "empty-mean", report)
    return overflow(report)


def _corrected(report: Report) -> Cause:
    if not report.nan:
        return overflow(report)
    return event_cause("division-by-zero", "corrected-one", report)


def _gamma(report: Report) -> Cause:
    """lgamma/digamma/polygamma: infinite at their poles, 0 and the negative integers (a dispersion or a
    concentration that underflowed to 0: ``lgamma(theta)`` of a negative binomial, a Dirichlet's ``lgamma(alpha)``)."""
    operand = report.operand("self") or report.operand("x")
    if operand is None or not (operand.zeros or operand.negatives):
        return overflow(report)
    return event_cause("log-domain", "gamma-pole", report, base=op_function(report.op), zeros=operand.zeros,
                       negatives=operand.negatives)


def _domain_edge(reading: str) -> Callable[[Report], Cause]:
    """The rule of a function infinite at an edge of its domain and NaN past it (``reading``: which one): a
    non-finite value it made is read at that edge; infinities alone, an overflow."""

    def rule(report: Report) -> Cause:
        if not report.nan + report.posinf + report.neginf:
            return overflow(report)
        return event_cause("log-domain", reading, report, base=op_function(report.op))

    return rule


def _logdet(report: Report) -> Cause:
    """log|det A| of a singular matrix is -inf (logdet: NaN where the determinant rounds negative)."""
    if not report.neginf + report.nan:
        return overflow(report)
    return event_cause("log-domain", "logdet-singular", report, base=op_function(report.op))


def _solve(report: Report) -> Cause:
    """A solve by (or the inverse of) a matrix divides by its pivots: from finite operands, a non-finite result means a
    singular matrix (a triangular factor's diagonal holding a 0: a Cholesky diagonal by ``exp`` that underflowed),
    unless its operands show an overflow (a right-hand side near the dtype's max: ``overflow`` reads it)."""
    if not report.nan + report.posinf + report.neginf or (
            report.posinf + report.neginf and report.dtype not in HALF and wide_overflow_signs(report)):
        return overflow(report)
    return event_cause("division-by-zero", "solve-singular", report, base=op_function(report.op))


def _ctc(report: Report) -> Cause:
    if report.posinf and not report.nan + report.neginf:
        return event_cause("ctc-infeasible", "ctc-infeasible", report)
    return overflow(report)


_OP_RULES: dict[str, Callable[[Report], Cause]] = {
    # xlogy(x, y) = x * log(y): -inf where y is 0 and x > 0 (a Beta's or Dirichlet's log_prob of a value at its
    # support's edge, 0 or 1), NaN where y < 0; the log's rule, its operand ``other``.
    **dict.fromkeys(("log", "log2", "log10", "log1p", *_X_LOG_OPS), _log),
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    **dict.fromkeys(("acos", "asin", "arccos", "arcsin"), _inverse_trig),
    **dict.fromkeys(("pow", "float_power"), _pow),
    **dict.fromkeys(("exp", "exp2", "expm1", "sinh", "cosh"), _exp),
    **dict.fromkeys(("i0", "special_i0", "special_i1"), _bessel),
    **dict.fromkeys(("linalg_matrix_exp", "matrix_exp"), _matrix_exp),
    **dict.fromkeys(("div", "true_divide", "floor_divide", "reciprocal", "fmod", "remainder"), _division),
    **dict.fromkeys(_MEAN_OPS, _mean),
    **dict.fromkeys(_CORRECTED_OPS, _corrected),
    **dict.fromkeys(("weight_norm_interface", "weight_norm"), _weight_norm),
    **dict.fromkeys(NORMALISATION_OPS, _normalisation),
    **dict.fromkeys(("ctc_loss", "_ctc_loss"), _ctc),
    "soft_margin_loss": _soft_margin,
    **dict.fromkeys(("lgamma", "digamma", "polygamma", "mvlgamma"), _gamma),
    # artanh(x) = log((1 + x) / (1 - x)) / 2: ±inf at ±1, NaN past them (a Poincaré ball's norm at its edge).
    **dict.fromkeys(("atanh", "arctanh"), _domain_edge("atanh-edge")),
    # logit(p) = log(p / (1 - p)): -inf at 0, +inf at 1, NaN outside [0, 1] (a sigmoid that rounded to 1).
    **dict.fromkeys(("logit", "special_logit"), _domain_edge("logit-edge")),
    # erfinv (±inf at ±1) and ndtri (-inf at 0, +inf at 1), NaN past them: an inverse CDF of a rank n / n.
    **dict.fromkeys(("erfinv", "special_erfinv", "special_ndtri", "ndtri"), _domain_edge("icdf-edge")),
    **dict.fromkeys(("logdet", "slogdet", "linalg_slogdet"), _logdet),
    **dict.fromkeys(_SOLVE_OPS, _solve),
}


def _loss(report: Report) -> Cause:
    return event_cause("unclassified", "loss-unknown-op", report)


def _unknown_op(report: Report) -> Cause:
    """The op is unknown (no replay, or it stayed finite): read the module's inputs carefully."""
    infinite = bool(report.posinf + report.neginf)
    # float32 overflows only with values near its max: a reading only where the inputs or output show them.
    signs = wide_overflow_signs(report) if infinite and report.dtype not in HALF else ()
    overflows = infinite and (report.dtype in HALF or bool(signs))
    others = any(stats.zeros for _ref, stats in report.input_stats) or (
        report.nan and any(stats.negatives for _ref, stats in report.input_stats))
    if overflows and not others:
        return half_overflow(report) if report.dtype in HALF else wide_overflow(report, signs)
    return event_cause("unclassified", "module-unknown-op", report, overflows=overflows,
                       limit=dtype_max(report.dtype))
