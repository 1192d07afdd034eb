"""Which tensors the model made: the taint the live op tracer carries through the ops it sees (ops mode).

PRODUCT.md's phase ``data`` is a value "built in the loop from outside data": no parameter, no model output in it.
The recorded modes tell it from the data region's records (outside/recorded_ops.made_from_outside_data), with this
taint run through them at an event, seeded with what the loss code before them detached; the live op tracer keeps no
records, so it carries the taint as the ops run. A tensor is *model-derived* where it

- requires a gradient (a model output, anything computed from a parameter with grad on, a penalty's input), or
- is an ``nn.Parameter`` (an unwatched, frozen teacher's too: its weights are no outside data), or
- was written or returned by an op that read a model-derived tensor: ``detach()`` and ``torch.no_grad()`` do not
  clean it (a detached output's EMA, a teacher's output under no_grad, a center loss's centers moved by the
  features, a mask from the prediction's argmax all stay model-derived).

Only the last kind is held here, by weak reference. The tracer runs below autograd, so a forward op's output does
not require a gradient yet when it is looked at: every op output made from a model-derived tensor gets an entry,
and so does every tensor the optimizer's step and the watch's own reads make from the parameters (160 to 230 a step
for a 37-parameter MLP under Adam), swept for freed tensors each time the table doubles. Ops the autograd engine
runs (a backward's) are not followed: a gradient the loop reads in the data region would count as outside data. An
op that overwrites a tensor (``copy_``, ``fill_``, ``zero_``) does not read it: a buffer that held a model output
and is filled from the batch again is outside data again. A write through a view marks its base too (``buf[:, :4]
= h``), and a view reads as its base. The table is emptied as the tracer is left, so that no weak reference stays
on the user's tensors (``torch.utils.swap_tensors`` refuses a tensor that has one).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nan_magic.localize.ops.plans import Plan, tensors

__all__ = ["ModelDerived"]

#: Entries the table holds before its first sweep for freed tensors (as kinds.KnownKinds).
_FIRST_SWEEP = 256

_Parameter = torch.nn.Parameter


class ModelDerived:
    """The tensors made from a parameter or a model output that do not require a gradient themselves."""

    def __init__(self) -> None:
        # id(tensor) -> weak reference; the reference makes a stale id harmless.
        self._marked: dict[int, weakref.ref[torch.Tensor]] = {}
        self._sweep_at = _FIRST_SWEEP

    def __len__(self) -> int:
        return len(self._marked)

    def clear(self) -> None:
        """Forget every tensor (the tracer is left: no weak reference stays on the user's tensors)."""
        self._marked.clear()

    def mark(self, made: list[torch.Tensor]) -> None:
        """Take ``made`` as model-derived (what the loss code detached, recorded_ops.made_from_outside_data)."""
        for tensor in made:
            self._mark(tensor)

    def forget(self, tensor: torch.Tensor) -> None:
        """Drop one tensor's weak reference (the user swaps it: patches/swaps.py)."""
        self._marked.pop(id(tensor), None)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (a tensor, or a list of them) is model-derived."""
        if isinstance(value, torch.Tensor):
            if value.requires_grad or isinstance(value, _Parameter):
                return True
            entry = self._marked.get(id(value))
            if entry is not None and entry() is value:
                return True
            base = value._base  # (a view taken before its base was written with a model output)
            return base is not None and (entry := self._marked.get(id(base))) is not None and entry() is base
        if isinstance(value, (list, tuple)):
            return any(self.holds(item) for item in value)
        return False

    def any_of(self, values: Iterable[Any]) -> bool:
        """Whether any of ``values`` (an op's inputs) is model-derived."""
        return any(self.holds(value) for value in values)

    def after_op(self, plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """An op ran outside the autograd engine: what it returned or wrote is model-derived if what it read was.

        Runs for every op the tracer follows: a tensor argument is looked at inline, a list through :meth:`holds`,
        so that an op on plain tensors costs a lookup per tensor. An op that overwrites an argument (``copy_``,
        ``fill_``, ``zero_``) does not read it: a buffer that held a model output and is filled from the batch is
        outside data again."""
        marked = self._marked
        if plan.overwrites:
            values: Iterable[Any] = [tensor for _label, tensor in tensors(plan, args, kwargs, plan.reads)]
        else:
            values = (*args, *kwargs.values()) if kwargs else args
        for value in values:
            if value.__class__ is torch.Tensor:  # (the common case, without a call: a subclass goes to holds)
                if value.requires_grad:
                    break
                entry = marked.get(id(value))
                if entry is not None and entry() is value:
                    break
                base = value._base  # (a view taken before its base was written with a model output)
                if base is not None and (entry := marked.get(id(base))) is not None and entry() is base:
                    break
            elif isinstance(value, (torch.Tensor, list, tuple)) and self.holds(value):
                break
        else:
            if plan.overwrites:
                for _label, written in tensors(plan, args, kwargs, plan.writes):
                    if written._base is None:
                        marked.pop(id(written), None)
            return
        self._mark(out)
        if plan.writes:
            for _label, written in tensors(plan, args, kwargs, plan.writes):
                self._mark(written)
                if written._base is not None:  # (``buf[:, :4] = h``: the slice is written, and its base)
                    self._mark(written._base)

    def _mark(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.requires_grad or isinstance(value, _Parameter):
                return
            marked = self._marked
            entry = marked.get(id(value))
            if entry is not None and entry() is value:
                return
            marked[id(value)] = weakref.ref(value)
            if len(marked) > self._sweep_at:
                for key in [key for key, ref in marked.items() if ref() is None]:
                    del marked[key]
                self._sweep_at = max(_FIRST_SWEEP, 2 * len(marked))
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._mark(item)
