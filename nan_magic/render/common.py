"""Formatting shared by every renderer: numbers, names, the summary sentence.

Stdlib only, so that the text report (used in exception messages and logs)
never pulls in pandas or matplotlib.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass

from nan_magic.locations import name_location
from nan_magic.records import (
    LayerCall,
    Report,
    SourcePointer,
    StepSummary,
    TensorStats,
)

#: Largest finite value of each floating dtype, keyed by its short name.
FINITE_LIMITS: dict[str, float] = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}

#: Columns of the per-layer table, in order (the DataFrame and the text table).
COLUMNS = (
    "call", "phase", "module", "type", "tensor", "dtype", "shape",
    "min", "max", "mean", "std", "absmax", "nan", "+inf", "-inf", "status",
)


#: StepSummary fields a history can show, with their labels. Loss and
#: max |activation| always; the others where the watch recorded them.
HISTORY_FIELDS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("absmax", "max |activation|"),
    ("grad_norm", "grad norm"),
    ("headroom", "headroom to overflow"),
    ("input_absmax", "max |input|"),
    ("scale", "loss scale"),
)
_ALWAYS_SHOWN = frozenset({"loss", "absmax"})


def history_fields(history: tuple[StepSummary, ...]) -> list[tuple[str, str]]:
    """The :data:`HISTORY_FIELDS` worth a column: always shown, or recorded somewhere."""
    return [
        (field, label)
        for field, label in HISTORY_FIELDS
        if field in _ALWAYS_SHOWN or any(getattr(entry, field) is not None for entry in history)
    ]


#: Early warnings listed in a report; older ones are counted, not listed.
MAX_WARNINGS = 10


def skipped_line(report: Report) -> str | None:
    """What the watch could not read, or None: ``"12 tensors it cannot read (nested: 12)"``."""
    if not report.skipped:
        return None
    total = sum(count for _reason, count in report.skipped)
    reasons = ", ".join(f"{reason}: {count}" for reason, count in report.skipped)
    return f"{total} tensor{'s' if total != 1 else ''} it cannot read, left unchecked ({reasons})"


def warning_lines(report: Report) -> list[str]:
    """The report's last early warnings, one line each, plus what was left out.

    ``"step 12, encoder.3: activations within 4x of float16's max"``.
    """
    shown = report.warnings[-MAX_WARNINGS:]
    lines = [
        f"step {w.step}{f', {w.module}' if w.module else ''}: {w.message}" for w in shown
    ]
    if len(report.warnings) > len(shown):
        lines.insert(0, f"({len(report.warnings) - len(shown)} earlier warnings not listed)")
    return lines


def short_dtype(dtype: str | None) -> str:
    """``"torch.float16"`` -> ``"float16"``; ``None`` -> ``""``."""
    if not dtype:
        return ""
    return dtype.removeprefix("torch.")


def finite_limit(dtype: str | None) -> float | None:
    """The largest finite value of a floating dtype, or ``None`` if unknown."""
    return FINITE_LIMITS.get(short_dtype(dtype))


def fmt_number(value: float | None) -> str:
    """Four significant digits; empty for a value that was not computed."""
    if value is None:
        return ""
    return f"{value:.4g}"


def fmt_count(value: int | None) -> str:
    """A count, or ``"?"`` where the engine could not count."""
    return "?" if value is None else str(value)


def fmt_shape(shape: tuple[int, ...]) -> str:
    """``(4, 16)`` -> ``"4x16"``; a 0-d tensor is ``"scalar"``."""
    return "x".join(str(size) for size in shape) if shape else "scalar"


def fmt_fraction(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a percentage with three significant digits."""
    if whole <= 0:
        return "?%"
    return f"{100.0 * part / whole:.3g}%"


def module_label(module: str | None) -> str:
    """Display name of a qualified module name (root and outside made visible)."""
    if module is None:
        return "(outside modules)"
    return module or "(root)"


def counts_phrase(nan: int | None, posinf: int | None, neginf: int | None) -> str:
    """The three counts apart, always all three: ``"3 nan, 0 +inf, 1 -inf"``."""
    return f"{fmt_count(nan)} nan, {fmt_count(posinf)} +inf, {fmt_count(neginf)} -inf"


