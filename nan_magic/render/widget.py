"""The interactive report: core ipywidgets only (no custom widget JavaScript).

Core controls render in JupyterLab, Notebook 7, VS Code and Colab without
installing a frontend extension; the code runs on ipywidgets 7 (Colab's)
and 8. Everything a tab shows is bounded: the table renders at most
``max_rows`` rows (filtering re-renders on demand) and a histogram is
drawn only for the sample picked in the selector, so a model with
thousands of module calls does not freeze the kernel or the page.
"""

from __future__ import annotations

import base64
from html import escape

import ipywidgets as widgets

from nan_magic.records import LayerCall, Report
from nan_magic.render.common import (
    about_zeros,
    in_call_order,
    labelled_samples,
    module_label,
    near_rows,
)
from nan_magic.render.html import (
    HTML_MAX_ROWS,
    HTML_MAX_SAMPLES,
    REPORT_CSS,
    debug_section,
    facts_html,
    fixes_html,
    hide_static_css,
    history_section,
    layers_table_html,
    moments_note,
    summary_html,
)
from nan_magic.render.layer_tree import layers_count, unmeasured_note
from nan_magic.render.plots import histogram_png
from nan_magic.render.words.counted import counted, noun
from nan_magic.render.words.names import row_tensor

#: Tab titles, in order. Tests and users' screenshots rely on them.
TAB_TITLES = ("Summary", "Layers", "Histograms", "Debug", "History")
#: Rows on each side of the producer kept by "only rows near the producer".
NEAR_RADIUS = 10
#: Dropdown value that draws every sample at once.
ALL_SAMPLES = -1
#: Height of every tab's content: switching tabs must not move the cells
#: below, and the report must stay well under the ~1,800 px at which
#: Notebook 7 boxes an output in a scroll area. Longer content scrolls inside.
PANEL_HEIGHT = "560px"


def build_widget(report: Report, hides: str | None = None) -> widgets.Tab:
    """The tabbed report widget: Summary, Layers, Histograms, Debug and History.

    ``hides`` is the element id of this report's static copy, hidden while the widget shows (the style lives in
    the widget, so it goes with it).
    """
    hide = hide_static_css(hides) if hides else ""
    children = [
        _html(hide + summary_html(report) + fixes_html(report) + facts_html(report)),
        LayersView(in_call_order(report.layers), report.layers_dropped, HTML_MAX_ROWS).widget,
        HistogramsView(report).widget,
        _html(debug_section(report)[1]),
        _html(history_section(report)[1]),
    ]
    for child in children:
        # No margin either: an HTML widget has one and a box has none, which would make tabs differ by 4 px.
        child.layout.height, child.layout.overflow, child.layout.margin = PANEL_HEIGHT, "auto", "0px"
    tab = widgets.Tab(children=children)
    if tab.has_trait("titles"):  # ipywidgets 8
        tab.titles = TAB_TITLES
    else:  # ipywidgets 7 (Colab's): titles are set one by one
        for index, title in enumerate(TAB_TITLES):
            tab.set_title(index, title)
    tab.add_class("nan-magic-widget")
    return tab


def _styled(body: str) -> str:
    # Each HTML widget carries the stylesheet: tabs render independently.
    return f'<div class="nan-magic-report"><style>{REPORT_CSS}</style>{body}</div>'


def _html(body: str) -> widgets.HTML:
    return widgets.HTML(_styled(body))


def _row_text(layer: LayerCall) -> str:
    """What the filter box matches against, lower-cased."""
    return " ".join((
        module_label(layer.module, layer.module_type, layer.model),  # a GAN's "d" finds D's rows
        layer.status,
        str(layer.phase),
        row_tensor(layer),
        layer.stats.dtype if layer.stats is not None else "",
    )).lower()


def touched_rows(layers: tuple[LayerCall, ...]) -> tuple[LayerCall, ...]:
    """The producer and every row the event touched (propagated, benign): the measured rows that are not ok."""
    return tuple(layer for layer in layers if layer.status != "ok" and layer.stats is not None)


