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
  backward whose overflow it must hold, and keeps what it returned until the
  scaler's step (:func:`scaled_from_finite` reads it at a non-finite loss);
* ``step(optimizer)`` tells it, after the original returned, whether the
  optimizer stepped: the watch counts optimizer step calls (its global
  step hook), and a ``step`` that made none is a skipped step.

The line that built each scaler is noted once (:func:`scaler_source`), for
the ``scale`` fix's edit (fixes/remedies/scale.py): ``__init__`` is wrapped too, so a
scaler built while a watch is active names its own line; one built before
is looked up when ``scale`` first sees it, as the line of the calling code's
file that assigns the scaler's name from a ``GradScaler(...)`` call.
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from nan_magic.errors.frames import is_library_code, pointer
from nan_magic.patches.registry import ProcessPatch, Wrap
from nan_magic.records import SourcePointer

__all__ = [
    "ScalerCallbacks", "kept", "saw_losses", "scaled_from_finite", "scaler_classes", "scaler_source", "watch_scalers",
]


@dataclass(frozen=True)
class ScalerCallbacks:
    """What one watch wants to hear: a scaler in use, and a finished ``scaler.step``."""

    on_scale: Callable[[Any], None]
    #: Called before the original ``step``; returns a token given back to ``after_step``.
    before_step: Callable[[Any, torch.optim.Optimizer], Any]
    after_step: Callable[[Any, torch.optim.Optimizer, Any], None]


_callbacks: list[ScalerCallbacks] = []
#: The scale outputs kept between two steps of the scaler: a longer accumulation's first micro-steps fall out (their
#: overflow then reads as before).
_KEPT_SCALED = 8
# A subclass's ``step`` that calls ``super().step`` must report once, from the outermost call.
_depth = threading.local()


def scaler_classes() -> list[type]:
    """``torch.amp.GradScaler`` and all its subclasses imported so far."""
    found: list[type] = []
    pending: list[type] = [torch.amp.GradScaler]
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found


# id(scaler) -> (the scaler, weakly; the line that built it, or None where none was found): noted once a scaler.
_built_at: dict[int, tuple[weakref.ref[Any], SourcePointer | None]] = {}


def _note(scaler: Any, source: SourcePointer | None) -> None:
    key = id(scaler)
    _built_at[key] = (weakref.ref(scaler, lambda _ref: _built_at.pop(key, None)), source)


def scaler_source(scaler: Any) -> SourcePointer | None:
    """The line that built ``scaler``, where a watch saw it built or found it when it was first used."""
    entry = _built_at.get(id(scaler))
    return entry[1] if entry is not None and entry[0]() is scaler else None


def _user_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    return frame


def _assignment(scaler: Any, frame: FrameType | None) -> SourcePointer | None:
    """The line of ``frame``'s file that assigns a name bound to ``scaler`` from a ``GradScaler(...)`` call: the
    last such line above the frame's, else the first below it; None where the file has none."""
    frame = _user_frame(frame)
    if frame is None:
        return None
    names = {name for name, value in {**frame.f_globals, **frame.f_locals}.items() if value is scaler}
    if not names:
        return None
    built = re.compile(rf"^\s*(?:{'|'.join(map(re.escape, sorted(names)))})\s*(?::[^=]*)?=.*GradScaler\s*\(")
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)
    found = [number for number, line in enumerate(lines, 1) if built.match(line)]
    above = [number for number in found if number < frame.f_lineno]
    if not found:
        return None
    return pointer(frame, above[-1] if above else found[0])


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        original(self, *args, **kwargs)
        # A subclass's __init__ calling super().__init__ returns last: its caller's line stays.
        frame = _user_frame(sys._getframe(1))
        _note(self, pointer(frame) if frame is not None else None)

    return __init__


# (what ``scale`` returned, what it was given, the output's version then: ``s += other_loss`` after it is not the
# scale's overflow) for each tensor of the scale calls since the scaler's last step (each micro-step's of gradient
# accumulation): kept while a watch is active, so that a non-finite loss can be told for the scale's own overflow of a
# finite loss (:func:`scaled_from_finite`), checked only then. They hold their graphs (a ``backward(retain_graph=True)``
# loss's activations, AMP's several-losses recipe): dropped when the scaler's step returns, once the watch judged the
# step, as the user's loop drops its losses; bounded; cleared by the last watch's exit.
kept: deque[tuple[torch.Tensor, torch.Tensor, int]] = deque(maxlen=_KEPT_SCALED)
# (a weak reference to each loss a backward started from while scale outputs are kept, and its autograd node): the
# deferred check judges a loss that was a temporary (``(scaler.scale(l1) + scaler.scale(l2)).backward()``) once it is
# gone; its record's weak reference (the same object: weakref.ref without a callback is shared) finds its node here.
# Noted by patches/backward.py; dropped with ``kept``.
_losses: deque[tuple[weakref.ref[torch.Tensor], Any]] = deque(maxlen=_KEPT_SCALED)
# (the number each product or quotient node between those losses and the scale outputs kept, as their backward began:
# the backward frees it, the deferred check reads it; dropped with ``kept``)
_factors: dict[Any, Any] = {}
# Ops that only combine their inputs: sums, differences, and products or quotients by a number (checked at the node).
_SUMS = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0", "RsubBackward1",
                   "NegBackward0", "SumBackward0", "SumBackward1", "MeanBackward0", "MeanBackward1", "StackBackward0"})
_PRODUCTS = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})
_WALKED = 64


