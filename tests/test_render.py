"""Renderers on Reports of real events: what a user sees in each view.

Every report here comes from a fault of ``tests/faults.py`` (or a small model
written here) run under the watch, so the views are tested on what the
engine really produces: its dtype names, operand labels, causes and samples.
"""

from __future__ import annotations

import base64
import dataclasses
import re
import subprocess
import sys
import types
from functools import cache
from typing import Any

import pytest
import torch
from faults import FORWARD_FAULTS, LogLayer
from torch import nn
from watching import raised

import nan_magic
from nan_magic.records import Report, TensorRef

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAULTS = {fault.name: fault for fault in FORWARD_FAULTS}


@cache
def fault_report(name: str, **options: Any) -> Report:
    """The report of fault ``name`` under ``watch(model, **options)``."""
    model, run = FAULTS[name].build()
    return raised(run, model, **options)


class DivNet(nn.Module):
    """The root's own code divides by a zero, after its child ran."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h / x[:, :1]


@cache
def root_report() -> Report:
    torch.manual_seed(0)
    model = DivNet()
    x = torch.randn(3, 4)
    x[0, 0] = 0.0
    return raised(lambda: model(x), model)


@cache
def deep_report() -> Report:
    """300 Linear calls, a log of negatives, then 100 more: a table longer than any view shows."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Linear(4, 4) for _ in range(300)], LogLayer(), *[nn.Linear(4, 4) for _ in range(100)]
    )
    x = torch.randn(2, 4)
    return raised(lambda: model(x), model)


@cache
def diverging_report(**options: Any) -> Report:
    """float16 regression whose loss overflows at step 2: a history of two finite steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4).half(), torch.randn(16, 1).half() * 100

    def train() -> None:
        for _ in range(20):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return raised(train, model, opt, **options)


def widget_views(report: Report) -> dict[str, str]:
    """The text each view shows: text report, static HTML, the widget's Summary tab."""
    from nan_magic.render.widget import build_widget

    return {
        "text": report.to_text(),
        "html": report.to_html(),
        "widget": build_widget(report).children[0].value,
    }


# -- one spelling per module ------------------------------------------------------


def test_root_is_spelled_the_same_in_every_view() -> None:
    report = root_report()
    assert report.module == "" and report.where == "DivNet (root)"
    for view, text in widget_views(report).items():
        assert "DivNet (root)" in text, view
        assert "<root>" not in text and "&lt;root&gt;" not in text, view
        assert "(root) (" not in text and ">(root)<" not in text, view
    assert "DivNet (root), op aten.div.Tensor" in report.message


def test_table_rows_spell_module_and_type_together() -> None:
    from nan_magic.render.table import style_layers

    html = style_layers(fault_report("zero_variance").layers).to_html()
    cells = re.findall(r'<td [^>]*class="[^"]*"[^>]*>([^<]*)</td>', html)
    assert "Sequential (root)" in cells and "0 (Linear)" in cells and "1 (HandNorm)" in cells


# -- the summary: headline, cause with its fix, facts -----------------------------


def test_summary_is_headline_then_cause_then_facts() -> None:
    report = fault_report("zero_variance")
    html = widget_views(report)["widget"]
    headline, sentence, facts = (
        html.index('class="nm-headline"'), html.index('class="nm-summary"'), html.index('class="nm-facts"')
    )
    assert headline < sentence < facts
    (summary,) = re.findall(r'<p class="nm-summary">(.*?)</p>', html)
    assert summary.startswith("Likely cause: division-by-zero. aten.div.Tensor in 1 (HandNorm)")
    assert "add eps" in summary
    assert html.count("division-by-zero") == 1  # not repeated in the facts
    text = report.to_text().splitlines()
    assert text[0].startswith("nan_magic: first non-finite value in forward step 0: 1 (HandNorm)")
    assert text[2].startswith("Likely cause: division-by-zero.")


