"""The exception a watch raises at the first non-benign event."""

from __future__ import annotations

from types import FrameType
from typing import Any

from nan_magic.engine.frames import end_at_producer, short_traceback
from nan_magic.locations import running_shell
from nan_magic.records import Report

__all__ = ["NanMagicWarning", "NonFiniteError"]


class NanMagicWarning(RuntimeWarning):
    """An early warning: a run heading for a non-finite value (``warn`` mode)."""


class NonFiniteError(FloatingPointError):
    """A non-finite value was produced under a watch.

    ``str(error)`` is the one-line summary; ``error.report`` holds everything
    else (see :class:`nan_magic.Report`).
    """

    def __init__(self, report: Report, *, producer_frame: FrameType | None = None) -> None:
        super().__init__(report.message)
        self.report = report
        #: The frame that ran the producing op where the traceback does not
        #: reach it (a replay found the op): %debug opens there (frames.py).
        self.producer_frame = producer_frame
        self._shown = False

    def __reduce__(self) -> tuple[type, tuple[Report]]:
        return (type(self), (self.report,))

    def _render_traceback_(self) -> list[str]:
        """How IPython shows this error (its ``_render_traceback_`` protocol).

        First our hook's frames are cut off the traceback, in place, and the
        producer's frame appended where a replay ran it: IPython has already
        stored it as ``sys.last_traceback``, so ``%debug`` opens there. The first time (the cell
        stops), the short error: headline, the user's frames, the producer's
        line, so that the report under it is on the first screen. Shown again
        (``%tb``), IPython's own full traceback.
        """
        __tracebackhide__ = True
        end_at_producer(self.__traceback__, self.producer_frame)
        if self._shown:
            full = _full_traceback(self)
            if full is not None:
                return full
        self._shown = True
        headline = f"{type(self).__name__}: {self}"
        return short_traceback(headline, self.__traceback__, self.report.source)


def _full_traceback(error: BaseException) -> Any:
    """IPython's structured traceback of ``error`` (None outside IPython)."""
    shell = running_shell()
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is None:
        return None
    return formatter.structured_traceback(type(error), error, error.__traceback__)
