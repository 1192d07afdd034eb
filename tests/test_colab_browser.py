"""The report on ipywidgets 7 in a browser: JupyterLab 3 with jupyterlab_widgets 1, headless Chromium.

The frontend of Colab's widget stack that can run here (Colab's own renders the
same core ipywidgets 7 controls). Runs in .venv-colab (scripts/setup-colab-env),
skipped elsewhere; without Chromium it skips, unless ``REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

IPython = pytest.importorskip("IPython")
if IPython.version_info[0] != 7:
    pytest.skip("Colab's stack (IPython 7): runs in .venv-colab (scripts/setup-colab-env)", allow_module_level=True)

from jupyter_support import (  # noqa: E402
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

#: ipywidgets 7's Tab is a Phosphor TabBar (p- classes); Lumino's (lm-) as well, for either.
TAB = ".p-TabBar-tab, .lm-TabBar-tab"


@pytest.fixture(scope="module")
def chromium() -> str:
    return chromium_or_skip()


@pytest.fixture(scope="module")
def lab(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    root = tmp_path_factory.mktemp("lab-root")
    shutil.copy(NOTEBOOKS / "colab_quickstart.ipynb", root / "colab_quickstart.ipynb")
    with jupyterlab(root, tmp_path_factory.mktemp("lab-home")) as server:
        yield server


def test_the_quickstart_report_renders_with_ipywidgets_7(lab: LabServer, chromium: str) -> None:
    import jupyterlab

    assert jupyterlab.__version__.startswith("3.")
    ARTIFACTS.mkdir(exist_ok=True)
    with chromium_page(chromium) as page:
        try:
            open_and_run_all(page, lab, "colab_quickstart.ipynb")
            widget = page.locator(".nan-magic-widget").first
            widget.wait_for(timeout=180_000)
            widget.scroll_into_view_if_needed()
            headline = widget.locator(".nm-headline").first
            headline.wait_for()
            assert "norm (Standardize)" in headline.inner_text()
            # The live widget hides its static twin, published before it in the same cell.
            cell = page.locator(".jp-Cell", has=widget).first
            assert cell.locator(".nm-static").count() == 1
            assert not cell.locator(".nm-static").first.is_visible()
            # Its whole output goes (prompt and margins): no empty band above the widget.
            twin = cell.locator(".jp-OutputArea-child").filter(has=page.locator(".nm-static")).first
            assert twin.evaluate("element => getComputedStyle(element).display") == "none"
            titles = [tab.inner_text().strip() for tab in widget.locator(TAB).all()]
            assert titles == ["Summary", "Layers", "Histograms", "Debug", "History"]
            widget.screenshot(path=str(ARTIFACTS / "colab_ipywidgets7_summary.png"))

            widget.locator(TAB, has_text="Layers").first.click()
            producer = widget.locator("td.nm-producer").first
            producer.wait_for(state="visible")
            assert "norm (Standardize)" in producer.locator("xpath=..").inner_text()

            widget.locator(TAB, has_text="Histograms").first.click()
            image = widget.locator(".jp-OutputArea img, .p-Widget img, img").first
            image.wait_for(state="visible")
            page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
            assert coloured_pixels(image) > 1000
            widget.screenshot(path=str(ARTIFACTS / "colab_ipywidgets7_histograms.png"))
        finally:
            page.screenshot(path=str(ARTIFACTS / "colab_ipywidgets7_page.png"))


def test_the_saved_report_after_a_restart_with_ipywidgets_7(lab: LabServer, chromium: str) -> None:
    """Saved, kernel restarted, reopened: the static copy is the report, and the dead widget shows no error."""
    ARTIFACTS.mkdir(exist_ok=True)
    name = "colab_quickstart.ipynb"
    with chromium_page(chromium) as page:
        try:
            open_and_run_all(page, lab, name)
            page.locator(".nan-magic-widget").first.wait_for(timeout=180_000)
            save_restart_and_reopen(page, lab, name)
            static = page.locator(".nm-static").first
            static.wait_for(timeout=60_000)
            static.scroll_into_view_if_needed()
            page.wait_for_timeout(1_000)
            errors = page.get_by_text("Error displaying widget")
            assert all(not error.is_visible() for error in errors.all())
            assert not page.locator(".nan-magic-widget").count()
            assert "norm (Standardize)" in static.locator(".nm-headline").inner_text()
            assert static.bounding_box()["height"] < 800
        finally:
            page.screenshot(path=str(ARTIFACTS / "colab_ipywidgets7_after_restart.png"))
