"""The gradient hook on a module output, holding its watch weakly.

A hook on a tensor sits in the tensor's hook dictionary, which its autograd node (C++) holds: the collector cannot
see that edge. A hook holding the watch strongly closed a cycle the collector could not break wherever the watch
held the tensor in turn: after an event the report's frames (``%debug``'s, their locals) hold the step's outputs, and
the model, its outputs and graphs, and the watch with its events stayed alive for the rest of the process after the
user let go of all of them. Held weakly, the hook of a watch that is gone does nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["judged_weakly"]


def judged_weakly(checks: weakref.ref[Any], record: Any, grad: Any) -> None:
    """``checks._on_output_grad(record, grad)`` while the gradient checks (their watch) live
    (``functools.partial(judged_weakly, weakref.ref(checks), record)`` is the hook)."""
    __tracebackhide__ = True  # (as GradientChecks._on_output_grad)
    owner = checks()
    if owner is not None:
        owner._on_output_grad(record, grad)
