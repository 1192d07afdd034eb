"""Overflows: an op that passed its dtype's largest finite value, and the evidence that shows it.

float16 and bfloat16 overflow in healthy models (65504 is not far), so a
half-precision op that made ±inf from finite inputs is read as an overflow
(``half-precision-overflow``). float32 and float64 overflow only when values
are already absurd, so ``overflow`` needs evidence: an op that cannot make a
non-finite value from finite operands any other way (a product, a sum, a
matmul), operands or finite outputs near the dtype's max, operands whose
squares or products pass it. Without such evidence the reading stays
``unclassified`` with the facts.
"""

from __future__ import annotations

import math

from nan_magic.explain.cause_text import (
    HALF,
    counts,
    dtype_max,
    fmt,
    input_lines,
    named_input,
    op_base,
    op_inputs,
    short_label,
    unclassified,
    what,
    where,
)
from nan_magic.records import Cause, Report

__all__ = [
    "ATTENTION_FIX", "MATMUL_OPS", "attention_op", "half_overflow", "overflow", "wide_overflow", "wide_overflow_facts",
]

MATMUL_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "einsum",
    "convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution", "cudnn_convolution",
})
#: Ops that make a non-finite value from finite operands only by passing the dtype's max: IEEE
#: sums and products give ±inf only past it, and NaN only from an inf - inf inside a sum. A
#: quotient reaches here only with a divisor known to hold no zeros (diagnose_forward's rule).
_ARITHMETIC_OPS = MATMUL_OPS | frozenset({
    "mul", "add", "sub", "rsub", "addcmul", "square", "sum", "cumsum", "prod", "cumprod", "mean",
    "div", "true_divide", "reciprocal", "var", "std", "var_mean", "std_mean",
})
#: Ops that square their operand (a variance, a norm): values above sqrt(max) overflow there even
#: when each value is far below max.
_SQUARING_OPS = frozenset({
    "square", "pow", "float_power", "var", "std", "var_mean", "std_mean", "norm",
    "linalg_vector_norm", "native_layer_norm", "layer_norm", "native_batch_norm", "batch_norm",
    "native_batch_norm_legit", "native_batch_norm_legit_no_training", "native_group_norm", "group_norm",
    "rms_norm", "fused_rms_norm", "cudnn_batch_norm", "miopen_batch_norm",
})
#: An operand or output within this factor of the dtype's max: any further scale or sum can pass it.
NEAR_MAX = 1e-3
#: The attention kernel already scales by d**-0.5: what is left is the size of q and k themselves.
ATTENTION_FIX = (
    "normalise q and k (QK-norm: a LayerNorm or RMSNorm on each) and find what grew them (the q/k projection "
    "weights: a learning rate too high, no gradient clipping)"
)


def attention_op(base: str | None) -> bool:
    return base is not None and base.startswith("scaled_dot_product")


def overflow(report: Report) -> Cause:
    """An op that made a non-finite value from finite inputs and no domain rule explains: an overflow, if shown."""
    if report.posinf + report.neginf and report.dtype in HALF:
        return half_overflow(report)
    facts = wide_overflow_facts(report) if report.dtype not in HALF else []
    if facts:
        return wide_overflow(report, facts)
    largest = max((stats.absmax for _name, stats in op_inputs(report) if stats.absmax is not None), default=None)
    size = f"; its inputs reached |x| = {fmt(largest)}" if largest is not None else ""
    return unclassified(
        report,
        f"{report.op or 'the op'} in {where(report)} made {counts(report)} in {report.tensor} from finite "
        f"{report.dtype} inputs{size}; no rule of the checklist matches",
        _input_lines(report),
    )


