"""A module call's arguments, kept for a replay after the call returned.

A backward producer is replayed from the gradient hook that found it, long
after its forward returned (localize/replay/module_run.py). Keeping every call's arguments
alive until then would retain the activations of a whole step; keeping
none would leave nothing to replay. So every argument is held by weak
reference, and strongly only where that costs no memory: when autograd
keeps the same tensor for the backward anyway (its use count shows a second
owner). Those strong references live in the metadata of the call's output
node, so they die with the graph, and are dropped as soon as the tensor's
gradient is complete. A freed argument can still be recomputed from the
call that returned it (``regenerate``, see localize/replay/producer_call.py).

A call still running has its arguments in its ``Module.__call__`` frame
(:func:`running_arguments`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from nan_magic.hot.kept.saved_hooks import ENTERED as SAVED_HOOKS
from nan_magic.hot.kept.saved_hooks import saved_hooks_of
from nan_magic.hot.reads import version_of
from nan_magic.records import Note

__all__ = ["Classify", "HeldArguments", "Regenerate", "Resolved", "hold_arguments", "running_arguments"]


class _Held:
    """A tensor argument, held weakly, with its version and the watch's record of it."""

    __slots__ = ("record", "ref", "version")

    def __init__(self, tensor: torch.Tensor, record: Any) -> None:
        self.ref = weakref.ref(tensor)
        self.version = version_of(tensor)
        #: The watch's record of the tensor (None for one it never saw), to recompute it from.
        self.record = record


class _Kept:
    """The arguments of one call held strongly, owned by that call's autograd graph.

    Stored in the ``metadata`` of the call's output node, so it lives exactly
    as long as the graph: a forward whose graph is dropped without a
    backward (an evaluation loop that forgot ``no_grad``) frees it with the
    graph. :meth:`HeldArguments.release` empties it sooner, when a held
    tensor's gradient is complete.
    """

    __slots__ = ("__weakref__", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []


#: Key of the :class:`_Kept` list in an autograd node's ``metadata``.
_KEPT_KEY = "nan_magic.kept"

#: Argument values kept as they are (small, immutable).
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size, slice, type(...))

#: ``tensor -> (its record or None, whether to hold it strongly)``
Classify = Callable[[torch.Tensor], tuple[Any, bool]]
#: ``record -> the tensor recomputed, or None``
Regenerate = Callable[[Any], "torch.Tensor | None"]


class Resolved(NamedTuple):
    """Arguments ready for a replay, and which tensor each record became."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    by_record: dict[int, torch.Tensor]


class HeldArguments(NamedTuple):
    """A module call's arguments, tensors held as :func:`hold_arguments` decided."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    kept: weakref.ref[_Kept] | None = None
    #: The user's ``saved_tensors_hooks`` context the call ran under (saved_hooks.py), or None: a backward replay of
    #: the call packs what autograd saves as the call did (a float16 pack's 0 under sqrt's backward).
    saved_hooks: Any = None

    def packed(self) -> contextlib.AbstractContextManager[None]:
        """Inside it, what autograd saves is packed as the call packed it (:attr:`saved_hooks`; a backward replay)."""
        return saved_hooks_of(self.saved_hooks)

    def resolve(self, regenerate: Regenerate | None = None) -> Resolved | Note:
        """The arguments again, or why they are gone (a note).

        A tensor that was freed since is recomputed by ``regenerate`` from
        its record, when it can.
        """
        by_record: dict[int, torch.Tensor] = {}
        try:
            args = _unhold(self.args, regenerate, by_record)
            kwargs = _unhold(self.kwargs, regenerate, by_record)
        except _Gone as gone:
            return gone.note
        return Resolved(args, kwargs, by_record)

    def records(self) -> Iterator[Any]:
        """The records of the held tensors (None for a tensor the watch never saw)."""
        stack: list[Any] = [self.args, self.kwargs]
        while stack:
            value = stack.pop()
            if type(value) is _Held:
                yield value.record
            elif type(value) in (tuple, list):
                stack.extend(value)
            elif type(value) is dict:
                stack.extend(value.values())

    def release(self, tensor: torch.Tensor) -> None:
        """Stop holding ``tensor`` strongly (its gradient is complete)."""
        kept = self.kept() if self.kept is not None else None
        if kept is None:
            return
        for held in kept.tensors:
            if held is tensor:
                kept.tensors = [held for held in kept.tensors if held is not tensor]
                return


