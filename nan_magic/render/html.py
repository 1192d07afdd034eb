"""The static, self-contained HTML report.

Used as the ``text/html`` fallback (VS Code without widgets, nbviewer,
GitHub) and by ``report.to_html(path)``. It is a fragment (no ``<html>``
element) so that it can sit inside a notebook output, and pure ASCII
(non-ASCII characters become character references) so that a file written
from it reads the same in any encoding. The widget reuses its sections.
"""

from __future__ import annotations

import base64
from html import escape

from nan_magic.records import LayerCall, Report, SourcePointer, StepSummary
from nan_magic.render.common import (
    about_zeros,
    cause_sentence,
    fact_rows,
    fmt_number,
    headline,
    history_fields,
    history_value,
    in_call_order,
    labelled_samples,
    measured,
    module_label,
    plotted_history_fields,
    producer_position,
    row_window,
    source_excerpt,
    stats_phrase,
)
from nan_magic.render.fixes import fix_lines, fixes_title
from nan_magic.render.history_layers import layer_magnitude_lines
from nan_magic.render.layer_tree import layers_count, missing_note, unmeasured_note
from nan_magic.render.plots import histogram_png, history_png
from nan_magic.render.table import TABLE_CSS, layers_html
from nan_magic.render.words.counted import counted

#: Rows of the per-layer table in the static HTML.
HTML_MAX_ROWS = 200
#: Histograms in one static figure; the widget's selector reaches the rest.
HTML_MAX_SAMPLES = 6
#: Steps of history listed as a table (the plot shows all of them).
HISTORY_ROWS = 20

REPORT_CSS = TABLE_CSS + """
.nan-magic-report { font-family: sans-serif; font-size: 13px; line-height: 1.4; }
.nan-magic-report h3 { color: #c62828; font-size: 15px; margin: 4px 0; }
.nan-magic-report h4 { font-size: 13px; margin: 12px 0 4px 0; }
.nan-magic-report table.nm-facts td { padding: 1px 10px 1px 0; vertical-align: top;
                                      text-align: left; }
.nan-magic-report table.nm-facts td:first-child { font-weight: bold; }
.nan-magic-report table.nm-facts { margin: 4px 0; }
.nm-code { font-family: monospace; font-size: 12px; margin: 4px 0; padding: 4px;
           background: rgba(127, 127, 127, 0.12); white-space: pre; overflow-x: auto; }
.nm-code .nm-mark { background: rgba(230, 40, 40, 0.30); font-weight: bold; }
.nm-scroll { max-height: 420px; overflow: auto; }
.nm-cut { font-style: italic; opacity: 0.8; }
.nan-magic-report details.nm-section { margin: 2px 0; }
.nan-magic-report details.nm-section > summary { cursor: pointer; font-weight: bold; padding: 3px 0; }
.nan-magic-report details.nm-section[open] > summary { border-bottom: 1px solid rgba(127, 127, 127, 0.4); }
"""


def render_html(report: Report, element_id: str | None = None) -> str:
    """Render ``report`` as one self-contained HTML fragment: the report's static twin.

    Parameters
    ----------
    element_id
        An ``id`` for the outer element. A live widget hides the output that
        holds it (:mod:`nan_magic.render.display`); and the fragment hides
        the output right after its own when that holds no live report: the
        widget's "Error displaying widget: model not found" once the kernel
        is gone (a saved notebook reopened, an nbconvert export).

    Returns
    -------
    str
        The headline, the cause sentence and the facts, then one closed
        ``<details>`` per tab of the widget (Layers, Histograms, Debug,
        History): about one screen tall until a reader opens a section, with
        no script and no stylesheet needed to open one (GitHub, nbviewer and
        sanitised outputs keep ``<details>``).
    """
    sections = "".join(
        f'<details class="nm-section"><summary>{title}</summary>\n{body}\n</details>\n'
        for title, body in (
            layers_section(in_call_order(report.layers), report.layers_dropped),
            histograms_section(report),
            debug_section(report),
            history_section(report),
        )
    )
    identity, hide_dead_widget = "", ""
    if element_id:
        identity = f' id="{escape(element_id)}"'
        hide_dead_widget = f"<style>{DEAD_WIDGET_CSS.replace('ELEMENT', escape(element_id))}</style>\n"
    page = (
        f'<div class="nan-magic-report nm-static"{identity}>\n'
        f"<style>{REPORT_CSS}</style>\n{hide_dead_widget}"
        f"{summary_html(report)}\n{fixes_html(report)}\n{facts_html(report)}\n{sections}</div>"
    )
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


