"""The plain-text report: terminals, logs, ``str(report)``, ``text/plain``.

Stdlib only: this runs inside exception messages in scripts and CI.
"""

from __future__ import annotations

from nan_magic.records import LayerCall, Report
from nan_magic.render.common import (
    cause_sentence,
    fact_rows,
    fmt_count,
    fmt_number,
    fmt_shape,
    in_call_order,
    producer_position,
    row_window,
    stats_phrase,
)
from nan_magic.render.fixes import fixes_text
from nan_magic.render.layer_tree import depth, layers_count, missing_note, row_labels, shown_statuses, unmeasured_note
from nan_magic.render.text_histograms import histograms_text
from nan_magic.render.words.counted import counted
from nan_magic.render.words.names import row_tensor
from nan_magic.render.words.note_words import debugger_command

#: Rows of the per-layer table shown in text; the rest is summarised as cut.
TEXT_MAX_ROWS = 30

#: The status and the counts first, as in the HTML table (table.VIEW_COLUMNS).
_TEXT_COLUMNS = (
    "call", "status", "nan", "+inf", "-inf", "module", "phase", "tensor", "dtype", "shape",
    "min", "max", "absmax",
)
_NUMERIC = frozenset({"call", "min", "max", "absmax", "nan", "+inf", "-inf"})
#: Long module names are cut from the left: the tail names the layer.
_MAX_CELL = 40


def render_text(report: Report, compact: bool = False) -> str:
    """``report`` as a plain-text report (:func:`render_compact_text` with ``compact``: the note under a script's
    uncaught NonFiniteError).

    Headline, cause, fixes, producer facts, the producer's histograms, per-layer table (:data:`TEXT_MAX_ROWS` rows
    at most, those around the producer, the others summarised as ``"N rows cut"``) and the frame ``%debug`` opens,
    separated by blank lines.
    """
    if compact:
        return render_compact_text(report)
    parts = [
        f"nan_magic: {report.message}",
        cause_sentence(report),
        fixes_text(report),
        _facts(report),
        histograms_text(report),
    ]
    if report.layers:
        parts.append(_layer_section(report, TEXT_MAX_ROWS))
    debug = _debug_section(report)
    if debug:
        parts.append(debug)
    return "\n\n".join(part for part in parts if part)


def render_compact_text(report: Report) -> str:
    """The report as it reads under an error in a script or a CI log (the note a watch adds to its NonFiniteError):
    the cause, the fixes tried, the producer's facts and the frame the debugger opens in; the headline is the
    error's own line, and the histograms and the per-layer table are left to ``print(error.report)``."""
    parts = [
        "nan_magic report (print(error.report) adds the histograms and the per-layer table):",
        cause_sentence(report),
        fixes_text(report),
        _facts(report),
        _debug_section(report, frames=False),  # (the traceback above is those frames)
    ]
    return "\n\n".join(part for part in parts if part)


def _facts(report: Report) -> str:
    rows = fact_rows(report)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}".rstrip() for label, value in rows)


def _cell(text: str) -> str:
    return text if len(text) <= _MAX_CELL else "..." + text[-(_MAX_CELL - 3):]


def _layer_row(layer: LayerCall, status: str, label: str) -> dict[str, str]:
    stats = layer.stats
    row = {
        "call": "" if layer.index is None else str(layer.index),
        "phase": str(layer.phase),
        # Indented by depth (two spaces a level, at most eight levels): the model's tree, as torchinfo prints it.
        "module": "  " * min(depth(layer), 8) + _cell(label),
        "status": status,
    }
    if stats is None:  # a module the step has no numbers for: its status says why
        return {column: row.get(column, "") for column in _TEXT_COLUMNS}
    return {
        **row,
        "tensor": row_tensor(layer),
        "dtype": stats.dtype,
        "shape": fmt_shape(stats.shape),
        "min": fmt_number(stats.min),
        "max": fmt_number(stats.max),
        "absmax": fmt_number(stats.absmax),
        "nan": fmt_count(stats.nan),
        "+inf": fmt_count(stats.posinf),
        "-inf": fmt_count(stats.neginf),
    }


def _layer_section(report: Report, max_rows: int) -> str:
    layers = in_call_order(report.layers)
    focus = producer_position(layers)
    window = row_window(len(layers), focus, max_rows)
    shown = layers[window.start: window.stop]
    cells = [_layer_row(layer, status, label)
             for layer, status, label in zip(shown, shown_statuses(shown), row_labels(shown, layers))]
    widths = {
        column: max([len(column)] + [len(row[column]) for row in cells])
        for column in _TEXT_COLUMNS
    }

    def line(values: dict[str, str], marker: str) -> str:
        aligned = (
            values[c].rjust(widths[c]) if c in _NUMERIC else values[c].ljust(widths[c])
            for c in _TEXT_COLUMNS
        )
        return f"{marker} " + "  ".join(aligned).rstrip()

    title = f"Layers of step {report.step}: {layers_count(layers)}"
    if report.layers_dropped:
        title += f" ({counted(report.layers_dropped, 'earlier call')} not kept)"
    lines = [title, line({c: c for c in _TEXT_COLUMNS}, " ")]
    lines.extend(
        line(values, ">" if layer.status == "producer" else " ")
        for layer, values in zip(shown, cells)
    )
    if window.cut:
        lines.append(f"  ... {window.cut_message()}; report.table has every row")
    for note in (missing_note(shown, moments=False), unmeasured_note(shown)):
        if note:
            lines.append(f"  {note}")
    return "\n".join(lines)


def _debug_section(report: Report, *, frames: bool = True) -> str:
    if report.debug_frame is None and not (frames and report.frames):
        return ""
    lines = []
    if report.debug_frame is not None:
        lines.append(f"{debugger_command()} opens in {report.debug_frame}")
    lines.extend(f"  local {name}: {stats_phrase(stats)}" for name, stats in report.debug_locals)
    if frames and report.frames:
        lines.append("Frames from your code to the producer:")
        for frame in report.frames:
            lines.append(f"  {frame}")
            if frame.line:
                lines.append(f"      {frame.line.strip()}")
    return "\n".join(lines)
