"""The MIME bundle of a Report: static views always, the widget where it can show.

Frontends pick the richest type they render: JupyterLab and VS Code with
widget support show the widget, nbviewer, GitHub and widget-less frontends
the static HTML, terminals the text. Displaying must never fail: an error
in a rich view drops that view, never the report.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from nan_magic.records import Report
from nan_magic.render.text import render_text

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def mimebundle(report: Report) -> dict[str, Any]:
    """The MIME bundle for ``Report._repr_mimebundle_``.

    Parameters
    ----------
    report
        The report to display.

    Returns
    -------
    dict
        ``text/plain`` always; ``text/html`` (the static report) unless it
        failed to render; the widget view only inside an IPython kernel
        with ipywidgets importable.
    """
    bundle: dict[str, Any] = {"text/plain": render_text(report)}
    # A failing rich view (a missing optional dependency, a frontend quirk)
    # drops that view only: the text report must always reach the user.
    with contextlib.suppress(Exception):
        from nan_magic.render.html import render_html

        bundle["text/html"] = render_html(report)
    if _in_kernel():
        with contextlib.suppress(Exception):
            from nan_magic.render.widget import build_widget

            view = build_widget(report)._repr_mimebundle_()
            bundle[WIDGET_MIME] = view[WIDGET_MIME]
    return bundle


def _in_kernel() -> bool:
    """Whether we run in an IPython kernel, where a widget frontend may exist.

    IPython is only looked up, never imported: if nobody imported it, this
    is not a kernel. Terminal IPython has no ``kernel`` attribute.
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return getattr(shell, "kernel", None) is not None