class LayersView:
    """The Layers tab: filter box, "near the producer" toggle and table."""

    def __init__(self, layers: tuple[LayerCall, ...], dropped: int, max_rows: int) -> None:
        self.layers = layers
        self.max_rows = max_rows
        # No description label: the placeholder says what the box is, and a
        # label would take the room it needs to be read whole.
        self.filter = widgets.Text(
            placeholder="filter rows: module, type, status, dtype (all words match)",
            continuous_update=False,
            layout=widgets.Layout(width="440px"),
        )
        # Each toggle is offered only where it changes what the table shows.
        self.touched = widgets.ToggleButton(
            value=False,
            description="only non-finite rows",
            tooltip="the producer and the rows that hold non-finite values",
            disabled=len(touched_rows(layers)) in (0, len(layers)),
            layout=widgets.Layout(width="auto"),
        )
        self.near = widgets.ToggleButton(
            value=False,
            description="only rows near the producer",
            tooltip=f"{NEAR_RADIUS} rows before and after the producer",
            disabled=len(near_rows(layers, NEAR_RADIUS)) == len(layers),
            layout=widgets.Layout(width="auto"),
        )
        self.status = widgets.HTML()
        self.table = widgets.HTML()
        title = layers_count(layers)
        if dropped:
            title += f"; {counted(dropped, 'earlier call')} not kept"
        note = " ".join(part for part in (moments_note(layers), escape(unmeasured_note(layers))) if part)
        self.widget = widgets.VBox([
            widgets.HBox([self.filter, self.touched, self.near]),
            widgets.HTML(f"<b>{title}</b>"),
            self.status,
            self.table,
            widgets.HTML(_styled(f'<p class="nm-cut">{note}</p>') if note else ""),
        ])
        self.filter.observe(self._refresh, names="value")
        self.near.observe(self._refresh, names="value")
        self.touched.observe(self._refresh, names="value")
        self._refresh()

    def rows(self) -> tuple[LayerCall, ...]:
        """The rows that pass the toggle and the filter box, in call order."""
        rows = near_rows(self.layers, NEAR_RADIUS) if self.near.value else self.layers
        if self.touched.value:
            rows = touched_rows(rows)
        words = self.filter.value.lower().split()
        if words:
            rows = tuple(
                layer for layer in rows if all(word in _row_text(layer) for word in words)
            )
        return rows

    def _refresh(self, _change: object = None) -> None:
        rows = self.rows()
        table, cut = layers_table_html(rows, self.max_rows, self.layers)
        self.table.value = _styled(table)
        status = f"{len(rows)} of {counted(len(self.layers), 'row')} {noun(len(rows), 'matches', 'match')}"
        if cut:
            status += f"; {cut}. Narrow the filter, or use <code>report.table</code>"
        self.status.value = f'<span class="nm-cut">{status}.</span>'


class HistogramsView:
    """The Histograms tab: a sample selector and the figure it picks."""

    def __init__(self, report: Report) -> None:
        self.samples = labelled_samples(report)
        self.zeros = about_zeros(report)
        options: list[tuple[str, int]] = [
            (f"{position}: {sample.label}", position)
            for position, sample in enumerate(self.samples)
        ]
        if sum(sample.producer for sample in self.samples) > 1:
            options.insert(0, ("all samples of the producer", ALL_SAMPLES))
        self.selector = widgets.Dropdown(
            options=options,
            description="Sample",
            disabled=not options,
            layout=widgets.Layout(width="480px"),
        )
        self.output = widgets.Output()
        self.widget = widgets.VBox([self.selector, self.output])
        self.selector.observe(self._draw, names="value")
        self._draw()

    def _draw(self, _change: object = None) -> None:
        if not self.samples:
            self.output.outputs = (_display("No value samples were recorded for this event."),)
            return
        choice = self.selector.value
        producer = tuple(sample for sample in self.samples if sample.producer)
        chosen = producer if choice == ALL_SAMPLES else (self.samples[choice],)
        shown = chosen[:HTML_MAX_SAMPLES]
        label = ", ".join(sample.label for sample in shown)
        outputs = [_display(f"<histograms of {label}>", histogram_png(shown, self.zeros))]
        if len(chosen) > len(shown):
            left = len(chosen) - len(shown)
            outputs.append(_display(f"{left} more {noun(left, 'sample')}: pick them one by one above."))
        self.output.outputs = tuple(outputs)


def _display(text: str, png: bytes | None = None) -> dict[str, object]:
    """A ``display_data`` output for an Output widget (no kernel context needed)."""
    data: dict[str, str] = {"text/plain": text}
    if png is not None:
        data["image/png"] = base64.b64encode(png).decode("ascii")
    return {"output_type": "display_data", "data": data, "metadata": {}}
