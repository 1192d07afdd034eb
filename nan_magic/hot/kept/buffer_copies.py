"""Copies of a model's buffers before its call, for a replay, without an allocation per step.

A step replay runs a top-level call again with the buffers the call may
change (BatchNorm's running statistics) as they were before it
(localize/replay/tiered/step.py). Cloning them at every call allocates a tensor per buffer
every step; instead, the copies of a call that can need no replay any more
(its optimizer stepped) are kept, and the next call of the same model copies
into them with one ``_foreach_copy_``.

A BatchNorm's ``num_batches_tracked`` is not copied after the first call (:func:`step_counters`): torch's
BatchNorm moves it by ``add_(1)`` alone, one version a call, so its value before the call is its value at the
replay less the versions it moved since (:func:`counted_back`), with no copy on a healthy step. (Its running
statistics are not copied either: ``native_batch_norm`` writes them without moving their version counters.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from nan_magic.hot.reads import GradOff, version_of

__all__ = ["BufferCopies", "ScriptedBuffers", "counted_back", "step_counters", "with_versions"]

#: ``(the buffers copied, in order; their copies by id(buffer))``
_Spare = tuple[list[torch.Tensor], dict[int, torch.Tensor]]


class BufferCopies:
    """Buffer copies per model, recycled from released calls."""

    def __init__(self) -> None:
        self._spare: dict[int, _Spare] = {}

    def take(self, module: nn.Module, live: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Copies of the ``live`` buffers (by id) as they are now.

        Into a released call's copies where it copied these very buffers (the
        spare holds them, so their ids cannot have been reused), else fresh clones.
        """
        spare = self._spare.pop(id(module), None)
        if spare is not None:
            sources, copies = spare
            # The same buffers: the copies are keyed by their ids, and the spare holds them, so an id is not reused.
            # (Paired in the spare's own order below, whatever order ``live`` lists them in.)
            if copies.keys() == live.keys():
                with GradOff():
                    torch._foreach_copy_(list(copies.values()), sources)
                return copies
        return {key: buffer.detach().clone() for key, buffer in live.items()}

    def recycle(self, released: Iterable[tuple[nn.Module, list[torch.Tensor], dict[int, torch.Tensor]]]) -> None:
        """``(model, buffers copied, copies)`` of calls that need no replay any more: their copies are free."""
        for module, sources, copies in released:
            if copies:
                self._spare[id(module)] = (sources, copies)

    def clear(self) -> None:
        """The watch ends: hold no buffer."""
        self._spare.clear()


#: The forwards that write ``num_batches_tracked`` only by ``add_(1)`` (torch 2.x's ``_BatchNorm`` and
#: ``SyncBatchNorm``; a subclass with a ``forward`` of its own may write it otherwise, and is copied).
_COUNTING_FORWARDS = frozenset({nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward})


def step_counters(module: nn.Module) -> frozenset[int]:
    """Ids of the ``num_batches_tracked`` buffers in ``module`` that torch's own BatchNorm forward counts.

    None in a compiled model (its graph writes the counter its own way, which need not move the version once a call)
    or under DistributedDataParallel (its forward may broadcast the buffers in place first: a version more a call).
    """
    modules = list(module.modules())
    if any(hasattr(owner, "_orig_mod") or isinstance(owner, nn.parallel.DistributedDataParallel) for owner in modules):
        return frozenset()
    return frozenset(
        id(counter)
        for owner in modules
        if isinstance(owner, nn.modules.batchnorm._BatchNorm)
        and type(owner).forward in _COUNTING_FORWARDS
        and isinstance(counter := owner._buffers.get("num_batches_tracked"), torch.Tensor)
    )


def counted_back(counter: torch.Tensor, version: int) -> torch.Tensor:
    """A step counter's value when its version was ``version``: each version since was one ``add_(1)``."""
    with GradOff():
        moved = version_of(counter) - version
        return counter.detach().clone() if moved <= 0 else counter.detach() - moved


def with_versions(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each tensor with its version counter (``version_of``, read directly where none is an inference tensor)."""
    try:
        return [(tensor, tensor._version) for tensor in tensors]
    except RuntimeError:  # an inference tensor has no version counter
        return [(tensor, version_of(tensor)) for tensor in tensors]


class ScriptedBuffers:
    """A ``torch.jit.script``ed submodule's buffers, read like a dict (its ``OrderedDictWrapper`` has no ``get``)."""

    __slots__ = ("_buffers",)

    def __init__(self, buffers: Any) -> None:
        self._buffers = buffers

    def get(self, name: str) -> torch.Tensor | None:
        return self._buffers[name] if name in self._buffers else None  # noqa: SIM401 (it has no get)
