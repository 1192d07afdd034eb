"""The sentences of a forward op's cause: a domain error (log, sqrt, pow), a division, an empty mean, a softmax.

Each reading is written from the cause's event (the op, its inputs by role, the counts;
render/words/causes/phrases.py) and the numbers its rule in explain/forward.py or explain/attention.py gave.
"""

from __future__ import annotations

from collections.abc import Callable

from nan_magic.records import Cause, Report, TensorRole
from nan_magic.render.words.causes.domain_edges import edge_hint
from nan_magic.render.words.causes.logs import log_hint, suggested_eps
from nan_magic.render.words.causes.phrases import (
    Reading,
    constant_inputs,
    counts,
    divisor_phrase,
    fmt,
    input_label,
    input_lines,
    input_named,
    inputs_or_counts,
    number_phrase,
    on_event,
    op_counts,
    rerun_for_op,
    short_label,
    stats_counts,
    where,
)
from nan_magic.render.words.counted import counted, noun

__all__ = ["OP_READINGS"]


def _made(counted: Callable[[Report], str]) -> Callable[[Report, Cause], tuple[str, ...]]:
    """Evidence that the op made ``counted`` values from finite inputs, then the inputs."""
    return lambda event, _cause: (f"{event.op} made {counted(event)} from finite inputs", *input_lines(event))


def _gamma_hint(event: Report, cause: Cause) -> str:
    zeros, negatives, base = cause.fact("zeros"), cause.fact("negatives"), cause.fact("base")
    return (
        f"{base} got {counted(zeros, 'zero')} and {counted(negatives, 'negative')} in "
        f"{input_named(event, zeros, negatives)}: it is "
        "infinite at 0 and at each negative integer (lgamma(x) ~ -log(x) near 0); keep its argument positive, "
        "e.g. a dispersion or concentration as softplus(x) + 1e-4 rather than exp(x), which underflows to 0"
    )


def _logdet_hint(event: Report, cause: Cause) -> str:
    return (
        f"{cause.fact('base')} in {where(event)} gave {counts(event)}: the matrix is singular (its determinant is 0, "
        "or rounds below it: repeated or collinear rows, a kernel of a duplicated input); add jitter to its "
        "diagonal (K + 1e-6 * torch.eye(n)) before the determinant or the Cholesky"
    )


def _solve_hint(event: Report, cause: Cause) -> str:
    return (
        f"{cause.fact('base')} in {where(event)} gave {counts(event)}: the matrix it solves by (or inverts) is "
        "singular, a 0 on a triangular factor's diagonal (a Cholesky or scale diagonal made by exp(x), which "
        "underflows to 0) or collinear rows; keep the diagonal positive (softplus(x) + 1e-3) or add jitter to it "
        "(A + 1e-6 * torch.eye(n))"
    )


def _number_hint(event: Report, cause: Cause) -> str:
    given = ", ".join(f"{input_label(event, name)} = {value}" for name, value in event.nonfinite_numbers)
    return (
        f"{event.op} was given a Python number that is not finite ({given}): no tensor op made the value, the "
        "number the code passed did; find where it is set (a config value, float('-inf') multiplied into a mask "
        "where masked_fill(mask, float('-inf')) was meant, a division by zero in Python) and keep it finite"
    )


def _number_evidence(event: Report, _cause: Cause) -> tuple[str, ...]:
    numbers = tuple(f"{input_label(event, name)}: {value}, a Python number" for name, value in event.nonfinite_numbers)
    return (*numbers, *input_lines(event))


def _sqrt_hint(event: Report, cause: Cause) -> str:
    return (
        f"sqrt got {counted(event.nan, 'negative')} in {input_named(event, 0, event.nan)}: clamp to >= 0 first "
        "(x.clamp_min(0)), or compute the value so it cannot go negative (a variance as ((x - mean)**2).mean())"
    )


def _outside_unit_hint(event: Report, cause: Cause) -> str:
    base = cause.fact("base")
    return (
        # (Nine digits: 1.00000012 is what rounding gives, and fmt's three would show it as 1.)
        f"{base} got values outside [-1, 1] in {input_label(event, 'self')} (from {cause.fact('low'):.9g} to "
        f"{cause.fact('high'):.9g}), where it is NaN: a cosine or a dot of unit vectors that rounding pushed past 1; "
        f"clamp into [-1 + 1e-7, 1 - 1e-7] first (a clamp to [-1, 1] lets the infinite derivative at ±1 through)"
    )


