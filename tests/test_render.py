"""Renderers on hand-built Reports (no torch): what a user sees in each view."""

from __future__ import annotations

import base64
import dataclasses
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from nan_magic.records import (
    Cause,
    EarlyWarning,
    LayerCall,
    Phase,
    Report,
    Sample,
    SourcePointer,
    StepSummary,
    TensorStats,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PRODUCER = "encoder.layers.1.attn"


def stats(
    dtype: str = "torch.float16", nan: int = 0, posinf: int = 0, scale: float = 1.0
) -> TensorStats:
    return TensorStats(
        dtype=dtype, shape=(4, 8, 16), numel=512, nan=nan, posinf=posinf, neginf=0,
        min=-scale, max=scale, mean=0.0, std=scale / 2, absmax=scale,
    )


def make_layers(count: int, producer_at: int) -> tuple[LayerCall, ...]:
    """``count`` calls; the producer at position ``producer_at``, then propagators."""
    layers = []
    for index in range(count):
        if index < producer_at:
            layer = LayerCall(index, Phase.FORWARD, f"encoder.layers.{index}.mlp", "MLP",
                              stats(scale=10.0 + index))
        elif index == producer_at:
            layer = LayerCall(index, Phase.FORWARD, PRODUCER, "SelfAttention",
                              stats(posinf=48, nan=3), status="producer")
        else:
            layer = LayerCall(index, Phase.FORWARD, f"head.{index}", "Linear",
                              stats(nan=512), status="propagated")
        layers.append(layer)
    return tuple(layers)


@pytest.fixture()
def source_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(
        "class SelfAttention:\n"
        "    def forward(self, q, k):\n"
        "        q = q * self.scale\n"
        "        scores = q @ k.transpose(-2, -1)\n"
        "        return scores.softmax(-1)\n"
    )
    return path


def make_report(
    source_file: Path | None = None, layers: int = 6, producer_at: int = 3, **changes: Any
) -> Report:
    """An fp16 attention overflow at step 7, with every optional part filled in."""
    pointer = SourcePointer(
        str(source_file or "/nonexistent/model.py"), 4, "forward",
        "        scores = q @ k.transpose(-2, -1)",
    )
    report = Report(
        phase=Phase.FORWARD, module=PRODUCER, module_type="SelfAttention", step=7,
        nan=3, posinf=48, neginf=0, numel=512, model="model", op="aten.bmm.default",
        source=pointer, dtype="torch.float16",
        cause=Cause(
            "fp16 overflow",
            "Scale q by 1/sqrt(d) before the matmul, or compute scores in float32.",
            ("input absmax 300 is 0.46% of float16 max",),
        ),
        output_stats=stats(nan=3, posinf=48),
        input_stats=(("input[0]", stats(scale=300.0)),),
        layers=make_layers(layers, producer_at),
        samples=(
            Sample("input[0]", "torch.float16", tuple(v % 700 - 350.0 for v in range(512)), 512),
            Sample("output", "torch.float16", tuple(v * 120.0 for v in range(500)), 512),
        ),
        history=tuple(
            StepSummary(
                step=step, loss=2.0 / (step + 1), absmax=10.0**step, nonfinite=step == 7,
                headroom=65504 / 10.0**step, headroom_module=PRODUCER,
                headroom_dtype="torch.float16",
            )
            for step in range(8)
        ),
        warnings=tuple(
            EarlyWarning(step, "overflow-risk", f"headroom {65504 / 10.0**step:.3g}x", PRODUCER)
            for step in range(3, 15)
        ),
        debug_frame=pointer,
        debug_locals=(("scores", stats(posinf=48)),),
        frames=(SourcePointer("<cell>", 3, "<module>", "loss = model(x).sum()"), pointer),
        notes=("the same module also ran in step 6 without non-finite values",),
    )
    return dataclasses.replace(report, **changes)


# -- text ----------------------------------------------------------------------


def test_text_names_producer_counts_cause_and_marks_row() -> None:
    from nan_magic.render.text import render_text

    text = render_text(make_report())
    assert text.startswith("nan_magic: first non-finite output in forward step 7")
    for expected in (
        f"{PRODUCER} (SelfAttention)", "aten.bmm.default", "model.py:4, in forward",
        "scores = q @ k.transpose(-2, -1)", "3 nan, 48 +inf, 0 -inf of 512 elements (9.96%)",
        "inputs      finite", "fp16 overflow", "Scale q by 1/sqrt(d)",
        "also ran in step 6", "%debug opens in", "loss = model(x).sum()",
        "local scores: float16 4x8x16: 0 nan, 48 +inf, 0 -inf",
        "(2 earlier warnings not listed)", f"step 14, {PRODUCER}: headroom 6.55e-10x",
    ):
        assert expected in text
    producer_rows = [line for line in text.splitlines() if line.startswith("> ")]
    assert len(producer_rows) == 1 and PRODUCER in producer_rows[0]
    assert "producer" in producer_rows[0] and "48" in producer_rows[0]


def test_text_cuts_long_tables_and_keeps_producer() -> None:
    from nan_magic.render.text import render_text

    text = render_text(make_report(layers=5000, producer_at=4000, layers_dropped=12))
    assert "5000 calls (12 earlier calls not kept)" in text
    assert "4970 rows cut (3980 before, 990 after the rows shown)" in text
    assert sum(line.startswith("> ") for line in text.splitlines()) == 1
    assert len(text.splitlines()) < 80


def test_text_minimal_report_outside_modules() -> None:
    from nan_magic.render.text import render_text

    report = Report(phase=Phase.BACKWARD, module=None, module_type=None, step=0,
                    nan=1, posinf=0, neginf=0, numel=1, inputs_finite=False)
    text = render_text(report)
    assert "code outside any watched module" in text
    assert "1 nan, 0 +inf, 0 -inf of 1 elements (100%)" in text
    assert "already non-finite (another kind)" in text
    assert "Layers" not in text and "%debug" not in text
    assert str(report) == text


# -- table ---------------------------------------------------------------------


def test_layer_table_columns_and_values() -> None:
    report = make_report()
    frame = report.table
    assert list(frame.columns) == [
        "call", "phase", "module", "type", "tensor", "dtype", "shape", "min", "max",
        "mean", "std", "absmax", "nan", "+inf", "-inf", "status",
    ]
    producer = frame[frame.status == "producer"]
    assert producer.module.tolist() == [PRODUCER]
    assert producer["+inf"].tolist() == [48] and producer["nan"].tolist() == [3]
    assert frame.dtype.unique().tolist() == ["float16"]
    assert frame.status.tolist() == ["ok"] * 3 + ["producer"] + ["propagated"] * 2


def test_layer_table_empty_and_unknown_values() -> None:
    empty = make_report(layers=0, producer_at=0).table
    assert empty.empty and "status" in empty.columns
    unknown = LayerCall(0, Phase.DATA, "", "Net", TensorStats("torch.float32", (2,), 2, nan=None))
    outside = LayerCall(1, Phase.FORWARD, None, None, stats(posinf=1), "producer", "loss")
    frame = dataclasses.replace(make_report(), layers=(unknown, outside)).table
    assert frame["nan"].isna().tolist() == [True, False]
    assert frame["min"].isna().tolist() == [True, False]
    assert frame.module.tolist() == ["", None] and frame.type.tolist() == ["Net", None]


def test_styled_table_highlights_producer_marks_propagated_dims_after() -> None:
    from nan_magic.render.table import style_layers

    html = style_layers(make_layers(6, producer_at=3)).to_html()
    rows = re.findall(r"<tr>(.*?)</tr>", html, flags=re.DOTALL)[1:]
    assert len(rows) == 6
    assert "nm-producer" in rows[3] and PRODUCER in rows[3]
    assert all("nm-producer" not in row for row in rows[:3] + rows[4:])
    assert "nm-propagated" in rows[4] and "nm-after" in rows[4] and "nm-after" in rows[5]
    assert all("nm-after" not in row for row in rows[:4])
    assert "4x8x16" in rows[0]


def test_styled_table_escapes_names_and_labels_root_and_outside() -> None:
    from nan_magic.render.table import style_layers

    odd = LayerCall(0, Phase.FORWARD, "blocks.<0>", "<lambda>", stats(), tensor="output[0]")
    root = LayerCall(1, Phase.DATA, "", "Net", stats(), tensor="input[0]")
    outside = LayerCall(2, Phase.FORWARD, None, None, stats(posinf=1), "producer", "loss")
    html = style_layers((odd, root, outside)).to_html()
    assert "blocks.&lt;0&gt;" in html and "&lt;lambda&gt;" in html and "<lambda>" not in html
    assert ">(root)<" in html and ">(outside modules)<" in html and ">nan</td>" not in html


# -- plots ---------------------------------------------------------------------


def test_histogram_png_marks_fp16_range_without_pyplot() -> None:
    import matplotlib.pyplot as plt

    from nan_magic.render.plots import figure_png, histogram_figure, histogram_png

    samples = make_report().samples
    figure = histogram_figure(samples)
    output_axes = figure.axes[1]
    limit_lines = [line.get_xdata()[0] for line in output_axes.get_lines()]
    assert sorted(limit_lines) == [-65504.0, 65504.0]
    assert output_axes.get_yscale() == "log"
    assert "float16 finite range" in output_axes.get_legend().get_texts()[0].get_text()
    assert figure_png(figure).startswith(PNG_MAGIC)
    assert histogram_png(samples).startswith(PNG_MAGIC)
    assert plt.get_fignums() == []


def test_histogram_far_from_limit_and_empty_sample() -> None:
    from nan_magic.render.plots import figure_png, histogram_figure

    far = Sample("x", "torch.float32", (0.5, -0.25, 1.0), 3)
    empty = Sample("y", "torch.float32", (), 10)
    figure = histogram_figure((far, empty))
    assert figure.axes[0].get_lines() == []
    legend = figure.axes[0].get_legend().get_texts()[0].get_text()
    assert legend == "float32 finite range \u00b13.4028e+38: 3.4e+38x the largest |value|"
    assert "no finite values" in [text.get_text() for text in figure.axes[1].texts]
    assert figure_png(figure).startswith(PNG_MAGIC)
    assert figure_png(histogram_figure(())).startswith(PNG_MAGIC)


def test_history_figure_scales_and_marks_nonfinite_steps() -> None:
    from nan_magic.render.plots import figure_png, history_figure

    blow_up = tuple(
        StepSummary(
            step=step, loss=float("nan") if step == 5 else 1.0, absmax=10.0**step,
            grad_norm=0.5, nonfinite=step == 5,
        )
        for step in range(6)
    )
    loss_axes, absmax_axes, grad_axes = history_figure(blow_up).axes
    assert absmax_axes.get_yscale() == "log" and grad_axes.get_yscale() == "linear"
    assert grad_axes.get_ylabel() == "grad norm"
    loss_line, marker = loss_axes.get_lines()
    assert list(loss_line.get_xdata()) == [0, 1, 2, 3, 4] and marker.get_xdata()[0] == 5
    flat = tuple(StepSummary(step=step, loss=2.0, absmax=3.0 + step / 10) for step in range(4))
    figure = history_figure(flat)
    assert len(figure.axes) == 2 and figure.axes[1].get_yscale() == "linear"
    assert figure_png(figure).startswith(PNG_MAGIC)


# -- static HTML ---------------------------------------------------------------


def embedded_pngs(html: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r"data:image/png;base64,([^\"]+)", html)]


