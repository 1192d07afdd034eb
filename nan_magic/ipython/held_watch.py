"""The watch ``%nanwatch`` holds between IPython's cell events, and the report a watch leaves in the namespace.

Apart from magics.py (the magics themselves: parsing their lines, building the
watch, ``%nanreplay``, the status) because this is the one part driven by
IPython's ``pre_run_cell``/``post_run_cell`` events rather than by a magic's
line: arming a held watch, leaving it by the cell's exception (paused, for a
``%nanwatch on`` run), and storing and displaying the report.
:class:`HeldWatchMagics` is the base :class:`~nan_magic.ipython.magics.NanMagics` gets these methods from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from IPython.core.error import UsageError
from IPython.core.magic import Magics

from nan_magic.ipython.watched_cell import cut_users_errors
from nan_magic.lifecycle.watch import Watch

__all__ = ["HeldWatchMagics"]


class _Held(NamedTuple):
    """A watch held between the cell events (see :meth:`NanMagics._hold`)."""

    watch: Watch
    args: Any
    #: Whether ``%nanwatch on`` armed it.
    persistent: bool
    #: The depth of %%nantrace bodies it was armed at: it is left at that depth's post_run_cell.
    depth: int
    #: Its events when the cell began: the cell's are the rest.
    seen: int
    #: Puts the shell's showtraceback back (watched_cell.cut_users_errors).
    uncut: Callable[[], None]


class HeldWatchMagics(Magics):
    """A watch held between the cell events (its state is :class:`NanMagics`'s, set by its ``__init__``)."""

    _persistent: tuple[str, Any, Watch | None] | None
    _held: _Held | None
    _bodies: int
    _outcome: tuple[Any, BaseException | None] | None
    _cell_counted: bool
    _in_cell: bool
    _last_report: Any
    _unloaded: bool

    @property
    def _shell(self) -> Any:
        """The shell (IPython types it as optional; a loaded extension always has one)."""
        assert self.shell is not None
        return self.shell

    def _make_watch(self, args: Any, name: str) -> Watch:
        raise NotImplementedError  # (NanMagics's: parses the options and builds the watch)

    def _take_over(self, name: str) -> None:
        """Make room for this cell's own watch: it takes over from the one ``%nanwatch on`` armed."""
        if self._held is not None:
            if not self._held.persistent:
                raise UsageError(f"{name}: a watch is already armed for this cell")
            self._release(None)

    def _hold(self, watch: Watch, args: Any, persistent: bool) -> None:
        if persistent:
            watch.resume()
        else:
            watch.__enter__()
        # (The cell's own error is shown at the user's line until it is released: watched_cell.py.)
        self._held = _Held(watch, args, persistent, self._bodies, len(watch.events), cut_users_errors(self._shell))

    def _release(self, result: Any) -> None:
        """Leave the held watch by the cell's exception (``result``: the cell's ExecutionResult).

        The watch of a ``%nanwatch on`` run still armed is paused: the next cell resumes its run.
        """
        assert self._held is not None
        watch, args, seen = self._held.watch, self._held.args, self._held.seen
        self._held.uncut()
        self._held = None
        error = None if result is None else result.error_in_exec
        try:
            if self._persistent is not None and self._persistent[2] is watch:
                watch.pause(error)
            elif error is None:
                watch.__exit__(None, None, None)
            else:
                watch.__exit__(type(error), error, error.__traceback__)
        except Exception as raised:  # the watch's own: a deferred check at the exit, an error it explains
            self._shell.showtraceback((type(raised), raised, raised.__traceback__))
            if result is not None:
                result.error_in_exec = raised
        self._finish(watch, args, seen)

    # -- events ------------------------------------------------------------------

    def pre_run_cell(self, info: Any = None) -> None:
        if self._bodies:
            return  # a %%nantrace body: its cell is already watched
        self._outcome = None  # a body run by a direct run_cell_magic call had no cell of its own
        self._cell_counted = bool(getattr(info, "store_history", False))
        self._in_cell = True
        if self._persistent is not None and self._held is None:
            line, args, watch = self._persistent
            if watch is None or not watch.paused:
                try:
                    watch = self._make_watch(args, "%nanwatch on")
                except UsageError as error:
                    self._persistent = None
                    print(f"nan_magic: watch off ({error})", file=sys.stderr)
                    return
                self._persistent = (line, args, watch)
            self._hold(watch, args, persistent=True)

    def post_run_cell(self, result: Any) -> None:
        if not self._bodies:
            self._in_cell = False
        if self._bodies == 0 and self._outcome is not None and result is not None:
            # A %%nantrace cell: IPython ran its body as a cell of its own; its outcome is this cell's.
            (body, error), self._outcome = self._outcome, None
            if result.error_in_exec is None:
                result.error_in_exec = error or body.error_in_exec or body.error_before_exec
            if result.result is None:
                result.result = body.result
        if self._held is not None and self._held.depth == self._bodies:
            self._release(result)

    def _finish(self, watch: Watch, args: Any, seen: int = 0) -> None:
        """Store the report of the events after the first ``seen`` (the cell's) in the user namespace; display it."""
        if watch.report is not None:
            self._last_report = watch.report
        new = watch.events[seen:]
        if not new:
            return
        report = next((event for event in new if not event.benign), new[-1])
        self._shell.user_ns[args.output] = report
        if not args.quiet:
            from IPython.display import display

            display(report)

    def unload(self) -> None:
        """Leave any held watch and answer every later call with a usage error."""
        if self._persistent is not None:
            # %reload_ext (after an upgrade, an edit) turned a %nanwatch on silently off: the cells after it ran
            # unwatched and a NaN there went by without a word. Say so; the user turns it on again.
            print("nan_magic: unloaded, so %nanwatch on is off; after %load_ext nan_magic, %nanwatch on again")
        self._persistent = None
        if self._held is not None:
            self._release(None)
        self._unloaded = True
