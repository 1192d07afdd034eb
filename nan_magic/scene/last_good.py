"""Roll back: the state of the last step that ended finite.

With ``keep_last_good`` (``"cpu"`` or ``"device"``) the watch calls
:meth:`LastGood.capture` after every optimizer step that ended finite, and
the watched models' state (parameters and buffers) and the optimizers' state
are copied into buffers kept here. At the first real event the copy is handed
to a registry in this module under a random integer token; the Report carries
only the token (a Report holds no tensors, so it stays picklable), and
``report.restore()`` looks it up and copies the state back.

Cost, and why it is opt-in: one more copy of the model and of the optimizer
state (on the CPU or on the model's device), refreshed after every finite
step. After the first capture the copies go into the same buffers
(``copy_``), so steady state allocates nothing; but ``"cpu"`` for a model on
a GPU is a full device-to-host transfer per step (and a host
synchronisation), ``"device"`` a device-to-device copy that doubles the
model's memory. GradScaler state is not kept: the scaler adapts by itself.

The models' state of the capture before the last one is kept too (a run
that diverged is remedied by redoing its last update, fixes/remedies/diverged.py):
the buffers are swapped, not copied, so a step still makes one copy, and
the models' state takes twice the memory (the optimizers' state once).

In the deferred mode a step's result is judged at the next step's check,
after that step's forward has run (a batch norm's running statistics
already moved) and after the loop's code between the steps: the state is
copied right after the step all the same (:meth:`LastGood.stage`, the RNG
with it), and kept once the check finds the step finite
(:meth:`LastGood.promote`), before it judges the new step's calls. So an
event in the step after it rolls back to the step right before, as the
immediate mode does; the copy waiting for its check costs one more copy of
the models' and optimizers' state.

The registry holds the kept state strongly (the models and optimizers only
weakly) for the :data:`KEPT_REPORTS` most recent reports of this process;
older ones are released, and ``restore()`` on them says so.
"""

from __future__ import annotations

import copy
import secrets
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nan_magic.hot.kept.rng import RngState, capture_rng_state
from nan_magic.records import Report

__all__ = ["KEPT_REPORTS", "LastGood", "keep", "restore"]

#: Reports of this process whose kept state ``restore()`` can still put back.
KEPT_REPORTS = 2


@dataclass
class _Kept:
    """Copies of the watched state after one finite step.

    ``models`` and ``optimizers`` map ``id()`` of the live object to a weak
    reference to it and the copy of its state (a ``state_dict`` whose tensors
    are the kept buffers).
    """

    step: int | None = None
    models: dict[int, tuple[weakref.ref[nn.Module], dict[str, Any]]] = field(default_factory=dict)
    optimizers: dict[int, tuple[weakref.ref[torch.optim.Optimizer], dict[str, Any]]] = field(default_factory=dict)
    rng: RngState | None = None

    def restore(self) -> None:
        if self.step is None:
            raise RuntimeError(
                "no optimizer step ended finite before this event, so there is no state to roll back to"
            )
        live = [(ref(), state) for ref, state in self.models.values()]
        live_optimizers = [(ref(), state) for ref, state in self.optimizers.values()]
        if any(owner is None for owner, _state in live + live_optimizers):
            raise RuntimeError("the model or optimizer whose state was kept no longer exists")
        for module, state in live:
            # load_state_dict copies into the existing parameters: the optimizer
            # keeps pointing at the same Parameter objects.
            module.load_state_dict(state)  # type: ignore[union-attr]
        for optimizer, state in live_optimizers:
            # The optimizer adopts tensors it is given on its own device and
            # dtype without copying them: hand it copies, so that the kept
            # state survives further training and a second restore().
            optimizer.load_state_dict(_copy_state(None, state, None))  # type: ignore[union-attr]