def wide_overflow_facts(report: Report) -> list[str]:
    """What shows that a float32/float64 op passed its dtype's max; empty where nothing does."""
    limit = dtype_max(report.dtype)
    base = op_base(report.op)
    operands = [(name, stats.absmax) for name, stats in op_inputs(report)
                if stats.absmax is not None and stats.finite]
    facts = []
    if operands and base in _ARITHMETIC_OPS and (base != "mean" or report.posinf + report.neginf):
        facts.append(f"{base} of finite operands makes inf (or inf - inf = NaN in a sum) only past {fmt(limit)}")
    if operands and base in ("pow", "float_power"):
        self = named_input(report, "self")
        if self is not None and self.zeros == 0 and report.posinf + report.neginf:
            facts.append(f"pow of a base without zeros makes inf only past {fmt(limit)}")
    near = [(name, absmax) for name, absmax in operands if absmax >= limit * NEAR_MAX]
    facts += [f"{short_label(name)} reached |x| = {fmt(absmax)}, within {fmt(1 / NEAR_MAX)}x of the "
              f"{report.dtype} max" for name, absmax in near]
    output = report.output_stats
    if output is not None and output.absmax is not None and output.absmax >= limit * NEAR_MAX:
        facts.append(f"the finite values of {report.tensor} reached |x| = {fmt(output.absmax)}, near the max")
    if base in _SQUARING_OPS:
        root = math.sqrt(limit)
        facts += [f"{short_label(name)} reached |x| = {fmt(absmax)} > sqrt(max) = {fmt(root)}: its square "
                  "overflows" for name, absmax in operands if root <= absmax < limit * NEAR_MAX]
    if base in MATMUL_OPS or base == "mul":
        top = sorted((absmax for _name, absmax in operands), reverse=True)[:2]
        if len(top) == 2 and top[0] * top[1] >= limit:
            facts.append(f"the product of its largest operands, {fmt(top[0])} · {fmt(top[1])}, passes the max")
    return facts


def wide_overflow(report: Report, facts: list[str]) -> Cause:
    limit = dtype_max(report.dtype)
    base = op_base(report.op)
    if attention_op(base):
        fix = f"the scores q·kᵀ passed it: {ATTENTION_FIX}"
    else:
        fix = (
            f"values this large are not a precision problem ({report.dtype} already holds {fmt(limit)}): find "
            "what grew them (a parameter or activation growing each step: lower the learning rate, clip "
            "gradients; inputs that are not normalised) and normalise or clip before this op"
        )
    if base in MATMUL_OPS:
        fix += " (for attention, scale q by d**-0.5 before q·kᵀ and normalise q and k)"
    return Cause(
        "overflow",
        f"{what(report)} made {counts(report)}: it overflowed {report.dtype} (max {fmt(limit)})"
        f"{_reached(report)}; {fix}",
        (f"dtype {report.dtype}, finite limit {fmt(limit)}", *facts, *_input_lines(report)),
    )


def half_overflow(report: Report) -> Cause:
    limit = dtype_max(report.dtype)
    fix = "compute it in float32 (cast its inputs, or keep it out of torch.autocast) or scale the inputs down"
    base = op_base(report.op)
    if base in MATMUL_OPS:
        fix += " (for attention, scale q by d**-0.5 before q·kᵀ)"
    elif attention_op(base):
        fix += f" ({ATTENTION_FIX})"
    infinite = report.posinf + report.neginf
    made = f"in {infinite} elements" if infinite else f"({counts(report)}: inf - inf inside the op)"
    return Cause(
        "half-precision-overflow",
        f"{what(report)} overflowed {report.dtype} (max {fmt(limit)}) {made}{_reached(report)}; {fix}",
        (f"dtype {report.dtype}, finite limit {fmt(limit)}", f"{report.tensor}: {counts(report)}",
         *_input_lines(report)),
    )


def _reached(report: Report) -> str:
    """``; its inputs reached |x| = 20 (`self`), 60 (`mat2`)``: the op's operands in schema order."""
    inputs = [(name, stats.absmax) for name, stats in op_inputs(report) if stats.absmax is not None]
    reached = ", ".join(f"{fmt(absmax)} ({short_label(name)})" for name, absmax in inputs)
    return f"; its inputs reached |x| = {reached}" if reached else ""


def _input_lines(report: Report) -> tuple[str, ...]:
    return tuple(input_lines(report))
