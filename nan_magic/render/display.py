"""How a Report is displayed: the static report as an output of its own, then the widget.

A widget view does not survive a kernel restart: reopened, JupyterLab
draws "Error displaying widget: model not found" for it and does not fall
back to the other types of the same output. So in a kernel the static HTML
report is published first, as its own output, which JupyterLab after a
restart, GitHub and nbviewer render; then the widget's output follows.
While the widget lives, a style inside it hides that static copy (by its
element id), so the report is not shown twice; once the widget is gone,
its style goes with it and the static copy shows.

Outside a kernel (terminal IPython, a plain ``display`` call) the bundle is
the text and the static HTML. Displaying must never fail: an error in a
rich view drops that view, never the report.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from nan_magic.locations import running_shell
from nan_magic.records import Report
from nan_magic.render.text import render_text

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: The widget output's text, for frontends that draw neither widgets nor HTML.
WIDGET_PLAIN = "nan_magic report widget (the static report is the output above)"


def mimebundle(report: Report) -> dict[str, Any]:
    """The MIME bundle for ``Report._repr_mimebundle_``.

    Inside an IPython kernel with ipywidgets importable: the widget view and a one-line ``text/plain``, after the
    static report was published as an output of its own. Elsewhere (or when the widget fails): ``text/plain`` (the
    text report) and ``text/html`` (the static report) unless that failed to render.
    """
    bundle: dict[str, Any] = {"text/plain": render_text(report)}
    static_id = f"nan-magic-{uuid.uuid4().hex[:12]}"
    # A failing rich view (a missing optional dependency, a frontend quirk)
    # drops that view only: the text report must always reach the user.
    with contextlib.suppress(Exception):
        from nan_magic.render.html import render_html

        bundle["text/html"] = render_html(report, element_id=static_id)
    shell = _kernel_shell()
    if shell is None or "text/html" not in bundle:
        return bundle
    try:
        from nan_magic.render.widget import build_widget

        view = _widget_view(build_widget(report, hides=static_id))
    except Exception:
        return bundle
    shell.display_pub.publish(data=bundle, metadata={})
    return {"text/plain": WIDGET_PLAIN, WIDGET_MIME: view}


def _widget_view(widget: Any) -> Any:
    """The widget's view (its model id), displayed the way its ipywidgets displays widgets.

    ipywidgets 8 returns it from ``_repr_mimebundle_``. ipywidgets 7
    (Colab's) has no such method: ``_ipython_display_`` publishes the view
    itself, so that publication is captured (IPython's own capture) and its
    view returned; the report's bundle then carries it, after the static copy.
    """
    repr_mimebundle = getattr(widget, "_repr_mimebundle_", None)
    if repr_mimebundle is not None:
        return repr_mimebundle()[WIDGET_MIME]
    from IPython.utils.capture import capture_output

    with capture_output(stdout=False, stderr=False) as captured:
        widget._ipython_display_()
    return next(output.data[WIDGET_MIME] for output in captured.outputs if WIDGET_MIME in output.data)


def _kernel_shell() -> Any:
    """The IPython kernel's shell, where a widget frontend may exist; else None.

    IPython is only looked up, never imported: if nobody imported it, this
    is not a kernel. Terminal IPython has no ``kernel`` attribute.
    """
    shell = running_shell()
    return shell if getattr(shell, "kernel", None) is not None else None
