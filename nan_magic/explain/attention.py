"""Softmax and attention: a row whose every position was masked, or scores that overflowed.

``softmax`` subtracts the row's max first, so over finite values and -inf it
is NaN exactly in the rows that are all -inf (``-inf - -inf``): a NaN there
with no +inf in its input is a fully masked row, and each NaN position had a
-inf. ``scaled_dot_product_attention`` runs ``softmax(q·kᵀ·scale + mask)·v``
in one kernel whose scores the report does not hold: its NaN rows come from
a row whose keys were all masked, or from scores that overflowed (+inf and
-inf in a row make ``inf - inf``). The operands bound the scores:
``|q·kᵀ| <= |q|max·|k|max·d``, ``·d**-0.5`` with the default scale. A fully
masked row is claimed only where that bound shows the scores cannot
overflow and the mask holds enough -inf to fill a row.

``logsumexp`` is the softmax's normaliser: over finite values and -inf it is
-inf exactly in the rows that are all -inf, and a loss over it (``lse -
score``, ``-lse.mean()``) is then infinite or NaN. A -inf there with no NaN
or +inf in its input is a fully masked row.
"""

from __future__ import annotations

import math

from nan_magic.explain.cause_text import (
    HALF,
    counts,
    dtype_max,
    fmt,
    input_label,
    input_lines,
    legacy_cause,
    named_input,
    op_base,
    op_inputs,
    place_facts,
    unclassified,
    where,
)
from nan_magic.explain.overflow import attention_op, half_overflow, wide_overflow
from nan_magic.records import Cause, Report, TensorStats

__all__ = ["logsumexp_cause", "softmax_cause"]


def softmax_cause(report: Report) -> Cause:
    """The cause of a NaN or inf made by a softmax, log_softmax or scaled_dot_product_attention op."""
    return _attention(report) if attention_op(op_base(report.op)) else _softmax(report)


def logsumexp_cause(report: Report) -> Cause | None:
    """A logsumexp's -inf over rows its input masked entirely; None where the input does not show that."""
    scores = named_input(report, "self")
    if (scores is None or not report.neginf or report.nan or report.posinf or scores.nan or scores.posinf
            or not report.numel or scores.numel % report.numel):
        return None
    positions = scores.numel // report.numel
    if (scores.neginf or 0) < report.neginf * positions:
        return None
    return Cause("masked-softmax", "masked-logsumexp", (
        *place_facts(report), ("rows", report.neginf), ("positions", positions), ("masked", scores.neginf),
    ))


def _softmax(report: Report) -> Cause:
    scores = named_input(report, "self")
    row = _row(report)
    overflowing = [name for name, stats in op_inputs(report) if stats.posinf]
    if (scores is not None and report.nan and not overflowing and not scores.nan and row
            and report.nan % row == 0 and (scores.neginf or 0) >= report.nan):
        return _masked(report, report.nan // row, row, (
            f"{input_label(report, 'self')} held {scores.neginf} -inf (masked positions), one at least for each "
            "NaN: a softmax over finite values and -inf is NaN only in a row that is all -inf",
        ))
    if report.posinf + report.neginf and report.dtype in HALF:
        return half_overflow(report)
    held = f", with +inf in {', '.join(map(str, overflowing))}" if overflowing else ""
    return unclassified(
        report,
        f"{report.op} in {where(report)} made {counts(report)}{held}; the -inf of its input do not fill the NaN "
        "rows (a fully masked row needs a -inf at every NaN position)",
        tuple(input_lines(report)),
    )