def _rsqrt_hint(event: Report, cause: Cause) -> str:
    zeros = event.posinf + event.neginf
    return (
        f"rsqrt got {counted(zeros, 'zero')} in {input_named(event, zeros, 0)}: 1/sqrt(0) is inf; if it is a "
        "variance, add eps inside (torch.rsqrt(var + 1e-5))"
    )


def _pow_negative_hint(event: Report, cause: Cause) -> str:
    return (
        f"pow got a negative base with a fractional exponent in {input_named(event, 0, event.nan)} "
        f"({event.nan} NaN): clamp the base to >= 0 (x.clamp_min(0) ** p) or use x.sign() * x.abs() ** p"
    )


def _pow_zero_hint(event: Report, cause: Cause) -> str:  # (eps ** p is no fix: 1e6 for p = -0.5, fixes/scale_check)
    p = dict(event.numbers).get("exponent")
    moved = f"{fmt(1e-12 ** p)} (eps 1e-12)" if isinstance(p, (int, float)) and p < 0 else "eps ** p, a huge value"
    return (f"pow raised {counted(cause.fact('zeros'), 'zero')} of `self` of {event.op} in {where(event)} to a "
            f"negative power{number_phrase(event, 'exponent')}, giving {event.posinf + event.neginf} inf: an eps added "
            f"to the base only moves it to {moved}; where a zero base means none (an isolated node's degree, an empty "
            "count), set its result to 0: x.pow(p).masked_fill(x == 0, 0), as PyG's gcn_norm does")


def _pow_unknown_hint(event: Report, cause: Cause) -> str:
    return (
        f"pow in {where(event)} made {counts(event)}: zero to a negative power or an overflow of "
        f"{event.dtype}; the base is not known here: {rerun_for_op(event)}"
    )


def _soft_margin_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} overflowed {event.dtype}: it computes log1p(exp(-y * x)) as written, inf "
        f"once -y * x > {cause.fact('threshold'):.4g} (a logit confidently on the wrong side of its label); "
        "F.softplus(-y * x).mean() is the same loss and stays finite"
    )


def _bessel_hint(event: Report, cause: Cause) -> str:
    base = cause.fact("base")
    scaled = "i1e" if base.endswith("i1") else "i0e"
    inputs = [(ref, stats) for ref, stats in event.op_inputs if stats.absmax is not None]
    reached = "".join(f", {short_label(event, ref)} reached |x| = {fmt(stats.absmax)}" for ref, stats in inputs)
    return (
        f"{base} in {where(event)} overflowed {event.dtype} in {counted(event.posinf + event.neginf, 'element')}: "
        f"the modified Bessel function grows as exp(|x|) / sqrt(2 pi |x|), past float32's max once |x| > 91.9 "
        f"(float64's: 713){reached}; use the exponentially scaled torch.special.{scaled}(x) = {base}(x) * exp(-|x|), "
        f"and for its log (a von Mises likelihood's normaliser) log({scaled}(x)) + |x|"
    )


def _division_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.op} made {op_counts(event)[0]} NaN (0/0) and {op_counts(event)[1]} inf (x/0)",
            *input_lines(event), *constant_inputs(event))


def _division_hint(event: Report, cause: Cause) -> str:
    divisor = event.operand(cause.fact("divisor"))
    results = [f"{count} {what}" for count, what in zip(op_counts(event), ("NaN (0/0)", "inf (x/0)")) if count]
    number = number_phrase(event, cause.fact("divisor")) if divisor is None else ""
    if number:
        # No tensor was 0: the code passed a zero (a temperature or scale from a config).
        return (
            f"{event.op} in {where(event)} divided by zero{number}, giving {' and '.join(results)}; find where "
            "that number is set (a config value, a temperature, a schedule that reaches 0) and keep it non-zero"
        )
    constant = "".join(f"; {line}" for line in constant_inputs(event)) if divisor is None else ""
    zeros = divisor_phrase(divisor, _divisor_said(event, cause.fact("divisor") or "other"))
    return (
        f"{event.op} in {where(event)} divided by zero{zeros}, giving {' and '.join(results)}{constant}; if the "
        f"divisor is a std, variance or norm add eps (x / (std + 1e-5), x / norm.clamp_min({suggested_eps(event)})); "
        "if it is a count, clamp it to >= 1; if it is read from a table (a schedule's entry by timestep, "
        "alphas_cumprod[t]), the table holds a 0: fix that entry or the index"
    )