def test_the_cause_sentence_starts_its_hint_with_a_capital() -> None:
    """A reading that opens with a common word is capitalised; one that opens with a name keeps its case."""
    import dataclasses

    from nan_magic.explain.evidence import event_cause
    from nan_magic.plain import to_pairs
    from nan_magic.records import LOSS, Cause, TensorRef, TensorRole
    from nan_magic.render.common import cause_sentence

    weight = to_pairs(TensorRef.parameter("fc.weight"))
    step = (("optimizer", "Adam"), ("subject", weight), ("dtype", "float16"), ("nan", 3), ("posinf", 0),
            ("neginf", 0), ("lr", 1e-3), ("eps", None), ("limit", 65504.0), ("step", 7))
    report = dataclasses.replace(
        fault_report("zero_variance"), cause=Cause("unclassified", "optimizer-unmatched", step)
    )
    assert cause_sentence(report).startswith("Likely cause: unclassified. The Adam step made fc.weight 3 nan from")
    state = Cause("half-precision-overflow", "optimizer-state-overflow",
                  (*step[:1], ("subject", to_pairs(TensorRef(TensorRole.OPTIMIZER_STATE, "fc.weight", "exp_avg_sq"))),
                   *step[2:]))
    named = dataclasses.replace(report, cause=state)
    assert cause_sentence(named).startswith(
        "Likely cause: half-precision-overflow. state exp_avg_sq of fc.weight overflowed float16 (max 65504)"
    )
    # A reading of an event that opens with the op's name keeps its case; one that opens with "the loss" not.
    division = event_cause("division-by-zero", "division-by-zero", report, divisor="other")
    assert cause_sentence(dataclasses.replace(report, cause=division)).startswith(
        "Likely cause: division-by-zero. aten.div.Tensor in 1 (HandNorm) divided by zero"
    )
    loss = dataclasses.replace(report, tensor=LOSS, op=None)
    overflow = event_cause("overflow", "wide-overflow", loss, limit=3.4e38, signs=(), matmul=False, attention=False)
    assert cause_sentence(dataclasses.replace(report, cause=overflow)).startswith(
        "Likely cause: overflow. The loss made 32 nan"
    )


def test_operands_are_named_as_the_user_wrote_them() -> None:
    text = fault_report("zero_variance").to_text()
    # The op's output is the report's tensor; the module's output the check saw is beside it.
    # The user's expression for the op beside its aten name; counts only where not zero.
    assert "op          centred / centred.pow(2).mean(-1, keepdim=True).sqrt()  (aten.div.Tensor)" in text
    assert "tensor      output of aten.div.Tensor f32[4,8]" in text
    assert "non-finite  32 nan of 32 elements (100%)" in text
    assert "module out  output of 1 (HandNorm): f32[4,8] 32 nan\n" in text
    assert "centred (self): f32[4,8] finite in [0, 0]" in text
    assert "centred.pow(2).mean(-1, keepdim=T... (other): f32[4,1]" in text
    assert "0 +inf" not in text and "0 -inf" not in text
    matmul = fault_report("fp16_overflow").to_text()
    assert "x (self): f16[2,64]" in matmul and "self.weight (mat2): f16[64,64]" in matmul
    assert "op          x @ self.weight  (aten.mm.default)" in matmul


@pytest.mark.parametrize(("op", "line", "expression"), [
    ("aten.bmm.default", "scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5", "q @ k.transpose(-2, -1)"),
    ("aten.log.default", "return -probs.log().gather(1, target[:, None]).mean()", "probs.log()"),
    ("aten.div_.Tensor", "h /= scale", "h /= scale"),
    ("aten.div.Tensor", "return a / b + c / d", ""),
    ("aten.addmm.default", "return self.proj(x)", ""),
])
def test_the_op_is_named_by_the_users_expression(op: str, line: str, expression: str) -> None:
    from nan_magic.render.words.operands import op_expression

    assert op_expression(op, line) == expression


def test_the_report_title_is_short_and_counts_only_what_is_there() -> None:
    from nan_magic.render.common import headline

    report = fault_report("zero_variance")
    title = headline(report)
    assert title == "32 nan in forward step 0: 1 (HandNorm), centred / centred.pow(2).mean(-1, keepdim=True).sqrt()"
    from html import escape

    html = widget_views(report)["widget"]
    (shown,) = re.findall(r'<h3 class="nm-headline"[^>]*>(.*?)</h3>', html)
    assert shown == escape(title)
    # The whole sentence only as the title's tooltip: the error above the report says it.
    assert html.count(escape(report.message)) == 1 and f'title="{escape(report.message)}"' in html


