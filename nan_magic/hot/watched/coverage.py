"""Which module calls a step checks: one object per ``mode``, chosen once (:func:`coverage_for`).

* :class:`Boundaries` (``mode="tiered"``, the default): a step's top-level
  calls of the watched models, their batch, outputs and output gradients;
  while a top-level call runs, the global module hooks step aside, so its
  submodules' calls cost nothing (module_hooks.py). Except on the
  per-module steps (the watch's second, then every ``full_every``-th, and
  every step of a sharded model, whose shards only a per-module check
  sees), which check every call as :class:`EveryCall` does. A compiled
  model is checked from outside: its graph never sees a hook.
  A backward with no optimizer step after it has its parameter gradients
  read when the next forward starts (no per-module check saw them).
* :class:`EveryCall` (``mode="full"``): every module call of every step. A
  compiled model runs its original module's code eagerly, under the hooks.

The step cycle and the forward checks call these where a step opens and a
top-level call starts; nothing else asks which mode it runs in. How an
event's op is then named (a step replay, a module call's replay, the op
tracer) is the localizer's per-mode object (localize/modes.py).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from nan_magic.hot.watched.module_hooks import SEES_ITS_HOOKS
from nan_magic.options import WatchConfig

__all__ = ["Boundaries", "Coverage", "EveryCall", "coverage_for"]


def coverage_for(config: WatchConfig) -> Coverage:
    """The coverage of ``config.mode``."""
    return Boundaries(config.full_every) if config.tiered else EveryCall()


class Coverage:
    """The two modes' common face."""

    #: Whether every module call is checked before any step opened (the watch just entered).
    every_call = False
    #: Whether a compiled model's original code runs eagerly under the hooks (forward.py).
    runs_compiled_eagerly = False

    def per_module_step(self, opened: int, sharded: Callable[[], bool]) -> bool:
        """Whether the step opening now (``opened`` steps opened before it) checks every module call.

        ``sharded()``: whether a model's parameters are sharded (FSDP), so
        that only a per-module check sees each layer's (asked only where it
        decides).
        """
        raise NotImplementedError

    def steps_aside(self, compiled: bool, per_module: bool, module: nn.Module) -> bool:
        """Whether the global hooks step aside while top-level ``module`` runs (its submodules go unchecked)."""
        raise NotImplementedError

    def reads_unstepped_gradients(self, training: bool) -> bool:
        """Whether a backward's parameter gradients are read when no optimizer step followed it."""
        raise NotImplementedError


class Boundaries(Coverage):
    """``mode="tiered"``: a step's boundaries, and every call on its per-module steps (module docstring)."""

    def __init__(self, full_every: int) -> None:
        self.full_every = full_every
        self._first = min(1, full_every - 1)  # the first per-module step: the second (the first, every step's)

    def per_module_step(self, opened: int, sharded: Callable[[], bool]) -> bool:
        return opened % self.full_every == self._first or sharded()

    def steps_aside(self, compiled: bool, per_module: bool, module: nn.Module) -> bool:
        # A compiled model always: its graph must never see a hook (no graph break, no recompile). Otherwise where a
        # hook on the module itself leaves its forward alone (not TransformerEncoderLayer's fast path).
        return compiled or (not per_module and not isinstance(module, SEES_ITS_HOOKS))

    def reads_unstepped_gradients(self, training: bool) -> bool:
        # Training: an optimizer's check reads them (a skipped step's settle too). Inference (a saliency map):
        # no per-module check saw the backward, so they are read when the next forward starts.
        return not training


class EveryCall(Coverage):
    """``mode="full"``: every module call of every step (module docstring)."""

    every_call = True
    runs_compiled_eagerly = True

    def per_module_step(self, opened: int, sharded: Callable[[], bool]) -> bool:
        return True

    def steps_aside(self, compiled: bool, per_module: bool, module: nn.Module) -> bool:
        return False

    def reads_unstepped_gradients(self, training: bool) -> bool:
        # As the tiered watch: each module's backward check saw the gradients flowing through it, but not a
        # parameter's gradient that its own formula made (``sqrt(|s|)`` at ``s = 0``), which no optimizer reads here.
        return not training
