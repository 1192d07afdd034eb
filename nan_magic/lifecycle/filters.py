"""One warning line where ``include`` / ``types`` match no module: the user would watch nothing and feel safe.

A misspelled pattern (``--include 'encodr.*'``) or type (``types=["Linaer"]``) is not an error (a pattern
may be meant for a model that changes), so the cell runs on; but it is said once, at the watch's start, naming
the pattern and a few of the module names (or types) that do exist. Where the watch finds its models as the cell
uses them (``%%nantrace`` with no targets), it is said as the watch ends, once it knows them.
"""

from __future__ import annotations

import sys
import warnings

from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.errors.frames import user_line
from nan_magic.errors.warning_lines import NOWHERE
from nan_magic.hot.watched.targets import Targets, unmatched_filters
from nan_magic.options import WatchConfig

__all__ = ["warn_unmatched_filters"]

_WHAT = {"include": ("include pattern", "module names"), "types": ("types entry", "module types")}


def warn_unmatched_filters(targets: Targets, config: WatchConfig) -> bool:
    """Warn for each ``include`` pattern and ``types`` entry that no module matches; whether the models were
    known to judge it (False before any was named: judged again later)."""
    if not (config.include or config.types):
        return True
    if not targets.roots:
        return False
    for option, pattern, existing in unmatched_filters(targets, config):
        what, kinds = _WHAT[option]
        # (A model of one module has only the root's name, "": it read "their module names: )".)
        named = [name for name in existing if name]
        there = ", ".join(named) if named else "none but the root" if existing else "none"
        message = (
            f"nan_magic: {what} {pattern!r} matches no module of the watched models, so nothing it meant "
            f"is checked (their {kinds}: {there})"
        )
        # At the user's line, and with no registry: said again when the cell runs again (a plain warn says a
        # message once per line, and a re-run cell with the same misspelling would go silent); filters still apply.
        where = user_line(sys._getframe(1))
        # (No user frame: a %nanwatch cell's end, from IPython's cell events. Printed without a place: warning_lines.)
        filename, line, module_globals = (where[0].co_filename, where[1], where[2]) if where else (NOWHERE, 0, None)
        warnings.warn_explicit(message, NanMagicWarning, filename, line, module_globals=module_globals)
    return True
