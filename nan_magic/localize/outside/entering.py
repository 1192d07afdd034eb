"""Non-finite tensors that entered the loss code from outside the watched code.

A non-finite loss whose model outputs were all finite was either made by the
loss code or given to it: a NaN label, a target from a DataLoader worker. The
second is phase ``data`` (PRODUCT.md: a tensor that no watched code
produced). Only looked for once the loss is known to be non-finite, never on
the hot path, in two places:

* the arguments of the recorded loss code's ops (outside/recorder.py: ``target``
  of ``aten.mse_loss.default``), or where that code was not recorded, the
  saved tensors of its autograd nodes (``MseLossBackward0`` saves its
  ``target``; the deferred mode takes those as backward starts, before backward
  frees them): a leaf that needs no gradient is data;
* the local variables of the user's frames that called ``backward()`` (or
  ``opt.step()``, at the deferred check): ``y`` in ``loss = F.mse_loss(out, y)``
  when the node saved nothing of it (``(out - y) ** 2``). Where the loss code
  was recorded in full (:func:`recorded_in_full`), its records name every
  tensor it read: a local variable then only names one of them, and a
  non-finite tensor the loop left lying about (a NaN kept from an earlier run,
  in a notebook's namespace) is never taken for the step's data. Where it ran
  over the recorder's budget (:func:`unrecorded`), such a variable is named
  only as a suspect beside the loss code.

A tensor the watch already saw enter a watched model was judged there; an
additive attention mask (its finite values all 0) is deliberate, not data; a
Python number the code passed (``loss * math.inf``: ``MulBackward0`` saves it
as a 0-dim float64 tensor) is no data either: the op given it is named, with
the ``nonfinite-number`` cause, as the recorded ops' arguments show it.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.errors.frames import is_library_file
from nan_magic.hot.checks.backward.loss_region import loss_region_nodes
from nan_magic.hot.checks.hosts import Entered
from nan_magic.hot.reads import is_checkable
from nan_magic.hot.stats import kinds_of
from nan_magic.localize.ops.masks import is_additive_mask
from nan_magic.localize.ops.plans import is_wrapped_number, plan_of, tensors
from nan_magic.localize.outside.recorded_ops import WeakRecord, op_source, record_key
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.records import SourcePointer, TensorRef, TensorRole

__all__ = ["NodeOrigin", "entering_tensors", "recorded_in_full", "recorded_leaves", "saved_leaves", "unrecorded"]

#: The forward op that made an autograd node, and its line (the op tracer's NodeSources.forward_op).
NodeOrigin = Callable[[Any], tuple[str | None, SourcePointer | None]]

#: How many of the loss code's autograd nodes an event walks for what they saved.
_EVENT_NODES = 8192
#: How many of the user's frames are searched, innermost first.
_MAX_FRAMES = 8


def entering_tensors(
    loss: torch.Tensor | None,
    boundary: int,
    seen: Callable[[torch.Tensor], bool],
    saved_before: list[Entered] = (),  # type: ignore[assignment]
    read_all: bool = False,
    node_origin: NodeOrigin | None = None,
) -> list[Entered]:
    """Non-finite data tensors the loss code may have read, named as the user knows them.

    ``boundary`` is the autograd sequence number where the loss code began
    (loss_region.py); ``seen(tensor)`` tells a tensor the watch already saw;
    ``saved_before`` what :func:`saved_leaves` took before backward freed
    the graph (the deferred check), or what the recorded loss code read;
    ``read_all``: that is everything the loss code read (:func:`recorded_in_full`),
    and the user's local variables only name it. ``node_origin`` (the op tracer's) names what a node saved
    by the forward op that made the node, with its line. Each comes with the line that read it, where known.
    """
    bad_locals: dict[int, tuple[TensorRef, torch.Tensor, None]] = {}
    for local, value in _user_locals():  # (innermost first: the name the loss code's own frame gives it wins)
        if _is_bad_data(value):
            bad_locals.setdefault(id(value), (TensorRef.argument(local), value, None))
    # What the loss code saved is known to have been read by it: those come
    # first, named by the user's variable where one holds the same tensor.
    found: dict[int, Entered] = {}
    for label, tensor, line in [*saved_before, *_saved_by_loss_code(loss, boundary, node_origin)]:
        if id(tensor) not in found and _is_bad_data(tensor) and not seen(tensor):
            found[id(tensor)] = (bad_locals.get(id(tensor), (label,))[0], tensor, line)
    for key, (name, tensor, line) in () if read_all else bad_locals.items():
        if key not in found and not seen(tensor):
            found[key] = (name, tensor, line)
    return list(found.values())


def saved_leaves(
    nodes: list[Any], node_origin: NodeOrigin | None = None
) -> list[tuple[TensorRef, weakref.ref[torch.Tensor], SourcePointer | None]]:
    """The floating leaves that need no gradient among what ``nodes`` saved, held weakly.

    Taken when backward starts, in deferred mode, for the check after it
    (backward frees saved tensors). The names of each node type's saved
    attributes are looked up once.
    """
    leaves = [
        _named(node, attribute, tensor, node_origin)
        for node, attribute, tensor in _saved_tensors(nodes)
        if tensor.grad_fn is None and not tensor.requires_grad and is_checkable(tensor)
    ]
    return [(label, weakref.ref(tensor), line) for label, tensor, line in leaves]


def recorded_leaves(
    recorder: OutsideRecorder | None, key: int
) -> list[Entered] | None:
    """The floating tensors that need no gradient among the arguments of the recorded ops that made the loss.

    The deferred check's stand-in for :func:`saved_leaves`, where the loss code
    was recorded (``key``: the loss's id when ``backward()`` started): what an
    op read, autograd may have saved, and the records still hold it (a small
    one strongly, a large one while it lives). Named ``target of
    aten.mse_loss.default``, as a saved tensor is by its node, with the line of the
    op that read it first. None where no recorded op returned the loss.
    """
    found = recorder.loss_code(key, last=False) if recorder is not None else None
    if found is None:
        return None
    leaves: dict[int, Entered] = {}
    # Each leaf is named by the first op that carried it into the graph the loss's backward runs through (its
    # output needs a gradient), else by the first op that read it: ``known = ~y.isnan()`` reads a NaN-coded label
    # first, ``torch.where(known, (out - y) ** 2, 0)`` is where its NaN goes on into the backward.
    into_graph: set[int] = set()
    # A tensor that this op or a later one wrote in place no longer holds what the op read (``out.div_(size)``
    # on a model's output, through ``out.detach()`` before it): its value now is that write's, not data's.
    written_from = _written_from(found[0])
    for index, op in enumerate(found[0]):
        schema = getattr(op.func, "_schema", None)
        names = [argument.name for argument in schema.arguments] if schema is not None else []
        carries = None
        for name, value in [*zip(names, op.args), *op.kwargs.items()]:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                tensor = _recorded_leaf(item)
                if tensor is None or id(tensor) in into_graph or written_from.get(_storage(tensor), -1) >= index:
                    continue
                carries = _needs_gradient(op.out) if carries is None else carries
                if id(tensor) not in leaves or carries:
                    leaves[id(tensor)] = (TensorRef(TensorRole.INPUT, str(op.func), name), tensor, op_source(op))
                if carries:
                    into_graph.add(id(tensor))
    return list(leaves.values())


def _needs_gradient(out: Any) -> bool:
    """Whether a recorded op's output (a tensor, or a :class:`WeakRecord` once backward started) needs a gradient."""
    return any(isinstance(item, (torch.Tensor, WeakRecord)) and item.requires_grad for item in tree_leaves(out))


def _written_from(ops: list[Any]) -> dict[int | None, int]:
    """The storages the recorded ``ops`` wrote in place, each with the index of the last op that wrote it."""
    written: dict[int | None, int] = {}
    for index, op in enumerate(ops):
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if plan is not None and plan.writes:
            for _label, value in tensors(plan, op.args, op.kwargs, plan.writes):
                tensor = value.ref() if isinstance(value, WeakRecord) else value
                if isinstance(tensor, torch.Tensor):
                    written[_storage(tensor)] = index
    written.pop(None, None)
    return written


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, nested, a subclass)
        return None


