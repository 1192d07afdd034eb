"""Copies of a watched model made inside the watch (deepcopy, pickle, torch.save) leave the watch's hooks behind.

The tiered watch puts a forward hook on a model it steps aside for (hot/watched/module_hooks.py's
``_ModelReturned``). A copy carried it: as a stand-in that runs nothing (a deep copy) or an inert hook of the
standard library (a pickle, ``torch.save`` of the whole model), and ``torch.jit.script`` of the copy, or of the file
loaded in a process without nan_magic, raised (a hook with no ``__name__``). So while a watch is active
``nn.Module.__reduce_ex__``, which deepcopy and pickle both ask for a module's state, leaves ours out of the state it
returns (a new dict: the live module's are untouched). It wraps what a class's own ``__getstate__`` or
``__reduce__`` returns too (LightningModule's ``__getstate__`` does not call torch's).

``copy.copy`` asks ``__reduce_ex__`` as well, and there torch's semantics are shared hook dicts: a hook removed from
the original leaves the copy, one put on the copy reaches the original. So ``nn.Module.__copy__`` is added for the
watch's life: the plain shallow copy, the state unfiltered, as copy.copy makes it without the watch.

The stand-ins remain where a class bypasses ``nn.Module.__reduce_ex__``: its own ``__deepcopy__``, its own
``__reduce_ex__``, or a reducer in ``copyreg.dispatch_table`` (a deep copy carries the stand-in, gone at the copy's
first call; a pickle the inert hook).
"""

from __future__ import annotations

import copy
import copyreg
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from nan_magic.hot.watched.module_hooks import is_watch_hook
from nan_magic.patches.registry import ProcessPatch

__all__ = ["unhooked_copies"]

#: A module's forward-hook dicts, keyed alike by a hook's id (register_forward_hook(with_kwargs, always_call)).
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

#: Set on a thread while :func:`_plain_copy` asks a module's reduction: left unfiltered for a shallow copy.
_shallow = threading.local()


def _without_ours(reduced: Any) -> Any:
    """A module's reduction with the watch's hooks left out of its state (the reduction itself where none)."""
    if not (isinstance(reduced, tuple) and len(reduced) > 2 and isinstance(state := reduced[2], dict)):
        return reduced
    hooks = state.get("_forward_hooks")
    ours = [key for key, hook in hooks.items() if is_watch_hook(hook)] if isinstance(hooks, dict) else []
    if not ours:
        return reduced
    state = dict(state)  # (the state may be the module's own __dict__: it stays as it is)
    for name in _HOOK_DICTS:
        if isinstance(entries := state.get(name), dict):
            state[name] = type(entries)((key, value) for key, value in entries.items() if key not in ours)
    return (*reduced[:2], state, *reduced[3:])


def _wrap_reduce_ex(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_ex(module: nn.Module, protocol: int) -> Any:
        reduced = original(module, protocol)
        return reduced if getattr(_shallow, "on", False) else _without_ours(reduced)

    return reduce_ex


def _plain_copy(module: nn.Module) -> Any:
    """``copy.copy(module)`` as the standard library makes it past ``__copy__``, the state unfiltered."""
    reductor = copyreg.dispatch_table.get(type(module))
    if reductor is not None:
        reduced = reductor(module)
    else:
        before, _shallow.on = getattr(_shallow, "on", False), True
        try:
            reduced = module.__reduce_ex__(4)
        finally:
            _shallow.on = before
    if isinstance(reduced, str):
        return module
    return copy._reconstruct(module, None, *reduced)  # type: ignore[attr-defined]


def _wrap_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    return original  # (nn.Module has no __copy__: the original is _plain_copy, the patch's ``absent``)


_REDUCE = ProcessPatch(lambda: [(nn.Module, "__reduce_ex__", _wrap_reduce_ex),
                                (nn.Module, "__copy__", _wrap_copy, _plain_copy)])


@contextmanager
def unhooked_copies() -> Iterator[None]:
    """Inside the block, a module deep-copied or pickled carries none of the watch's hooks; a shallow copy shares
    the original's hook dicts, as without the watch (the module docstring)."""
    with _REDUCE.held():
        yield