@pytest.mark.parametrize(("op", "line", "names"), [
    ("aten.div.Tensor", "return a / b.sqrt()  # why", {"self": "a", "other": "b.sqrt()"}),
    ("aten.mm.default", "y = x @ self.weight", {"self": "x", "mat2": "self.weight"}),
    ("aten.log.default", "return torch.log(probs)", {"self": "probs"}),
    ("aten.sqrt.default", "d = (a - b).sqrt()", {"self": "a - b"}),
    ("aten.div_.Tensor", "h /= scale", {"self": "h", "other": "scale"}),
    # Two divisions: which one ran is not in the line, so the schema names stay.
    ("aten.div.Tensor", "return a / b + c / d", {}),
    ("aten.addmm.default", "return self.proj(x)", {}),
    ("aten.div.Tensor", "x / (", {}),  # one line of a multi-line statement
])
def test_operand_names_only_where_the_line_is_unambiguous(op: str, line: str, names: dict[str, str]) -> None:
    from nan_magic.render.words.operands import operand_names

    found = operand_names(op, line)
    assert {key: found[key] for key in names} == names
    assert bool(found) == bool(names)


class SqrtNormed(nn.Module):
    """Rows divided by their norm, written ``w / (sqrt(s) + eps)``: the forward's ``/`` is finite at a zero row, the
    sqrt's derivative there is not (its formula divides too)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        with torch.no_grad():
            self.weight[1] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return x @ (w / (torch.sqrt((w ** 2).sum(-1, keepdim=True)) + 1e-6)).T


def test_a_backward_formulas_op_is_not_named_by_a_same_named_op_of_its_forward_line() -> None:
    # SqrtBackward0's division ran on no line of the user's: the reported line made its node, and its ``/`` is the
    # forward's, on other operands (w and the norm; the formula's are the gradient and 2 * sqrt(s)). Were the line's
    # expressions read, the op row would show the forward's division and the operands its names (hunt22).
    from nan_magic.render.common import headline, labelled_inputs, op_phrase

    model = SqrtNormed()

    def run() -> None:
        model(torch.randn(2, 4)).sum().backward()
        model(torch.randn(2, 4))

    report = raised(run, model)
    assert (report.phase, report.op, report.autograd_node) == ("backward", "aten.div.Tensor", "SqrtBackward0")
    assert "w / (" in report.source.line
    assert op_phrase(report) == "aten.div.Tensor" and headline(report).endswith(", aten.div.Tensor")
    assert [label for label, _stats in labelled_inputs(report)] == ["self", "other"]
    assert "w (self)" not in report.to_text()


# -- histograms -------------------------------------------------------------------


def titles(figure: Any) -> list[str]:
    return [axes.get_title().splitlines()[0] for axes in figure.axes]


def test_histograms_show_op_operands_output_then_module_tensors() -> None:
    from nan_magic.render.common import about_zeros, labelled_samples
    from nan_magic.render.plots import histogram_figure

    report = fault_report("zero_variance", mode="full")  # the full mode also samples the module's input
    producer = tuple(sample for sample in labelled_samples(report) if sample.producer)
    figure = histogram_figure(producer, about_zeros(report))
    assert titles(figure) == [
        "centred (self of aten.div.Tensor)",
        "centred.pow(2).mean(-1, keepdim=T... (other of aten.div.Tensor)",
        "output of aten.div.Tensor",
        "input[0] of 1 (HandNorm)",
        "output of 1 (HandNorm)",
    ]
    numerator, _divisor, output, module_input, _ = figure.axes
    # The cause is about zeros: the operands say how many are exactly 0.
    assert [t.get_text() for t in numerator.get_legend().get_texts()][-1] == "32 exact zeros"
    assert numerator.get_xlabel() == "value (finite elements)"
    # All 32 outputs are NaN: said in words, and drawn as a marked bar at the end.
    texts = [text.get_text() for text in output.texts]
    assert "no finite values: all 32 elements are nan" in texts and "nan\n32" in texts
    (bar,) = [patch for patch in output.patches if patch.get_hatch() == "//"]
    assert bar.get_height() == 32
    assert "exact zeros" not in " ".join(t.get_text() for t in module_input.get_legend().get_texts())


class HalfAttention(nn.Module):
    """fp16 attention whose q @ k overflows: the bmm's output is freed long before the module returns."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) * 0.25
        return self.proj(scores.softmax(dim=-1) @ v)