def recorded_in_full(recorder: OutsideRecorder | None, key: int, seen: Callable[[torch.Tensor], bool]) -> bool:
    """Whether the recorded loss code up to the loss (``key``, as in :func:`recorded_leaves`) is all of it.

    It is unless an op read a computed tensor that no recorded op made and no
    watched model returned (``seen``): a loss summed over two model calls
    (``mse(m(a), ya) + mse(m(b), yb)``) is recorded from the second call's
    return on, and what its first part read is not in the records.
    """
    found = recorder.loss_code(key, last=False) if recorder is not None else None
    if found is None:
        return False
    made: set[int | None] = set()
    for op in found[0]:
        for value in [*op.args, *op.kwargs.values()]:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if record_key(item) is None or record_key(item) in made:
                    continue
                tensor = item.ref() if isinstance(item, WeakRecord) else item
                if tensor is None:
                    if item.requires_grad:  # freed since: what made it is not known
                        return False
                elif tensor.grad_fn is not None and not seen(tensor):
                    return False
        made.update(record_key(out) for out in tree_leaves(op.out))
    return True


def unrecorded(recorder: OutsideRecorder | None) -> bool:
    """Whether the loss code ran over the recorder's budget: then nothing tells what it read but its saved tensors.

    A non-finite tensor in the user's variables is then only a suspect (one left from an earlier run, or a label
    the loss read without saving it): the report names it beside the loss code, never as the step's data.
    """
    return recorder is not None and "loss" in recorder.untraced


