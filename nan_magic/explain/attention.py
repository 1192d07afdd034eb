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

A sum or mean of values holding a mask's -inf (label smoothing or an
entropy over a vocabulary masked with -inf) is infinite in every result
that took in a masked position: the mask was added up, not left out.

``logsumexp`` is the softmax's normaliser: over finite values and -inf it is
-inf exactly in the rows that are all -inf, and a loss over it is then
infinite or NaN. A -inf there with no NaN or +inf in its input, and -inf
enough to fill its rows, is a fully masked row.
"""

from __future__ import annotations

import math

from nan_magic.explain.evidence import HALF, dtype_max, event_cause
from nan_magic.explain.overflow import Sign, attention_op, half_overflow, wide_overflow
from nan_magic.records import Cause, Report, TensorStats
from nan_magic.tensor_refs import op_function

__all__ = ["FUSED_ATTENTION_OPS", "MAX_OPS", "PICK_OPS", "RESAMPLE_OPS", "logsumexp_cause", "masked_max_cause",
           "masked_pick_cause", "masked_resample_cause",
           "masked_sum_cause", "padded_cause", "softmax_cause"]


def softmax_cause(report: Report) -> Cause:
    """The cause of a NaN or inf made by a softmax, log_softmax or scaled_dot_product_attention op."""
    return _attention(report) if attention_op(op_function(report.op)) else _softmax(report)


#: torch's fused inference kernels (``nn.TransformerEncoderLayer``'s and ``nn.MultiheadAttention``'s fast path in
#: eval under no_grad) take the key padding mask as a float ``mask`` of -inf at padded keys (op_function drops the _).
FUSED_ATTENTION_OPS = frozenset({"transformer_encoder_layer_fwd", "native_multi_head_attention"})


def padded_cause(report: Report) -> Cause | None:
    """A fused attention kernel's NaN over samples whose every key was padded; None where the mask does not show it.

    Such a kernel is NaN for a sample whose keys are all masked (a softmax over nothing); its mask holds -inf at
    each padded key, so a mask with -inf for at least a whole row's keys, finite other inputs, and NaN (no inf)
    only in whole samples of the output is a fully padded sample.
    """
    mask = report.operand("mask")
    keys = mask.shape[-1] if mask is not None and mask.shape else 0
    if (mask is None or not keys or (mask.neginf or 0) < keys or mask.nan or mask.posinf or not report.nan
            or report.posinf + report.neginf
            or any(stats.nonfinite for ref, stats in report.op_inputs if ref.name != "mask")):
        return None
    shape = report.output_stats.shape if report.output_stats else ()
    per_sample = math.prod(shape[1:]) if len(shape) > 1 else 0
    rows = report.nan // per_sample if per_sample and report.nan % per_sample == 0 else None
    return event_cause("masked-softmax", "masked-padding", report, rows=rows, positions=keys,
                       masked=mask.neginf)


def logsumexp_cause(report: Report) -> Cause | None:
    """A logsumexp's -inf over rows its input masked entirely; None where the input does not show that."""
    scores = report.operand("self")
    if (scores is None or not report.neginf or report.nan or report.posinf or scores.nan or scores.posinf
            or not report.numel or scores.numel % report.numel):
        return None
    positions = scores.numel // report.numel
    if (scores.neginf or 0) < report.neginf * positions:
        return None
    return event_cause("masked-softmax", "masked-logsumexp", report, rows=report.neginf, positions=positions,
                       masked=scores.neginf)


def masked_sum_cause(report: Report) -> Cause | None:
    """A sum or mean whose every result is infinite from a mask's infinities of one sign; None otherwise.

    The tracer names such a sum only when its input's infinities were deliberate (localize/ops/masks.py).
    """
    values = report.operand("self")
    infinite = report.posinf + report.neginf
    if (values is None or report.nan or values.nan or not report.numel or infinite != report.numel
            or bool(values.posinf) == bool(values.neginf) or bool(report.posinf) == bool(report.neginf)):
        return None
    return event_cause("masked-softmax", "masked-sum", report, rows=infinite,
                       masked=values.posinf or values.neginf)


#: Ops that pick elements by an index (the tracer names one whose masked picks a sum added up: ops/origins.Picked).
PICK_OPS = frozenset({"gather", "index", "_unsafe_index", "index_select", "take"})


def masked_pick_cause(report: Report) -> Cause | None:
    """An index op that picked positions masked to ±inf (an action the policy masked); None where it does not show.

    Its input holds infinities of one sign and no NaN, and so does what it picked: each picked infinity was a masked
    position the index chose.
    """
    masked = _one_sign_carried(report)
    if masked is None:
        return None
    return event_cause("masked-softmax", "masked-pick", report, picked=report.posinf + report.neginf, masked=masked)