def test_html_is_self_contained_report(source_file: Path, tmp_path: Path) -> None:
    report = make_report(source_file)
    path = tmp_path / "report.html"
    html = report.to_html(str(path))
    assert path.read_text(encoding="ascii") == html
    assert PRODUCER in html and "aten.bmm.default" in html
    assert "3 nan, 48 +inf, 0 -inf" in html
    assert re.search(r'<td [^>]*class="[^"]*nm-producer[^"]*"[^>]*>' + re.escape(PRODUCER), html)
    pngs = embedded_pngs(html)
    assert len(pngs) == 2 and all(png.startswith(PNG_MAGIC) for png in pngs)
    marked = re.findall(r'<span class="nm-mark">(.*?)</span>', html)
    assert any("scores = q @ k.transpose(-2, -1)" in line for line in marked)
    assert "q = q * self.scale" in html
    assert "History (8 steps kept)" in html
    assert f"<td>655 ({PRODUCER} float16)</td>" in html and "headroom to overflow" in html
    assert "step 5, encoder.layers.1.attn: headroom 0.655x" in html
    assert "<code>scores</code>: float16 4x8x16: 0 nan, 48 +inf" in html
    assert "<script" not in html and "http" not in html


def test_html_caps_rows_and_says_so() -> None:
    html = make_report(layers=3000, producer_at=2500).to_html()
    assert len(re.findall(r'class="[^"]*nm-producer', html)) == 16
    assert len(re.findall(r"<tr>", html)) < 260
    assert "2800 rows cut (2367 before, 433 after the rows shown)" in html


