"""The report widget in a real browser: JupyterLab on 127.0.0.1, headless Chromium.

Each test opens a demo notebook (a copy: Lab autosaves), runs all cells and
reads what the user sees. Screenshots go to ``test-artifacts/``. Without
Chromium or Playwright the tests skip, unless ``REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_support import (
    ARTIFACTS,
    NOTEBOOKS,
    LabServer,
    chromium_or_skip,
    chromium_page,
    coloured_pixels,
    jupyterlab,
    open_and_run_all,
    save_restart_and_reopen,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPORT_TIMEOUT_MS = 180_000
TRANSPARENT = "rgba(0, 0, 0, 0)"
#: Each tab, and an element only it shows.
TAB_CONTENT = {
    "Summary": ".nm-facts",
    "Layers": "table.nm-layers",
    "Histograms": ".jp-OutputArea img",
    "Debug": "h4:has-text('%debug opens in')",
    "History": "table.nm-history",
}
VIEWPORT_HEIGHT = 1000  # jupyter_support.chromium_page's viewport


@pytest.fixture(scope="module")
def chromium() -> str:
    return chromium_or_skip()


@pytest.fixture(scope="module")
def lab(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    root = tmp_path_factory.mktemp("lab-root")
    for notebook in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(notebook, root / notebook.name)
    with jupyterlab(root, tmp_path_factory.mktemp("lab-home")) as server:
        yield server


@pytest.fixture()
def page(chromium: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium_page(chromium) as browser_page:
        yield browser_page
        # The whole page as the test left it: the first thing to look at when it failed.
        browser_page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-page.png"))


def report_widget(page: Any) -> Any:
    widget = page.locator(".nan-magic-widget").first
    widget.wait_for(timeout=REPORT_TIMEOUT_MS)
    widget.scroll_into_view_if_needed()
    return widget


def open_tab(widget: Any, title: str) -> None:
    widget.locator(".lm-TabBar-tab", has_text=title).first.click()


def failing_cell(page: Any) -> Any:
    """The notebook cell whose output holds the report widget."""
    return page.locator(".jp-Cell", has=page.locator(".nan-magic-widget")).first


def test_first_screen_is_the_short_error_then_the_report(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "transformer_attention_blowup.ipynb")
    widget = report_widget(page)
    cell = failing_cell(page)
    cell.evaluate("cell => cell.scrollIntoView({block: 'start'})")
    headline = widget.locator(".nm-headline").first
    headline.wait_for()
    page.screenshot(path=str(ARTIFACTS / "transformer_first_screen.png"))
    error = cell.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    traceback_lines = len(error.first.inner_text().splitlines()) if error.count() else 0
    assert traceback_lines <= 15, f"{traceback_lines} lines of traceback above the report"
    box = headline.bounding_box()
    assert box is not None and box["y"] + box["height"] <= VIEWPORT_HEIGHT, box


def test_transformer_report_in_jupyterlab(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "transformer_attention_blowup.ipynb")
    widget = report_widget(page)
    cell = failing_cell(page)
    headline = widget.locator(".nm-headline").first
    headline.wait_for()
    summary = widget.locator(".nm-summary").first
    assert summary.inner_text().startswith("Likely cause: ")
    assert "blocks.0.attn (SelfAttention)" in headline.inner_text()
    # While the widget lives, the static copy above it is hidden.
    assert not cell.locator(".nm-static").first.is_visible()
    widget.screenshot(path=str(ARTIFACTS / "report.png"))

    # Every tab renders its own content, and only while it is the current tab.
    for title, content in TAB_CONTENT.items():
        open_tab(widget, title)
        widget.locator(content).first.wait_for(state="visible")
        for other, hidden in TAB_CONTENT.items():
            if other != title:
                assert not widget.locator(hidden).first.is_visible(), (title, other)

    # One height whatever the tab: the cells below do not move when a tab is switched.
    heights = {}
    for title in TAB_CONTENT:
        open_tab(widget, title)
        widget.locator(TAB_CONTENT[title]).first.wait_for(state="visible")
        heights[title] = round(widget.bounding_box()["height"])
    assert max(heights.values()) - min(heights.values()) <= 2, heights
    assert max(heights.values()) < 800, heights

    open_tab(widget, "Layers")
    producer = widget.locator("td.nm-producer").first
    producer.wait_for()
    row = producer.locator("xpath=..").inner_text()
    assert "blocks.0.attn (SelfAttention)" in row and "producer" in row
    assert producer.evaluate("cell => getComputedStyle(cell).backgroundColor") != TRANSPARENT
    # Every number visible without a sideways scroll, with the notebook 900 px wide.
    table = widget.locator("table.nm-layers").first
    box = table.locator("xpath=ancestor::div[contains(@class, 'nm-scroll')]").first
    width = table.evaluate("table => table.scrollWidth")
    assert width <= 900 and box.evaluate("box => box.scrollWidth <= box.clientWidth"), width
    # Every module of the step, the producer's parents in bold saying they contain it.
    assert widget.locator("table.nm-layers tbody tr").count() >= 24
    parents = widget.locator("td.nm-contains", has_text="contains producer")
    assert parents.count() >= 3
    assert parents.first.evaluate("cell => getComputedStyle(cell).fontWeight") in ("700", "bold")
    widget.screenshot(path=str(ARTIFACTS / "transformer_layers.png"))

    open_tab(widget, "History")
    layers_history = widget.locator(".nm-layers-history").first
    layers_history.wait_for(state="visible")
    assert "Step 1 measured every module" in layers_history.inner_text()
    listed = widget.locator(".nm-layers-history + ul").first.inner_text()
    assert "The producer, blocks.0.attn, on the per-module steps" in listed
    widget.screenshot(path=str(ARTIFACTS / "transformer_history.png"))

    open_tab(widget, "Histograms")
    image = widget.locator(".jp-OutputArea img").first
    image.wait_for()
    page.wait_for_function(
        "img => img.complete && img.naturalWidth > 100", arg=image.element_handle()
    )
    assert coloured_pixels(image) > 1000
    # Drawn at its own size (not scaled down), so its 11 px labels stay 11 px.
    assert image.evaluate("img => img.naturalWidth <= 900 && img.width === img.naturalWidth")
    # The failing op's operands and output, as the user wrote them.
    options = [option.replace("\xa0", " ") for option in widget.locator("select option").all_inner_texts()]
    assert any("q (self of aten.bmm.default)" in option for option in options), options
    assert any("output of aten.bmm.default" in option for option in options), options
    assert len(options) == len(set(option.split(": ", 1)[-1] for option in options))
    widget.screenshot(path=str(ARTIFACTS / "transformer_histograms.png"))


def test_report_survives_save_restart_and_reopen_compact(lab: LabServer, page: Any) -> None:
    name = "cnn_log_zero.ipynb"
    open_and_run_all(page, lab, name)
    report_widget(page)
    save_restart_and_reopen(page, lab, name)
    static = page.locator(".nm-static").first
    static.wait_for(timeout=60_000)
    static.scroll_into_view_if_needed()
    # The widget's model died with the kernel: its output is hidden, not an error.
    page.wait_for_timeout(1_000)
    assert page.get_by_text("Error displaying widget").count() == 0 or not page.get_by_text(
        "Error displaying widget").first.is_visible()
    assert not page.locator(".nan-magic-widget").count()
    assert "code outside any watched module" in static.locator(".nm-headline").inner_text()
    # Compact: summary and facts, every other section closed, about one screen.
    height = static.bounding_box()["height"]
    assert height < 800, height
    static.screenshot(path=str(ARTIFACTS / "cnn_static_after_restart.png"))
    sections = static.locator("details.nm-section > summary")
    assert [title.split(" (")[0] for title in sections.all_inner_texts()] == [
        "Layers", "Histograms", "Debug", "History"]
    # One click opens a section, no kernel and no script needed.
    sections.first.click()
    module_cell = static.locator("table.nm-layers td.nm-left").first
    module_cell.wait_for(state="visible")
    # Styled by its own stylesheet, not the notebook's table style.
    assert module_cell.evaluate("cell => getComputedStyle(cell).textAlign") == "left"
    producer = static.locator("td.nm-producer").first
    assert producer.evaluate("cell => getComputedStyle(cell).backgroundColor") != TRANSPARENT
    sections.nth(1).click()
    image = static.locator("img").first
    image.wait_for(state="visible")
    page.wait_for_function(
        "img => img.complete && img.naturalWidth > 100", arg=image.element_handle()
    )
    static.screenshot(path=str(ARTIFACTS / "cnn_static_after_restart_open.png"))


def test_cnn_report_filter_box_round_trip(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "cnn_log_zero.ipynb")
    widget = report_widget(page)
    assert "code outside any watched module" in widget.locator(".nm-headline").first.inner_text()

    open_tab(widget, "Layers")
    rows = widget.locator("table.nm-layers tbody tr")
    rows.first.wait_for()
    assert rows.count() > 5
    # The filter re-renders in the kernel: typing and Enter is a full round trip.
    box = widget.locator("input[type=text]").first
    box.fill("softmax")
    box.press("Enter")
    page.wait_for_function(
        "() => document.querySelectorAll('.nan-magic-widget table.nm-layers tbody tr').length === 1"
    )
    assert "Softmax" in rows.first.inner_text()
    widget.screenshot(path=str(ARTIFACTS / "cnn_layers_filtered.png"))



def test_notebook7_shows_the_report_unboxed_and_after_a_restart(lab: LabServer, page: Any) -> None:
    """Notebook 7 puts an output taller than ~1,800 px in a scroll box: nothing the report publishes may be."""
    pytest.importorskip("notebook", reason="Notebook 7 is not installed (pip install notebook)")
    name = "transformer_attention_blowup.ipynb"
    page.goto(f"{lab.base}/notebooks/{name}?token={lab.token}")
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.locator("li.lm-MenuBar-item", has_text="Run").first.click()
    page.locator('li.lm-Menu-item[data-command="runmenu:run-all"]:not(.lm-mod-disabled)').click()
    widget = report_widget(page)
    cell = failing_cell(page)
    # The last cell ran: every output that will be published was.
    page.locator(".jp-Cell").last.locator(".jp-OutputArea-output").first.wait_for(timeout=REPORT_TIMEOUT_MS)
    assert "jp-mod-outputsScrolled" not in (cell.get_attribute("class") or "")
    assert widget.bounding_box()["height"] < 800
    cell.evaluate("cell => cell.scrollIntoView({block: 'start'})")
    page.screenshot(path=str(ARTIFACTS / "notebook7_report.png"))

    page.keyboard.press("Control+s")
    page.wait_for_timeout(2_000)
    for kernel in lab.api("/api/kernels"):
        lab.api(f"/api/kernels/{kernel['id']}/restart", method="POST")
    page.goto(f"{lab.base}/notebooks/{name}?token={lab.token}")
    static = page.locator(".nm-static").first
    static.wait_for(timeout=60_000)
    static.scroll_into_view_if_needed()
    page.wait_for_timeout(1_000)
    error = page.get_by_text("Error displaying widget")
    assert error.count() == 0 or not error.first.is_visible()
    cell = page.locator(".jp-Cell", has=page.locator(".nm-static")).first
    assert "jp-mod-outputsScrolled" not in (cell.get_attribute("class") or "")
    assert static.bounding_box()["height"] < 800
    page.screenshot(path=str(ARTIFACTS / "notebook7_after_restart.png"))


def test_nbconvert_html_export_shows_the_compact_report(chromium: str, page: Any) -> None:
    """An exported notebook has no kernel and, offline, no widget manager: the static twin is the report."""
    from jupyter_support import execute_notebook
    from nbconvert import HTMLExporter

    nb = execute_notebook(NOTEBOOKS / "cnn_log_zero.ipynb")
    html, _resources = HTMLExporter(template_name="lab").from_notebook_node(nb)
    page.set_content(html, wait_until="domcontentloaded")
    static = page.locator(".nm-static").first
    static.wait_for(state="visible")
    assert "code outside any watched module" in static.locator(".nm-headline").inner_text()
    error = page.get_by_text("Error displaying widget")
    assert error.count() == 0 or not error.first.is_visible()
    assert static.bounding_box()["height"] < 800
    static.locator("details.nm-section > summary", has_text="Layers").click()
    static.locator("td.nm-producer").first.wait_for(state="visible")
    static.screenshot(path=str(ARTIFACTS / "cnn_nbconvert_export.png"))