class LastGood:
    """The watch's copy of its state after the last step that ended finite, kept ``where``: ``"cpu"``, ``"device"``
    (next to each tensor), or None (nothing)."""

    def __init__(self, where: str | None) -> None:
        self.where = where
        self._kept = _Kept()
        #: The models' kept state one capture earlier (id -> weak reference, state), and its step.
        self._before: dict[int, tuple[weakref.ref[nn.Module], dict[str, Any]]] = {}
        self._before_step: int | None = None
        #: The state copied right after a step whose check is still to come (deferred), and buffers to reuse.
        self._staged: _Kept | None = None
        self._spare = _Kept()

    @property
    def step(self) -> int | None:
        """The step after which the state was kept, or None before the first capture."""
        return self._kept.step

    @property
    def rng(self) -> RngState | None:
        """The RNG state right after that step (None where it was captured later; see :meth:`capture`)."""
        return self._kept.rng

    @property
    def before_step(self) -> int | None:
        """The step after which :meth:`before` was kept: the capture before the last one (None: none)."""
        return self._before_step

    def before(self, module: nn.Module) -> dict[str, Any] | None:
        """A watched model's kept ``state_dict`` one capture before :meth:`state_of`'s, or None."""
        ref, state = self._before.get(id(module), (None, None))
        return state if ref is not None and ref() is module else None

    def state_of(self, owner: nn.Module | torch.optim.Optimizer) -> dict[str, Any] | None:
        """The kept ``state_dict`` of a watched model or optimizer, or None."""
        table: dict[int, Any] = self._kept.models if isinstance(owner, nn.Module) else self._kept.optimizers
        ref, state = table.get(id(owner), (None, None))
        return state if ref is not None and ref() is owner else None

    def capture(
        self, roots: Iterable[tuple[str | None, nn.Module]], optimizers: Iterable[torch.optim.Optimizer], step: int,
        right_after: bool,
    ) -> None:
        """Copy the watched models' and optimizers' state after a step that ended finite.

        Called by the watch right after each optimizer step whose parameters
        and state it found finite at once (a deferred step's result is
        staged and promoted instead); ``right_after`` False: taken later, the
        RNG has moved on, so none is kept. ``step`` is the watch's step
        counter.
        """
        if self.where is None:
            return
        # The models' state two captures ago is written over (the last capture's becomes the one before), the
        # optimizers' kept state in place: one copy a step.
        copies = _copied(_Kept(models=self._before, optimizers=self._kept.optimizers), roots, optimizers, self.where)
        # The optimizer hooks count a step as its post hook begins: right
        # after it, as at the next step's deferred check, the counter has
        # moved on past the step that just completed.
        copies.step, copies.rng = step - 1, capture_rng_state() if right_after else None
        self._keep(copies)
        self._spare = _Kept()  # (its buffers may be the ones just kept: a deferred step read at once, stage after)

    def stage(
        self, roots: Iterable[tuple[str | None, nn.Module]], optimizers: Iterable[torch.optim.Optimizer], step: int
    ) -> None:
        """Copy the state right after a step whose result the next step's check judges (deferred): :meth:`promote`
        keeps it once the check finds the step finite. ``step`` is the watch's counter, as for :meth:`capture`."""
        if self.where is None:
            return
        spare, self._spare = self._spare, _Kept()
        staged = _copied(spare, roots, optimizers, self.where)
        staged.step, staged.rng = step - 1, capture_rng_state()
        if self._staged is not None:  # (never judged: a watch that went on past an event) its buffers reused
            self._spare = self._staged
        self._staged = staged

    def promote(self) -> None:
        """The staged step was judged finite: keep its copy as the last good state (the kept models' as the one
        before it); the buffers let go are reused by the next :meth:`stage`."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        self._spare = _Kept(models=self._before, optimizers=self._kept.optimizers)
        self._keep(staged)

    def _keep(self, copies: _Kept) -> None:
        """``copies`` become the kept state, the kept models' the state before it."""
        self._before, self._before_step = dict(self._kept.models), self._kept.step
        self._kept = copies

    def hand_over(self) -> _Kept:
        """Give up the kept state (to the registry); later captures start afresh.

        In ``warn``/``log`` mode training goes on after the event: its finite
        steps must not overwrite what the event's ``restore()`` puts back.
        """
        kept, self._kept = self._kept, _Kept()
        self._before, self._before_step, self._staged = {}, None, None
        return kept


