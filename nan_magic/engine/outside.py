"""Op-level tracing of the code between the watched models' calls: the loss, and data code in the loop.

The tiered watch replays a failing model call to name its op (step_replay.py),
but code outside every watched module cannot be replayed: the loss, a
normalisation of the batch inside the loop, an advantage computed from
rewards. That code is short (a loss is a handful of ops), so it is traced
while it runs: an :class:`~nan_magic.engine.ops.OpTracer` is pushed when a
top-level model call returns and popped when the next one starts, when
``backward()`` starts and when an optimizer steps (the model's own forward
and backward, and the optimizer, are never traced: their ops are many).
When the loss holds a non-finite value, its origin names the op and the line.

The code between an optimizer step and the next model call (data loading,
preprocessing in the loop) is traced too, but fetching one batch from a
``DataLoader`` runs a hundred ops or more: it is traced for at most
:data:`DATA_BUDGET` ops a step; a step that runs more turns its tracing off
for the rest of the watch, and reports say so. The loss region has a larger
budget, :data:`LOSS_BUDGET`, for loops that compute metrics there.

A Python dispatch mode costs a few microseconds per op, and the tracer reads
each op's output (a sum, read on the host), so this is cheap for a loss and
bounded elsewhere. That read is a host synchronisation on CUDA: the deferred
mode (CUDA, process groups, ``defer=True``) does not trace the code outside
the models, keeping its one synchronisation per step. Dispatch modes form a stack that ``with``
blocks push and pop, so the tracer is pushed only onto an empty stack (not
inside a mode the user entered around the model call, which their ``with``
must pop), and popped only when it is the innermost mode (a mode the user
entered since stays in place; ours then waits, inert, until it is on top).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from nan_magic.engine.ops import OpTracer

__all__ = ["DATA_BUDGET", "LOSS_BUDGET", "OutsideTracer"]

#: Ops a step traced in the code between an optimizer step and the next model call.
DATA_BUDGET = 64
#: Ops a step traced between a model call's return and ``backward()`` (the loss, and metrics).
LOSS_BUDGET = 512
# The budget of a tracer that passes every op through (spent, or stopped under a mode entered since).
_INERT = -1


class OutsideTracer(OpTracer):
    """An op tracer for the code outside the watched models, switched on and off at their boundaries."""

    def __init__(self, kinds: frozenset[str]) -> None:
        super().__init__(kinds=kinds, at_boundary=True)
        self.pushed = False
        self._budget = 0
        self._region = "loss"
        #: Regions whose tracing a step turned off by running more ops than their budget.
        self.untraced: set[str] = set()

    def start(self, region: str) -> None:
        """Trace ``region`` (``"loss"`` after a model call, ``"data"`` after an optimizer step)."""
        if region in self.untraced:
            return
        self._region = region
        self._budget = DATA_BUDGET if region == "data" else LOSS_BUDGET
        if not self.pushed and torch._C._len_torch_dispatch_stack() == 0:
            # Only onto an empty stack: a mode the user entered around the model call must be the one
            # their ``with`` pops when it ends, not ours.
            self.__enter__()
            self.pushed = True

    def stop(self) -> None:
        """Stop tracing (a model call, ``backward()`` or an optimizer step begins, or the watch ends)."""
        if not self.pushed:
            return
        if _get_current_dispatch_mode() is self:
            self.__exit__(None, None, None)
            self.pushed = False
        else:
            self._budget = _INERT

    def note(self) -> str | None:
        """What a report says where the code outside the models went untraced."""
        if not self.untraced:
            return None
        regions = " and ".join(sorted(self.untraced))
        return (f"the code outside the models ({regions}) ran more ops a step than the watch traces "
                f"({LOSS_BUDGET} for the loss, {DATA_BUDGET} for data code): its op and line are not named")

    def _note_node(self, *_: Any) -> None:
        """Not traced here: the forward line of the loss code's autograd nodes (its backward is not traced)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._budget <= 0:
            if self._budget == 0:  # over budget: the region is not traced again
                self._budget = _INERT
                self.untraced.add(self._region)
            return func(*args, **(kwargs or {}))
        self._budget -= 1
        return super().__torch_dispatch__(func, types, args, kwargs)
