"""Two of session 33's walk notebooks in JupyterLab in headless Chromium: what the person sees in the widget and
after a save, a kernel restart and a reopen. Without Chromium or Playwright they skip, unless ``REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import (
    ARTIFACTS,
    LabServer,
    coloured_pixels,
    open_and_run_all,
    report_widget,
    save_restart_and_reopen,
    walk_fixtures,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user_s33"


lab, page = walk_fixtures(WALK, ("unet_dice.ipynb", "housing_ratio.ipynb"))


def test_the_unet_widget_names_the_mask_count_and_shows_its_histograms(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "unet_dice.ipynb")
    widget = report_widget(page)
    headline = widget.locator(".nm-headline", has_text="step").first
    headline.wait_for(timeout=60_000)
    expected = ("1 nan in forward step 3: code outside any watched module, (bce * target).sum((1, 2, 3)) / "
                "target.sum((1, 2, 3))")
    # (the widget fills its headline after it is attached: under a loaded CI run the first read was still empty)
    deadline = time.monotonic() + 30
    while not headline.inner_text().strip() and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    assert headline.inner_text().startswith(expected), headline.inner_text()
    text = widget.inner_text()
    assert "`target.sum((1, 2, 3))` (16,) held 1 zero of 16" in text, text
    fixes = widget.locator(".nm-fixes").first.inner_text()
    assert "1 of 1 verified" in fixes and "clamp_min(1.2e-07)" in fixes, fixes
    widget.screenshot(path=str(ARTIFACTS / "user_s33_unet_summary.png"))
    widget.locator(".lm-TabBar-tab", has_text="Histograms").first.click()
    image = widget.locator(".jp-OutputArea img").first
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
    assert coloured_pixels(image) > 1000


def test_the_house_prices_report_after_a_restart_is_compact_and_says_the_sample(lab: LabServer, page: Any) -> None:
    name = "housing_ratio.ipynb"
    open_and_run_all(page, lab, name)
    report_widget(page)
    page.get_by_text("| Idle").first.wait_for(timeout=180_000)
    save_restart_and_reopen(page, lab, name)
    static = page.locator(".nm-static").first
    static.wait_for(timeout=60_000)
    static.scroll_into_view_if_needed()
    headline = static.locator(".nm-headline").inner_text()
    assert "in data step 4: Sequential (root)" in headline, headline
    assert "dataset[300]" in static.inner_text()
    assert static.bounding_box()["height"] < 800
    static.screenshot(path=str(ARTIFACTS / "user_s33_housing_after_restart.png"))
