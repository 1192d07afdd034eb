"""Tensors that stand in for a module's parameters: ``torch.func.functional_call``'s (MAML's fast weights).

``functional_call(model, fast, (x,))`` runs the model on tensors the loop's own code made
(``fast = {n: p - g * lr ...}``), swapped into the modules' ``_parameters`` for the call's duration. They are
not the model's parameters: a non-finite one is an input made by the loop's code, named by the op and line that
made it (phase forward, no module), never "a parameter already non-finite". An ``nn.Parameter`` can only be
registered as one; a tensor in ``_parameters`` that is no ``nn.Parameter`` was put there by such a swap.

Inside the call (the immediate check, every call of ``mode="full"``) the module holds them: :func:`stand_ins`
reads them there. The deferred check judges the call at the optimizer step, the parameters back in place:
:class:`SwappedTensors` is told as each swapped call returns (patches/functional_calls.py) and keeps, for the
watch's record of that call, the tensors by weak reference (the loop usually holds them until the step; one
freed since cannot be named). Nothing here runs on a step that calls no ``functional_call``.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch
from torch import nn

from nan_magic.hot.kept.call_records import Call
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.records import Phase

__all__ = ["MAX_SWAPPED_CALLS", "SwappedTensors", "stand_ins"]

#: The swapped calls remembered (the latest ones): a step of MAML over many tasks makes two calls a task.
MAX_SWAPPED_CALLS = 64


def stand_ins(module: nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in ``module``'s (and its submodules') parameter slots that are no ``nn.Parameter``, named."""
    return [(prefix + name, tensor) for name, tensor in module.named_parameters()
            if not isinstance(tensor, nn.Parameter)]


class SwappedTensors:
    """The stand-ins each swapped call of this step ran with, for the deferred check."""

    def __init__(self, log: StepLog) -> None:
        self._log = log
        self._calls: deque[tuple[Call, list[tuple[str, weakref.ref[torch.Tensor]]]]] = deque(
            maxlen=MAX_SWAPPED_CALLS)

    def returned(self, module: nn.Module) -> None:
        """A ``functional_call`` of ``module`` returns, its stand-ins still in place: keep them for its call."""
        found = stand_ins(module)
        if not found:
            return  # (the inner loop's call with the parameters themselves)
        for call in reversed(self._log.calls):  # the latest call of the module: the one just returned
            if call.module is module and call.phase == Phase.FORWARD:  # (not the data entering it)
                self._calls.append((call, [(name, weakref.ref(tensor)) for name, tensor in found]))
                return

    def of(self, call: Call) -> list[tuple[str, torch.Tensor]]:
        """The stand-ins ``call`` ran with (named in its module), those still alive."""
        for kept, tensors in reversed(self._calls):
            if kept is call:
                return [(name, tensor) for name, ref in tensors if (tensor := ref()) is not None]
        return []

    def forget(self) -> None:
        self._calls.clear()