def stats_phrase(stats: TensorStats) -> str:
    """One line about a tensor: dtype, shape, counts and finite range."""
    text = f"{short_dtype(stats.dtype)} {fmt_shape(stats.shape)}: "
    text += counts_phrase(stats.nan, stats.posinf, stats.neginf)
    if stats.min is not None and stats.max is not None:
        text += f", finite values in [{fmt_number(stats.min)}, {fmt_number(stats.max)}]"
    return text


def located_at(report: Report) -> str:
    """``", op aten.mm.default at model.py:12"`` where op and source are known."""
    text = ""
    if report.op:
        text += f", op {report.op}"
    if report.source is not None:
        text += f" at {pointer_short(report.source)}"
    return text


def pointer_short(pointer: SourcePointer) -> str:
    """``Cell In[5], line 12`` or ``models/net.py:12`` (see nan_magic.locations)."""
    return name_location(pointer.filename, pointer.lineno)


def inputs_phrase(report: Report) -> str:
    """Whether the producer's inputs were finite, as a clause."""
    if report.inputs_finite:
        return "its inputs were finite"
    return "its inputs already held non-finite values of another kind"


def summary_sentence(report: Report) -> str:
    """The one sentence every view opens with (issue 3, Summary tab).

    Names the producer (module, type, op, source line), phase and step, the
    three counts and the fraction of the tensor, whether the inputs were
    finite, and the likely cause with its hint.
    """
    verb = "produced" if not report.benign else "produced (benign, not raised)"
    sentence = (
        f"{report.where}{located_at(report)} {verb} "
        f"{counts_phrase(report.nan, report.posinf, report.neginf)} "
        f"({fmt_fraction(report.nonfinite, report.numel)} of {report.numel} elements) "
        f"in its {report.tensor} during the {report.phase} phase of step {report.step}; "
        f"{inputs_phrase(report)}."
    )
    if report.cause is not None:
        sentence += f" Likely cause: {report.cause.label}. {report.cause.hint}"
    return sentence


def producer_position(layers: tuple[LayerCall, ...]) -> int | None:
    """Position (not call index) of the producer's row in ``layers``, if any."""
    for position, layer in enumerate(layers):
        if layer.status == "producer":
            return position
    return None


@dataclass(frozen=True)
class RowWindow:
    """Which rows of a long table are shown, and how many were cut."""

    start: int
    stop: int
    total: int

    @property
    def cut_before(self) -> int:
        return self.start

    @property
    def cut_after(self) -> int:
        return self.total - self.stop

    @property
    def cut(self) -> int:
        return self.cut_before + self.cut_after

    def cut_message(self) -> str:
        """``"1800 rows cut (1200 before, 600 after the rows shown)"``, or ``""``."""
        if not self.cut:
            return ""
        return (
            f"{self.cut} rows cut ({self.cut_before} before, "
            f"{self.cut_after} after the rows shown)"
        )


def row_window(total: int, focus: int | None, limit: int) -> RowWindow:
    """At most ``limit`` consecutive rows of ``total``, placed around ``focus``.

    Two thirds of the room go to rows before the focus: how the values got
    there matters more than the propagation after it.
    """
    if total <= limit:
        return RowWindow(0, total, total)
    if focus is None:
        return RowWindow(0, limit, total)
    start = max(0, min(focus - (2 * limit) // 3, total - limit))
    return RowWindow(start, start + limit, total)


def near_rows(layers: tuple[LayerCall, ...], radius: int) -> tuple[LayerCall, ...]:
    """The rows within ``radius`` positions of the producer (all rows if none)."""
    focus = producer_position(layers)
    if focus is None:
        return layers
    return layers[max(0, focus - radius): focus + radius + 1]


def source_excerpt(pointer: SourcePointer, context: int = 3) -> list[tuple[int, str]]:
    """Lines ``lineno - context .. lineno + context`` of the pointer's file.

    Uses :mod:`linecache`, which also knows IPython cells. Empty when the
    file cannot be read (a frozen module, a deleted temp file).
    """
    lines = linecache.getlines(pointer.filename)
    if not lines or not 1 <= pointer.lineno <= len(lines):
        return []
    first = max(1, pointer.lineno - context)
    last = min(len(lines), pointer.lineno + context)
    return [(number, lines[number - 1].rstrip("\n")) for number in range(first, last + 1)]
