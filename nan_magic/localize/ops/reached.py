"""Whether a non-finite value reached the code that raised an exception, and the op that made it.

A forward that raised is replayed to find a non-finite value before the exception (``torch.multinomial`` on NaN
probabilities, an embedding of an index made from a NaN). The replay meets every op of the forward, a NaN that a
``torch.where`` discarded too; that NaN did not cause the user's shape error two lines on. The exception is the
user's own unless a non-finite value reached what raised it:

- the op that raised read a non-finite value an op made, or a value made *of* one: an integer cast of a NaN (an
  index), a ``nan_to_num``'s number for an inf, and what integer ops make of those (:func:`after_op` follows them
  on while the step has a non-finite value at all). A mask that only says where the NaN was (``isnan(x)``) is the
  user's handling of it, not a bad value: a shape error in a ``where`` over it stays theirs;
- Python code raised (``int(nan)``, a distribution's validation, the user's ``if not isfinite(x).all(): raise``)
  right after the user's code read a value made *from* one into Python (``.item()``, ``bool()``, masks included):
  the last op before the raise (our own reads and the autograd engine's, anomaly mode's, do not count).

Nothing of this runs on a step where no op made a non-finite value (the tracer started no origin then; a
benign mask's -inf starts none either): a truth test of a list an op.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.hot.reads import relevant_kinds
from nan_magic.localize.ops.kinds import KnownKinds
from nan_magic.localize.ops.origins import OpFinding, Origin, Origins
from nan_magic.localize.ops.plans import run_op
from nan_magic.localize.ops.sources import called_by_us

__all__ = ["after_op", "bad_origin", "failed_ops", "reached_failure"]

#: The op that reads a tensor's value into Python (``.item()``, ``bool(t)``, ``int(t)``).
_READ = torch.ops.aten._local_scalar_dense.default
#: Ops that replace a non-finite value by a number (float32's largest for an inf): what they make of one is still
#: made from it (``exp(x).nan_to_num().long()``, an index of 3.4e38), where a ``where`` leaves it out.
_REPLACES = frozenset({torch.ops.aten.nan_to_num.default, torch.ops.aten.nan_to_num_.default,
                       torch.ops.aten.nan_to_num.out})


class OpTracer(Protocol):
    """What this module reads and writes of the op tracer (tracer.py, which calls :func:`after_op`)."""

    _origins: Origins
    _known: KnownKinds
    kinds: frozenset[str]
    forward_task: int
    read_bad: OpFinding | None
    made_of: dict[int, weakref.ref[torch.Tensor]]


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def bad_origin(tracer: OpTracer, tensor: torch.Tensor, read: bool = False) -> Origin | None:
    """The origin of ``tensor`` where it holds a non-finite value an op made, or a value made of one (an index cast
    from a NaN, a ``nan_to_num``'s number for an inf); with ``read``, also where it is anything made from one (an
    ``isfinite`` mask, its ``all()``: what the user's check reads). None otherwise: a finite value a discarded NaN's
    op passed its origin on to (``where``'s output), a mask that only says where the NaN was, for an op."""
    entry = tracer._origins.entry(tensor)
    if not isinstance(entry, Origin):
        return None
    if read and not _floating(tensor):
        return entry
    if (ref := tracer.made_of.get(id(tensor))) is not None and ref() is tensor:
        return entry
    return entry if _floating(tensor) and relevant_kinds(tracer._known.kinds(tensor), tracer.kinds) else None


def after_op(tracer: OpTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    """After an op, on a step where some op made a non-finite value: an output made of one (an integer cast of a
    NaN, a ``nan_to_num``) or any non-floating output made from one (a mask) carries its origin on; the op read one
    into Python (:attr:`read_bad`)."""
    try:
        _after_op(tracer, func, args, kwargs, out)
    except Exception:  # (a tensor subclass that refuses our reads: what reached an op is then not followed)
        tracer.read_bad = None


def _after_op(tracer: OpTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
    if tracer.read_bad is not None and called_by_us():
        return  # (our own copies of a line's locals as it ends, line_state.py, are not the user's next op)
    inputs = [value for value in tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)]
    origin = next((found for value in inputs if (found := bad_origin(tracer, value, read=True)) is not None), None)
    # (our own reads of a bad value, a gradient hook's counts, are not the user's code reading it; nor the autograd
    # engine's own, anomaly mode's check of a backward's output)
    tracer.read_bad = origin.finding if origin is not None and func is _READ and not called_by_us() and (
        torch._C._current_graph_task_id() in (-1, tracer.forward_task)) else None
    if origin is None:
        return
    made = next((found for value in inputs if (found := bad_origin(tracer, value)) is not None), None)
    replaces = func in _REPLACES
    for value in tree_leaves(out):
        if not isinstance(value, torch.Tensor):
            continue
        floating = _floating(value)
        if made is not None and (replaces if floating else value.dtype is not torch.bool):
            tracer._origins.note(value, made)
            tracer.made_of[id(value)] = weakref.ref(value)
        elif not floating and tracer._origins.entry(value) is None:
            tracer._origins.note(value, origin)


def failed_ops(error: BaseException) -> Iterator[tuple[Any, list[torch.Tensor]]]:
    """The op that raised ``error`` under a dispatch mode of ours, innermost first, with its tensors."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is run_op.__code__:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        func, args, kwargs = (frame.f_locals.get(name) for name in ("func", "args", "kwargs"))
        yield func, [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


def reached_failure(tracer: OpTracer, error: BaseException) -> OpFinding | None:
    """The op that made the non-finite value that reached what raised ``error`` (the module docstring); None
    where none did: the error is the user's own, whatever NaN the step made and discarded before it. (A check of
    the user's that read the NaN through ``.numpy()`` or ``.tolist()``, which no op sees, or by ``.item()`` some ops
    before its raise, is not followed: their own error reaches them, with no report. A NaN held in a local is no
    evidence either way: the user may keep the raw value they then handle.)"""
    ops = list(failed_ops(error))
    for _func, arguments in ops:
        for tensor in arguments:
            if (origin := bad_origin(tracer, tensor)) is not None:
                return origin.finding
    return None if ops else tracer.read_bad
