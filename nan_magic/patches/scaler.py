"""Seeing a GradScaler that was not passed to ``watch``, while a watch is active.

Most people write ``watch(model)`` or ``watch(model, opt)`` and leave the
scaler out, yet a step that the scaler skips because its scaled gradients
overflowed is benign (PRODUCT.md). GradScaler has no hooks, so while at
least one watch needs it, ``scale`` and ``step`` of ``torch.amp.GradScaler``
(and of every subclass that defines its own, e.g. the deprecated
``torch.cuda.amp.GradScaler`` defines neither and shares these) are wrapped,
and restored when the last watch leaves (patches.py), as ``Tensor.backward``
is for backward_patch.py. The wrappers call the originals unchanged:

* ``scale(outputs)`` tells the watch that this scaler is in use, before the
  backward whose overflow it must hold;
* ``step(optimizer)`` tells it, after the original returned, whether the
  optimizer stepped: the watch counts optimizer step calls (its global
  step hook), and a ``step`` that made none is a skipped step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from nan_magic.patches.registry import ProcessPatch, Wrap

__all__ = ["ScalerCallbacks", "watch_scalers"]


@dataclass(frozen=True)
class ScalerCallbacks:
    """What one watch wants to hear: a scaler in use, and a finished ``scaler.step``."""

    on_scale: Callable[[Any], None]
    #: Called before the original ``step``; returns a token given back to ``after_step``.
    before_step: Callable[[Any, torch.optim.Optimizer], Any]
    after_step: Callable[[Any, torch.optim.Optimizer, Any], None]


_callbacks: list[ScalerCallbacks] = []
# A subclass's ``step`` that calls ``super().step`` must report once, from the outermost call.
_depth = threading.local()


def _scaler_classes() -> list[type]:
    """``torch.amp.GradScaler`` and all its subclasses imported so far."""
    found: list[type] = []
    pending: list[type] = [torch.amp.GradScaler]
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    def scale(self: Any, outputs: Any) -> Any:
        __tracebackhide__ = True
        for callbacks in list(_callbacks):
            callbacks.on_scale(self)
        return original(self, outputs)

    return scale


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        depth = getattr(_depth, "value", 0)
        if depth:
            return original(self, optimizer, *args, **kwargs)
        listeners = list(_callbacks)
        tokens = [callbacks.before_step(self, optimizer) for callbacks in listeners]
        _depth.value = depth + 1
        try:
            result = original(self, optimizer, *args, **kwargs)
        finally:
            _depth.value = depth
        for callbacks, token in zip(listeners, tokens):
            callbacks.after_step(self, optimizer, token)
        return result

    return step


def _plan() -> list[tuple[type, str, Wrap]]:
    """Each scaler class's own ``scale`` and ``step`` (a subclass that inherits them shares the base's)."""
    wraps = (("scale", _wrap_scale), ("step", _wrap_step))
    return [(cls, name, wrap) for cls in _scaler_classes() for name, wrap in wraps if name in vars(cls)]


_PATCH = ProcessPatch(_plan)


@contextmanager
def watch_scalers(callbacks: ScalerCallbacks) -> Iterator[None]:
    """Call ``callbacks`` from every GradScaler's ``scale`` and ``step`` inside the block."""
    with _PATCH.held():
        _callbacks.append(callbacks)
        try:
            yield
        finally:
            _callbacks.remove(callbacks)