# token -> kept state, oldest first (see KEPT_REPORTS).
_REGISTRY: OrderedDict[int, _Kept] = OrderedDict()


def keep(last_good: LastGood) -> int:
    """Move ``last_good``'s state to the registry; return the token for the Report.

    Tokens are random, not counted: a report unpickled in another process
    must not find that process's state under the same number.
    """
    token = secrets.randbits(62)
    _REGISTRY[token] = last_good.hand_over()
    while len(_REGISTRY) > KEPT_REPORTS:
        _REGISTRY.popitem(last=False)
    return token


def restore(report: Report) -> None:
    """Put back the state kept for ``report``: the models' and optimizers' after the last finite step.

    Raises
    ------
    RuntimeError
        When the report has no kept state (no ``keep_last_good``), when it was
        made in another process or released, when no step ended finite before
        the event, or when the model or optimizer no longer exists.
    """
    if report.restore_token is None and report.scene is not None:
        # A scene's report read back (after a restart, say): the state is in its file, not in this process. It
        # said "watch with keep_last_good" to a user who had, and whose scene held the last finite step's state.
        raise RuntimeError(
            f"this report has no state kept in this process; its scene file holds the saved state: "
            f"nan_magic.load_scene({report.scene!r}).restore_into(model, optimizer, state='last_good') loads the "
            "last finite step's (saved where the watch had keep_last_good), state='event' the state at the event"
        )
    if report.restore_token is None:
        raise RuntimeError("this report has no kept state: watch with keep_last_good='cpu' or 'device'")
    kept = _REGISTRY.get(report.restore_token)
    if kept is None:
        raise RuntimeError(
            "the state kept for this report is not in this process: it lives only in the process that ran "
            f"the watch, and only for the {KEPT_REPORTS} most recent reports"
        )
    kept.restore()


def _copied(reuse: _Kept, roots: Iterable[tuple[str | None, nn.Module]],
            optimizers: Iterable[torch.optim.Optimizer], where: str | None) -> _Kept:
    """The models' and optimizers' state copied now, into ``reuse``'s buffers where they fit."""
    copies = _Kept()
    with torch.no_grad():
        for _label, module in roots:
            _, old = reuse.models.get(id(module), (None, None))
            copies.models[id(module)] = (weakref.ref(module), _copy_state(old, module.state_dict(), where))
        for optimizer in optimizers:
            _, old = reuse.optimizers.get(id(optimizer), (None, None))
            copies.optimizers[id(optimizer)] = (weakref.ref(optimizer), _copy_state(old, optimizer.state_dict(), where))
    return copies


def _copy_state(old: Any, new: Any, where: str | None) -> Any:
    """Copy a (nested) state dict, reusing the tensors of ``old`` where they fit.

    ``where``: ``"cpu"``, ``"device"`` (next to each tensor) or None (same as
    ``"device"``: a plain deep copy of the tensors).
    """
    if isinstance(new, torch.Tensor):
        return _copy_tensor(old if isinstance(old, torch.Tensor) else None, new, where)
    if isinstance(new, dict):
        old_dict = old if isinstance(old, dict) else {}
        return type(new)((key, _copy_state(old_dict.get(key), value, where)) for key, value in new.items())
    if isinstance(new, (list, tuple)) and type(new) in (list, tuple):
        old_items = old if isinstance(old, (list, tuple)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_state(before, value, where) for before, value in zip(old_items, new))
    return copy.deepcopy(new)


def _copy_tensor(old: torch.Tensor | None, new: torch.Tensor, where: str | None) -> torch.Tensor:
    new = new.detach()
    device = torch.device("cpu") if where == "cpu" else new.device
    if new.layout != torch.strided:
        return new.to(device, copy=True)
    if old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == device:
        old.copy_(new)
        return old
    # Pinned host memory makes the per-step device-to-host copy a fast DMA.
    pinned = device.type == "cpu" and new.device.type == "cuda"
    buffer = torch.empty_like(new, device=device, pin_memory=pinned)
    buffer.copy_(new)
    return buffer
