"""The words every cause's sentences share: the producer's place, the op's inputs by role, counts.

A cause of one event carries that event as its ``event`` fact
(explain/evidence.py); :func:`event_of` reads it back as a :class:`Report`
of the producer's fields, and the phrases below name its parts the same way
for every reading.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from nan_magic.locations import name_location
from nan_magic.plain import from_plain
from nan_magic.records import Cause, Phase, Report, TensorRef, TensorRole, TensorStats, module_label
from nan_magic.render.words.counted import counted
from nan_magic.render.words.operands import operand_names, written_line
from nan_magic.tensor_refs import op_function

__all__ = [
    "Reading",
    "constant_inputs",
    "counts",
    "counts_phrase",
    "divisor_phrase",
    "event_of",
    "fmt",
    "input_label",
    "input_lines",
    "input_named",
    "inputs_or_counts",
    "line",
    "on_event",
    "rerun_for_op",
    "short_label",
    "stats_counts",
    "what",
    "where",
    "zeros_phrase",
]


@dataclass(frozen=True)
class Reading:
    """How one reading of a cause is written: its hint (with the fix) and its evidence lines."""

    hint: Callable[[Cause], str]
    evidence: Callable[[Cause], tuple[str, ...]]
    #: Whether the hint opens with a common word ("the ..."), capitalised at a sentence's start; one that
    #: opens with a name (an op, a parameter) keeps its case. A callable where the opening word varies.
    sentence: bool | Callable[[Cause], bool] = True


def on_event(
    hint: Callable[[Report, Cause], str],
    evidence: Callable[[Report, Cause], tuple[str, ...]],
    sentence: bool | Callable[[Report], bool] = True,
) -> Reading:
    """A reading of one event, written from the event (:func:`event_of`) and the cause's own numbers."""
    opens = sentence if isinstance(sentence, bool) else lambda cause: sentence(event_of(cause))
    return Reading(lambda cause: hint(event_of(cause), cause), lambda cause: evidence(event_of(cause), cause), opens)


def event_of(cause: Cause) -> Report:
    """The event a cause is about, as the diagnosis saw it."""
    return _decoded(cause.fact("event"))


@functools.lru_cache(maxsize=64)
def _decoded(pairs: tuple[tuple[str, object], ...]) -> Report:
    return from_plain(Report, pairs)


def fmt(value: float | None) -> str:
    """``31000.0`` → ``"3.1e4"``; ``0.52`` → ``"0.52"``."""
    if value is None:
        return "?"
    if not math.isfinite(value):  # an lr of inf, a bound past float64: int() would raise
        return str(value)
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    text = f"{value:.3g}"
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'-' if m.group(1) == '-' else ''}{m.group(2)}", text)


def counts_phrase(nan: int, posinf: int, neginf: int) -> str:
    """The non-zero counts only: ``"334 +inf"``; ``"non-finite"`` where none is known."""
    parts = [f"{count} {kind}" for kind, count in (("nan", nan), ("+inf", posinf), ("-inf", neginf)) if count]
    return ", ".join(parts) or "non-finite"


def rerun_for_op(report: Report) -> str:
    """What a hint says of an op it does not know: rerun with ops=True, unless every op was traced already.

    ops=True traced them; so did the default watch's replay of the step, which reproduced the event under the
    op tracer (its note ``step-replayed``) and still names no op: ops=True would see no more.
    """
    if report.ops or any(note.kind == "step-replayed" for note in report.note_facts):
        return ("the op tracer saw no op make it from finite values (it came from code it does not see: another "
                "thread, a C extension's own kernel, or from a tensor that is no argument, parameter or buffer of "
                "the module, such as a plain tensor attribute made non-finite in an earlier step)")
    return "rerun with ops=True (%%nantrace --ops) to name the op"


def counts(report: Report) -> str:
    return counts_phrase(report.nan, report.posinf, report.neginf)


