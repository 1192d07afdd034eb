"""The watch's warnings named at the user's cell as IPython names it: ``Cell In[5], line 4: NanMagicWarning: ...``.

A warning is located at the user's line (``user_stacklevel``), which in a
notebook is the kernel's temporary file for the cell: Python prints
``/tmp/ipykernel_42/1234.py:4: RuntimeWarning: ...``, a name the user never
typed, where the report and IPython's own tracebacks say ``Cell In[5], line 4``.
:func:`cell_named` wraps :func:`warnings.formatwarning` so that the watch's
warnings located in a cell are printed with the cell's name. Other libraries'
warnings, and ours located in a file, print as before; filters,
``catch_warnings`` and the once-per-location registry see the same filename as
before (only the printed text changes). The wrapper is a process-wide patch,
held while the IPython extension is loaded (ipython/magics.py's ``load``,
through patches/registry.py): importing nan_magic in a script changes nothing
of Python's warnings.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.errors.frames import user_line, user_stacklevel
from nan_magic.locations import cell_location

__all__ = ["NOWHERE", "cell_named", "heard_in_the_step", "warn_at_user", "watch_warning"]

#: The filename of a warning of ours that no user's line is the place of (said as a ``%nanwatch`` cell ends,
#: from IPython's cell events): printed as ``NanMagicWarning: ...``, with no place.
NOWHERE = "nan_magic"

#: The attribute that marks a warning the watch gave under a standard category (``on_detect="warn"``'s
#: RuntimeWarning, whose category users and tests filter on as it is).
_MARK = "_nan_magic_warning"


def watch_warning(message: str, category: type[Warning] = RuntimeWarning) -> Warning:
    """``category(message)`` marked as the watch's, for ``warnings.warn`` (its category stays ``category``)."""
    warning = category(message)
    setattr(warning, _MARK, True)
    return warning


def warn_at_user(message: Warning | str, category: type[Warning] = NanMagicWarning) -> None:
    """``warnings.warn`` at the user's innermost line (``user_stacklevel``); where no frame of the user's runs (a
    ``%nanwatch`` cell's end, from IPython's cell events: the watch's summary of its repeated events), without a
    place, as :data:`NOWHERE` prints: the first frame up from there was the kernel's ``<frozen runpy>:198:``."""
    if user_line(sys._getframe(1)) is None:
        warnings.warn_explicit(message, category, NOWHERE, 0)
    else:
        warnings.warn(message, category, stacklevel=user_stacklevel())


def _ours(message: Any) -> bool:
    return isinstance(message, NanMagicWarning) or getattr(message, _MARK, False)


def cell_named(format_warning: Any) -> Any:
    """``format_warning`` printing the watch's warnings located in a cell as ``Cell In[N], line M: ...``."""

    def format_named(message: Any, category: Any, filename: str, lineno: int, line: str | None = None) -> str:
        text = format_warning(message, category, filename, lineno, line)
        if not _ours(message):
            return text
        prefix = f"{filename}:{lineno}:"
        if filename == NOWHERE and text.startswith(prefix):
            return text[len(prefix) :].lstrip()
        named = cell_location(filename, lineno)
        if named is None or not text.startswith(prefix):
            return text
        return text.replace(prefix, f"{named}:", 1)

    return format_named


@contextmanager
def heard_in_the_step() -> Iterator[None]:
    """Around an event's replays and fix trials, which run the user's step again: the warnings that code gives
    (torch's ``var(): degrees of freedom is <= 0``, the user's own) were said as the step ran, and a watch entering
    resets Python's once-per-place registry, so each replay said them again. Only the watch's own are said."""
    heard: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as heard:  # (the filters as they are: an error filter still raises)
            yield
    finally:
        for said in heard:
            if _ours(said.message):
                warnings.warn_explicit(said.message, said.category, said.filename, said.lineno, source=said.source)