@cache
def attention_report() -> Report:
    torch.manual_seed(1)
    model = HalfAttention().half()
    x = torch.randn(2, 8, 16).half()
    x[1, 3] = 600.0  # one token far larger than the rest, as a badly initialised embedding
    return raised(lambda: model(x), model)


def test_histograms_show_the_failing_ops_operands_and_output_once_each() -> None:
    from nan_magic.render.common import labelled_samples
    from nan_magic.render.plots import histogram_figure

    report = attention_report()
    assert report.op == "aten.bmm.default"
    samples = labelled_samples(report)
    producer = [sample for sample in samples if sample.producer]
    assert [sample.label for sample in producer] == [
        "q (self of aten.bmm.default)",
        "k.transpose(-2, -1) (mat2 of aten.bmm.default)",
        "output of aten.bmm.default",
        "input[0] of HalfAttention (root)",  # what entered the producer module (round 21: in every mode)
        "output of proj",
    ]
    # Drawn when the op ran (its output was freed before the module returned): the +inf it made.
    output = producer[2]
    assert output.dtype == "float16" and output.posinf == report.posinf > 0 and output.values
    # The largest operand value is in the sample: the outlier row is what a reader looks for.
    q_stats = dict(report.input_stats)[producer[0].tensor]
    assert max(abs(value) for value in producer[0].values) == q_stats.absmax
    # One entry per tensor: proj's output is the module's output, not listed again under its own name.
    labels = [sample.label for sample in samples]
    assert len(labels) == len(set(labels)) and "proj output" not in labels
    figure = histogram_figure(tuple(producer))
    # Readable at a notebook's width: no wider than 900 px, so never scaled down, and no text under 10 px.
    assert figure.get_figwidth() * figure.dpi <= 900
    texts = figure.findobj(match=lambda o: hasattr(o, "get_fontsize") and bool(getattr(o, "get_text", str)()))
    sizes = [text.get_fontsize() * figure.dpi / 72 for text in texts]
    assert sizes and min(sizes) >= 10


def test_histogram_marks_float16_range_inside_the_axes_above_the_bars() -> None:
    from nan_magic.render.common import labelled_samples
    from nan_magic.render.plots import figure_png, histogram_figure

    report = fault_report("fp16_overflow")
    (output,) = [s for s in labelled_samples(report) if s.label == "output of aten.mm.default"]
    figure = histogram_figure((output,))
    (axes,) = figure.axes
    limits = sorted(line.get_xdata()[0] for line in axes.get_lines())
    assert limits == [-65504.0, 65504.0]
    (bar,) = [patch for patch in axes.patches if patch.get_hatch() == "//"]
    assert bar.get_x() > 65504.0 and bar.get_height() == 128  # +inf: past the right limit
    figure_png(figure)  # lay the figure out
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    frame = axes.get_window_extent(renderer)
    assert frame.x0 <= legend.x0 and legend.x1 <= frame.x1 and legend.y1 <= frame.y1
    bar_top = axes.transData.transform((bar.get_x(), bar.get_height()))[1]
    assert legend.y0 > bar_top


def test_histogram_png_is_drawn_without_pyplot() -> None:
    import matplotlib.pyplot as plt

    from nan_magic.render.plots import histogram_png

    assert histogram_png(fault_report("log_negative").samples).startswith(PNG_MAGIC)
    assert plt.get_fignums() == []