#: The notes of an optimizer-phase event whose op ran in the loop's own code, not in an optimizer's step: a learning
#: rate it made non-finite, or a parameter it wrote (localize/outside/lr_lines.py, loop_writes.py).
LOOP_OP_NOTES = frozenset({"lr-made-by-loop", "loop-wrote", "loop-wrote-after-step"})


def op_counts(report: Report) -> tuple[int, int]:
    """``(nan, inf)`` the report's op made: the event's, but where the event is a parameter that an op of the loop's
    own code made non-finite (a learning rate it made, a write: :data:`LOOP_OP_NOTES`), that op's own output's."""
    note = next((note for note in report.note_facts if note.kind in LOOP_OP_NOTES), None)
    if note is not None and note.fact("nan") is not None:
        return note.fact("nan"), note.fact("posinf") + note.fact("neginf")
    return report.nan, report.posinf + report.neginf


def stats_counts(stats: TensorStats) -> str:
    return counts_phrase(stats.nan or 0, stats.posinf or 0, stats.neginf or 0)


def where(report: Report) -> str:
    # A batch the loop computed: its op ran in the loop's code, before the model it entered (the report's module);
    # so did a learning rate the loop computed (the optimizer's event names the stepped parameter's module).
    # So did an update the loop wrote into a parameter by hand (an EMA teacher's, a renormalisation).
    in_loop = report.op is not None and (report.phase == Phase.DATA or any(
        note.kind in LOOP_OP_NOTES for note in report.note_facts))
    if report.module is None or in_loop:
        if report.source is not None:
            return f"the code at {name_location(report.source.filename, report.source.lineno)}"
        return "code outside the watched modules"
    if report.phase == Phase.OPTIMIZER and report.op is not None and report.optimizer and report.tensor.name:
        # The op ran in the optimizer's step for that parameter, not in the code of the module that owns it
        # ("aten.div.Tensor in head_b (Linear)" read as head_b's forward).
        return f"the {report.optimizer} step of {report.tensor.name}"
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


def short_label(report: Report, ref: TensorRef) -> str:
    """A module input as itself (``input[0]``); an op's operand by the name the user wrote for it where the line
    says it unambiguously (```kappa```, not ```self```), else by its schema name."""
    if ref.is_argument:
        return str(ref)
    said = _said(report, ref.name) if ref.role is TensorRole.OPERAND and ref.name else None
    return f"`{ref}`" if said is None or _literal(said) else f"`{said}`"


def _said(report: Report, operand: str) -> str | None:
    """What the user wrote on the line for the op's ``operand`` (a schema name), where the line says it."""
    tensors = {ref.name for ref, _stats in report.input_stats if ref.role is TensorRole.OPERAND and ref.name}
    return operand_names(report.op, written_line(report), tensors).get(operand)


def input_label(report: Report, ref: TensorRef | str) -> str:
    """``input[0] of fc (Linear)``, or for an operand (a schema name) ```self` of aten.log.default in ...``."""
    if isinstance(ref, TensorRef) and ref.is_argument:
        return f"{ref} of {where(report)}"
    return f"`{ref}` of {report.op} in {where(report)}"


def input_named(report: Report, zeros: int, negatives: int) -> str:
    """The input whose zeros and negatives the op's output accounts for, by name where the evidence says which.

    The module's own input is the name the user knows; the op's ``self`` is
    named when no module input matches (the op ran on an intermediate value).
    """
    # xlogy(x, y) = x * log(y): the log's operand is ``other`` (y); ``self`` (x) only multiplies (xlog1py's too).
    x_log = report.op is not None and op_function(report.op).removeprefix("special_") in ("xlogy", "xlog1py")
    domain, multiplier = ("other", "self") if x_log else ("self", None)
    matching = [
        ref for ref, stats in report.input_stats
        if (stats.zeros, stats.negatives) == (zeros, negatives) and not stats.nonfinite
        and not (ref.role is TensorRole.OPERAND and ref.name == multiplier)
    ]
    for ref in sorted(matching, key=lambda ref: not ref.is_argument):
        return _as_written(report, ref)
    selfs = [ref for ref, _stats in report.input_stats if ref.role is TensorRole.OPERAND and ref.name == domain]
    if selfs:
        return _as_written(report, selfs[0])
    return f"the input of {report.op} in {where(report)}"