def test_html_without_optional_parts() -> None:
    report = Report(phase=Phase.DATA, module="", module_type="Net", step=0, nan=0,
                    posinf=0, neginf=2, numel=8, model="model")
    html = report.to_html()
    assert "model (root) (Net)" in html and "0 nan, 0 +inf, 2 -inf" in html
    assert "No layer calls recorded." in html and "data:image/png" not in html


# -- widget --------------------------------------------------------------------


def test_widget_tabs_table_and_histogram(source_file: Path) -> None:
    from nan_magic.render.widget import build_widget

    tab = build_widget(make_report(source_file))
    assert tuple(tab.titles) == ("Summary", "Layers", "Histograms", "Debug", "History")
    summary, layers, histograms, debug, history = tab.children
    assert f"{PRODUCER} (SelfAttention)" in summary.value and "fp16 overflow" in summary.value
    table = layers.children[-1].value
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>' + re.escape(PRODUCER), table)
    (output,) = histograms.children[1].outputs
    assert base64.b64decode(output["data"]["image/png"]).startswith(PNG_MAGIC)
    assert "%debug" in debug.value and "scores = q @ k.transpose" in debug.value
    assert "max |activation|" in history.value


def test_widget_filter_and_near_toggle_rerender() -> None:
    from nan_magic.render.widget import LayersView

    view = LayersView(make_layers(5000, producer_at=4000), dropped=0, max_rows=200)
    assert view.table.value.count("<tr>") == 201
    assert "4800 rows cut" in view.status.value
    view.filter.value = "attn producer"
    assert view.rows() == (view.layers[4000],)
    assert "1 of 5000 rows match" in view.status.value and "rows cut" not in view.status.value
    view.filter.value = ""
    view.near.value = True
    assert [layer.index for layer in view.rows()] == list(range(3990, 4011))
    assert view.table.value.count("<tr>") == 22


