"""Seeing the tensor that ``backward()`` starts from, while a watch is active.

``torch.Tensor.backward`` is wrapped (patches.py) while at least one watch
needs it; the wrapper only looks at the tensor and then calls the original,
so results do not change. ``torch.autograd.backward`` is wrapped too (what
``Tensor.backward`` calls, and what some loops call themselves), and
``torch.autograd.grad`` from scalar losses (a loop that sets ``p.grad``
itself): each tensor such a call starts from is judged as a loss, the first
of ``backward([loss_a, loss_b])`` first. An ``autograd.grad`` by no parameter
(an adversarial attack's input gradient, ``grad(attack, delta)``) is not the
step's loss backward: its loss is judged and its gradients checked as any
backward's, but the code after it is the loop's code of the same region,
recorded on (the recorder steps aside for the backward only and comes back),
not the update code that follows the step's backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nan_magic.hot.reads import BATCHED_GRADS
from nan_magic.patches import scaler
from nan_magic.patches.registry import ProcessPatch, Recorder, SelfGated, brought_back, stepped_aside

__all__ = ["marked_graph_grads", "unrecorded_input_grads", "watch_backward"]

_callbacks: list[Callable[[torch.Tensor, Any, Any], None]] = []
# Called after ``backward()`` returned (not when it raised).
_finished: list[Callable[[torch.Tensor], None]] = []
# The recorders that step aside for an ``autograd.grad`` by no parameter (unrecorded_input_grads).
_recorders: list[Recorder] = []
# The recorders told where an ``autograd.grad(create_graph=True)`` runs its backward (marked_graph_grads).
_marking: list[Recorder] = []


class _Running(threading.local):
    """Set while a wrapped backward runs on this thread: the torch.autograd.backward it calls is not seen twice."""

    active = False  # (a class default: read as an attribute on every thread, no getattr() call each backward)


_running = _Running()
_has_torch_function_unary = torch._C._has_torch_function_unary
_GradientEdge = getattr(torch.autograd.graph, "GradientEdge", ())  # (torch 2.4 on; () matches nothing)


def _begin(tensors: list[torch.Tensor], given: Any, retained: Any) -> None:
    """The callbacks before a backward from ``tensors``, each given a tensor as a loss, in order, with the gradient
    the call gave it (``given``: ``backward(gradient)``, ``grad_tensors``; None: none, the usual); ``retained``:
    whether the backward keeps the graph (``retain_graph``, ``create_graph``) for another one.

    Called by each patch's wrapper itself, which then calls torch's original from its own frame: the one frame of
    ours between the user's line and torch's function, whichever of the three the loop called. A warning torch gives
    from inside the backward with a stacklevel counted for its own frames (a full backward hook firing where no
    input needs a gradient: stacklevel=5 from its hook) then names the user's backward() / grad() line, and the
    gradient check finds that line at one depth (hot/timing.py's loss_logged: its own frame, the check's, this
    one, the wrapper's, then the caller)."""
    if scaler.kept:  # (a GradScaler's scale outputs kept until its step: the losses' nodes, for its deferred check)
        scaler.saw_losses(tensors)
    if given is None:  # (the usual backward: no gradient given, no index kept)
        for tensor in tensors:
            for callback in _callbacks:
                callback(tensor, retained, None)
    else:
        for index, tensor in enumerate(tensors):
            gradient = _given_gradient(given, index)
            for callback in _callbacks:
                callback(tensor, retained, gradient)


def _losses(given: Any) -> list[torch.Tensor]:
    """The tensors a backward starts from, as ``torch.autograd.backward`` or ``grad`` takes them."""
    if isinstance(given, torch.Tensor):
        return [given]
    if isinstance(given, (list, tuple)):
        return [tensor for tensor in given if isinstance(tensor, torch.Tensor)]
    return []


def _given_gradient(given: Any, index: int) -> Any:
    """The gradient a backward call gave its ``index``-th tensor (a tensor, or one of a sequence), or None."""
    if isinstance(given, torch.Tensor):
        return given if index == 0 else None
    if isinstance(given, (list, tuple)) and index < len(given):
        return given[index]
    return None


def _retained(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> Any:
    """Whether a ``torch.autograd`` call keeps its graph: ``retain_graph`` at ``index``, ``create_graph`` after it."""
    retain = kwargs.get("retain_graph", args[index] if len(args) > index else None)
    return retain or kwargs.get("create_graph", args[index + 1] if len(args) > index + 1 else False)


def _wrap(original: Callable[..., Any], entry: Any) -> Callable[..., Any]:
    # torch's own Tensor.backward only calls torch.autograd.backward (where no __torch_function__ applies), and ours
    # of that, installed after this one (_PATCH), only passes a call made inside a wrapped backward through: so where
    # torch.autograd.backward is still our pass-through of the function it wrapped, that function is called here
    # directly, as torch's own Tensor.backward would call it (two Python calls less a step: torch's frame and our
    # pass-through). Another patch of either, before ours or since, keeps the full path.
    code = getattr(original, "__code__", None)
    torchs = (code is not None and code.co_name == "backward"
              and code.co_filename.replace("\\", "/").endswith("torch/_tensor.py"))
    function = torch.autograd.backward  # (what ours of it will wrap: it is installed after this one)

    # Tensor.backward's own parameters (torch 2.4 to 2.13), taken by name: no call to read retain_graph.
    def backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False,
                 inputs: Any = None) -> Any:
        __tracebackhide__ = True
        if not entry.acting:  # (taken back under another's patch of it: a pass-through, registry.py)
            return original(self, gradient, retain_graph, create_graph, inputs)
        direct = False
        if torchs and not _has_torch_function_unary(self):
            try:
                direct = torch.autograd.backward.__wrapped__ is function  # type: ignore[attr-defined]  # (registry.py)
            except AttributeError:  # (not ours: another's patch since)
                direct = False
        # This frame stands where torch's own Tensor.backward would, one Python frame above torch.autograd.backward
        # on the direct path (_begin: why).
        _begin([self], gradient, retain_graph or create_graph)
        outer, _running.active = _running.active, True
        try:
            if direct:
                result = function(self, gradient, retain_graph, create_graph, inputs=inputs)
            else:
                result = original(self, gradient, retain_graph, create_graph, inputs)
        finally:
            _running.active = outer
        for done in _finished:
            done(self)
        return result

    return backward


def _wrap_function(original: Callable[..., Any], entry: Any) -> Callable[..., Any]:
    def backward(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if _running.active or not entry.acting:  # (Tensor.backward's own call: seen already; or inert, registry.py)
            return original(*args, **kwargs)
        tensors = _losses(args[0] if args else kwargs.get("tensors"))
        if not tensors:
            return original(*args, **kwargs)
        _begin(tensors, args[1] if len(args) > 1 else kwargs.get("grad_tensors"), _retained(args, kwargs, 2))
        outer, _running.active = _running.active, True
        try:
            result = original(*args, **kwargs)  # (from this frame: _begin says why)
        finally:
            _running.active = outer
        for done in _finished:
            done(tensors[-1])
        return result

    return backward


def _by_parameters(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, tuple[Any, ...], dict[str, Any]]:
    """Whether an ``autograd.grad`` call differentiates by a parameter, and its arguments with ``inputs`` a tuple
    (``model.parameters()``, a generator, is read here once: the call gets the tuple)."""
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    if isinstance(inputs, _GradientEdge):  # (a named tuple: one input, as a tensor is)
        return False, args, kwargs
    if not isinstance(inputs, (torch.Tensor, tuple)) and inputs is not None:
        inputs = tuple(inputs)
        args, kwargs = ((args[0], inputs, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "inputs": inputs})
    given = inputs if isinstance(inputs, tuple) else (inputs,)
    return any(isinstance(tensor, torch.nn.Parameter) for tensor in given), args, kwargs


def _wrap_grad(original: Callable[..., Any], entry: Any) -> Callable[..., Any]:
    def grad(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not entry.acting:  # (taken back under another's patch of it: a pass-through, registry.py)
            return original(*args, **kwargs)
        # A loss's backward: scalar outputs (no grad_outputs given) and no graph kept. ``create_graph`` is a
        # double backward inside the loss code (a gradient penalty), and the watch's own replays always give
        # ``grad_outputs``: both run as they are.
        losses = (not kwargs.get("create_graph") and kwargs.get("grad_outputs", args[2] if len(args) > 2 else None)
                  is None and not _running.active)
        tensors = _losses(args[0] if args else kwargs.get("outputs")) if losses else []
        # Each path calls torch's original from this frame (_begin: why), its state set and taken back around it.
        if not tensors:
            if kwargs.get("is_grads_batched", len(args) > 7 and args[7]):
                # Its backward runs under torch's legacy vmap, whose batched gradients the gradient hooks cannot
                # read: they step aside for it (BATCHED_GRADS).
                BATCHED_GRADS.running += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    BATCHED_GRADS.running -= 1
            if _marking and kwargs.get("create_graph", len(args) > 4 and args[4]):
                # A double backward in the loop's code (MAML's inner step): the recorder records its gradient
                # formulas' ops as the loop's; it notes the line that ran them (marked_graph_grads).
                marked = stepped_aside(_marking)
                try:
                    return original(*args, **kwargs)
                finally:
                    brought_back(marked)
            return original(*args, **kwargs)
        # By no parameter (PGD's ``grad(attack, delta)``): the step's loss backward is by the parameters (a loop
        # that sets ``p.grad`` itself); this one's loss is judged, but the code after it is the loss code's, recorded
        # on (the recorder stepped aside for the backward and back after it), no update code (the module docstring).
        by_parameters, args, kwargs = _by_parameters(args, kwargs)
        aside = [] if by_parameters else stepped_aside(_recorders)
        try:
            _begin(tensors, None, _retained(args, kwargs, 3))
            outer, _running.active = _running.active, True
            try:
                result = original(*args, **kwargs)
            finally:
                _running.active = outer
        finally:
            if aside:
                brought_back(aside)
        if by_parameters:
            for done in _finished:
                done(tensors[-1])
        return result

    return grad


# Each installed without the registry's dispatch frame (SelfGated): a warning torch gives from inside a backward
# with a stacklevel counted for its own frames names the user's line, and the gradient check finds the loop's
# backward() line at one depth whichever of the three the loop called (hot/timing.py's loss_logged).
_PATCH = ProcessPatch(lambda: [(torch.Tensor, "backward", SelfGated(_wrap)),
                               (torch.autograd, "backward", SelfGated(_wrap_function)),
                               (torch.autograd, "grad", SelfGated(_wrap_grad))])


@contextmanager
def watch_backward(
    callback: Callable[[torch.Tensor, Any, Any], None], finished: Callable[[torch.Tensor], None] | None = None
) -> Iterator[None]:
    """Call ``callback(tensor, retained, gradient)`` before every backward inside the block (once per loss;
    ``retained``: the graph is kept for another backward; ``gradient``: the one the call gave the tensor, or None),
    ``finished(tensor)`` after it returns.

    ``tensor.backward()``, or ``torch.autograd.backward`` or ``grad`` called by the loop itself.
    """
    with _PATCH.held((_callbacks, callback), *([(_finished, finished)] if finished is not None else [])):
        yield


@contextmanager
def unrecorded_input_grads(step_aside: Callable[[], bool], step_back: Callable[[], None]) -> Iterator[None]:
    """Inside the block, an ``autograd.grad`` by no parameter runs with the recorder stepped aside (``step_aside()``:
    whether it did) and brought back after (``step_back()``): the loop code around it is recorded as one region."""
    with _PATCH.held((_recorders, (step_aside, step_back))):
        yield


@contextmanager
def marked_graph_grads(begins: Callable[[], bool]) -> Iterator[None]:
    """Inside the block, ``begins()`` is called as an ``autograd.grad(create_graph=True)`` of the loop's code starts
    (its backward's ops are recorded with the loop's: the recorder notes the line that runs them)."""
    with _PATCH.held((_marking, (begins, _nothing))):
        yield


def _nothing() -> None:
    """(``begins`` says it stepped nothing aside: this is never called.)"""
