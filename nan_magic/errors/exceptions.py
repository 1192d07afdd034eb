"""The exception a watch raises at the first non-benign event."""

from __future__ import annotations

import linecache
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from nan_magic.errors.frames import end_at_producer, headline_lines, short_traceback
from nan_magic.locations import running_shell
from nan_magic.records import Report

__all__ = ["NanMagicWarning", "NonFiniteError", "PeerNonFiniteError"]


class NanMagicWarning(RuntimeWarning):
    """An early warning: a run heading for a non-finite value (``warn`` mode)."""


class NonFiniteError(FloatingPointError):
    """A non-finite value was produced under a watch.

    ``str(error)`` is the one-line summary; ``error.report`` holds everything
    else (see :class:`nan_magic.Report`).
    """

    def __init__(
        self,
        report: Report,
        *,
        producer_frame: FrameType | None = None,
        producer_position: tuple[int, int] | None = None,
        producer_calls: tuple[tuple[FrameType, int, int], ...] = (),
    ) -> None:
        super().__init__(report.message)
        self.report = report
        #: The frame that ran the producing op where the traceback does not
        #: reach it (a replay found the op): %debug opens there (frames.py),
        #: at ``producer_position`` (``(f_lasti, f_lineno)`` when the op ran), where known.
        self.producer_frame = producer_frame
        self.producer_position = producer_position
        #: The calls that led to a producer's frame that had returned (a loss helper's), outermost first: the
        #: traceback reads in call order, the caller at the line that called it (frames.end_at_producer).
        self.producer_calls = producer_calls
        self._shown = False
        #: The compact report added as a note (:meth:`note_report`), for a caller that prints the report itself.
        self.report_note: str | None = None

    def note_report(self) -> None:
        """Add the compact report as a note under the error, once, where no shell shows the report.

        A script that does not catch the error (``python train.py``, a CI job) showed the headline alone: Python
        prints an exception's notes under it, so the module, op, line and cause read there as in the notebook,
        under its short error. In IPython the magics show the report (and ``%tb`` would print it twice); ``run``
        prints the whole report after the traceback and takes the note off (:meth:`drop_report_note`).
        Called as the error leaves a watch, after the traceback is adopted (its frames are in the report).
        """
        if self.report_note is not None or running_shell() is not None or not hasattr(self, "add_note"):
            return  # (exception notes are Python 3.11+)
        self.report_note = self.report.to_text(compact=True)
        self.add_note(self.report_note)

    def drop_report_note(self) -> None:
        """Take :meth:`note_report`'s note off, where the caller prints the whole report itself."""
        notes = getattr(self, "__notes__", None)
        if self.report_note is not None and notes is not None and self.report_note in notes:
            notes.remove(self.report_note)

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
        end_at_producer(self.__traceback__, self.producer_frame, self.producer_position, self.producer_calls)
        if self._shown:
            full = _full_traceback(self)
            if full is not None:
                return full
        self._shown = True
        formatter = getattr(running_shell(), "InteractiveTB", None)
        if getattr(formatter, "tb", None) is not None:
            # %debug opens the traceback IPython's formatter formatted last before sys.last_traceback; the short
            # error is not formatted there, so an earlier cell's error (a NameError) would be the one it opens.
            formatter.tb = None  # type: ignore[union-attr]
        return short_traceback(self._headline(), self.__traceback__, self.report.source, self.producer_calls)

    def _headline(self) -> list[str]:
        what, separator, at, counts = self.report.message_parts
        return headline_lines(f"{type(self).__name__}: {what}", separator, at, counts)


class PeerNonFiniteError(NonFiniteError):
    """Another rank of the process group found a non-finite value; this rank stops with it.

    Raised under ``torch.distributed`` on every rank but the one that found
    the event, at the same step, so that no rank waits in a collective for
    one that stopped. ``error.report`` is that rank's report (its ``rank``
    names it) with a note of how the value reached this rank;
    ``error.local_report`` is this rank's own report of the step, or None
    when it saw nothing non-finite. ``error.rank`` is the rank that found it.
    """

    def __init__(self, report: Report, *, local_report: Report | None = None) -> None:
        super().__init__(report)
        self.args = (peer_message(report),)
        self.rank = report.rank
        self.local_report = local_report

    def __reduce__(self) -> tuple[Any, ...]:
        return (_peer_error, (self.report, self.local_report))

    def _headline(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def _peer_error(report: Report, local_report: Report | None) -> PeerNonFiniteError:
    return PeerNonFiniteError(report, local_report=local_report)


def peer_message(report: Report) -> str:
    """``rank 1 found a non-finite value at step 3: forward, 1 (LogLayer), aten.log.default``."""
    what = f"{report.phase}, {report.where}"
    if report.op:
        what += f", {report.op}"
    return f"rank {report.rank} found a non-finite value at step {report.step}: {what}"


def _full_traceback(error: BaseException) -> Any:
    """IPython's structured traceback of ``error`` (None outside IPython)."""
    shell = running_shell()
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is None:
        return None
    with _lines_of_cells_held():
        return formatter.structured_traceback(type(error), error, error.__traceback__)


@contextmanager
def _lines_of_cells_held() -> Iterator[None]:
    """Let IPython 9 format a cell's frame at the traceback entry's line, not where the frame stands now.

    IPython 9's formatter counts a frame's file lines on disk and, where it cannot open the file, formats the frame
    on its fast path at ``frame.f_lineno``. ipykernel names its cells ``/tmp/ipykernel_<pid>/<hash>.py`` and keeps
    them only in linecache, so every cell's frame went there. An ordinary traceback's frames stopped where they
    raised, so nobody sees it; ours have run on: a replay's frames (``Block.forward``) ran to their ``return``, and
    a deferred check raised at ``opt.step()``, after the line that called the model. ``%tb`` showed those lines
    (``line 42``, ``opt.step()``) between the cell and the producer, where the short error and ``%debug`` give the
    calling lines. A file missing on disk is counted from linecache instead (as the function's docstring says it
    does), so the traceback entry's own line (``tb_lineno``) is formatted.
    """
    try:
        from IPython.core import ultratb
    except ImportError:  # (no IPython: nothing to format)
        yield
        return
    counting = getattr(ultratb, "get_line_number_of_frame", None)
    if counting is None:  # IPython before 9: it formats every frame at the entry's line
        yield
        return

    def counted(frame: FrameType) -> int:
        filename = frame.f_code.co_filename
        if filename.endswith(".py") and not os.path.exists(filename) and linecache.getlines(filename):
            return len(linecache.getlines(filename))
        return counting(frame)

    ultratb.get_line_number_of_frame = counted
    try:
        yield
    finally:
        ultratb.get_line_number_of_frame = counting
