"""Seeing the tensor that ``backward()`` starts from, while a watch is active.

``torch.Tensor.backward`` is wrapped (patches.py) while at least one watch
needs it; the wrapper only looks at the tensor and then calls the original,
so results do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nan_magic.patches.registry import ProcessPatch

__all__ = ["watch_backward"]

_callbacks: list[Callable[[torch.Tensor], None]] = []
# Called after ``backward()`` returned (not when it raised).
_finished: list[Callable[[torch.Tensor], None]] = []


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        for callback in _callbacks:
            callback(self)
        result = original(self, *args, **kwargs)
        for callback in _finished:
            callback(self)
        return result

    return backward


_PATCH = ProcessPatch.of(torch.Tensor, "backward", _wrap)


@contextmanager
def watch_backward(
    callback: Callable[[torch.Tensor], None], finished: Callable[[torch.Tensor], None] | None = None
) -> Iterator[None]:
    """Call ``callback(tensor)`` before every ``tensor.backward()`` inside the block, ``finished`` after it returns."""
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
