"""The exception a watch raises at the first non-benign event."""

from __future__ import annotations

from nan_magic.records import Report

__all__ = ["NanMagicWarning", "NonFiniteError"]


class NanMagicWarning(RuntimeWarning):
    """An early warning: a run heading for a non-finite value (``warn`` mode)."""


class NonFiniteError(FloatingPointError):
    """A non-finite value was produced under a watch.

    ``str(error)`` is the one-line summary; ``error.report`` holds everything
    else (see :class:`nan_magic.Report`).
    """

    def __init__(self, report: Report) -> None:
        super().__init__(report.message)
        self.report = report

    def __reduce__(self) -> tuple[type, tuple[Report]]:
        return (type(self), (self.report,))
