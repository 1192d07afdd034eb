"""``torch.func.functional_call``'s swap of a module's tensors, told to the watches while one runs.

``functional_call(model, tensors, args)`` (MAML's fast weights, ``torch.func``'s per-sample gradients) puts
the given tensors into the modules' ``_parameters`` for the duration of the call
(``torch.nn.utils.stateless._reparametrize_module``) and puts the parameters back after. A forward check
judged inside the call sees the loop's tensors where the parameters were; one judged later (the deferred
check, at the optimizer step) sees the parameters again. So the swap is wrapped: as the module call inside
it returns, with the loop's tensors still in place, each watch is told the module (localize/swapped.py keeps
what it needs to judge that call later), and the module's own tensors are kept while the call runs, for a step
replay judged inside it (:func:`own_tensors`). A loop that never calls ``functional_call`` pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from nan_magic.patches.registry import ProcessPatch

__all__ = ["SWAPPED_OUT", "noted_swaps", "own_tensors"]

_noting: list[Callable[[nn.Module], None]] = []  # each watch's note, innermost last


#: ``(module, {name: the module's own tensor})`` of each swap in progress, innermost last: a step replay judged inside
#: the call (MAML's support call, replayed while the query call runs on the adapted weights) puts them back.
SWAPPED_OUT: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextmanager
    def reparametrized(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
        __tracebackhide__ = True
        given = args[0] if args else kwargs.get("parameters_and_buffers", {})
        try:
            accessor = NamedMemberAccessor(module)
            own = {name: accessor.get_tensor(name) for name in given}
        except (AttributeError, RuntimeError):  # (a name the module lacks: torch's own strict check says so)
            own = {}
        with original(module, *args, **kwargs):
            SWAPPED_OUT.append((module, own))
            try:
                yield
            finally:
                SWAPPED_OUT.pop()
                for note in list(_noting):  # (the loop's tensors are still in place here)
                    note(module)

    return reparametrized


@contextmanager
def own_tensors(module: nn.Module) -> Iterator[None]:
    """Inside a ``functional_call`` of ``module`` (a replay judged there), its own parameters and buffers in their
    slots for the duration, the call's tensors put back after; elsewhere nothing."""
    own = next((tensors for swapped, tensors in reversed(SWAPPED_OUT) if swapped is module), None)
    if not own:
        yield
        return
    accessor = NamedMemberAccessor(module)
    given, _missing = accessor.swap_tensors_dict(own, allow_missing=True)
    try:
        yield
    finally:
        accessor.swap_tensors_dict(given, allow_missing=True)


_PATCH = ProcessPatch.of(stateless, "_reparametrize_module", _wrap)


@contextmanager
def noted_swaps(note: Callable[[nn.Module], None]) -> Iterator[None]:
    """Inside the block, ``note(module)`` is called as each ``functional_call`` of ``module`` returns (or raises),
    the tensors it swapped in still in place."""
    with _PATCH.held((_noting, note)):
        yield