def test_history_marks_failing_step_and_headroom_on_log_axis() -> None:
    from nan_magic.render.common import plotted_history_fields
    from nan_magic.render.plots import history_figure

    # The tiered watch checks every module on its second step only: step 0 read the model's output.
    report = diverging_report()
    assert report.step == 2 and [(entry.step, entry.full) for entry in report.history] == [(0, False), (1, True)]
    figure = history_figure(report.history, report.step)
    labels = [axes.get_ylabel() for axes in figure.axes]
    assert labels == [label for _, label in plotted_history_fields(report.history)]
    assert "loss scale" not in labels  # no scaler: nothing to plot
    # One step with every module checked: no headroom line drawn from model outputs alone.
    assert not [label for label in labels if label.startswith("headroom")]
    outputs = figure.axes[labels.index("max |output|")]
    assert [text.get_text() for text in outputs.get_legend().get_texts()] == [
        "every module's output", "the model's outputs only"]
    assert "(model outputs)" in report.to_html() and "(every module)" in report.to_html()

    full = diverging_report(mode="full")  # every step checks every module
    figure = history_figure(full.history, full.step)
    labels = [axes.get_ylabel() for axes in figure.axes]
    assert figure.axes[labels.index("headroom to overflow, every module")].get_yscale() == "log"
    for axes in figure.axes:
        markers = [line for line in axes.get_lines() if line.get_color() == "#d62728"]
        assert [line.get_xdata()[0] for line in markers if line.get_marker() in ("v", "o")] == [2]


def test_history_of_one_step_says_there_is_nothing_to_plot() -> None:
    from nan_magic.render.plots import history_figure

    report = fault_report("log_negative")
    figure = history_figure(report.history[:1], report.step)
    assert "fewer than two steps" in figure.axes[0].texts[0].get_text()


# -- the layers table --------------------------------------------------------------


def test_layers_table_puts_status_and_counts_first_in_call_order() -> None:
    from nan_magic.render.table import VIEW_COLUMNS, style_layers

    # The engine records a call when it returns (the root's last); the report keeps the order calls began.
    nested = root_report()
    assert [layer.index for layer in nested.layers] == [0, 1, 2]
    assert nested.table["call"].tolist() == [0, 1, 2]
    assert nested.table["module"].tolist() == ["", "", "a"]
    section = nested.to_text().split("Layers of step 0: 3 calls measured\n")[1].split("\n\n")[0]
    rows = section.splitlines()[1:]  # under the header
    assert [row[1:].split()[0] for row in rows] == ["0", "1", "2"]
    report = deep_report()
    html = style_layers([layer for layer in report.layers if str(layer.phase) == "forward"][:5]).to_html()
    header = re.findall(r'<th [^>]*class="col_heading[^"]*"[^>]*>([^<]*)</th>', html)
    assert header[:4] == ["call", "status", "non-finite", "module"]
    assert set(header) <= set(VIEW_COLUMNS)
    # Every row is forward, float32, an output: said once under the table, not in three columns.
    assert "phase" not in header and "dtype" not in header and "tensor" not in header
    assert "Every row: phase forward, tensor output, dtype float32." in html
    # The rows without a mean hold no finite value (the NaN passed on): the table says so, not that they were only
    # probed for min/max (hunt-c-s42: it said that of these rows, which were measured).
    assert any(layer.stats.mean is None for layer in report.layers)
    assert all(layer.stats.min is None for layer in report.layers if layer.stats and layer.stats.mean is None)
    html = report.to_html()
    assert "empty where the tensor held no finite value to measure" in html
    assert "mean and std are computed only for tensors still alive" not in html


