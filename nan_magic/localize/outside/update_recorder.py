"""The update region's recorder (loop_writes.py): recorded in full, or only *watched* until it writes a parameter.

A watched region passes each op through, keeping the last :data:`RING` ops (by reference, with the user's line that
ran them) until an op writes a watched parameter in place; from that op on the region is recorded, the ring first.
The user's own in-place writes of a gradient that leave the ring are kept past it, each with the ops run since the
last one kept (up to :data:`WRITES_KEPT` ops): a LARS-style ``p.grad /= p.grad.norm()`` or
``p.grad.mul_(1.0 / p.grad.norm())`` over every parameter is judged at the step, its first writes and the ops that
made their operands (the norm, its reciprocal) long out of the ring.
Before a write, a watched parameter is copied (the write may be the producer: ``w.div_(w.norm())``), and so is any
tensor the user's own code writes in place (a gradient: ``g.div_(g.norm())``, ``g /= n``), so that a replay of the
records starts from the value the write read.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from types import CodeType, FrameType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.errors.frames import is_library_code
from nan_magic.hot.kept.lines import line_at
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.plans import Plan, plan_of, run_op
from nan_magic.localize.ops.sources import is_plumbing
from nan_magic.localize.outside.held import KEEP_TOTAL
from nan_magic.localize.outside.param_writes import Storages, copy_before, on_parameters, written_by
from nan_magic.localize.outside.recorded_ops import RecordedOp, WeakRecord, record_key
from nan_magic.localize.outside.recorder import OutsideRecorder, passes

__all__ = ["RING", "WRITES_KEPT", "UpdateRecorder"]

#: A watched region's last ops kept, for the replay of a parameter write (the ops that made its operand).
RING = 16
#: The ops a watched region kept past its ring: the user's own in-place writes of a gradient, each with the ops since
#: the last one kept (``p.grad /= p.grad.norm()`` over every parameter: the first writes, and the ops that made their
#: operands, fall out of the ring long before the step judges the gradients).
WRITES_KEPT = 1024

# ``.item()``'s op (``float(t)``'s too): the update code read a number (a learning rate computed in the loop).
_ITEM = torch.ops.aten._local_scalar_dense.default


#: A watched region's op: (op, args, kwargs, output, the user's frame that ran it, its line and f_lasti then, and
#: for a library's write, the user's frame that called the library: the library's ops before it take its line).
_Entry = tuple[Any, tuple[Any, ...], dict[str, Any], Any, FrameType | None, int, int, FrameType | None]

# What a watched region does with an op: pass it and keep it in the ring, check whether it writes a parameter,
# or pass it only (record_function's markers, an op that returns no tensor: nothing to replay, recorder.passes).
_PASSES, _WRITES, _MARKER = 0, 1, 2
# id(op) -> (op, what a watched region does with it, the callable that runs it: an OpOverload's C++ ``_op``,
# skipping its Python ``__call__``, and the plan of an op that writes: plan_of hashes the op in Python).
# Holding the op keeps its id unique.
_KINDS: dict[int, tuple[Any, int, Any, Plan | None]] = {}


def _kind_of(func: Any) -> tuple[Any, int, Any, Plan | None]:
    """An op's entry in :data:`_KINDS`, and an attribute of the op where it takes one (read at each op, no call)."""
    if (entry := _KINDS.get(id(func))) is None:
        if not isinstance(func, torch._ops.OpOverload):
            entry = func, _PASSES, func, None
        elif passes(func):
            entry = func, _MARKER, func._op, None
        else:
            plan = plan_of(func)
            entry = (func, _WRITES, func._op, plan) if plan.writes else (func, _PASSES, func._op, None)
        _KINDS[id(func)] = entry
        with contextlib.suppress(AttributeError, TypeError):
            func._nan_magic_update = entry
    return entry


# id(code) -> (code, what a frame running it is between a dispatch mode and the line that ran an op: the user's
# line, torch's plumbing (dispatch, a Tensor operator's wrapper), or a library function). Holding the code keeps
# its id unique; the id, not the code, is the key: a code's hash is computed anew.
_USER, _PLUMBING, _LIBRARY = 0, 1, 2
_CALLERS: dict[int, tuple[CodeType, int]] = {}
_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})


