"""``torch.utils.swap_tensors`` inside a watch: nothing of the watch's holds on to the two tensors meanwhile.

Under ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``model.to()`` (``.half()``, ``.cuda()``)
and ``load_state_dict`` swap each parameter's (and gradient's) contents with ``torch.utils.swap_tensors``, which
refuses a tensor that has a weak reference, or whose TensorImpl has another holder than its AccumulateGrad node.
Two of the watch's made the user's ``model.to(torch.float64)`` raise "_apply(): Couldn't swap Conv1d.weight":

* the op tracer (ops mode) remembers the kinds of the tensors it read by weak reference (localize/ops/kinds.py):
  every parameter an op read, and the converted gradient ``_apply`` made. Each registered ``forget`` drops what
  it holds of both tensors first (a weak reference nothing else holds dies with its entry); what was known of a
  swapped tensor would be stale anyway.
* the loop-code recorder (the other modes) records the ``view_as`` by which ``swap_tensors`` finds a parameter's
  AccumulateGrad node, and the view it keeps holds the parameter as its base. It steps aside for the call, as
  for ``zero_grad()`` (patches/zero_grad.py): the swap is no code a NaN could be born in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nan_magic.patches.registry import ProcessPatch, Recorder, call_aside

__all__ = ["forgotten_before_swaps", "unrecorded_swaps"]

_forgetters: list[Callable[[torch.Tensor], None]] = []
_recorders: list[Recorder] = []


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> Any:
        __tracebackhide__ = True
        for forget in list(_forgetters):
            forget(t1)
            forget(t2)
        return call_aside(_recorders, original, t1, t2)

    return swap_tensors


_PATCH = ProcessPatch.of(torch.utils, "swap_tensors", _wrap)


@contextmanager
def forgotten_before_swaps(forget: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, ``forget(tensor)`` runs for both tensors of every ``torch.utils.swap_tensors``, before it."""
    with _PATCH.held((_forgetters, forget)):
        yield


@contextmanager
def unrecorded_swaps(step_aside: Callable[[], bool], step_back: Callable[[], None]) -> Iterator[None]:
    """Inside the block, every ``torch.utils.swap_tensors`` runs with the recorder stepped aside (``step_aside()``:
    whether it did) and brought back after (``step_back()``)."""
    with _PATCH.held((_recorders, (step_aside, step_back))):
        yield