#: Hides the output after the static twin's (ELEMENT: its id) unless a live
#: report widget renders there. JupyterLab and Notebook 7 draw a widget view
#: whose model is gone (the kernel restarted, the notebook reopened) as "Error
#: displaying widget: model not found" and do not fall back to another type
#: of that output; the twin then is the report.
DEAD_WIDGET_CSS = (
    ".jp-OutputArea-child:has(#ELEMENT) + .jp-OutputArea-child:not(:has(.nan-magic-widget))"
    " { display: none; }"
)


def hide_static_css(element_id: str) -> str:
    """The live widget's style that hides its static twin's output (prompt and margins included)."""
    return (
        f"<style>#{element_id}, .jp-OutputArea-child:has(#{element_id}) {{ display: none; }}</style>"
    )


def png_img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}"/>'


def summary_html(report: Report) -> str:
    """The headline and one sentence: the likely cause with its fix."""
    return (
        f'<h3 class="nm-headline" title="{escape(report.message)}">{escape(headline(report))}</h3>\n'
        f'<p class="nm-summary">{escape(cause_sentence(report))}</p>'
    )


def fixes_html(report: Report) -> str:
    """The "Fixes tried" section (render/fixes.py): verified ones first, each verified one's edit as a suggestion."""
    if not report.fixes:
        return ""
    items = []
    for trial, text, edit in fix_lines(report):
        mark = "nm-verified" if trial.finite and not trial.fact("off_scale") else "nm-unverified"
        suggestion = f'<br/>suggested edit (not applied): <code>{escape(edit)}</code>' if edit else ""
        items.append(f'<li class="{mark}">{escape(text)}{suggestion}</li>')
    return f'<div class="nm-fixes"><h4>{escape(fixes_title(report))}</h4><ul>{"".join(items)}</ul></div>'


def facts_html(report: Report) -> str:
    body = "".join(
        f"<tr><td>{escape(label)}</td><td>{_fact_value(label, value)}</td></tr>"
        for label, value in fact_rows(report)
    )
    return f'<table class="nm-facts">{body}</table>'


def _fact_value(label: str, value: str) -> str:
    if label in ("op", "line"):
        return f"<code>{escape(value)}</code>"
    return escape(value)


def source_html(pointer: SourcePointer | None, title: str = "Source") -> str:
    """The pointer and a few lines of code around it, the line marked."""
    if pointer is None:
        return ""
    excerpt = source_excerpt(pointer)
    if excerpt:
        width = len(str(excerpt[-1][0]))
        lines = []
        for number, text in excerpt:
            marker = "&gt;" if number == pointer.lineno else " "
            line = f"{marker} {number:>{width}}  {escape(text)}"
            lines.append(f'<span class="nm-mark">{line}</span>' if marker != " " else line)
        code = "\n".join(lines)
    elif pointer.line:
        code = f'<span class="nm-mark">&gt; {pointer.lineno}  {escape(pointer.line)}</span>'
    else:
        code = "(source not available)"
    return (
        f"<h4>{escape(title)}: <code>{escape(str(pointer))}</code></h4>\n"
        f'<div class="nm-code">{code}</div>'
    )


def layers_table_html(
    layers: tuple[LayerCall, ...], limit: int = HTML_MAX_ROWS, among: tuple[LayerCall, ...] | None = None
) -> tuple[str, str]:
    """The styled table of at most ``limit`` rows around the producer (in a scrolling box), and the message
    saying what was cut (empty when nothing was); ``among``: the step's rows, where ``layers`` are those filtered."""
    if not layers:
        return "<p>No layer calls recorded.</p>", ""
    focus = producer_position(layers)
    window = row_window(len(layers), focus, limit)
    shown = layers[window.start: window.stop]
    table = layers_html(shown, layers if among is None else among)
    return f'<div class="nm-scroll">{table}</div>', window.cut_message()


def layers_section(layers: tuple[LayerCall, ...], dropped: int) -> tuple[str, str]:
    """The per-layer section's title and body: the table and what was cut."""
    table, cut = layers_table_html(layers)
    title = f"Layers ({layers_count(layers)}"
    title += f"; {dropped} earlier calls not kept)" if dropped else ")"
    notes = [cut + "; <code>report.table</code> has every row"] if cut else []
    if layers:
        notes.extend((moments_note(layers), escape(unmeasured_note(layers))))
    return title, table + "".join(f'<p class="nm-cut">{note}</p>' for note in notes if note)


def moments_note(layers: tuple[LayerCall, ...]) -> str:
    """What the table's empty number cells mean (mean and std not measured, no finite value): said wherever the
    table is shown."""
    return escape(missing_note(layers))


