"""Which in-place writes of the loop's code land on a watched parameter, and the copy a replay starts from.

Shared by the two regions whose code writes parameters: the update region
(``backward()`` to the optimizer step, outside/loop_writes.py) and the data
region (the optimizer step to the next model call: a max-norm renorm, weight
clipping, ``p.data.mul_(s)``), whose writes :class:`DataWrites` notes as the
main recorder (outside/recorder.py) records them. A write is named by
replaying the region's recorded ops on copies; the producer may be the write
itself (``w.div_(w.norm())``), so the replay must start from the value the
write read, copied just before it ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from nan_magic.localize.ops.plans import Plan
from nan_magic.localize.outside.held import KEEP_TOTAL
from nan_magic.localize.outside.region_records import RegionRecords

__all__ = ["FOLLOWED_BYTES", "DataWrites", "Index", "Rebound", "Storages", "copy_before", "data_ptr", "lookup",
           "on_parameters", "written_by"]

#: The most bytes of parameters the code after an optimizer step may write in one step and still be followed
#: (a renorm, a weight clip: a few layers); more (an EMA teacher's update of a whole model) turns it off.
FOLLOWED_BYTES = 1 << 20

#: A tensor of at most this many elements that the code after the step writes in place, not a parameter (a step
#: counter), is copied before its first write (DataWrites._keep_small): a replay must read it as it was.
SMALL_NUMEL = 64

# The watched parameters by id, and by storage with the bytes each spans in it (``p.data``, a row ``p[3]``).
Index = tuple[dict[int, tuple[str, torch.Tensor]], dict[int, list[tuple[int, int, str, torch.Tensor]]]]
Storages = dict[int, list[tuple[int, int, str, torch.Tensor]]]
_SELF = frozenset({"self"})
# What on_parameters maps over a written list, in C (no Python call per tensor).
_storage_of = torch._C.TensorBase.untyped_storage
data_ptr = torch.Tensor.data_ptr
_address = torch.UntypedStorage.data_ptr
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def has_own_memory(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is dense memory of its own: not a tensor subclass that dispatches (FSDP2's DTensor,
    whose shard lives in another tensor: its own ``data_ptr()`` raises)."""
    return parameter.layout is torch.strided and type(parameter).__torch_dispatch__ is _PLAIN_DISPATCH


