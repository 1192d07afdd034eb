"""Two of session 29's walk notebooks in JupyterLab in headless Chromium: what the person sees in the widget and
after a save, a kernel restart and a reopen. Without Chromium or Playwright they skip, unless ``REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

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

WALK = Path(__file__).parent / "notebooks" / "user_s29"


lab, page = walk_fixtures(WALK, ("gan_saturate.ipynb", "diffusion_schedule.ipynb"))


def test_the_gan_s_layers_tab_names_each_row_s_model(lab: LabServer, page: Any) -> None:
    """G and D are both nn.Sequential: the Layers tab read "Sequential (root)" on all six model rows."""
    open_and_run_all(page, lab, "gan_saturate.ipynb")
    widget = report_widget(page)
    assert "1 -inf in forward step 17: code outside any watched module" in widget.locator(
        ".nm-headline").first.inner_text()
    widget.locator(".lm-TabBar-tab", has_text="Layers").first.click()
    modules = widget.locator("table.nm-layers tbody tr td:nth-child(4)")
    modules.first.wait_for(state="visible")
    shown = [text.strip() for text in modules.all_inner_texts()]
    assert shown[:3] == ["Sequential (root) in G", "Sequential (root) in G", "Sequential (root) in D"], shown
    assert "3 (Sigmoid) in D" in shown, shown
    widget.screenshot(path=str(ARTIFACTS / "user_s29_gan_layers.png"))
    widget.locator(".lm-TabBar-tab", has_text="Histograms").first.click()
    image = widget.locator(".jp-OutputArea img").first
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
    assert coloured_pixels(image) > 1000
    options = [option.replace("\xa0", " ") for option in widget.locator("select option").all_inner_texts()]
    assert "3: input[0] of G" in options and "5: input[0] of D" in options, options


def test_the_diffusion_report_after_a_restart_says_why_no_fix_was_tried(lab: LabServer, page: Any) -> None:
    name = "diffusion_schedule.ipynb"
    open_and_run_all(page, lab, name)
    report_widget(page)
    page.get_by_text("| Idle").first.wait_for(timeout=180_000)
    save_restart_and_reopen(page, lab, name)
    static = page.locator(".nm-static").first
    static.wait_for(timeout=60_000)
    static.scroll_into_view_if_needed()
    assert "1088 +inf in optimizer step 0: net.0 (Linear)" in static.locator(".nm-headline").inner_text()
    assert "no fix was tried: the trials of the Adam step" in static.inner_text()
    assert static.bounding_box()["height"] < 800
    static.screenshot(path=str(ARTIFACTS / "user_s29_diffusion_after_restart.png"))
