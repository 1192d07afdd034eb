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

from nan_magic.explain.evidence import HALF, dtype_max, event_cause
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Report
from nan_magic.tensor_refs import op_function

__all__ = ["MATMUL_OPS", "Sign", "attention_op", "half_overflow", "overflow", "wide_overflow", "wide_overflow_signs"]

MATMUL_OPS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "einsum",
    "convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution", "cudnn_convolution",
})
#: Ops that make a non-finite value from finite operands only by passing the dtype's max: IEEE
#: sums and products give ±inf only past it, and NaN only from an inf - inf inside a sum. A
#: quotient reaches here only with a divisor known to hold no zeros (diagnose_forward's rule).
_ARITHMETIC_OPS = MATMUL_OPS | frozenset({
    "mul", "add", "sub", "rsub", "addcmul", "square", "sum", "cumsum", "prod", "cumprod", "mean",
    "div", "true_divide", "reciprocal", "var", "std", "var_mean", "std_mean", "mse_loss",
})
#: Ops that square their operand (a variance, a norm): values above sqrt(max) overflow there even
#: when each value is far below max.
_SQUARING_OPS = frozenset({
    "square", "pow", "float_power", "var", "std", "var_mean", "std_mean", "norm",
    "linalg_vector_norm", "native_layer_norm", "layer_norm", "native_batch_norm", "batch_norm",
    "native_batch_norm_legit", "native_batch_norm_legit_no_training", "native_group_norm", "group_norm",
    "rms_norm", "fused_rms_norm", "cudnn_batch_norm", "miopen_batch_norm", "mse_loss",
})
#: An operand or output within this factor of the dtype's max: any further scale or sum can pass it.
NEAR_MAX = 1e-3
#: A sign that an op passed its dtype's max, as plain values: ``(kind, *numbers)``; render/words/causes/overflow.py
#: writes each kind ("arithmetic", "pow", "near", "output-near", "square", "product", "scores", "mask").
Sign = tuple[object, ...]


def attention_op(base: str | None) -> bool:
    return base is not None and base.startswith("scaled_dot_product")


def overflow(report: Report) -> Cause:
    """An op that made a non-finite value from finite inputs and no domain rule explains: an overflow, if shown."""
    if report.posinf + report.neginf and report.dtype in HALF:
        return half_overflow(report)
    signs = wide_overflow_signs(report) if report.dtype not in HALF else ()
    if signs:
        return wide_overflow(report, signs)
    return event_cause("unclassified", "op-unmatched", report)


def wide_overflow_signs(report: Report) -> tuple[Sign, ...]:
    """What shows that a float32/float64 op passed its dtype's max; empty where nothing does."""
    limit = dtype_max(report.dtype)
    base = op_function(report.op)
    operands = [(ref, stats.absmax) for ref, stats in report.op_inputs
                if stats.absmax is not None and stats.finite]
    signs: list[Sign] = []
    if operands and base in _ARITHMETIC_OPS and (base != "mean" or report.posinf + report.neginf):
        signs.append(("arithmetic", base))
    if base in ("pow", "float_power") and report.posinf + report.neginf:
        self, number = report.operand("self"), dict(report.numbers).get("self")
        # The base is a finite tensor without zeros, or a finite nonzero Python number (pow.Scalar's ``gamma ** t``,
        # whose integer exponent may have no stats as an operand).
        scalar = self is None and isinstance(number, (int, float)) and math.isfinite(number) and number != 0
        if scalar or (operands and self is not None and self.zeros == 0):
            signs.append(("pow",))
    signs += [("near", to_pairs(ref), absmax, NEAR_MAX) for ref, absmax in operands if absmax >= limit * NEAR_MAX]
    output = report.output_stats
    if output is not None and output.absmax is not None and output.absmax >= limit * NEAR_MAX:
        signs.append(("output-near", output.absmax))
    if base in _SQUARING_OPS:
        root = math.sqrt(limit)
        signs += [("square", to_pairs(ref), absmax, root) for ref, absmax in operands
                  if root <= absmax < limit * NEAR_MAX]
    if base in MATMUL_OPS or base == "mul":
        top = sorted((absmax for _ref, absmax in operands), reverse=True)[:2]
        if len(top) == 2 and top[0] * top[1] >= limit:
            signs.append(("product", top[0], top[1]))
    return tuple(signs)


def wide_overflow(report: Report, signs: tuple[Sign, ...]) -> Cause:
    return event_cause("overflow", "wide-overflow", report, limit=dtype_max(report.dtype), signs=signs,
                       **_kind_of_op(report))


def half_overflow(report: Report, signs: tuple[Sign, ...] = ()) -> Cause:
    limit = dtype_max(report.dtype)
    # A finite Python number past the dtype's max (a mask bias of -1e9 in float16) is ±inf there: said as such.
    number = next(((name, value) for name, value in report.numbers if math.isfinite(value) and abs(value) > limit),
                  None)
    extra = {"number": number} if number is not None else {}
    return event_cause("half-precision-overflow", "half-overflow", report, limit=limit, signs=signs,
                       **_kind_of_op(report), **extra)


def _kind_of_op(report: Report) -> dict[str, bool]:
    """Whether the op is a matmul or an attention kernel: each has a fix of its own."""
    base = op_function(report.op)
    return {"matmul": base in MATMUL_OPS, "attention": attention_op(base)}