def table_cells(html: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """``(module, tensor or "")`` -> the classes of the module cell, the status and the count cell."""
    rows = re.findall(r"<tr>(.*?)</tr>", html, re.S)[1:]
    header = re.findall(r'<th [^>]*class="col_heading[^"]*"[^>]*>([^<]*)</th>', html)
    found = {}
    for row in rows:
        cells = dict(zip(header, re.findall(r'<td class="([^"]*)" >([^<]*)</td>', row)))
        key = (cells["module"][1], cells["tensor"][1] if "tensor" in cells else "")
        found[key] = (cells["module"][0], cells["status"][1], cells["non-finite"][1])
    return found


def test_layers_table_is_a_tree_with_counts_only_where_not_zero() -> None:
    from nan_magic.render.common import in_call_order
    from nan_magic.render.table import style_layers
    from nan_magic.render.widget import LayersView

    report = attention_report()
    layers = in_call_order(report.layers)
    cells = table_cells(style_layers(layers).to_html())
    # The value the root's code passed to proj is the root's own output (it returns proj's): one row, not two.
    assert ("HalfAttention (root)", "output of proj") not in cells
    root_classes, status, counts = cells[("HalfAttention (root)", "output")]
    assert status == "producer" and counts.endswith(" nan") and "nm-depth" not in root_classes
    # Its children, indented one level, ran inside it: not dimmed as rows after it.
    for child in ("qkv (Linear)", "proj (Linear)"):
        classes, _, _ = cells[(child, "output")]
        assert "nm-depth-1" in classes and "nm-after" not in classes
    # Counts only where not zero: an ok row's count cell is empty.
    assert cells[("qkv (Linear)", "output")][1:] == ("ok", "")
    # The toggles are offered only where they change the rows.
    view = LayersView(layers, dropped=0, max_rows=200)
    assert view.near.disabled  # four rows: all of them are near the producer
    assert not view.touched.disabled
    view.touched.value = True
    # The root's own output (the producer's row), and proj's, which returned it.
    assert [(layer.module, layer.tensor, layer.status) for layer in view.rows()] == [
        ("", TensorRef.output(), "producer"), ("proj", TensorRef.output(), "propagated")]



def test_html_caps_rows_around_the_producer_and_says_so() -> None:
    report = deep_report()
    html = report.to_html()
    assert len(report.layers) > 300
    producer_rows = re.findall(r'<tr>\s*<td [^>]*nm-producer[^>]*>', html)
    assert len(producer_rows) == 1
    assert re.search(r"\d+ rows cut \(\d+ before, \d+ after the rows shown\)", html)
    assert "300 (LogLayer)" in html


def test_widget_filter_and_near_toggle_rerender() -> None:
    from nan_magic.render.widget import LayersView

    report = deep_report()
    view = LayersView(report.layers, dropped=0, max_rows=200)
    assert view.table.value.count("<tr>") == 201
    view.filter.value = "loglayer producer"
    (row,) = view.rows()
    assert row.module == "300" and row.status == "producer"
    assert "1 of" in view.status.value and "rows cut" not in view.status.value
    view.filter.value = ""
    view.near.value = True
    # Ten rows on either side of the producer: the calls before it, and the replayed step's calls after it.
    rows = view.rows()
    assert len(rows) == 21 and rows[10].status == "producer" and rows[10].module == "300"
    assert {layer.status for layer in rows[11:]} == {"propagated"}
    assert "filter rows" in view.filter.placeholder and view.filter.description == ""


# -- static HTML, the widget, the display --------------------------------------------


def embedded_pngs(html: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r"data:image/png;base64,([^\"]+)", html)]


def test_html_is_self_contained_and_ascii(tmp_path: Any) -> None:
    report = diverging_report()
    path = tmp_path / "report.html"
    html = report.to_html(str(path))
    assert path.read_text(encoding="ascii") == html
    pngs = embedded_pngs(html)
    assert len(pngs) == 2 and all(png.startswith(PNG_MAGIC) for png in pngs)  # histograms, history
    assert "History (2 steps kept)" in html
    assert "<script" not in html and "http" not in html


def test_widget_tabs_render_every_part() -> None:
    from nan_magic.render.widget import TAB_TITLES, build_widget

    report = fault_report("log_negative")
    tab = build_widget(report)
    assert tuple(tab.titles) == TAB_TITLES
    summary, layers, histograms, debug, _history = tab.children
    assert "1 (LogLayer)" in summary.value and "log-domain" in summary.value
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>1 \(LogLayer\)<', layers.children[3].value)
    labels = [label for label, _ in histograms.children[0].options]
    assert labels[:3] == ["all samples of the producer", "0: x (self of aten.log.default)",
                          "1: output of aten.log.default"]
    (output,) = histograms.children[1].outputs
    assert base64.b64decode(output["data"]["image/png"]).startswith(PNG_MAGIC)
    assert "%debug" in debug.value