def _attention(report: Report) -> Cause:
    query, key, mask = (named_input(report, name) for name in ("query", "key", "attn_mask"))
    limit = dtype_max(report.dtype)
    bound = _score_bound(query, key)
    keys = mask.shape[-1] if mask is not None and mask.shape else 0
    masked = mask is not None and keys > 0 and (mask.neginf or 0) >= keys
    mask_fact = (f"{input_label(report, 'attn_mask')}, shape {mask.shape}, held {mask.neginf} -inf: enough to "
                 f"mask every one of the {keys} keys of some row" if masked and mask is not None else None)
    if bound is not None and bound[1] >= limit and not (masked and report.dtype in HALF):
        # float32 scores past 3.4e38 are a fault in themselves; in half precision a masked row fits as well.
        return _scores_overflow(report, bound[1], mask_fact)
    if bound is not None and bound[0] < limit and masked and report.nan and not report.posinf + report.neginf:
        rows = report.nan // row if (row := _row(report)) and report.nan % row == 0 else None
        return _masked(report, rows, keys, (
            f"|q·kᵀ| <= {fmt(bound[0])} (|q|max · |k|max · d), below the {report.dtype} max {fmt(limit)}: the "
            "scores cannot overflow, so the NaN rows are rows whose every key was masked",
            str(mask_fact),
        ))
    readings = []
    if bound is not None and bound[0] >= limit:
        readings.append(f"an overflow of q·kᵀ (it can reach {fmt(bound[0])} unscaled, past {fmt(limit)})")
    elif bound is not None:
        readings.append(f"not an overflow of the scores (|q·kᵀ| <= {fmt(bound[0])})")
    if masked:
        readings.append("a row whose keys are all masked")
    elif mask is None:
        readings.append("no float attn_mask was read: a boolean mask with a row all False would give NaN rows")
    else:
        readings.append(f"attn_mask held {mask.neginf} -inf, fewer than the {keys} keys of one row")
    return unclassified(
        report,
        f"{report.op} in {where(report)} made {counts(report)}: {'; '.join(readings)}; rerun on the failing step "
        "with the mask and the q·kᵀ scores in hand",
        tuple(input_lines(report)),
    )


def _score_bound(query: TensorStats | None, key: TensorStats | None) -> tuple[float, float] | None:
    """``(|q|max·|k|max·d, the same at the default scale d**-0.5)``, or None where q or k is not known."""
    if query is None or key is None or query.absmax is None or key.absmax is None or not query.shape:
        return None
    dim = query.shape[-1]
    unscaled = query.absmax * key.absmax * dim
    return unscaled, unscaled / math.sqrt(dim)


def _scores_overflow(report: Report, bound: float, mask_fact: str | None) -> Cause:
    query, key = named_input(report, "query"), named_input(report, "key")
    assert query is not None and key is not None
    fact = (f"q·kᵀ·scale can reach |q|max · |k|max · sqrt(d) = {fmt(query.absmax)} · {fmt(key.absmax)} · "
            f"sqrt({query.shape[-1]}) = {fmt(bound)}, past the {report.dtype} max {fmt(dtype_max(report.dtype))}: "
            "scores of +inf and -inf in a row make inf - inf = NaN in the softmax")
    extra = (fact,) + ((f"also: {mask_fact}; if NaN remain once q and k are small, look for such a row",)
                       if mask_fact else ())
    if report.dtype in HALF:
        cause = half_overflow(report)
        # Legacy path: half_overflow still writes its evidence as text.
        return legacy_cause(cause.label, cause.fact("hint"), (*extra, *cause.fact("evidence")))
    return wide_overflow(report, list(extra))


def _masked(report: Report, rows: int | None, positions: int, facts: tuple[str, ...]) -> Cause:
    which = f"{rows} row(s) of {positions} positions" if rows is not None else "rows"
    return legacy_cause(
        "masked-softmax",
        f"{which} of {report.op} in {where(report)} had every position masked to -inf, and a softmax over "
        "nothing is NaN: keep at least one position unmasked per row (e.g. the query's own), mask with "
        "torch.finfo(dtype).min instead of -inf, or zero fully masked rows after the softmax",
        (f"{report.op} made {report.nan} NaN ({which})", *facts),
    )


def _row(report: Report) -> int:
    """The length of the last dim of the op's output (a softmax's row; an attention output's feature dim)."""
    shape = report.output_stats.shape if report.output_stats else ()
    return shape[-1] if shape else 0