def _users(frame: FrameType | None) -> FrameType | None:
    """The user's frame that ran an op, past torch's plumbing; None where a library function ran it.

    Asked at each op of a watched region, so it walks no further: clipping's
    ops, run by ``clip_grad_norm_``, are some ten frames below the loop.
    """
    while frame is not None:
        code = frame.f_code
        entry = _CALLERS.get(id(code))
        if entry is None:
            entry = _CALLERS[id(code)] = (code, _caller_kind(frame))
        if entry[1] == _USER:
            return frame
        if entry[1] == _LIBRARY:
            return None
        frame = frame.f_back
    return None


def _beyond_library(frame: FrameType | None) -> FrameType | None:
    """The user's frame that called the library function running ``frame``, past it and torch's plumbing: asked once
    for each library call that writes in a watched region (clip_grad_norm_'s scaling, every healthy step)."""
    while frame is not None:
        entry = _CALLERS.get(id(frame.f_code))
        if entry is None:
            entry = _CALLERS[id(frame.f_code)] = (frame.f_code, _caller_kind(frame))
        if entry[1] == _USER:
            return frame
        frame = frame.f_back
    return None


#: The ops an infinite bound leaves finite (``clip_grad_value_(params, inf)``, clipping switched off by a config).
_CLAMPS = frozenset({"clamp_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_"})


def _number_not_finite(func: Any, args: Sequence[Any]) -> bool:
    """Whether an op is given a Python number that can make its output non-finite: a NaN (``clip_grad_value_``'s
    clamp of a NaN clip value), or an infinity, but for a clamp's bound."""
    return any(type(arg) is float and not math.isfinite(arg) and (
        arg != arg or getattr(func, "_opname", None) not in _CLAMPS) for arg in args)


def _caller_kind(frame: FrameType) -> int:
    if not is_library_code(frame.f_code) and frame.f_code.co_name not in _HOOKS:
        return _USER
    return _PLUMBING if is_plumbing(frame) or frame.f_code.co_name in _HOOKS else _LIBRARY


