"""Two of session 30's walk notebooks in JupyterLab in headless Chromium: what the person sees in the widget and
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

WALK = Path(__file__).parent / "notebooks" / "user_s30"


lab, page = walk_fixtures(WALK, ("char_lstm.ipynb", "seq2seq_pad.ipynb"))


def test_the_char_lstm_widget_suggests_the_log_softmax_of_the_logits(lab: LabServer, page: Any) -> None:
    open_and_run_all(page, lab, "char_lstm.ipynb")
    widget = report_widget(page)
    assert "in backward step 38: code outside any watched module" in widget.locator(
        ".nm-headline").first.inner_text()
    shown = widget.inner_text()
    assert "torch.log_softmax(logits, -1)" in shown and "torch.log_softmax(-1)" not in shown
    widget.screenshot(path=str(ARTIFACTS / "user_s30_char_lstm_summary.png"))
    widget.locator(".lm-TabBar-tab", has_text="Histograms").first.click()
    image = widget.locator(".jp-OutputArea img").first
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
    assert coloured_pixels(image) > 1000


def test_the_seq2seq_report_after_a_restart_is_compact_and_static(lab: LabServer, page: Any) -> None:
    name = "seq2seq_pad.ipynb"
    open_and_run_all(page, lab, name)
    report_widget(page)
    page.get_by_text("| Idle").first.wait_for(timeout=180_000)
    save_restart_and_reopen(page, lab, name)
    static = page.locator(".nm-static").first
    static.wait_for(timeout=60_000)
    static.scroll_into_view_if_needed()
    assert "1 nan in forward step 9: code outside any watched module" in static.locator(".nm-headline").inner_text()
    assert "clamp_min" in static.inner_text()
    assert static.bounding_box()["height"] < 800
    static.screenshot(path=str(ARTIFACTS / "user_s30_seq2seq_after_restart.png"))
