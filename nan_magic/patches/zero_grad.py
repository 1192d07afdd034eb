"""Running ``zero_grad()`` outside the loop-code recorder, while a watch records that code.

The code between an optimizer step and the next model call (data loading) is
recorded op by op by a dispatch mode (localize/outside/recorder.py), and
``opt.zero_grad()`` usually runs there. Its ops make no value a NaN could be
in: ``set_to_none=True`` (the default) runs only ``record_function``'s two
profiler markers, and ``set_to_none=False`` one ``zero_`` per gradient, past
the data region's budget of 64 ops on a model of more than 64 parameters,
which would turn that region's recording off. Every op a dispatch mode sees
costs torch's Python trampoline (benchmarks/interception.py), so
``Optimizer.zero_grad`` and ``Module.zero_grad`` are wrapped: the recorder
steps aside (is popped, where it is the innermost mode of this thread) for the
call and is pushed back after it. So is ``GradScaler.update``: its one op
(``aten._amp_update_scale_``, the scaler's own bookkeeping) recorded there kept
the loop's frame, and with it a ``backward(retain_graph=True)`` loss's graph,
alive past the step (a returned frame whose tensor locals are small is kept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nan_magic.patches.registry import ProcessPatch, Recorder, call_aside
from nan_magic.patches.scaler import scaler_classes

__all__ = ["unrecorded_zero_grad"]

_recorders: list[Recorder] = []  # each recorder active


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return call_aside(_recorders, original, self, *args, **kwargs)

    return zero_grad


def _wrap_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        return call_aside(_recorders, original, self, *args, **kwargs)

    return update


# (each scaler class's own ``update``: FSDP's ShardedGradScaler, a user's subclass, as patches/scaler.py wraps ``step``)
_PATCH = ProcessPatch(lambda: [(torch.optim.Optimizer, "zero_grad", _wrap), (nn.Module, "zero_grad", _wrap),
                               *[(cls, "update", _wrap_update) for cls in scaler_classes() if "update" in vars(cls)]])


@contextmanager
def unrecorded_zero_grad(step_aside: Callable[[], bool], step_back: Callable[[], None]) -> Iterator[None]:
    """Inside the block, every ``zero_grad()`` runs with the recorder stepped aside (``step_aside()``: whether it
    did) and brought back after (``step_back()``)."""
    with _PATCH.held((_recorders, (step_aside, step_back))):
        yield
