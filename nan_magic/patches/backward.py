"""Seeing the tensor that ``backward()`` starts from, while a watch is active.

``torch.Tensor.backward`` is wrapped (patches.py) while at least one watch
needs it; the wrapper only looks at the tensor and then calls the original,
so results do not change. ``torch.autograd.backward(loss)`` is wrapped too
(what ``Tensor.backward`` calls, and what some loops call themselves), for one
tensor: several (``backward([loss_a, loss_b])``) have no one loss to judge,
and their gradients are judged as they flow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nan_magic.patches.registry import ProcessPatch

__all__ = ["watch_backward"]

_callbacks: list[Callable[[torch.Tensor], None]] = []
# Called after ``backward()`` returned (not when it raised).
_finished: list[Callable[[torch.Tensor], None]] = []


# Set while a wrapped backward runs on this thread: the torch.autograd.backward it calls is not seen twice.
_running = threading.local()


def _seen(tensor: torch.Tensor, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)``, a backward from ``tensor``, with the callbacks around it."""
    __tracebackhide__ = True
    for callback in _callbacks:
        callback(tensor)
    outer, _running.active = getattr(_running, "active", False), True
    try:
        result = original(*args, **kwargs)
    finally:
        _running.active = outer
    for callback in _finished:
        callback(tensor)
    return result


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return _seen(self, original, self, *args, **kwargs)

    return backward


def _wrap_function(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        tensors = args[0] if args else kwargs.get("tensors")
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
            tensors = tensors[0]
        if getattr(_running, "active", False) or not isinstance(tensors, torch.Tensor):
            return original(*args, **kwargs)
        return _seen(tensors, original, *args, **kwargs)

    return backward


_PATCH = ProcessPatch(lambda: [(torch.Tensor, "backward", _wrap), (torch.autograd, "backward", _wrap_function)])


@contextmanager
def watch_backward(
    callback: Callable[[torch.Tensor], None], finished: Callable[[torch.Tensor], None] | None = None
) -> Iterator[None]:
    """Call ``callback(tensor)`` before every backward from one tensor inside the block, ``finished`` after it returns.

    ``tensor.backward()``, or ``torch.autograd.backward(tensor)`` called by the loop itself.
    """
    with _PATCH.held():
        _callbacks.append(callback)
        if finished is not None:
            _finished.append(finished)
        try:
            yield
        finally:
            _callbacks.remove(callback)
            if finished is not None:
                _finished.remove(finished)