class FakeKernel:
    """Stands in for ipykernel's shell: records what is published."""

    def __init__(self) -> None:
        self.kernel = object()
        self.published: list[dict[str, Any]] = []
        self.display_pub = types.SimpleNamespace(
            publish=lambda data, metadata: self.published.append(data)
        )


def test_mimebundle_static_outside_kernel() -> None:
    bundle = fault_report("log_negative")._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"].startswith("nan_magic: first non-finite")


def test_kernel_gets_static_report_as_its_own_output_then_the_widget(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    from nan_magic.render import widget
    from nan_magic.render.display import WIDGET_MIME

    shell = FakeKernel()
    built: list[Any] = []
    build = widget.build_widget
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(widget, "build_widget", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    bundle = fault_report("log_negative")._repr_mimebundle_()
    assert set(bundle) == {"text/plain", WIDGET_MIME}
    assert bundle[WIDGET_MIME]["model_id"] == built[0].model_id
    (static,) = shell.published
    assert static["text/plain"].startswith("nan_magic: first non-finite")
    (element,) = re.findall(r'<div class="nan-magic-report nm-static" id="([^"]+)"', static["text/html"])
    # The live widget hides that static copy; after a restart its style is gone with it.
    summary = built[0].children[0].value
    assert f"<style>#{element}, .jp-OutputArea-child:has(#{element}) {{ display: none; }}</style>" in summary
    # And the static copy hides the widget's output where no live widget renders (after a restart).
    assert f".jp-OutputArea-child:has(#{element}) + .jp-OutputArea-child:not(:has(.nan-magic-widget))" in (
        static["text/html"])


def test_mimebundle_degrades_when_views_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    from nan_magic.render import html, widget

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("boom")

    shell = FakeKernel()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(widget, "build_widget", broken)
    assert set(fault_report("log_negative")._repr_mimebundle_()) == {"text/plain", "text/html"}
    monkeypatch.setattr(html, "render_html", broken)
    assert set(fault_report("log_negative")._repr_mimebundle_()) == {"text/plain"}
    assert shell.published == []


def test_text_render_stays_light() -> None:
    code = (
        "import sys; from nan_magic.records import Report, Phase;"
        "Report(Phase.FORWARD, 'a', 'Linear', 0, 1, 0, 0, 1).to_text();"
        "print(sorted(m for m in ('pandas', 'matplotlib', 'ipywidgets', 'IPython')"
        " if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_report_survives_pickling_and_renders_the_same() -> None:
    import pickle

    report = fault_report("dict_output")
    assert pickle.loads(pickle.dumps(report)).to_text() == report.to_text()
    assert nan_magic.Report is Report


def test_the_last_ten_early_warnings_are_listed_and_the_earlier_ones_counted() -> None:
    from nan_magic.records import EarlyWarning

    spikes = [EarlyWarning(step, "loss-spike", (("value", 10.0 * step), ("ratio", 5.0))) for step in range(10)]
    scale = EarlyWarning(10, "scale-falling", (("falls", 3), ("scale", 512.0)))
    norm = EarlyWarning(11, "grad-norm-overflow", (("parameters", ("a", "b", "c", "d")), ("optimizer", "Adam")))
    report = fault_report("log_negative")
    text = dataclasses.replace(report, warnings=(*spikes, scale, norm)).to_text()
    assert "(2 earlier warnings not listed)" in text
    assert "step 1: the loss reached 10" not in text and "step 2: the loss reached 20, 5x its running median" in text
    assert "step 10: the GradScaler scale fell on each of the last 3 steps, to 512" in text
    assert "step 11: the gradient norm of a, b, c and 1 more overflowed float32 before the Adam step" in text


def test_a_running_row_beside_the_producer_folds_no_column_into_the_caption() -> None:
    # A NaN batch into a Sequential, every call checked: the root's call is still running (no tensor, no dtype)
    # beside the data row as its child passes the NaN on (calm20: the batch is judged then, not as it enters).
    from nan_magic.render.table import style_layers

    model = nn.Sequential(nn.Linear(3, 3))
    report = raised(lambda: model(torch.tensor([[1.0, float("nan"), 2.0]])), model, mode="full")
    assert [layer.status for layer in report.layers if layer.stats is None]  # the running row
    html = style_layers(report.layers).to_html()
    assert "tensor nan" not in html and "dtype nan" not in html
    cells = table_cells(html)
    assert cells[("Sequential (root)", "input[0]")][1:] == ("producer", "1 nan")
    assert "tensor nan" not in build_widget_layers_text(report)


def build_widget_layers_text(report: Report) -> str:
    """The widget's Layers tab, every HTML part of it."""
    from nan_magic.render.widget import build_widget

    layers_tab = build_widget(report).children[1]
    return "\n".join(child.value for child in layers_tab.children if hasattr(child, "value"))


def test_a_data_event_says_no_inputs_row_and_counts_one_call_in_the_singular() -> None:
    # The value came in with the batch: no op read it, so no row says whether its inputs were finite.
    model = nn.Linear(3, 3)
    report = raised(lambda: model(torch.tensor([[1.0, float("nan"), 2.0]])), model)
    assert report.phase == "data" and report.module == ""
    from nan_magic.render.common import fact_rows

    assert "inputs" not in [label for label, _ in fact_rows(report)]
    for view, text in widget_views(report).items():
        assert "<tr><td>inputs</td>" not in text and "\n  inputs " not in text, view
        assert "phase data: input[0] held 1 nan before any watched module ran" in text, view
    # (calm20: a NaN batch is judged when the step's first value goes non-finite, the root's returned output.)
    assert "Layers of step 0: 2 calls measured\n" in report.to_text()
    # An infinity is judged where it enters, as before: the root still running, one call measured, in the singular.
    infinite = raised(lambda: model(torch.tensor([[1.0, float("inf"), 2.0]])), model)
    assert infinite.phase == "data" and "Layers of step 0: 1 call measured; 1 running\n" in infinite.to_text()
    assert "1 calls" not in report.to_html()


def test_a_masked_minus_inf_leaves_the_finite_scores_visible_in_their_histogram() -> None:
    # Attention scores of about 1 with a row masked to -inf: the histogram shows the scores, not float32's range.
    from nan_magic.render.plots import histogram_figure

    scores = nan_magic.records.Sample(
        "float32", tuple(float(v) for v in torch.linspace(-0.8, 1.2, 95)), 100, neginf=5, nan=0, posinf=0
    )
    (axes,) = histogram_figure((scores,)).axes
    assert not axes.get_lines()  # no limit lines at +-3.4e38
    left, right = axes.get_xlim()
    assert -3 < left < -0.8 and 1.2 < right < 3, (left, right)
    (minus_inf,) = [patch for patch in axes.patches if patch.get_hatch() == "//"]
    assert minus_inf.get_height() == 5 and minus_inf.get_x() < -0.8
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == ["float32 limit \u00b13.4e+38: 2.84e+38x the largest |value|"]


def test_a_history_of_one_step_is_titled_in_the_singular() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    bad = y.clone()
    bad[2] = float("nan")

    def train() -> None:
        for target in (y, bad):
            loss = nn.functional.mse_loss(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(train, model, opt)
    assert len(report.history) == 1
    assert "History (1 step kept)" in report.to_html()


def test_a_float32_range_axis_reads_2e38_not_an_engineering_prefix_past_q() -> None:
    # An all-inf float32 output draws float32's range: its ticks read "-2e+08Q" (EngFormatter stops at Q, 1e30).
    from nan_magic.render.plots import figure_png, histogram_figure

    overflowed = nan_magic.records.Sample("float32", (), 8, posinf=8, nan=0, neginf=0)
    small = nan_magic.records.Sample("float16", tuple(float(v) for v in range(-40000, 40001, 8000)), 11)
    figure = histogram_figure((overflowed, small))
    figure_png(figure)  # lay the figure out: the tick labels are made then
    wide, narrow = ([label.get_text() for label in axes.get_xticklabels() if label.get_text()] for axes in figure.axes)
    assert "2e38" in wide and not any("Q" in label for label in wide), wide
    assert "30k" in narrow, narrow
