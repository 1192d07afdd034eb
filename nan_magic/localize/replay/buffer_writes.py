"""The op that wrote a buffer non-finite: the step's model call run again, its writes to that buffer watched.

A running statistic (BatchNorm's ``running_var`` from inputs of ~1e20, a user's
``self.running.mul_(0.9).add_(...)``) is read at the optimizer step
(hot/checks/optimizer/running_stats.py), by its value: which op wrote it is not seen
there. The tiered watch holds each top-level call of the step with copies of
the buffers it may change, as they were before it (replay/tiered/step.py); at a buffer
event, each call of the buffer's model is run again, in order, on those copies,
under a dispatch mode that reads the buffer after each op that writes it in
place: the first op that leaves it non-finite is named (where that op read a
value already non-finite, the first op of the replay that made one of finite
inputs: the producer, PRODUCT.md, the write a propagator), at the user's line that
ran it, by the op tracer's line rule (ops/sources.sources_of_op): the user's
innermost frame, or the line that called the model where its code is all
torch's (an ``nn.Sequential`` holding an ``nn.BatchNorm1d``), with torch's own
line said beside it. The op is the one eager torch runs (``native_batch_norm``
on the CPU, ``cudnn_batch_norm`` on a GPU, ``_native_batch_norm_legit_functional``
in a compiled graph run eagerly as the replay runs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.rng import generators_at
from nan_magic.localize.ops.plans import op_name
from nan_magic.localize.ops.sources import ReplayedFrom, sources_of_op
from nan_magic.localize.replay.module_run import copy_tensors, parameters_at, swapped_buffers
from nan_magic.localize.replay.tiered.root_calls import RootCall, replay_target
from nan_magic.localize.replay.untouched import untouched
from nan_magic.plain import to_pairs
from nan_magic.records import Note, Report, SourcePointer

__all__ = ["BufferWrite", "buffer_writer", "buffer_written"]


@dataclass(frozen=True)
class BufferWrite:
    """The op that first left the buffer non-finite in a replay, with the user's line and torch's inside it.

    ``from_zero``: the call kept no copy of the buffer from before it (``native_batch_norm`` writes its running
    statistics without moving their version counter, which is what has them copied): the replay started from
    the buffer as the step left it, its non-finite elements as 0, and made each of them non-finite again.
    """

    op: str
    source: SourcePointer | None
    inner: SourcePointer | None
    from_zero: bool = False
    #: The op that wrote the buffer where ``op`` is an earlier one that made the value it wrote (a propagator's).
    writer: str | None = None


def buffer_written(calls: Iterable[RootCall], finding: Finding, seen: Report,
                   standing_aside: Callable[[], AbstractContextManager[object]]) -> Report:
    """``seen`` (a buffer read non-finite at the optimizer step) with the op that wrote it and its line, where a
    replay of the step's calls names one; else ``seen`` as it is."""
    name, module = finding.tensor.name or "", finding.module
    write = buffer_writer(list(calls), module, name[len(module) + 1:] if module else name, standing_aside)
    if write is None:
        return seen
    if write.writer is not None:
        notes = [Note.of("buffer-carried", op=write.op, writer=write.writer, buffer=name, step=seen.step)]
    else:
        notes = [Note.of("buffer-written-from-zero" if write.from_zero else "buffer-written", op=write.op,
                         buffer=name, step=seen.step)]
    if write.inner is not None and write.inner != write.source:
        notes.append(Note.of("inside", source=to_pairs(write.inner)))  # torch's line (F.batch_norm's), as for any op
    found = dataclasses.replace(seen, op=write.op, source=write.source, reproduced=True,
                                note_facts=(*seen.note_facts, *notes))
    # The check's cause read the buffer's value (a running average past the max); an op that made the value the
    # write carried says why by its own rule (a variance of one sample: 0 / 0).
    return dataclasses.replace(found, cause=diagnose(dataclasses.replace(found, cause=None))) if write.writer else found