def _spread_hint(event: Report, cause: Cause) -> str:
    """A division by a std, a variance or a norm of 0 (localize/ops/divisor.py); its eps the eps trial's and edit's."""
    eps = {"float16": "0.00098", "bfloat16": "0.0078", "float64": "2.2e-16"}.get(event.dtype or "", "1.2e-07")
    spread, (nan, inf) = cause.fact("spread"), op_counts(event)
    results = [f"{count} {what}" for count, what in ((nan, "NaN (0/0)"), (inf, "inf (x/0)")) if count]
    alike = "all 0 (a zero row, a vector never written)" if spread == "norm" else "all equal (a constant row, a " + (
        "window of equal returns, a batch of one sample repeated)" if event.dtype not in ("float16", "bfloat16") else
        f"batch of one sample repeated), or closer together than {event.dtype} can square (its variance rounds to 0)")
    said = (f"{event.op} in {where(event)} divided by a {spread} of 0"
            f"{divisor_phrase(event.operand('other'), _divisor_said(event, 'other'))}, giving {' and '.join(results)}:"
            f" the values it measures were {alike}")
    if inf and not nan:  # (x / 0, ``mse / y.var()`` of equal targets: x / (var + eps) is x / eps, and diverges)
        return (f"{said}, and what it divides is not 0 there (x / 0): an eps added only makes it x / eps, 1 / eps "
                f"times too large, which still blows up; skip what has a {spread} of 0 (a batch: `if {spread} > 0`; "
                f"rows: divide by {spread}.masked_fill({spread} == 0, 1) and drop them), or find why it is 0")
    return (f"{said}, not a count of nothing; add eps to it (x / ({spread} + {eps}), or {spread}.clamp_min({eps}) "
            "where only some rows are 0), or take sqrt(var + eps) where the sqrt is written out")


def _divisor_said(event: Report, name: str) -> str:
    """The divisor as the user wrote it on the line (``target.sum((1, 2, 3))``), where the line says it; else its
    schema name (``other``): "`other` (16,) held 1 zero of 16" made the reader find which tensor `other` was."""
    refs = [ref for ref, _stats in event.input_stats if ref.role is TensorRole.OPERAND and ref.name == name]
    return short_label(event, refs[0]).strip("`") if refs else name


def _division_unknown_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} made {counts(event)} in {event.dtype}: a zero divisor or a quotient "
        f"above {fmt(cause.fact('limit'))}; the divisor is not known here: {rerun_for_op(event)}"
    )


def _empty(how: str) -> Reading:
    def hint(event: Report, _cause: Cause) -> str:
        return (
            f"{event.op} in {where(event)} gave {event.nan} NaN from finite inputs: {how}, e.g. a loss whose every "
            "target is ignore_index or a masked mean with an empty mask; skip such batches (if mask.any()) or "
            "divide a sum by count.clamp_min(1)"
        )

    return on_event(hint, _made(lambda event: f"{event.nan} NaN and no inf"), sentence=False)


def _first_shape(event: Report) -> str:
    """`` (self has shape (1, 8))``: the first operand with a shape, said beside a count that depends on it."""
    shapes = [(ref, stats.shape) for ref, stats in event.op_inputs if stats.shape]
    return f" ({shapes[0][0]} has shape {shapes[0][1]})" if shapes else ""


def _corrected_hint(event: Report, cause: Cause) -> str:
    shape = _first_shape(event)
    return (
        f"{event.op} in {where(event)} gave {event.nan} NaN: with correction=1 (the default) a std or variance "
        f"over N = 1 element divides by N - 1 = 0{shape}; pass correction=0, or use batches of more than one row"
    )


def _ctc_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} gave +inf for {event.posinf} of {counted(event.numel, 'sample')}: no "
        "alignment of "
        "their targets fits their inputs (a target longer than its input length, or than that length less the "
        "blanks its repeated labels need); pass zero_infinity=True to nn.CTCLoss, or drop or shorten those samples"
    )


def _carried_hint(event: Report, cause: Cause) -> str:
    held = "; ".join(f"{input_label(event, ref)} held {stats_counts(stats)}"
                     for ref, stats in event.op_inputs if stats.nonfinite)
    return (
        f"{event.op} in {where(event)} made {counts(event)} from inputs already non-finite "
        f"({held or 'see the inputs'}): inf·0 and inf - inf are NaN; find where that input became non-finite "
        "(a parameter already non-finite, a deliberate infinity upstream)"
    )


