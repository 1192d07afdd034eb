"""The words and numbers of a cause: where, which op, which inputs, their counts (diagnose.py's rules use them).

Every rule of the diagnosis states its evidence the same way: the producer's
place (:func:`where`, :func:`line`), the op's inputs by role
(:func:`input_named`), counts and numbers (:func:`counts`, :func:`fmt`).
"""

from __future__ import annotations

import torch

from nan_magic.locations import name_location
from nan_magic.number_words import counts_phrase, fmt
from nan_magic.records import Cause, Report, TensorRef, TensorRole, TensorStats, module_label

__all__ = [
    "HALF",
    "constant_inputs",
    "counts",
    "counts_phrase",
    "divisor_phrase",
    "dtype_max",
    "empty",
    "fmt",
    "input_label",
    "input_lines",
    "input_named",
    "is_module_input",
    "legacy_cause",
    "line",
    "named_input",
    "node_function",
    "op_base",
    "op_inputs",
    "place_facts",
    "plain_cause",
    "rerun_for_op",
    "short_label",
    "stats_counts",
    "stats_phrase",
    "unclassified",
    "what",
    "where",
    "zeros_phrase",
]

#: The half-precision dtypes, by name.
HALF = ("float16", "bfloat16")


def legacy_cause(label: str, hint: str, evidence: tuple[str, ...] | list[str] = ()) -> Cause:
    """Legacy path: a cause whose hint and evidence this module still writes as text.

    ``nan_magic.render.cause`` reads them back as they are (its ``"text"``
    reading); a kind converted to numbers gets a reading of its own there.
    """
    return Cause(label, "text", (("hint", hint), ("evidence", tuple(evidence))))


def place_facts(report: Report) -> tuple[tuple[str, object], ...]:
    """The bad tensor and where it was made, as a cause's plain facts (render/cause.py names them)."""
    source = report.source
    return (
        ("tensor", str(report.tensor)), ("tensor_role", report.tensor.role.value), ("tensor_name", report.tensor.name),
        ("op", report.op), ("module", report.module), ("module_type", report.module_type),
        ("source", (source.filename, source.lineno) if source is not None else None),
        ("nan", report.nan), ("posinf", report.posinf), ("neginf", report.neginf),
    )


def rerun_for_op(report: Report) -> str:
    """What a hint says of an op it does not know: rerun with ops=True, unless the watch traced every op."""
    if report.ops:
        return ("the op tracer saw no op make it from finite values (the value came from code it does not see: "
                "another thread, a C extension's own kernel)")
    return "rerun with ops=True (%%nantrace --ops) to name the op"


def plain_cause(cause: Cause) -> tuple[str, str, tuple[tuple[str, object], ...]]:
    """A cause as a plain fact of another (the reading it led to), so a scene stores it as data."""
    return cause.label, cause.reading, cause.facts


def unclassified(report: Report, facts: str, evidence: tuple[str, ...]) -> Cause:
    return legacy_cause("unclassified", facts, evidence or (f"{report.tensor}: {counts(report)}",))


def empty(report: Report, how: str) -> Cause:
    return legacy_cause(
        "empty-reduction",
        f"{report.op} in {where(report)} gave {report.nan} NaN from finite inputs: {how}, e.g. a loss whose every "
        "target is ignore_index or a masked mean with an empty mask; skip such batches (if mask.any()) or divide "
        "a sum by count.clamp_min(1)",
        (f"{report.op} made {report.nan} NaN and no inf from finite inputs", *input_lines(report)),
    )


def op_base(op: str | None) -> str | None:
    """``"aten._softmax.default"`` → ``"softmax"``; ``"aten.div_.Tensor"`` → ``"div"``."""
    if op is None:
        return None
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 else parts[0]
    return name.strip("_")


def node_function(node: str) -> str:
    """The forward function of an autograd node: ``"SqrtBackward0"`` → ``"sqrt"``, ``"DivBackward1"`` → ``"div"``."""
    return node.rstrip("0123456789").removesuffix("Backward").lower()


def where(report: Report) -> str:
    if report.module is None:
        if report.source is not None:
            return f"the code at {name_location(report.source.filename, report.source.lineno)}"
        return "code outside the watched modules"
    return module_label(report.module, report.module_type)


def what(report: Report) -> str:
    """The bad tensor with its op and module: ``output of aten.mm.default in 1 (HalfMatmul)``."""
    tensor = report.tensor
    if tensor.role is TensorRole.LOSS and report.op is None:
        return "the loss"
    if report.op is None:
        return f"{tensor} of {where(report)}"
    if tensor.role is TensorRole.OP_OUTPUT and tensor.name == report.op:
        return f"{tensor} in {where(report)}"
    return f"{tensor} of {report.op} in {where(report)}"