def buffer_writer(roots: Iterable[RootCall], module: str | None, key: str,
                  standing_aside: Callable[[], AbstractContextManager[object]]) -> BufferWrite | None:
    """The op that wrote buffer ``key`` of the module named ``module`` non-finite, in the first of ``roots`` (the
    step's calls, in order) whose replay makes it so; None where none does (a buffer first written outside a
    model call, one that reached the max by many finite steps, which a replay from 0 does not make again)."""
    for root in roots:
        target = replay_target(root.module)
        owner = _submodule(target, module) if target is not None else None
        # (``in`` and ``[]``: a scripted submodule's buffers, an OrderedDictWrapper, have no get)
        if target is None or owner is None or key not in owner._buffers or owner._buffers[key] is None:
            continue
        found = _replay(root, target, owner, key, standing_aside)
        if found is not None:
            return found
    return None


def _submodule(model: nn.Module, name: str | None) -> nn.Module | None:
    if name is None:
        return None
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        return None


def _replay(root: RootCall, target: nn.Module, owner: nn.Module, key: str,
            standing_aside: Callable[[], AbstractContextManager[object]]) -> BufferWrite | None:
    """Run ``root`` again on its buffers from before it; the op that first left ``owner``'s ``key`` non-finite."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(parameters_at(root.parameters))  # (outside the guard: it puts them back last)
        guard = stack.enter_context(untouched(target))
        stack.enter_context(standing_aside())
        stack.enter_context(swapped_buffers(root.module, root.buffers_before()))
        buffer = owner._buffers[key]
        if buffer is None:
            return None
        # (a copy: swapped_buffers gave the module copies, from before the call where it kept one)
        made = ~torch.isfinite(buffer)
        from_zero = bool(made.any())
        if from_zero:
            buffer.masked_fill_(made, 0)
        for device, dtype in root.autocast or ():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        stack.enter_context(torch.no_grad())  # (a running statistic is written the same without a graph)
        copies: dict[int, torch.Tensor] = {}
        args, kwargs = copy_tensors(root.args, copies), copy_tensors(root.kwargs, copies)
        stack.enter_context(generators_at(root.rng))
        stack.enter_context(ReplayedFrom(root.site, sys._getframe(), root.caller))
        watcher = _Writes(buffer, guard.before_write)
        try:
            with watcher:
                target(*args, **kwargs)
        except Exception:  # a replay that raises names what it saw before it
            pass
        found = watcher.found
        if found is None or (from_zero and not bool((~torch.isfinite(buffer))[made].all())):
            return None  # (from 0, the elements the step made non-finite are not all made so again: a guess)
        return dataclasses.replace(found, from_zero=from_zero)


class _Writes(TorchDispatchMode):
    """Reads ``buffer`` after each op; keeps the first op that leaves it non-finite (it was finite before).

    After every op, not only those whose schema says they write it: ``native_batch_norm`` writes the running
    statistics it is given without saying so. A replay at an event: one small read per op. ``before_write``
    saves what else an op writes in place (untouched.py).
    """

    def __init__(self, buffer: torch.Tensor, before_write: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.buffer = buffer
        self.before_write = before_write
        self.found: BufferWrite | None = None
        # The first op that made a non-finite value of finite inputs: the producer where the write only carried
        # it (``running_var.add_(0.1 * x.var(0))`` of one sample: the var's 0 / 0, not the add_, PRODUCT.md).
        self.first_made: BufferWrite | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.found is not None:
            return func(*args, **kwargs)
        for tensor in _written(func, args, kwargs):
            if tensor is not self.buffer:
                self.before_write(tensor)
        read_bad = _any_nonfinite((args, kwargs))  # (before the op: an in-place op's input is its value before)
        out = func(*args, **kwargs)
        if self.first_made is None and not read_bad and _any_nonfinite(out):
            self.first_made = BufferWrite(op_name(func), *sources_of_op(sys._getframe(1))[:2])
        if not bool(torch.isfinite(self.buffer).all()):
            source, inner, _user = sources_of_op(sys._getframe(1))
            if read_bad and self.first_made is not None:
                self.found = dataclasses.replace(self.first_made, writer=op_name(func))
            else:
                self.found = BufferWrite(op_name(func), source, inner)
        return out


def _any_nonfinite(values: Any) -> bool:
    """Whether any floating tensor or Python float in ``values`` (nested) holds a NaN or an infinity."""
    for value in pytree.tree_leaves(values):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
                return True
        elif isinstance(value, float) and not math.isfinite(value):
            return True
    return False


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> Iterable[torch.Tensor]:
    """The tensors ``func`` writes in place, by its schema (``Tensor(a!)``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    for index, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            yield value