# -- softmax and attention (explain/attention.py) -----------------------------------------


def _masked_hint(event: Report, cause: Cause) -> str:
    return (
        f"{_rows(cause)} of {event.op} in {where(event)} had every position masked to -inf, and a softmax over "
        "nothing is NaN: keep at least one position unmasked per row (e.g. the query's own), mask with "
        "torch.finfo(dtype).min instead of -inf, or zero fully masked rows after the softmax"
    )


def _padded_hint(event: Report, cause: Cause) -> str:
    rows = cause.fact("rows")
    which = counted(rows, "sample") if rows is not None else "some samples"
    return (
        f"{event.op} in {where(event)} (the fused fast path of eval under no_grad) attended over no key for {which}: "
        "every key was padded (a key padding mask True for a whole row), and attention over nothing is NaN for the "
        "whole sample; drop empty samples from the batch or keep at least one key unmasked (the training path "
        "may not show it: it returns finite values there)"
    )


def _padded_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    mask = event.operand("mask")
    shape = mask.shape if mask is not None else ()
    return (
        f"{event.op} made {event.nan} NaN, whole samples of its output",
        f"{input_label(event, 'mask')}, shape {shape}, held {cause.fact('masked')} -inf: enough to mask every one "
        f"of the {counted(cause.fact('positions'), 'key')} of some row",
    )


def _rows(cause: Cause) -> str:
    rows = cause.fact("rows")
    return f"{counted(rows, 'row')} of {counted(cause.fact('positions'), 'position')}" if rows is not None else "rows"


def _masked_softmax_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    scores = event.operand("self")
    return (
        f"{event.op} made {event.nan} NaN ({_rows(cause)})",
        f"{input_label(event, 'self')} held {scores.neginf if scores else None} -inf (masked positions), one at "
        "least for each NaN: a softmax over finite values and -inf is NaN only in a row that is all -inf",
    )


def _masked_logsumexp_hint(event: Report, cause: Cause) -> str:
    return (
        f"{_rows(cause)} of {event.op} in {where(event)} had every position masked to -inf, and a logsumexp over "
        "nothing is -inf (a loss over it is infinite, its gradient NaN): keep at least one position unmasked per "
        "row, mask with torch.finfo(dtype).min instead of -inf, or leave fully masked rows out of the loss"
    )


def _masked_logsumexp_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} made {event.neginf} -inf ({_rows(cause)})",
        f"its input held {cause.fact('masked')} -inf (masked positions) and no NaN or +inf: over finite values and "
        "-inf, logsumexp is -inf only in a row that is all -inf",
    )


def _masked_sum_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} added up positions masked to ±inf, so all {cause.fact('rows')} of its "
        "results are infinite: the mask was summed instead of left out (label smoothing or an entropy over a "
        "vocabulary masked with -inf); sum only the unmasked positions (x.masked_fill(mask, 0).sum(-1)), or for "
        "F.cross_entropy(label_smoothing=...) smooth over the allowed classes by hand: torch.finfo(dtype).min in "
        "place of -inf overflows the same sum once two positions of a row are masked"
    )


def _masked_sum_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} made {event.posinf + event.neginf} inf, every value of its output",
        f"its input held {counted(cause.fact('masked'), 'infinity', 'infinities')} of one sign (masked positions) "
        "and no NaN",
    )


def _masked_max_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} reduced {counted(cause.fact('rows'), 'row')} whose every position was masked "
        "to ±inf, and a max "
        "over nothing is that infinity (a sequence that is all padding): what uses it then is infinite or NaN; keep "
        "at least one position per row unmasked, replace the empty rows' max (torch.where(torch.isinf(top), 0, "
        "top)), or mask with torch.finfo(dtype).min instead of -inf"
    )


def _masked_max_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} made {event.posinf + event.neginf} inf",
        f"its input held {counted(cause.fact('masked'), 'infinity', 'infinities')} of one sign (masked positions) "
        "and no NaN: over finite values and one infinity, a max is infinite only in a row that is all infinite",
    )