def line(report: Report) -> str:
    """The forward line a backward op came from, with its text where known."""
    source = report.source
    if source is None:
        return where(report)
    text = f" `{source.line.strip()}`" if source.line else ""
    return f"{name_location(source.filename, source.lineno)}{text}"


def is_module_input(ref: TensorRef) -> bool:
    """Whether ``ref`` is an argument of the producer module (``input[0]``), not an operand of its op."""
    return ref.role is TensorRole.INPUT


def op_inputs(report: Report) -> list[tuple[TensorRef, TensorStats]]:
    """Input stats that are the op's own (ops mode names them by schema argument), else the module's."""
    own = [(ref, stats) for ref, stats in report.input_stats if not is_module_input(ref)]
    return own or list(report.input_stats)


def named_input(report: Report, argument: str) -> TensorStats | None:
    """The op's operand named ``argument`` (``"self"``, ``"other"``); its value before an in-place op."""
    for ref, stats in report.input_stats:
        if ref.role is TensorRole.OPERAND and ref.name == argument:
            return stats
    return None


def short_label(ref: TensorRef) -> str:
    return str(ref) if is_module_input(ref) else f"`{ref}`"


def input_label(report: Report, ref: TensorRef | str) -> str:
    """``input[0] of fc (Linear)``, or for an operand (a schema name) ```self` of aten.log.default in ...``."""
    if isinstance(ref, TensorRef) and is_module_input(ref):
        return f"{ref} of {where(report)}"
    return f"`{ref}` of {report.op} in {where(report)}"


def input_named(report: Report, zeros: int, negatives: int) -> str:
    """The input whose zeros and negatives the op's output accounts for, by name where the evidence says which.

    The module's own input is the name the user knows; the op's ``self`` is
    named when no module input matches (the op ran on an intermediate value).
    """
    matching = [
        name for name, stats in report.input_stats
        if (stats.zeros, stats.negatives) == (zeros, negatives) and not stats.nonfinite
    ]
    for ref in sorted(matching, key=lambda ref: not is_module_input(ref)):
        return input_label(report, ref)
    if named_input(report, "self") is not None:
        return input_label(report, "self")
    return f"the input of {report.op} in {where(report)}"


def input_lines(report: Report) -> list[str]:
    return [f"{input_label(report, name)}: {stats_phrase(stats)}" for name, stats in report.input_stats]


def constant_inputs(report: Report) -> list[str]:
    """Module inputs that are constant: their variance and centred norm are exactly 0."""
    return [
        f"{input_label(report, name)} is constant ({fmt(stats.min)}): its variance and centred norm are 0"
        for name, stats in report.input_stats
        if is_module_input(name) and stats.numel > 1 and stats.std == 0 and stats.min is not None
    ]


def divisor_phrase(divisor: TensorStats | None) -> str:
    if divisor is None:
        return ""
    rows = ""
    if len(divisor.shape) > 1 and divisor.shape[-1] == 1:
        # A keepdim reduction over the last dim (a std, a norm): one value per row.
        rows = f", a per-row reduction that is 0 for {divisor.zeros} rows"
    return f" (`other` {divisor.shape} held {divisor.zeros} zeros of {divisor.numel}{rows})"


def zeros_phrase(report: Report) -> str:
    zero_inputs = [(name, stats.zeros) for name, stats in report.input_stats if stats.zeros]
    return "".join(f" ({input_label(report, name)} held {zeros} zeros)" for name, zeros in zero_inputs[:1])


def stats_phrase(stats: TensorStats) -> str:
    parts = [f"{stats.dtype} {stats.shape}"]
    if stats.min is not None and stats.max is not None:
        parts.append(f"min {fmt(stats.min)}, max {fmt(stats.max)}")
    if stats.zeros is not None:
        parts.append(f"{stats.zeros} zeros, {stats.negatives} negatives")
    if stats.nonfinite:
        parts.append(stats_counts(stats))
    return ", ".join(parts)


def stats_counts(stats: TensorStats) -> str:
    return counts_phrase(stats.nan or 0, stats.posinf or 0, stats.neginf or 0)


def counts(report: Report) -> str:
    return counts_phrase(report.nan, report.posinf, report.neginf)



def float_dtype(dtype: str | None) -> torch.dtype | None:
    """The floating dtype a report names (``"float16"``), or None when it names none."""
    found = getattr(torch, dtype or "", None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def dtype_max(dtype: str | None) -> float:
    """Largest finite value of a floating dtype named like ``"float16"`` (float32's when unknown)."""
    return torch.finfo(float_dtype(dtype) or torch.float32).max


