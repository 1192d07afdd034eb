"""The line that loaded a non-finite value into a model or an optimizer: ``load_state_dict`` seen as it returns.

A run resumed from a checkpoint saved after its values went bad (``model.load_state_dict(ckpt["model"])``,
``opt.load_state_dict(ckpt["opt"])``) meets the value at the next forward or step, where no op of the run made it:
the report could say only that the parameter, or a state tensor of the optimizer, held it already. Loading runs no
op the loop-code recorder could name (an optimizer's ``load_state_dict`` keeps the very tensors it is given), so
``nn.Module.load_state_dict`` and ``Optimizer.load_state_dict`` are wrapped while a watch is active: as one returns,
what it filled is noted with the user's line that called it: each floating tensor's largest magnitude, one fused
``_foreach_norm`` (inf) left on the device (no host read: an EMA copy loaded every step adds no sync). A
report of a parameter, buffer or state tensor that no op made non-finite reads that magnitude, at the event only,
and names the line where it was non-finite as loaded (lifecycle/events.py). Nothing runs on a step without a load.
What the watch's own restores and fix trials load is not noted.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from nan_magic.errors.frames import user_line
from nan_magic.patches.registry import ProcessPatch

__all__ = ["Loaded", "forget_loads", "loaded_nonfinite", "noted_loads"]


@dataclass(frozen=True)
class Loaded:
    """One ``load_state_dict`` call: the user's line (code, line, globals), what loaded, and what it filled."""

    where: tuple[CodeType, int, dict[str, Any]]
    #: ``"model"`` (``Module.load_state_dict``) or ``"optimizer"`` (``Optimizer.load_state_dict``).
    loader: str
    owner: weakref.ref[Any]
    #: The floating tensors it filled, by id, to their place in :func:`_filled`'s order, and each one's largest
    #: magnitude as loaded (0-d tensors on their devices, NaN where one held a NaN; read only at an event).
    places: dict[int, int]
    largest: tuple[torch.Tensor, ...]


_holders: list[object] = []
#: The last load of each model and optimizer while a watch was active, by the owner's id (at most :data:`_KEPT`).
_loaded: dict[int, Loaded] = {}
_KEPT = 64


def _filled(owner: Any, loader: str) -> list[torch.Tensor]:
    """The floating tensors a load of ``owner`` fills: a module's parameters and buffers, an optimizer's state."""
    if loader == "model":  # (read from each module's own dicts: parameters() and buffers() cost twice as much)
        tensors = [tensor for module in owner.modules() for held in (module._parameters, module._buffers)
                   for tensor in held.values() if tensor is not None]
    else:
        tensors = [value for state in owner.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor)]
    return [tensor for tensor in tensors if tensor.is_floating_point()]


def _largest(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each tensor's largest magnitude (NaN where it holds one), left on its device: one fused call where all are on
    one device (a GPU's multi-tensor kernel), else one a tensor."""
    devices = {tensor.device for tensor in tensors}
    # (Read apart from every dispatch mode on the stack: the watch's recorders and op tracer, a user's own, record
    # the loop's ops, and this one is ours.)
    with torch.no_grad(), _disable_current_modes():
        if len(devices) == 1:
            return tuple(torch._foreach_norm([tensor.detach() for tensor in tensors], math.inf))
        return tuple(torch.linalg.vector_norm(tensor.detach(), math.inf) for tensor in tensors)


def _note(owner: Any, loader: str) -> None:
    try:
        caller = sys._getframe(3)  # (this, the replacement, the registry's dispatch: then whoever called the load)
    except ValueError:  # (called with no Python frame above it)
        return
    if caller.f_globals.get("__name__", "").startswith("nan_magic."):
        return  # the watch's own load (a restore, a fix trial's copy of the optimizer)
    where = user_line(caller)
    if where is None:
        return
    tensors = _filled(owner, loader)
    try:
        largest = _largest(tensors) if tensors else ()
    except (RuntimeError, NotImplementedError):  # (a sparse or meta tensor among them: not followed)
        return
    _loaded.pop(id(owner), None)
    if len(_loaded) >= _KEPT:
        del _loaded[next(iter(_loaded))]
    places = dict(zip(map(id, tensors), range(len(tensors))))
    _loaded[id(owner)] = Loaded(where, loader, weakref.ref(owner), places, largest)


def _wrap(loader: str) -> Any:
    def wrap(original: Any) -> Any:
        def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            result = original(self, *args, **kwargs)
            if _holders:
                _note(self, loader)
            return result

        return load_state_dict

    return wrap


_PATCH = ProcessPatch(lambda: [(nn.Module, "load_state_dict", _wrap("model")),
                               (torch.optim.Optimizer, "load_state_dict", _wrap("optimizer"))])


@contextmanager
def noted_loads() -> Iterator[None]:
    """Inside the block, what ``load_state_dict`` loads is noted with its line (kept until :func:`forget_loads`)."""
    with _PATCH.held((_holders, object())):
        yield


def forget_loads() -> None:
    """A watch ended for good (not paused: a ``%nanwatch on`` run's load in one cell is named in the next): where
    no other watch is active, the notes go."""
    if not _holders:
        _loaded.clear()


def loaded_nonfinite(tensor: torch.Tensor | None) -> Loaded | None:
    """The load that filled ``tensor`` (or the tensor whose memory it shares) non-finite, or None. At an event only:
    each load noted is looked through for a tensor on the same memory, which it loaded holding a NaN or an inf."""
    if tensor is None or not _loaded or tensor.layout is not torch.strided or not tensor.numel():
        return None
    address = tensor.untyped_storage().data_ptr()
    for loaded in reversed(_loaded.values()):  # (the latest load first)
        owner = loaded.owner()
        if owner is None:
            continue
        for filled in _filled(owner, loaded.loader):
            place = loaded.places.get(id(filled))
            if place is not None and filled.layout is torch.strided and (
                    filled.untyped_storage().data_ptr() == address):
                largest = loaded.largest[place]
                return loaded if largest.device.type != "meta" and not math.isfinite(float(largest)) else None
    return None
