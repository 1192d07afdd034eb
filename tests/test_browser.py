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
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPORT_TIMEOUT_MS = 180_000
TRANSPARENT = "rgba(0, 0, 0, 0)"


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


def test_transformer_report_in_jupyterlab(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "transformer_attention_blowup.ipynb")
    widget = report_widget(page)

    summary = widget.locator(".nm-summary").first
    summary.wait_for()
    assert "blocks.0.attn (SelfAttention)" in summary.inner_text()
    assert "during the forward phase of step 3" in summary.inner_text()

    open_tab(widget, "Layers")
    producer = widget.locator("td.nm-producer").first
    producer.wait_for()
    row = producer.locator("xpath=..").inner_text()
    assert "blocks.0.attn" in row and "producer" in row
    assert producer.evaluate("cell => getComputedStyle(cell).backgroundColor") != TRANSPARENT
    widget.screenshot(path=str(ARTIFACTS / "transformer_layers.png"))

    open_tab(widget, "Histograms")
    image = widget.locator(".jp-OutputArea img").first
    image.wait_for()
    page.wait_for_function(
        "img => img.complete && img.naturalWidth > 100", arg=image.element_handle()
    )
    assert coloured_pixels(image) > 1000
    widget.screenshot(path=str(ARTIFACTS / "transformer_histograms.png"))


def test_cnn_report_filter_box_round_trip(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "cnn_log_zero.ipynb")
    widget = report_widget(page)
    assert "code outside any watched module" in widget.locator(".nm-summary").first.inner_text()

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