def test_widget_sample_selector_draws_chosen_sample() -> None:
    from nan_magic.render.widget import HistogramsView

    view = HistogramsView(make_report())
    labels = [label for label, _ in view.selector.options]
    assert labels == ["all samples of the producer", "0: input[0]", "1: output"]
    view.selector.value = 1
    (output,) = view.output.outputs
    assert output["data"]["text/plain"] == "<histograms of output>"
    assert base64.b64decode(output["data"]["image/png"]).startswith(PNG_MAGIC)


def test_widget_without_layers_or_samples() -> None:
    from nan_magic.render.widget import build_widget

    report = Report(phase=Phase.OPTIMIZER, module=None, module_type=None, step=2,
                    nan=1, posinf=0, neginf=0, numel=4)
    tab = build_widget(report)
    assert len(tab.children) == 5
    (output,) = tab.children[2].children[1].outputs
    assert "No value samples" in output["data"]["text/plain"]
    assert "No history" in tab.children[4].value


# -- MIME bundle -----------------------------------------------------------------


def test_mimebundle_static_outside_kernel() -> None:
    bundle = make_report()._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"].startswith("nan_magic: first non-finite")


def test_mimebundle_adds_widget_in_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    from nan_magic.render.display import WIDGET_MIME

    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    bundle = make_report()._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", WIDGET_MIME}
    assert bundle[WIDGET_MIME]["model_id"]


def test_mimebundle_degrades_when_views_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    from nan_magic.render import html, widget

    def broken(report: Report) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setattr(html, "render_html", broken)
    monkeypatch.setattr(widget, "build_widget", broken)
    assert set(make_report()._repr_mimebundle_()) == {"text/plain"}


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


def test_widget_selector_offers_other_layers_but_all_means_the_producer() -> None:
    import dataclasses

    from nan_magic.render.widget import ALL_SAMPLES, HistogramsView

    report = make_report()
    other = Sample("encoder.0 output", "float32", (1.0, 2.0, 3.0), 3, producer=False)
    view = HistogramsView(dataclasses.replace(report, samples=(*report.samples, other)))
    labels = [label for label, _ in view.selector.options]
    assert labels == ["all samples of the producer", "0: input[0]", "1: output", "2: encoder.0 output"]
    view.selector.value = ALL_SAMPLES
    assert view.output.outputs[0]["data"]["text/plain"] == "<histograms of input[0], output>"
    view.selector.value = 2
    assert view.output.outputs[0]["data"]["text/plain"] == "<histograms of encoder.0 output>"