#: Reductions to a row's max or min: over a row masked entirely, the mask's infinity (ops/origins.Picked).
MAX_OPS = frozenset({"amax", "amin", "max", "min"})


def masked_max_cause(report: Report) -> Cause | None:
    """A max (or min) over rows whose every position was masked to ∓inf; None where its input does not show it.

    Over finite values and one sign of infinity a max is infinite only in a row that is all infinite: its output
    holds that sign alone, its input the same sign and no NaN.
    """
    masked = _one_sign_carried(report)
    if masked is None:
        return None
    return event_cause("masked-softmax", "masked-max", report, rows=report.posinf + report.neginf, masked=masked)


#: Interpolations: each output a weighted sum of input cells, the weights of some cells 0 at some outputs.
RESAMPLE_OPS = frozenset({"upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
                          "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"})


def masked_resample_cause(report: Report) -> Cause | None:
    """An interpolation of a mask of ∓inf (an additive attention bias upsampled to a feature map); None where its
    input does not show it. An output aligned with a finite cell still weighs its masked neighbour 0, and
    ``0 * -inf`` is NaN; the mask's infinities alone are deliberate (benign), the NaN is the interpolation's."""
    values = next((stats for _ref, stats in report.op_inputs), None)
    if values is None or not report.nan or values.nan or not (values.posinf or values.neginf):
        return None
    return event_cause("masked-softmax", "masked-resample", report, masked=(values.posinf or 0) + (values.neginf or 0))


def _one_sign_carried(report: Report) -> int | None:
    """The masked infinities of the op's ``self`` where it and the op's output hold infinities of one sign, the same,
    and no NaN (what a pick or a max passes on of a mask); else None."""
    values = report.operand("self")
    if (values is None or report.nan or values.nan or not (report.posinf or report.neginf)
            or bool(values.posinf) == bool(values.neginf) or bool(report.posinf) == bool(report.neginf)
            or bool(report.posinf) != bool(values.posinf)):
        return None
    return values.posinf or values.neginf


def _softmax(report: Report) -> Cause:
    scores = report.operand("self")
    row = _row(report)
    overflowing = any(stats.posinf for _ref, stats in report.op_inputs)
    if (scores is not None and report.nan and not overflowing and not scores.nan and row
            and report.nan % row == 0 and (scores.neginf or 0) >= report.nan):
        return event_cause("masked-softmax", "masked-softmax", report, rows=report.nan // row, positions=row)
    if report.posinf + report.neginf and report.dtype in HALF:
        return half_overflow(report)
    return event_cause("unclassified", "softmax-unmatched", report)


def _attention(report: Report) -> Cause:
    query, key, mask = (report.operand(name) for name in ("query", "key", "attn_mask"))
    limit = dtype_max(report.dtype)
    bound = _score_bound(query, key)
    keys = mask.shape[-1] if mask is not None and mask.shape else 0
    masked = mask is not None and keys > 0 and (mask.neginf or 0) >= keys
    if bound is not None and bound[1] >= limit and not (masked and report.dtype in HALF):
        # float32 scores past 3.4e38 are a fault in themselves; in half precision a masked row fits as well.
        assert query is not None and key is not None and query.absmax is not None and key.absmax is not None
        signs: tuple[Sign, ...] = (("scores", query.absmax, key.absmax, query.shape[-1], bound[1]),)
        signs += (("mask", keys),) if masked else ()
        return half_overflow(report, signs) if report.dtype in HALF else wide_overflow(report, signs)
    if bound is not None and bound[0] < limit and masked and report.nan and not report.posinf + report.neginf:
        rows = report.nan // row if (row := _row(report)) and report.nan % row == 0 else None
        return event_cause("masked-softmax", "masked-attention", report, rows=rows, positions=keys,
                           bound=bound[0], limit=limit)
    return event_cause("unclassified", "attention-unmatched", report, bound=bound, limit=limit, masked=masked,
                       keys=keys)


def _score_bound(query: TensorStats | None, key: TensorStats | None) -> tuple[float, float] | None:
    """``(|q|max·|k|max·d, the same at the default scale d**-0.5)``, or None where q or k is not known."""
    if query is None or key is None or query.absmax is None or key.absmax is None or not query.shape:
        return None
    dim = query.shape[-1]
    unscaled = query.absmax * key.absmax * dim
    return unscaled, unscaled / math.sqrt(dim)


def _row(report: Report) -> int:
    """The length of the last dim of the op's output (a softmax's row; an attention output's feature dim)."""
    shape = report.output_stats.shape if report.output_stats else ()
    return shape[-1] if shape else 0