def _recorded_leaf(value: Any) -> torch.Tensor | None:
    """A recorded argument's tensor if it is a checkable one that needs no gradient (as recorded), else None."""
    if isinstance(value, WeakRecord):
        if value.requires_grad:
            return None
        value = value.ref() if value.kept is None else value.kept
    if not isinstance(value, torch.Tensor) or value.requires_grad or value.grad_fn is not None:
        return None
    return value if is_checkable(value) else None


def _saved_by_loss_code(loss: torch.Tensor | None, boundary: int, node_origin: NodeOrigin | None) -> Iterator[Entered]:
    if loss is not None:
        # (At an event only: a loss code too long to be recorded is known by what its nodes saved, deep ones too.)
        for node, attribute, tensor in _saved_tensors(loss_region_nodes(loss.grad_fn, boundary, _EVENT_NODES)):
            yield _named(node, attribute, tensor, node_origin)


def _named(node: Any, attribute: str, tensor: torch.Tensor, node_origin: NodeOrigin | None) -> Entered:
    """A saved tensor by the argument of the forward op that made its node where the tracer saw it (``weight``
    of ``aten.nll_loss_forward.default``, as the records name it, with its line), else of the node."""
    op, line = node_origin(node) if node_origin is not None else (None, None)
    return TensorRef(TensorRole.INPUT, op or node.name(), attribute.removeprefix("_saved_")), tensor, line


def _saved_tensors(nodes: list[Any]) -> Iterator[tuple[Any, str, torch.Tensor]]:
    for node in nodes:
        for attribute in _saved_attributes(type(node)):
            try:
                value = getattr(node, attribute)
            except RuntimeError:  # freed by a backward that already ran
                continue
            for tensor in _tensors_in(value):
                yield node, attribute, tensor


_SAVED_ATTRIBUTES: dict[type, tuple[str, ...]] = {}


def _saved_attributes(node_type: type) -> tuple[str, ...]:
    """The ``_saved_*`` attribute names of an autograd node type (looked up once per type)."""
    names = _SAVED_ATTRIBUTES.get(node_type)
    if names is None:
        names = _SAVED_ATTRIBUTES[node_type] = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
    return names


def _user_locals() -> Iterator[tuple[str, torch.Tensor]]:
    frame = sys._getframe(2)
    searched = 0
    while frame is not None and searched < _MAX_FRAMES:
        if not is_library_file(frame.f_code.co_filename):
            searched += 1
            for name, value in list(frame.f_locals.items()):
                for index, tensor in enumerate(_tensors_in(value)):
                    yield (name if isinstance(value, torch.Tensor) else f"{name}[{index}]"), tensor
        frame = frame.f_back  # type: ignore[assignment]


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """A tensor, or the tensors directly inside a tuple, list or dict (a batch ``(x, y)``)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        yield from (item for item in value if isinstance(item, torch.Tensor))
    elif isinstance(value, dict):
        yield from (item for item in value.values() if isinstance(item, torch.Tensor))


def _is_bad_data(tensor: torch.Tensor) -> bool:
    """A non-finite floating leaf that no code of the step computed with gradients."""
    if tensor.grad_fn is not None or tensor.requires_grad or not is_checkable(tensor):
        return False
    # An additive attention mask (ops/masks.py) is deliberate, not data; so is a Python number the code passed
    # (``loss * math.inf``: its node saved the number as a 0-dim tensor): the op given it is named, as recorded.
    return bool(kinds_of(tensor)) and not is_additive_mask(tensor) and not is_wrapped_number(tensor)