def saw_losses(tensors: list[torch.Tensor]) -> None:
    """A backward starts from ``tensors`` while scale outputs are kept: note their nodes for the deferred check, and
    the numbers their products and quotients keep (a backward frees them: ``/ 2``'s and ``* torch.tensor(nan)``'s
    alike), by reference: nothing is read until a non-finite loss asks (:func:`scaled_from_finite`)."""
    for tensor in tensors:
        node = tensor.grad_fn
        _losses.append((weakref.ref(tensor), node))
        pending, walked, made = [node], 0, {out.grad_fn for out, _given, _version in kept}
        while pending and walked < _WALKED:
            node, walked = pending.pop(), walked + 1
            if node is None or node in made:
                continue
            name = node.name()
            if name in _PRODUCTS:
                _factors[node] = _factor(node)
            elif name not in _SUMS:
                break  # (not a combination: judged so at the check, whatever it keeps)
            pending.extend(part for part, _ in node.next_functions)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)] if isinstance(value, (list, tuple)) else []


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return not isinstance(value, (int, float, complex)) or (value == value and abs(value) != float("inf"))


def _factor(node: Any) -> Any:
    """The number a product or quotient node keeps (``None`` where it is no product by one number)."""
    edges = node.next_functions
    constant = [index for index, (part, _) in enumerate(edges) if part is None]
    if len(edges) == 1:  # (the Scalar overloads: ``s * 0.5`` where torch keeps the number)
        constant = [1]
    if len(constant) != 1 or (node.name().startswith("Div") and constant != [1]):
        return None  # (a product of two scaled losses, a number divided by one: not a combination)
    return getattr(node, "_saved_other" if constant == [1] else "_saved_self", None)


def _by_a_finite_number(node: Any) -> bool:
    """A product or quotient node whose other operand is a finite number: its saved value, or where the backward has
    freed it (the deferred check), the value :func:`saw_losses` kept as the backward started; else not known finite,
    so the node is not a combination."""
    try:
        factor = _factor(node)
    except RuntimeError:  # (freed by the backward)
        if node not in _factors:
            return False
        factor = _factors[node]
    return factor is not None and _finite(factor)


def scaled_from_finite(loss: torch.Tensor | None, freed: weakref.ref[torch.Tensor] | None = None) -> bool:
    """``loss`` (or the loss that was a temporary, ``freed`` its record's weak reference) is made by ops that only
    combine (add, subtract, multiply or divide by a finite number) from what a GradScaler's ``scale`` returned for
    finite losses, at least one of those itself not finite (the scale overflowed it): the scale's own overflow,
    ``scaler.scale(l)``, ``scaler.scale(l) / 2``, ``scaler.scale(l1) + scaler.scale(l2)``, the
    ``torch.stack([...]).mean()`` of them. Walks a few autograd nodes and reads the scaled losses: at a non-finite
    loss only."""
    node = loss.grad_fn if loss is not None else next((node for ref, node in _losses if ref is freed), None)
    if node is None:
        return False
    made = {out.grad_fn: (out, given) for out, given, version in kept
            if out._version == version and out.grad_fn is not None}
    reached: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending, walked = [node], 0
    while pending:
        node, walked = pending.pop(), walked + 1
        if walked > _WALKED:
            return False
        if node in made:
            reached.append(made[node])
            continue
        name = node.name()
        if name in _SUMS:
            # An operand with no graph (a detached NaN metric, ``+ torch.tensor(nan)``, Python's ``sum()``'s 0: they
            # look alike here) is not known to be finite: not benign (a false alarm, never a hidden incident).
            if any(part is None for part, _ in node.next_functions) or not _finite(getattr(node, "_saved_alpha", 1)):
                return False  # (``torch.add(a, b, alpha=nan)``: the factor is the node's)
        elif not (name in _PRODUCTS and _by_a_finite_number(node)):
            return False
        pending.extend(part for part, _ in node.next_functions if part is not None)
    # A scale that overflows a finite loss makes it +-inf, never NaN (a NaN scale, a NaN loss: not benign).
    overflowed = [out for out, _ in reached if not _finite(out)]
    return bool(overflowed) and all(_finite(given) for _, given in reached) and not any(
        bool(torch.isnan(out).any()) for out in overflowed)


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    def scale(self: Any, outputs: Any) -> Any:
        __tracebackhide__ = True
        if id(self) not in _built_at:  # first seen (built before any watch): once a scaler
            _note(self, _assignment(self, sys._getframe(1)))
        for callbacks in list(_callbacks):
            callbacks.on_scale(self)
        scaled = original(self, outputs)
        if _callbacks:
            kept.extend((out, given, out._version) for out, given in zip(_tensors(scaled), _tensors(outputs)))
        return scaled

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
        # The step is judged (a skip's check ran in after_step): the scaled losses and their graphs go with it.
        kept.clear()
        _losses.clear()
        _factors.clear()
        return result

    return step


def _plan() -> list[tuple[type, str, Wrap]]:
    """Each scaler class's own ``__init__``, ``scale`` and ``step`` (a subclass that inherits one shares the base's)."""
    wraps = (("__init__", _wrap_init), ("scale", _wrap_scale), ("step", _wrap_step))
    return [(cls, name, wrap) for cls in scaler_classes() for name, wrap in wraps if name in vars(cls)]


_PATCH = ProcessPatch(_plan)


@contextmanager
def watch_scalers(callbacks: ScalerCallbacks) -> Iterator[None]:
    """Call ``callbacks`` from every GradScaler's ``scale`` and ``step`` inside the block."""
    try:
        with _PATCH.held((_callbacks, callbacks)):
            yield
    finally:
        if not _callbacks:
            kept.clear()
            _losses.clear()
            _factors.clear()