def lookup(index: Index, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """``(name, parameter)`` of the watched parameter ``tensor`` is or lies inside (``p.data``, ``p[3]``), or None."""
    by_id, by_storage = index
    entry = by_id.get(id(tensor))
    if entry is not None or tensor.layout is not torch.strided:
        return entry
    spans = by_storage.get(tensor.untyped_storage().data_ptr())
    if spans:
        at = tensor.data_ptr()
        for first, end, name, parameter in spans:
            if first <= at < end:
                return name, parameter
    return None


def written_by(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> Sequence[Any]:
    """What an op writes in place: its written arguments, lists flattened (a gradient list is not walked in
    Python: a GradScaler's unscale writes every gradient); a non-tensor in a list is left for the caller."""
    if plan.writes == _SELF and args:
        first = args[0]
        return first if type(first) is list or type(first) is tuple else (first,)
    written: list[Any] = []
    for name, value in (*zip(plan.names, args), *kwargs.items()):
        if name in plan.writes:
            if type(value) is list or type(value) is tuple:
                written.extend(value)
            else:
                written.append(value)
    return written


def on_parameters(storages: Storages, parameter_of: Callable[[torch.Tensor], torch.Tensor | None],
                  written: Sequence[Any]) -> bool:
    """Whether any of the tensors an op writes in place is a watched parameter or on one's memory.

    Asked for every in-place op of a watched region. Clipping's ``_foreach_mul_`` and a GradScaler's unscale
    write every gradient: a tensor on a storage no parameter is on is ruled out with two calls.
    """
    try:
        # One pass in C over what the op writes: no tensor on a parameter's storage is the usual answer, and
        # asking tensor by tensor cost four calls each.
        if storages.keys().isdisjoint(map(_address, map(_storage_of, written))):
            return False
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # a sparse tensor, a subclass without storage, a non-tensor: asked one by one below
    return any(
        isinstance(tensor, torch.Tensor)
        and (tensor.layout is not torch.strided or tensor.untyped_storage().data_ptr() in storages)
        and parameter_of(tensor) is not None for tensor in written
    )


def copy_before(records: RegionRecords, tensor: torch.Tensor, parameter: torch.Tensor, copied: int) -> int:
    """Copy ``parameter`` (and ``tensor``, the view written: ``p.data``) into ``records.before`` before a write.

    Only the first write of each is copied, within :data:`KEEP_TOTAL` bytes a region (``copied``: the bytes
    copied so far; returned updated). ``tensor`` is not copied where a recorded op made it (``p.detach()``,
    which the replay makes again from the parameter's copy).
    """
    for kept in (parameter, tensor) if parameter is not tensor and not records.made(tensor) else (parameter,):
        size = kept.numel() * kept.element_size()
        if id(kept) not in records.before and copied + size <= KEEP_TOTAL:
            records.before[id(kept)] = kept.detach().clone()
            copied += size
    return copied


class DataWrites:
    """The watched parameters the data region's code wrote in place, noted as the main recorder records them.

    The main recorder calls :meth:`on_write` before an op that writes in place
    runs in its data region (recorder.py: ``on_write``; no other op pays
    anything); a write on a watched parameter is copied before it runs and
    noted. :meth:`take`, at the region's end (the next model call, an optimizer
    step, the watch's end), hands the noted tensors to the update code's check
    (loop_writes.py), which measures the parameters and names the write.
    """

    def __init__(self, records: RegionRecords, index: Callable[[], Index]) -> None:
        self.records = records
        self._index = index
        #: What was written since the last :meth:`take`, by the id of the tensor written: (tensor, the
        #: parameter's name, the parameter), in the order first written.
        self.written: dict[int, tuple[torch.Tensor, str, torch.Tensor]] = {}
        self._copied = 0
        self._bytes = 0  # of the parameters written since the last take
        #: A region wrote more than :data:`FOLLOWED_BYTES` of parameters (an EMA teacher's update, every step):
        #: the writes after the step are no longer followed (the next forward finds such a parameter, unnamed).
        self.off = False

    def on_write(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """An op of the data region is about to write ``args``/``kwargs`` in place (``plan``: the op's).

        Asked at every in-place op of the region: an EMA teacher's update writes each of its parameters twice a
        step (``t.mul_(m).add_(s, alpha=1 - m)``), so a parameter written directly is looked up by its id, and one
        written already this region costs nothing more.
        """
        if self.off:
            return
        index = self._index()
        first = args[0] if args else None
        if plan.writes == _SELF and (type(first) is torch.Tensor or type(first) is torch.nn.Parameter):
            if id(first) in self.written:
                return
            entry = index[0].get(id(first))
            if entry is None:
                # (A normalisation of the batch: one storage to rule out, with two calls; ``p.data``: found by it.)
                if first.layout is not torch.strided or _address(_storage_of(first)) not in index[1]:
                    self._keep_small(first)
                    return
                entry = lookup(index, first)
                if entry is None:
                    return
            self._note(first, *entry)
            return
        written = written_by(plan, args, kwargs)
        try:  # (a GradScaler's update writes its scale and growth tracker: ruled out in one pass in C)
            if index[1].keys().isdisjoint(map(_address, map(_storage_of, written))):
                return
        except (RuntimeError, NotImplementedError, TypeError):
            pass
        for tensor in written:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in self.written:
                entry = lookup(index, tensor)
                if entry is not None:
                    self._note(tensor, *entry)

    def _keep_small(self, tensor: torch.Tensor) -> None:
        """A small tensor that is no parameter, written in place (a counter: AveragedModel's ``n_averaged += 1``
        after ``(avg * n + p) / (n - 1)`` read it), is copied before its first write: the replay that names a
        parameter's write reads it as the ops before that write did, not as the region left it."""
        if tensor.numel() <= SMALL_NUMEL and id(tensor) not in self.records.before and not self.records.made(tensor):
            self.records.before[id(tensor)] = tensor.detach().clone()

    def _note(self, tensor: torch.Tensor, name: str, parameter: torch.Tensor) -> None:
        """``tensor`` (``parameter`` or a view on it) is about to be written: copied as it is, and noted."""
        self._bytes += parameter.numel() * parameter.element_size()
        if self._bytes > FOLLOWED_BYTES:
            # Copied and measured every step, they would cost more than the step's own gradient check.
            self.off, self.written = True, {}
            return
        if not self.records.before:  # the region started afresh since (recorder.forget emptied the copies)
            self._copied = 0
        self._copied = copy_before(self.records, tensor, parameter, self._copied)
        self.written[id(tensor)] = (tensor, name, parameter)

    def take(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """What was written since the last :meth:`take`: (tensor written, name, parameter), in the order first
        written."""
        written, self.written = self.written, {}
        self._bytes = 0
        return list(written.values())


class Rebound:
    """The watched parameters a recorded data region rebound: ``param.data = v``, which runs no op.

    ``vector_to_parameters(v, model.parameters())`` sets each ``param.data`` to a slice of ``v``: no op writes
    the parameter, so :class:`DataWrites` sees no write, and the next forward would find it already non-finite,
    unnamed. A parameter whose ``data_ptr()`` moved since the last recorded data region ended is judged as one
    that region wrote (loop_writes.py): the region's ops read its old memory (an alias of each parameter is
    kept, sharing its memory until it is rebound), so :meth:`moved` puts that in the region's ``before`` and
    the replay of the ops that made the new memory (``v / 0``) starts from the values they read. Cost: one
    ``data_ptr()`` a parameter, mapped in C, as a recorded data region ends. The parameters are those of the
    first recorded data region, learned again after a rebinding (one added in between is not followed until
    then).
    """

    def __init__(self, index: Callable[[], Index], fresh_index: Callable[[], Index]) -> None:
        self._index = index
        self._fresh_index = fresh_index
        # names, parameters, data_ptr() each, an alias of each (its memory then)
        self.seen: tuple[list[str], list[torch.Tensor], list[int], list[torch.Tensor]] | None = None

    def moved(self, records: RegionRecords) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The parameters rebound since the last call: (name, parameter, the recorded output on its new memory,
        or the parameter where no recorded op made that memory)."""
        seen = self.seen
        if seen is None:
            self.seen = _memory(self._index())
            return []
        names, parameters, pointers, aliases = seen
        if list(map(data_ptr, parameters)) == pointers:
            return []
        found = []
        for name, parameter, pointer, alias in zip(names, parameters, pointers, aliases):
            if parameter.data_ptr() != pointer:
                records.before.setdefault(id(parameter), alias)  # the values the region's ops read from it
                made = records.made_on(parameter)
                found.append((name, parameter, made if made is not None else parameter))
        self.seen = _memory(self._fresh_index())  # (their storages moved)
        return found

    def forget(self) -> None:
        self.seen = None


def _memory(index: Index) -> tuple[list[str], list[torch.Tensor], list[int], list[torch.Tensor]]:
    named = [(name, parameter) for name, parameter in index[0].values() if has_own_memory(parameter)]
    parameters = [parameter for _name, parameter in named]
    return ([name for name, _parameter in named], parameters, list(map(data_ptr, parameters)),
            [parameter.detach() for parameter in parameters])