class _Gone(Exception):
    """An argument was freed or changed in place since the call (``note`` says which)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.note = Note(kind)


def hold_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], classify: Classify, anchor: torch.Tensor | None
) -> HeldArguments | None:
    """Hold a call's arguments for a later replay without adding to the memory peak.

    Every tensor is held weakly. ``classify`` gives each tensor's record and
    whether also holding it strongly costs nothing (the watch asks: does
    autograd hold it anyway, and will our gradient hook release it); those
    are kept in the graph of ``anchor`` (an output of the call, see
    :class:`_Kept`), none without one. Runs in the forward hook of every
    watched call, so plain tensor arguments take a fast path. None when an
    argument is an object that cannot be held weakly (a cache object, say):
    that call is not replayed.
    """
    strong: list[torch.Tensor] = []
    held_args: tuple[Any, ...]
    held_kwargs: dict[str, Any] = {}
    if not kwargs and all(type(arg) is torch.Tensor for arg in args):
        # The hot path (``module(x)``): no closure, no recursion.
        entries = []
        for arg in args:
            record, keep = classify(arg)
            if keep:
                strong.append(arg)
            entries.append(_Held(arg, record))
        held_args = tuple(entries)
    else:

        def hold(tensor: torch.Tensor) -> _Held:
            record, keep = classify(tensor)
            if keep:
                strong.append(tensor)
            return _Held(tensor, record)

        try:
            held_args, held_kwargs = _hold(args, hold, 0), _hold(kwargs, hold, 0)
        except TypeError:
            return None
    node = anchor.grad_fn if strong and anchor is not None else None
    return HeldArguments(held_args, held_kwargs, _keep_in_graph(node, strong) if node is not None else None,
                         SAVED_HOOKS[-1] if SAVED_HOOKS else None)


def _keep_in_graph(node: Any, tensors: list[torch.Tensor]) -> weakref.ref[_Kept] | None:
    """Hold ``tensors`` strongly in ``node``'s metadata (see :class:`_Kept`); None where it has none."""
    kept = _Kept()
    kept.tensors = tensors
    try:
        metadata: Any = node.metadata  # a dict owned by the C++ node (anomaly mode keeps its traceback there)
        if callable(metadata):
            metadata = metadata()
        metadata.setdefault(_KEPT_KEY, []).append(kept)
    except (AttributeError, TypeError):
        return None  # a node without metadata: hold nothing strongly
    return weakref.ref(kept)


def _hold(value: Any, hold: Callable[[torch.Tensor], _Held], depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return hold(value)
    if isinstance(value, _PLAIN):
        return value
    if depth < 4 and type(value) in (tuple, list):
        return type(value)(_hold(item, hold, depth + 1) for item in value)
    if depth < 4 and type(value) is dict:
        return {key: _hold(item, hold, depth + 1) for key, item in value.items()}
    raise TypeError(type(value).__name__)


def _unhold(value: Any, regenerate: Regenerate | None, by_record: dict[int, torch.Tensor]) -> Any:
    if type(value) is _Held:
        tensor = value.ref()
        if tensor is not None and version_of(tensor) != value.version:
            raise _Gone("held-changed")
        if tensor is None and regenerate is not None and value.record is not None:
            tensor = regenerate(value.record)
        if tensor is None:
            raise _Gone("held-freed")
        if value.record is not None:
            by_record[id(value.record)] = tensor
        return tensor
    if type(value) in (tuple, list):
        return type(value)(_unhold(item, regenerate, by_record) for item in value)
    if type(value) is dict:
        return {key: _unhold(item, regenerate, by_record) for key, item in value.items()}
    return value


#: The code objects of ``nn.Module.__call__``'s frames, which hold a running call's arguments.
_CALL_CODES = frozenset(
    code for code in (getattr(getattr(nn.Module, name, None), "__code__", None)
                      for name in ("_call_impl", "_wrapped_call_impl")) if code is not None
)


def running_arguments(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of ``module``'s call that is running now, from its ``__call__`` frame.

    Global forward pre-hooks never see keyword arguments, so a call still in
    progress (a parent whose own code made a value its child received) has
    them only in the frame of ``Module._call_impl`` (the innermost such
    frame: the arguments after the module's own pre-hooks). Only read on an
    event, never on the hot path. None when no such frame is found.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            local = frame.f_locals
            if local.get("self") is module and "args" in local:
                return tuple(local["args"]), dict(local.get("kwargs") or {})
        frame = frame.f_back  # type: ignore[assignment]
    return None
