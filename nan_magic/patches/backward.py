"""Seeing the tensor that ``backward()`` starts from, while a watch is active.

``torch.Tensor.backward`` is wrapped once while at least one watch needs it
and restored when the last one leaves; the wrapper only looks at the tensor
and then calls the original, so results do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["watch_backward"]

_callbacks: list[Callable[[torch.Tensor], None]] = []
_original: Callable[..., Any] | None = None


def _install() -> None:
    global _original
    original = torch.Tensor.backward
    _original = original

    @functools.wraps(original)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        for callback in _callbacks:
            callback(self)
        return original(self, *args, **kwargs)

    torch.Tensor.backward = backward  # type: ignore[method-assign]


def _uninstall() -> None:
    global _original
    if _original is not None:
        torch.Tensor.backward = _original  # type: ignore[method-assign]
        _original = None


@contextmanager
def watch_backward(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``callback(tensor)`` before every ``tensor.backward()`` inside the block."""
    if not _callbacks:
        _install()
    _callbacks.append(callback)
    try:
        yield
    finally:
        _callbacks.remove(callback)
        if not _callbacks:
            _uninstall()