def _masked_resample_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} interpolated a mask holding "
        f"{counted(cause.fact('masked'), 'infinity', 'infinities')}: each output is a weighted sum of input cells; "
        "an output aligned with a kept cell still weighs its masked neighbour 0, and 0 * inf is NaN; resample "
        "the boolean mask (mode=\"nearest\") and fill -inf after, or mask with torch.finfo(dtype).min"
    )


def _masked_resample_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} made {event.nan} NaN",
        f"its input held {counted(cause.fact('masked'), 'infinity', 'infinities')} (masked cells) and no NaN",
    )


def _logdet_negative_hint(event: Report, cause: Cause) -> str:
    return (
        f"torch.logdet in {where(event)} is NaN for a matrix whose determinant is negative (log of det < 0: a "
        "reflection, an odd number of negative eigenvalues; torch passes the NaN where slogdet's sign is -1); take "
        "log|det| with torch.linalg.slogdet(w).logabsdet, as Glow's invertible convolution does, or keep the "
        "determinant positive (an LU parametrisation with its sign fixed)"
    )


def _logdet_negative_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (f"{event.op} inside torch.logdet made {event.nan} NaN from torch's own number, its inputs finite",)


def _masked_pick_hint(event: Report, cause: Cause) -> str:
    picked = cause.fact("picked")
    return (
        f"{event.op} in {where(event)} picked {counted(picked, 'position')} masked to ±inf: an index chose what the "
        "mask rules out (an action the policy masked, sampled outside it, or a target at a masked position), and "
        "what adds the picked values up is infinite; pick only unmasked positions (draw the action from the masked "
        "distribution), or leave the masked picks out of the loss"
    )


def _masked_pick_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} picked {event.posinf + event.neginf} inf of {event.numel} values",
        f"its input held {counted(cause.fact('masked'), 'infinity', 'infinities')} of one sign (masked positions) "
        "and no NaN",
    )


def _weight_norm_hint(event: Report, cause: Cause) -> str:
    return (
        f"{event.op} in {where(event)} divides each row of v by its norm, and "
        f"{counted(cause.fact('zeros'), 'value')} of v {noun(cause.fact('zeros'), 'is', 'are')} 0: a row of v that "
        f"is all zeros (pruned, or zero-initialised) has norm 0, giving {event.nan} NaN (0/0); "
        "re-initialise or drop the zero rows before weight_norm, or prune after it"
    )


def _norm_eps_hint(event: Report, cause: Cause) -> str:
    shape = _first_shape(event)
    return (
        f"{event.op} in {where(event)} normalises by rsqrt(var + eps) with eps=0: a group or row whose values are all "
        f"equal (one element a group, a constant row){shape} has variance 0, and (x - mean) * rsqrt(0) is 0 * inf, "
        f"giving {event.nan} NaN; keep the layer's eps (1e-5 by default)"
    )


def _masked_attention_evidence(event: Report, cause: Cause) -> tuple[str, ...]:
    return (
        f"{event.op} made {event.nan} NaN ({_rows(cause)})",
        f"|q·kᵀ| <= {fmt(cause.fact('bound'))} (|q|max · |k|max · d), below the {event.dtype} max "
        f"{fmt(cause.fact('limit'))}: the scores cannot overflow, so the NaN rows are rows whose every key was "
        "masked",
        mask_phrase(event, cause.fact("positions")),
    )


def mask_phrase(event: Report, keys: int) -> str:
    """The float attention mask that holds enough -inf to mask a whole row."""
    mask = event.operand("attn_mask")
    assert mask is not None  # the rule read it
    return (f"{input_label(event, 'attn_mask')}, shape {mask.shape}, held {mask.neginf} -inf: enough to mask every "
            f"one of the {counted(keys, 'key')} of some row")


def _softmax_unmatched_hint(event: Report, cause: Cause) -> str:
    overflowing = [str(ref) for ref, stats in event.op_inputs if stats.posinf]
    held = f", with +inf in {', '.join(overflowing)}" if overflowing else ""
    return (
        f"{event.op} in {where(event)} made {counts(event)}{held}; the -inf of its input do not fill the NaN "
        "rows (a fully masked row needs a -inf at every NaN position)"
    )