def histograms_section(report: Report) -> tuple[str, str]:
    """Embedded PNG histograms of the producer's samples (other layers: the widget's selector)."""
    title = "Histograms"
    producer = [sample for sample in labelled_samples(report) if sample.producer]
    if not producer:
        return title, "<p>No value samples were recorded for this event.</p>"
    shown = tuple(producer[:HTML_MAX_SAMPLES])
    body = HISTOGRAMS_CAPTION + png_img(
        histogram_png(shown, about_zeros(report)),
        "histograms of " + ", ".join(s.label for s in shown),
    )
    left = len(report.samples) - len(shown)
    if left:
        body += f'<p class="nm-cut">{counted(left, "more sample")} not drawn here.</p>'
    return title, body


HISTOGRAMS_CAPTION = '<p class="nm-cut">Elements per value, log scale; red: non-finite.</p>\n'


def debug_section(report: Report) -> tuple[str, str]:
    """The Debug section: the source around the line, the frame %debug opens and its locals."""
    body = source_html(report.source) + debug_html(report)
    if report.debug_frame is not None:
        body += "<p>Run <code>%debug</code> in a new cell to inspect that frame's locals.</p>"
    return "Debug", body or "<p>No source location was recorded for this event.</p>"


def debug_html(report: Report) -> str:
    """What ``%debug`` opens on, and the frames between it and the user's code."""
    parts = []
    if report.debug_frame is not None and report.debug_frame == report.source:
        parts.append(
            f"<h4>%debug opens in <code>{escape(str(report.debug_frame))}</code>"
            " (the source line above)</h4>"
        )
    elif report.debug_frame is not None:
        parts.append(source_html(report.debug_frame, "%debug opens in"))
    if report.debug_locals:
        items = "".join(
            f"<li><code>{escape(name)}</code>: {escape(stats_phrase(stats))}</li>"
            for name, stats in report.debug_locals
        )
        later = [note for note in report.note_facts if note.kind == "debug-later-step"]
        # The deferred check of an optimizer step's result runs in the next step: the locals are that step's.
        when = f" (step {later[0].fact('judged')}'s, where the deferred check ran)" if later else ""
        parts.append(f"<h4>Tensors among that frame's locals{when}</h4>\n<ul>{items}</ul>")
    if report.frames:
        items = "".join(
            f"<li><code>{escape(str(frame))}</code>"
            + (f"<br/><code>{escape(frame.line.strip())}</code>" if frame.line else "")
            + "</li>"
            for frame in report.frames
        )
        parts.append(f"<h4>Frames from your code to the producer</h4>\n<ol>{items}</ol>")
    return "\n".join(parts)


def _history_cell(entry: StepSummary, field: str) -> str:
    value = fmt_number(history_value(entry, field))
    if field == "absmax" and value:
        value += f" ({measured(entry)})"
    if field == "headroom" and value and entry.headroom_module is not None:
        where = module_label(entry.headroom_module)
        value += f" ({escape(where)} {escape(entry.headroom_dtype or '')})"
    return value


def history_section(report: Report) -> tuple[str, str]:
    """Loss, largest |activation| and the rest of the history: a plot and the last rows."""
    if not report.history:
        return "History", "<p>No history: the watch kept no earlier steps.</p>"
    recent = report.history[-HISTORY_ROWS:]
    fields = history_fields(report.history)
    head = "".join(f"<th>{escape(label)}</th>" for _, label in fields)
    body = "".join(
        f"<tr><td>{entry.step}</td>"
        + "".join(f"<td>{_history_cell(entry, field)}</td>" for field, _ in fields)
        + f"<td>{'yes' if entry.nonfinite else ''}</td></tr>"
        for entry in recent
    )
    table = (
        f'<table class="nm-table nm-history"><thead><tr><th>step</th>{head}'
        f"<th>non-finite</th></tr></thead><tbody>{body}</tbody></table>"
    )
    title = f"History ({counted(len(report.history), 'step')} kept"
    title += f"; the table lists the last {HISTORY_ROWS})" if len(report.history) > HISTORY_ROWS else ")"
    if plotted_history_fields(report.history):
        plot = png_img(history_png(report.history, report.step, report.module), "loss and max |output| per step")
    else:
        plot = '<p class="nm-cut">No plot: no value was recorded at two steps or more.</p>'
    lines = layer_magnitude_lines(report.history, report.module)
    layers = ""
    if lines:
        items = "".join(f"<li>{escape(line)}</li>" for line in lines[1:])
        layers = f'<p class="nm-layers-history">{escape(lines[0])}</p><ul>{items}</ul>\n'
    # The layers first: the plot is taller than the tab, and what the layers inside came to is the news.
    return title, f'{layers}{plot}\n<div class="nm-scroll">{table}</div>'
