"""``torch.func.functional_call``'s swap of a module's tensors, told to the watches while one runs.

``functional_call(model, tensors, args)`` (MAML's fast weights, ``torch.func``'s per-sample gradients) puts
the given tensors into the modules' ``_parameters`` for the duration of the call
(``torch.nn.utils.stateless._reparametrize_module``) and puts the parameters back after. A forward check
judged inside the call sees the loop's tensors where the parameters were; one judged later (the deferred
check, at the optimizer step) sees the parameters again. So the swap is wrapped: as the module call inside
it returns, with the loop's tensors still in place, each watch is told the module (localize/swapped.py keeps
what it needs to judge that call later). A loop that never calls ``functional_call`` pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.utils import stateless

from nan_magic.patches.registry import ProcessPatch

__all__ = ["noted_swaps"]

_noting: list[Callable[[nn.Module], None]] = []  # each watch's note, innermost last


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextmanager
    def reparametrized(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
        __tracebackhide__ = True
        with original(module, *args, **kwargs):
            try:
                yield
            finally:
                for note in list(_noting):  # (the loop's tensors are still in place here)
                    note(module)

    return reparametrized


_PATCH = ProcessPatch.of(stateless, "_reparametrize_module", _wrap)


@contextmanager
def noted_swaps(note: Callable[[nn.Module], None]) -> Iterator[None]:
    """Inside the block, ``note(module)`` is called as each ``functional_call`` of ``module`` returns (or raises),
    the tensors it swapped in still in place."""
    with _PATCH.held((_noting, note)):
        yield