class UpdateRecorder(OutsideRecorder):
    """The update region's recorder: a watched parameter is copied before the region first writes it in place.

    The producer may be that write itself (``w.div_(w.norm())``): a replay
    must start from the value it divided, not the one it left. The copy is
    kept under the parameter and under the tensor written (``p.data``), where
    that is not a recorded op's output (``p.detach()``, which the replay makes
    again from the parameter's copy). Up to
    :data:`~nan_magic.localize.outside.held.KEEP_TOTAL` bytes a region; only a
    loop that writes parameters pays for it.

    :meth:`watch` starts a region that is only watched until it writes a
    watched parameter (the module docstring).
    """

    def __init__(self, kinds: frozenset[str], parameter_of: Callable[[torch.Tensor], torch.Tensor | None],
                 storages: Callable[[], Storages]) -> None:
        super().__init__(kinds)
        self._parameter_of = parameter_of
        self._storages = storages
        self._copied = 0
        #: ``id(tensor)`` -> its version counter as :meth:`_keep_written` copied it into ``before`` (the step replay
        #: starts a model call from that copy where it is the value the call read: :meth:`values_before`).
        self.versions_before: dict[int, int] = {}
        #: The library function's frame that ran the last library write of the region, and the user's frame that
        #: called it (:func:`_beyond_library`, asked once a library call, not once a write: clip_grad_value_ writes
        #: each gradient in turn on the CPU). Held until the region is forgotten, so that ``is`` cannot alias.
        self._library: tuple[FrameType | None, FrameType | None] = (None, None)
        #: Whether the region is watched, not recorded (no watched parameter written yet).
        self.watching = False
        # The watched region's last ops: (op, args, kwargs, output, the user's frame that ran it, its line and
        # f_lasti then).
        self._ring: deque[_Entry] = deque(
            maxlen=RING)
        # The user's in-place writes of a gradient, each after the ops since the last one kept, in order, the
        # ring's too (told apart at _record_ring, by id): kept for the step's claim of a gradient (its write and the
        # ops that made its operand, replayed from its copy), with the bytes of their operands and outputs.
        self._writes_bytes, self._writes_left = 0, WRITES_KEPT
        self._writes: list[_Entry] = []

    def watch(self) -> None:
        """Watch the update region: record it only from its first write of a watched parameter."""
        self.start("update")
        self.watching = self.pushed

    def forget(self, last: bool = False, stepping: bool = False, others: bool = False) -> None:
        super().forget(last, stepping, others)
        self._copied = 0
        self.read_number = False
        self._library = (None, None)
        self._ring.clear()
        if self._writes:
            self._writes = []  # (a new list, not a clear: no call)
            self._writes_bytes, self._writes_left = 0, WRITES_KEPT
        if self.versions_before:
            self.versions_before.clear()

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        try:  # cached on the op, as the recorder's entry is (op_entries.op_entry)
            _func, kind, call, plan = func._nan_magic_update
        except AttributeError:
            _func, kind, call, plan = _kind_of(func)
        if kind == _MARKER:  # opt.step()'s profiler marker, every step: run here, not through the recorder's dispatch
            if func is _ITEM:  # (a number read: kept through the step, as a learning rate it may be: recorder.forget)
                self.read_number = True
            return call(*args, **kwargs)  # (which runs it and nothing more, as the watched branch below would)
        if self.watching:
            if plan is not None and on_parameters(self._storages(), self._parameter_of,
                                                  written := written_by(plan, args, kwargs)):
                self.watching = False
                self._record_ring()
            else:
                # The caller's code is looked up here first (_users, inlined): a library function's
                # (clip_grad_norm_'s) runs most of a watched region's ops.
                caller, library, called = sys._getframe(1), None, False
                known = _CALLERS.get(id(caller.f_code))
                frame = (caller if known[1] == _USER else None if known[1] == _LIBRARY else _users(caller)
                         ) if known is not None else _users(caller)
                if plan is not None and frame is not None:  # the user's own write of a gradient (not a library's)
                    self._keep_written(written)
                elif plan is not None:  # a library's write (clip_grad_norm_'s _foreach_mul_, a GradScaler's unscale)
                    # Kept with the user's call of the library, at its line (one short walk a library call: its ops
                    # before take it at a claim, _record_ring); copied first where given a number that makes it
                    # non-finite (clip_grad_value_(params, nan)).
                    if self._library[0] is not caller:  # (its first write is kept past the ring, as a user's)
                        self._library = (caller, _beyond_library(caller.f_back))  # (caller: the library's frame)
                        called = True
                    library = frame = self._library[1]
                    for arg in args:  # (inlined: no call for a write given finite numbers, every healthy step)
                        if type(arg) is float and not -math.inf < arg < math.inf:
                            if _number_not_finite(func, args):
                                self._keep_written(written)
                            break
                try:
                    out = call(*args, **kwargs)
                except RuntimeError:  # a wrapped number alone (run_op says why); only the failure path pays
                    out = run_op(func, args, kwargs)
                self._clean = False
                entry = (func, tuple(args), kwargs, out, frame, line_at(frame) if frame else 0,
                         frame.f_lasti if frame else -1, library)
                ring = self._ring
                ring.append(entry)
                if plan is not None and frame is not None and (library is None or called) and self._writes_left > 0:
                    # Kept past the ring (inlined: a LARS helper writes every gradient every step), with the ops since
                    # the last write kept (the loop body that made its operand: ``1.0 / p.grad.norm()``'s norm and
                    # reciprocal), while within KEEP_TOTAL bytes a region (its operands and their outputs): a large
                    # temporary (a mask the gradient is multiplied by) is not held, as unwatched, and its write goes
                    # unnamed past the ring. (A walk back of the ring to the last write kept, no call.) A library
                    # call's first write only (``clip_grad_norm_(foreach=False)`` scales each gradient in turn by one
                    # coefficient: the first parameter's, which the step judges first, with the ops that made it).
                    writes = self._writes
                    last = writes[-1] if writes else None
                    operands, back = 0, 1
                    for arg in args[1:]:
                        if type(arg) is torch.Tensor:
                            operands += arg.nbytes
                    size = operands
                    try:
                        while (earlier := ring[-back - 1]) is not last:
                            if type(made := earlier[3]) is torch.Tensor:  # (a view counted too: no more read)
                                size += made.nbytes
                            back += 1
                    except IndexError:  # (back to the ring's first op: all of it, ``back`` ops)
                        pass
                    if self._writes_bytes + size > KEEP_TOTAL:
                        # The ops before it made gradient-sized temporaries (``(g - g.mean()).pow(2)``): the write is
                        # kept alone, its operands held as before them (the replay then starts from the operand).
                        size, back = operands, 1
                    if self._writes_bytes + size <= KEEP_TOTAL:
                        self._writes_bytes += size
                        self._writes_left -= back
                        # (The ring's last ``back`` ops, oldest first; the write alone with no call.)
                        writes += (entry,) if back == 1 else islice(ring, len(ring) - back, None)
                return out
        if plan is not None and self.recording():
            written = written_by(plan, args, kwargs)
            if on_parameters(self._storages(), self._parameter_of, written):
                for tensor in written:
                    if isinstance(tensor, torch.Tensor):
                        self._copy(tensor)
            elif _users(sys._getframe(1)) is not None or _number_not_finite(func, args):
                self._keep_written(written)  # (the user's own write; a library's of a non-finite number given it)
        # (A region past its budget is left unrecorded for the rest of the run, as every recorded region: watching
        # it instead, op by op every step, cost a 200-parameter LARS helper 3.5 ms a step, 5x the whole watch.)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _keep_written(self, written: Sequence[Any]) -> None:
        """Copy what the user's own update code is about to write in place (not a parameter: a gradient, by
        ``p.grad /= n``, ``p.grad.div_(p.grad.norm())``, ``p.grad.mul_(c)``): that write may make the value non-finite
        (0 / 0 where n is 0), or ops before it read the value it changes (a total norm), and a replay must start
        from the value they read, not the one it left (:meth:`RegionRecords.claim`'s ``before``). Up to
        :data:`KEEP_TOTAL` bytes a region; a library's writes (``clip_grad_norm_``'s) are not copied."""
        before = self.before
        for tensor in written:  # (two calls a tensor: its id and its clone; nbytes and requires_grad are fields)
            if type(tensor) is torch.Tensor and (key := id(tensor)) not in before:
                try:
                    size = tensor.nbytes
                except RuntimeError:  # a sparse COO gradient (sparse=True embedding) has no nbytes: not copied
                    continue
                if self._copied + size <= KEEP_TOTAL:
                    before[key] = tensor.detach().clone() if tensor.requires_grad else tensor.clone()
                    self._copied += size
                    self._clean = False
                    if not tensor.is_inference():  # (an inference tensor has no version counter)
                        self.versions_before[key] = tensor._version

    def values_before(self) -> dict[int, tuple[torch.Tensor, int]]:
        """``{id(tensor): (its value before the region's code first wrote it in place, its version then)}`` for what
        the user's update code wrote that is not a parameter: a batch buffer the loop refills with the next batch
        before ``opt.step()`` (a CUDA graph's static input, prefetched). At an event only."""
        return {key: (self.before[key], version) for key, version in self.versions_before.items()
                if key in self.before}

    def settled(self) -> bool:
        if self._ring:  # (a watched region's last ops, held for a claim: gradient accumulation's next batch)
            self._record_ring()
        return bool(self._ops)

    def _record_ring(self) -> None:
        """The watched region wrote a parameter: its last ops become the first records (what made the operand)."""
        self._clean = False
        ring = self._ring
        writes = self._writes
        # (The kept ops the ring no longer holds, older than its ops; none where the first kept is the ring's first.)
        if writes and (not ring or writes[0] is not ring[0]):
            in_ring = set(map(id, ring))
            kept: list[_Entry] = [
                *(entry for entry in writes if id(entry) not in in_ring), *ring]
        else:
            kept = list(ring)
        calling: tuple[FrameType | None, int, int] = (None, 0, -1)
        for at in range(len(kept) - 1, -1, -1):  # (a library's ops take the line of its write, that called it)
            func, args, kwargs, out, frame, lineno, lasti, library = kept[at]
            if library is not None:
                calling = frame, lineno, lasti
            elif frame is None:
                if calling[0] is not None:
                    kept[at] = (func, args, kwargs, out, *calling, None)
            else:
                calling = (None, 0, -1)
        for func, args, kwargs, out, frame, lineno, lasti, _library in kept:
            self._ops.append(RecordedOp(func, args, kwargs, out, frame.f_code if frame else None, lineno,
                                        frame.f_globals if frame else None, lasti, frame))
            index = len(self._ops) - 1
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._produced[id(tensor)] = index
        self._n_ops = len(self._ops)
        self._budget -= len(kept)
        self._ring.clear()
        self._writes = []
        self._writes_bytes, self._writes_left = 0, WRITES_KEPT

    def claim_written(self, gradient: torch.Tensor) -> OpFinding | None:
        """The op that made ``gradient`` non-finite where :meth:`claim` finds none by the tensor itself: the last
        recorded op that wrote its memory in place through another tensor object (``p.grad.data.div_(n)``: ``.data``
        is a new tensor over the same storage, the DDP tutorial's averaging by hand) or in a list
        (``torch._foreach_div_(grads, n)``, ``clip_grad_value_``'s ``_foreach_clamp_min_``: a foreach op returns
        nothing), its records replayed up to that write. Matched by memory, at an event only."""
        if gradient.layout is not torch.strided or not gradient.numel() or not self._ops:
            return None
        address, start = gradient.untyped_storage().data_ptr(), gradient.data_ptr()
        end = start + gradient.numel() * gradient.element_size()
        ops = self._ops
        for index in range(len(ops) - 1, -1, -1):
            func = ops[index].func
            plan = plan_of(func) if isinstance(func, torch._ops.OpOverload) else None
            if plan is None or not plan.writes:
                continue
            for value in written_by(plan, ops[index].args, ops[index].kwargs):
                tensor = value.ref() if isinstance(value, WeakRecord) else value
                if (isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and tensor.numel()
                        and tensor.untyped_storage().data_ptr() == address and tensor.data_ptr() < end
                        and start < tensor.data_ptr() + tensor.numel() * tensor.element_size()):
                    key, before = record_key(value), self.before
                    if key in before and id(gradient) not in before and (
                            earlier := _through(gradient, tensor, before[key])) is not None:
                        # ``p.grad.data`` is recorded as a detach of the gradient, ``p.grad.view(-1)`` as a view: the
                        # replay makes it again from the gradient, whose value before the write is the one copied
                        # under the alias written, put back where the alias lies in it.
                        before = {**before, id(gradient): earlier}
                    replayed = list(ops[: index + 1])
                    if key not in before and id(gradient) not in before:
                        # Not copied (a library's write of a tensor: clip_grad_norm_'s scaling by its coefficient,
                        # every healthy step): what read the memory it overwrote is taken as it ran, not run again.
                        replayed = _past_overwritten(replayed, ops, before)
                    # (written: a number the code wrote in, ``p.grad[0, 0] = inf``, is named by its lift)
                    return self._claim_ops(replayed, self._rng, before, key, ops, written=True)
        return None

    def _copy(self, tensor: torch.Tensor) -> None:
        parameter = self._parameter_of(tensor)
        if parameter is not None:
            self._clean = False
            self._copied = copy_before(self, tensor, parameter, self._copied)