def _attention_unmatched_hint(event: Report, cause: Cause) -> str:
    bound, limit, keys = cause.fact("bound"), cause.fact("limit"), cause.fact("keys")
    mask = event.operand("attn_mask")
    readings = []
    if bound is not None and bound[0] >= limit:
        readings.append(f"an overflow of q·kᵀ (it can reach {fmt(bound[0])} unscaled, past {fmt(limit)})")
    elif bound is not None:
        readings.append(f"not an overflow of the scores (|q·kᵀ| <= {fmt(bound[0])})")
    if cause.fact("masked"):
        readings.append("a row whose keys are all masked")
    elif mask is None:
        readings.append("no float attn_mask was read: a boolean mask with a row all False would give NaN rows")
    else:
        readings.append(f"attn_mask held {mask.neginf} -inf, fewer than the {counted(keys, 'key')} of one row")
    return (
        f"{event.op} in {where(event)} made {counts(event)}: {'; '.join(readings)}; rerun on the failing step "
        "with the mask and the q·kᵀ scores in hand"
    )


OP_READINGS: dict[str, Reading] = {
    "nonfinite-number": on_event(_number_hint, _number_evidence, sentence=False),
    "log-domain": on_event(log_hint, _made(counts), sentence=False),
    "gamma-pole": on_event(_gamma_hint, _made(counts), sentence=False),
    **dict.fromkeys(("atanh-edge", "logit-edge", "icdf-edge"), on_event(edge_hint, _made(counts), sentence=False)),
    "logdet-singular": on_event(_logdet_hint, _made(counts), sentence=False),
    "solve-singular": on_event(_solve_hint, _made(counts), sentence=False),
    "sqrt-negative": on_event(_sqrt_hint, _made(lambda event: f"{event.nan} nan"), sentence=False),
    "outside-unit": on_event(_outside_unit_hint, _made(lambda event: f"{event.nan} nan"), sentence=False),
    "rsqrt-zero": on_event(_rsqrt_hint, _made(lambda event: f"{event.posinf + event.neginf} inf"), sentence=False),
    "pow-negative-base": on_event(_pow_negative_hint, _made(counts), sentence=False),
    "pow-zero-base": on_event(_pow_zero_hint, _made(counts), sentence=False),
    "pow-unknown-base": on_event(_pow_unknown_hint, _made(counts), sentence=False),
    "soft-margin-overflow": on_event(_soft_margin_hint, _made(lambda event: f"{event.posinf} +inf"), sentence=False),
    "bessel-overflow": on_event(_bessel_hint, _made(counts), sentence=False),
    "division-by-zero": on_event(_division_hint, _division_evidence, sentence=False),
    "spread-zero": on_event(_spread_hint, _division_evidence, sentence=False),
    "division-unknown-divisor": on_event(_division_unknown_hint, _division_evidence, sentence=False),
    "empty-quotient": _empty("a sum over nothing divided by a count of nothing (0/0)"),
    "empty-mean": _empty("an average over zero elements (0/0)"),
    "corrected-one": on_event(_corrected_hint, _made(lambda event: f"{event.nan} nan"), sentence=False),
    "carried": on_event(_carried_hint, inputs_or_counts, sentence=False),
    "ctc-infeasible": on_event(_ctc_hint, _made(lambda event: f"{event.posinf} +inf"), sentence=False),
    "masked-softmax": on_event(_masked_hint, _masked_softmax_evidence, sentence=False),
    "masked-attention": on_event(_masked_hint, _masked_attention_evidence, sentence=False),
    "masked-padding": on_event(_padded_hint, _padded_evidence, sentence=False),
    "masked-logsumexp": on_event(_masked_logsumexp_hint, _masked_logsumexp_evidence, sentence=False),
    "masked-sum": on_event(_masked_sum_hint, _masked_sum_evidence, sentence=False),
    "masked-pick": on_event(_masked_pick_hint, _masked_pick_evidence, sentence=False),
    "masked-max": on_event(_masked_max_hint, _masked_max_evidence, sentence=False),
    "masked-resample": on_event(_masked_resample_hint, _masked_resample_evidence, sentence=False),
    "logdet-negative": on_event(_logdet_negative_hint, _logdet_negative_evidence, sentence=False),
    "weight-norm-zero": on_event(_weight_norm_hint, _division_evidence, sentence=False),
    "norm-eps-zero": on_event(_norm_eps_hint, _made(lambda event: f"{event.nan} nan"), sentence=False),
    "softmax-unmatched": on_event(_softmax_unmatched_hint, inputs_or_counts, sentence=False),
    "attention-unmatched": on_event(_attention_unmatched_hint, inputs_or_counts, sentence=False),
}