def _as_written(report: Report, ref: TensorRef) -> str:
    """An input by :func:`input_label`, with what the line wrote for an operand first: "`rate` (`self` of
    aten.log.default in ...)", where "`self` of aten.log.default" alone left the reader to find which tensor it was."""
    label, written = input_label(report, ref), short_label(report, ref)
    return label if ref.is_argument or written == f"`{ref}`" else f"{written} ({label})"


def input_lines(report: Report) -> tuple[str, ...]:
    return tuple(f"{input_label(report, ref)}: {_stats_phrase(stats)}" for ref, stats in report.input_stats)


def inputs_or_counts(event: Report, _cause: Cause) -> tuple[str, ...]:
    """The evidence of a reading that fits no rule: the inputs, or where none was read the counts."""
    return input_lines(event) or (f"{event.tensor}: {counts(event)}",)


def constant_inputs(report: Report) -> tuple[str, ...]:
    """Module inputs that are constant: their variance and centred norm are exactly 0."""
    return tuple(
        f"{input_label(report, ref)} is constant ({fmt(stats.min)}): its variance and centred norm are 0"
        for ref, stats in report.input_stats
        if ref.is_argument and stats.numel > 1 and stats.std == 0 and stats.min is not None
    )


def number_phrase(report: Report, operand: str) -> str:
    """`` (t = 0.0, a Python number)`` where the op's ``operand`` (a schema name) was a Python number; else ``""``.

    The user's name for it where the line says it unambiguously (render/words/operands.py), else the schema's.
    """
    value = next((value for name, value in report.numbers if name == operand), None)
    if value is None:
        return ""
    said = _said(report, operand)
    name = f"`{operand}`" if said is None or _literal(said) else said  # (``x / 0.0`` names no variable)
    return f" ({name} = {value}, a Python number)"


def _literal(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def divisor_phrase(divisor: TensorStats | None, name: str = "other") -> str:
    """The divisor's zeros, by its operand name (``self`` of a reciprocal, ``1.0 / counts``; ``other`` of a div)."""
    if divisor is None:
        return ""
    if divisor.shape == () and divisor.zeros:
        # A 0-d divisor (a mean, a norm, a count): "`other` () held 1 zero of 1" read as a garbled shape.
        return f" (`{name}`, a single number, was 0)"
    # (Its shape says one value per row, not what made it: a keepdim std and a schedule's entries gathered by
    # timestep, ``alphas_cumprod[t].view(-1, 1)``, look alike. What made it is said where known: spread-divisor.)
    rows = f", one value per row: 0 for {counted(divisor.zeros, 'row')}" if len(divisor.shape) > 1 and (
        divisor.shape[-1] == 1) else ""
    return f" (`{name}` {divisor.shape} held {counted(divisor.zeros, 'zero')} of {divisor.numel}{rows})"


def zeros_phrase(report: Report) -> str:
    zero_inputs = [(ref, stats.zeros) for ref, stats in report.input_stats if stats.zeros]
    return "".join(f" ({input_label(report, ref)} held {counted(zeros, 'zero')})" for ref, zeros in zero_inputs[:1])


def _stats_phrase(stats: TensorStats) -> str:
    parts = [f"{stats.dtype} {stats.shape}"]
    if stats.min is not None and stats.max is not None:
        parts.append(f"min {fmt(stats.min)}, max {fmt(stats.max)}")
    if stats.zeros is not None:
        parts.append(f"{counted(stats.zeros, 'zero')}, {counted(stats.negatives, 'negative')}")
    if stats.nonfinite:
        parts.append(stats_counts(stats))
    return ", ".join(parts)
