"""Which of a watch's models every rank of a process group runs in step, and so where the ranks can agree.

A DDP model's backward all-reduces and its forward may sync buffers; an
FSDP model's forward gathers parameters from every rank. Every rank runs
such a model, and steps its optimizer, at the same point of its loop: those
optimizer steps are agreement points (agreement.py), and an event found
between them waits for the next. A model each rank has for itself, or an
optimizer that only one rank steps (a probe), runs no collective: a
collective issued there would wait forever for the ranks that never come.
Asked only under a process group (its callers, the step cycle and the
events, check ``Agreement.several`` first): one process walks no model for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from nan_magic.distributed.ranks import is_sharded

__all__ = ["Lockstep"]


class Lockstep:
    """The watched models' data-parallel facts, learned once (and again when a model joins the watch).

    ``roots`` gives the watched models; ``training`` whether an optimizer is in use (:meth:`OptimizerChecks.in_use`).
    """

    def __init__(self, roots: Callable[[], Iterable[nn.Module]], training: Callable[[], bool]) -> None:
        self._roots = roots
        self._training = training
        self.forget()

    def forget(self) -> None:
        """A model joined the watch: it may be data-parallel."""
        self._sharded: bool | None = None
        self._data_parallel: list[nn.parallel.DistributedDataParallel] | None = None
        self._parameters: frozenset[int] | None = None
        self._agreeing: dict[int, bool] = {}  # per optimizer: agrees_at

    def sharded(self) -> bool:
        """Whether a watched model is sharded by FSDP: its calls cannot be replayed on one rank alone."""
        if self._sharded is None:
            self._sharded = any(is_sharded(root) for root in self._roots())
        return self._sharded

    def data_parallel(self) -> list[nn.parallel.DistributedDataParallel]:
        if self._data_parallel is None:
            self._data_parallel = [
                module for root in self._roots() for module in root.modules()
                if isinstance(module, nn.parallel.DistributedDataParallel)
            ]
        return self._data_parallel

    def parameters(self) -> frozenset[int]:
        """The parameters of the watched DDP and FSDP models: the ones every rank steps together."""
        if self._parameters is None:
            owners = [*self.data_parallel(), *(root for root in self._roots() if is_sharded(root))]
            self._parameters = frozenset(id(parameter) for owner in owners for parameter in owner.parameters())
        return self._parameters

    def in_step(self) -> bool:
        """Whether the ranks step together now: an event found on one rank then waits for the others.

        The watch's events ask it (``EventContext.lockstep``), only under a
        process group (``Agreement.hold``), so one process walks no model for
        it. The watch has an FSDP model, or a DDP model that is trained
        (``training()``: an optimizer steps) or whose next forward syncs its
        buffers with the other ranks (DDP's own test: evaluated with
        gradients, with buffers). A DDP model evaluated otherwise runs no
        collective (DDP stops syncing buffers after a call under
        ``no_grad``), nor does a model of one rank's own: its rank can stop
        at once, and the others read the stop channel after their next step.
        """
        if not self.parameters():
            return False
        return self.sharded() or self._training() or any(ddp.will_sync_module_buffers() for ddp in self.data_parallel())

    def meets_at_exit(self) -> bool:
        """Whether every rank leaves the watch at the same point: it watches a DDP or FSDP model.

        Then the exit is a round through the store (agreement.py), even where
        no step is in step: ranks that evaluate without a collective still
        leave together, and an event one of them found stops the others there.
        A watch of one rank's own models has no such exit (the others would
        wait for a rank that never comes).
        """
        return bool(self.parameters())

    def agrees_at(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt``'s step is an agreement point: it steps a DDP or FSDP model's parameters."""
        known = self._agreeing.get(id(opt))
        if known is None:
            parallel = self.parameters()
            known = self._agreeing[id(opt)] = any(
                id(p) in parallel for group in opt.param_groups for p in group["params"]
            )
        return known
