"""Watches entered at once, and the watch as a decorator.

A watch nested over the same modules takes over from the outer one (whose
hooks are removed until this one exits): never two sets of our hooks on one
model. The steps the nested watch took are the outer watch's steps too, and its events the outer's events
(its first real event the outer's report, where the outer has none). A
step replay's watch (``replay_of``, localize/replay/tiered/step.py) runs inside the watch it
replays, which stands aside instead of being taken over from.

Who calls whom: each watch owns a :class:`Nesting`, given its own hooks'
``attach`` and ``detach`` as callables; one watch's nesting removes and
restores another's hooks only through those.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.hot.step_cycle import StepCycle
    from nan_magic.hot.watched.targets import Targets
    from nan_magic.lifecycle.events import Events
    from nan_magic.options import WatchConfig

__all__ = ["Nested", "Nesting"]

F = TypeVar("F", bound=Callable[..., Any])


class Nested(Protocol):
    """What a nesting reads of its watch: what it watches, whether it is in, its steps; and entering it."""

    @property
    def targets(self) -> Targets: ...

    @property
    def replay_of(self) -> object | None: ...

    @property
    def active(self) -> bool: ...

    @property
    def cycle(self) -> StepCycle: ...

    @property
    def outcome(self) -> Events: ...

    @property
    def config(self) -> WatchConfig: ...

    def __enter__(self) -> Any: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> Any: ...


# The nestings of the watches currently entered, outermost first.
_ACTIVE: list[Nesting] = []


class Nesting:
    """One watch's place among the watches entered at once (see the module docstring)."""

    def __init__(self, watch: Nested, attach: Callable[[], None], detach: Callable[[], None]) -> None:
        self._watch = watch
        self._attach = attach
        self._detach = detach
        self._suspended: list[Nesting] = []
        # Serialises the decorator's check-and-enter (:meth:`decorate`).
        self._entering = threading.Lock()

    def _overlaps(self, other: Nesting) -> bool:
        mine, theirs = self._watch.targets, other._watch.targets
        if mine.discover or theirs.discover:
            return True
        return not mine.modules.keys().isdisjoint(theirs.modules.keys())

    def attach(self) -> None:
        """The watch is being entered: take over from the outer watches it overlaps, then attach its hooks."""
        self._suspended = [] if self._watch.replay_of else [outer for outer in _ACTIVE if outer._overlaps(self)]
        for outer in self._suspended:
            outer._detach()
        try:
            self._attach()
        except BaseException:
            self.hand_back()
            raise

    def entered(self) -> None:
        _ACTIVE.append(self)

    def left(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def hand_back(self) -> None:
        """The watch is left (its hooks are removed): the outer watches it took over from watch again."""
        for outer in self._suspended:
            if outer._watch.active:
                # The steps taken while this watch had taken over are the outer watch's steps too, and so
                # are its events.
                outer._watch.cycle.absorb(self._watch.cycle)
                outer._watch.outcome.absorb(self._watch.outcome)
                outer._attach()
        self._suspended = []

    def outer_dump(self) -> str | None:
        """The scene folder of an outer watch this one took over from, whose events its events become (the
        ``dump`` of ``python -m nan_magic run --dump DIR`` around a script's own watch); None where none has one."""
        return next((outer._watch.config.dump for outer in self._suspended if outer._watch.config.dump), None)

    def decorate(self, function: F) -> F:
        """``function`` entering the watch at each outermost call (:meth:`Watch.__call__`).

        The watch is entered once per outermost call and left when that call
        returns. A call made while it is active does not enter it again:

        * on the watching thread (recursion, or the function calling itself
          through other code), the inner call simply runs inside the watch
          already active, and is watched as part of it;
        * on another thread, the call runs unwatched by this watch. Its
          module hooks are global but act only for the thread that entered
          the watch (:meth:`mine`): the step counter, the module stack and
          the deferred check belong to one thread's sequence of steps, and
          interleaving a second thread's calls into them would attribute
          one thread's values to the other's step. Give each thread a watch
          of its own (``with watch(model):`` inside the thread) to watch both.

        ``with w:`` on a watch already active still raises, as before: that is
        a nesting the code asked for explicitly.
        """
        watch = self._watch

        @functools.wraps(function)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self._entering:
                # Checked and entered under one lock: two threads calling at
                # once must not both try to enter.
                entered = None if watch.active else ExitStack()
                if entered is not None:
                    entered.enter_context(watch)
            if entered is None:
                return function(*args, **kwargs)
            with entered:  # leaves the watch with the call's exception, as ``with watch:`` does
                return function(*args, **kwargs)

        return watched  # type: ignore[return-value]
