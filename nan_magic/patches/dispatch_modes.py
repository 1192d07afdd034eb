"""A ``TorchDispatchMode`` the user enters while a watch runs: told to the watch as it is entered and left.

A mode entered around the watch is known as the watch attaches, and the
watch's callbacks are wrapped to run beside it (lifecycle/users_modes.py). One
entered inside the loop (``with FlopCounterMode(): loss = ...``, an op counter
around one step) comes too late for that: torch already holds the callbacks.
So ``TorchDispatchMode.__enter__`` and ``__exit__`` are wrapped while a watch
runs: after a mode is entered, each watch may act (users_modes.py pushes a
gate above it) and hands back what undoes that, which runs before the mode is
left (``__exit__`` pops the innermost mode: the gate must be gone by then). A
mode whose class enters without ``TorchDispatchMode.__enter__`` is not seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.patches.registry import ProcessPatch

__all__ = ["Entered", "seeing_modes_entered"]

#: ``entered(mode) -> undo | None``: a mode was entered; ``undo()`` runs before it is left.
Entered = Callable[[TorchDispatchMode], "Callable[[], None] | None"]

_watchers: list[Entered] = []


class _Undos(threading.local):
    """This thread's modes entered under the patch and not yet left, innermost last, with their undos."""

    def __init__(self) -> None:
        self.open: list[tuple[TorchDispatchMode, list[Callable[[], None]]]] = []


_undos = _Undos()


def _wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    def __enter__(self: TorchDispatchMode) -> Any:
        __tracebackhide__ = True
        entered = original(self)
        undos = [undo for watcher in list(_watchers) if (undo := watcher(self)) is not None]
        # Every entry, undos or not: a mode entered again inside itself (make_fx's proxy mode, around each op it
        # traces) must not take its outer entry's undos as its inner one is left.
        _undos.open.append((self, undos))
        return entered

    return __enter__


def _wrap_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def __exit__(self: TorchDispatchMode, *exc: Any) -> Any:
        __tracebackhide__ = True
        open_modes = _undos.open
        for index in range(len(open_modes) - 1, -1, -1):
            if open_modes[index][0] is self:
                for undo in reversed(open_modes.pop(index)[1]):
                    undo()
                break
        return original(self, *exc)

    return __exit__


_PATCH = ProcessPatch(lambda: [(TorchDispatchMode, "__enter__", _wrap_enter),
                               (TorchDispatchMode, "__exit__", _wrap_exit)])


@contextmanager
def seeing_modes_entered(entered: Entered) -> Iterator[None]:
    """Inside the block, ``entered(mode)`` is called after each ``TorchDispatchMode`` is entered, and what it
    returns (if not None) before that mode is left."""
    try:
        with _PATCH.held((_watchers, entered)):
            yield
    finally:
        if not _watchers:  # (the modes left open past the last watch: nothing of theirs to undo)
            _undos.open.clear()
