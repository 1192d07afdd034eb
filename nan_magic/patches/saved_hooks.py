"""``torch.autograd.graph.saved_tensors_hooks`` entered and left while a watch is active, listed for its replays.

The hooks are a stack that torch keeps in C++ per thread; a call that starts under them is noted with the innermost
one (hot/kept/saved_hooks.py says why: a replay after the user's ``with`` must pack as the call did). Reading torch's
stack at every top-level call would be a Python call more on every healthy step; wrapping the context's enter and
exit costs only the loops that use it, and the list they keep is read with no call. ``save_on_cpu`` and a user's
subclass pass through the same methods. Checkpointing's contexts (``torch.utils.checkpoint``, around each
checkpointed region) are not listed: their hooks belong to the running checkpoint's frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.autograd.graph import saved_tensors_hooks

from nan_magic.hot.kept.saved_hooks import ENTERED
from nan_magic.patches.registry import ProcessPatch

__all__ = ["listed_saved_hooks"]

_CHECKPOINTS = "torch.utils.checkpoint"


def _wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
    def enter(self: saved_tensors_hooks) -> Any:
        __tracebackhide__ = True
        entered = original(self)  # (torch refuses hooks under disable_saved_tensors_hooks: nothing is listed then)
        if type(self).__module__ != _CHECKPOINTS:
            ENTERED.append(self)
        return entered

    return enter


def _wrap_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def leave(self: saved_tensors_hooks, *exc: object) -> Any:
        __tracebackhide__ = True
        try:
            return original(self, *exc)
        finally:
            # The innermost entry of this context (one entered before the watch began is not listed; nothing is
            # listed around a checkpoint's own, the usual case: no walk then).
            if ENTERED:
                for index in range(len(ENTERED) - 1, -1, -1):
                    if ENTERED[index] is self:
                        del ENTERED[index]
                        break

    return leave


_PATCH = ProcessPatch(lambda: [(saved_tensors_hooks, "__enter__", _wrap_enter),
                               (saved_tensors_hooks, "__exit__", _wrap_exit)])


@contextmanager
def listed_saved_hooks() -> Iterator[None]:
    """Inside the block, the ``saved_tensors_hooks`` contexts entered are listed in hot/kept/saved_hooks.ENTERED."""
    try:
        with _PATCH.held():
            yield
    finally:
        if not _PATCH.targets():  # (the last watch let go: a context still open is no longer followed out)
            ENTERED.clear()