def _through(gradient: torch.Tensor, alias: torch.Tensor, copied: torch.Tensor) -> torch.Tensor | None:
    """``gradient``'s value before a write through ``alias`` (a tensor on its memory: ``.data``, ``.view(-1)``, a
    row), made of ``copied`` (the alias's copy before the write) where the alias lies within it; else None."""
    if copied.shape == gradient.shape and alias.data_ptr() == gradient.data_ptr() and (
            alias.stride() == gradient.stride()):
        return copied
    if not gradient.is_contiguous() or copied.shape != alias.shape:
        return None
    offset = alias.storage_offset() - gradient.storage_offset()
    last = offset + sum((size - 1) * stride for size, stride in zip(alias.shape, alias.stride()))
    if offset < 0 or last >= gradient.numel() or alias.dtype != gradient.dtype:
        return None
    earlier = gradient.detach().clone()
    earlier.as_strided(alias.shape, alias.stride(), offset).copy_(copied)
    return earlier


def _memory(value: Any) -> tuple[int, int, int] | None:
    """A recorded value's memory: its storage, its first and past-its-last byte; None for no strided tensor."""
    tensor = value.ref() if isinstance(value, WeakRecord) else value
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided or not tensor.numel():
        return None
    start = tensor.data_ptr()
    return tensor.untyped_storage().data_ptr(), start, start + tensor.numel() * tensor.element_size()


def _past_overwritten(replayed: list[RecordedOp], ops: Sequence[RecordedOp], before: dict[int, Any]
                      ) -> list[RecordedOp]:
    """``replayed`` without the ops that only read memory a recorded write overwrote with no copy kept before it
    (``clip_grad_norm_``'s norms of the gradients it then scales): run again, they would read the values written
    since, not those they read; their outputs, held by the records and written by none of them, are what they made.
    At an event only."""
    overwritten: list[tuple[int, int, int]] = []
    for op in ops:
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if plan is not None and plan.writes:
            overwritten += [memory for value in written_by(plan, op.args, op.kwargs)
                            if record_key(value) not in before and (memory := _memory(value)) is not None]
    if not overwritten:
        return replayed

    def on_overwritten(values: Any) -> bool:
        for value in tree_leaves(values):
            if (memory := _memory(value)) is not None and any(
                    memory[0] == storage and memory[1] < end and start < memory[2]
                    for storage, start, end in overwritten):
                return True
        return False

    kept = []
    for op in replayed[:-1]:
        plan = plan_of(op.func) if isinstance(op.func, torch._ops.OpOverload) else None
        if (plan is not None and not plan.writes and on_overwritten((op.args, op.kwargs))
                and not on_overwritten(op.out)):
            continue
        kept.append(op)
    return [*kept, replayed[-1]]
