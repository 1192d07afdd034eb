"""How a watch's step cycle ends as the watch is left: the last step's checks, a pause, an exception's exit.

Apart from step_cycle.py, which opens and closes the steps while the watched
code runs (the hot path's part), because this runs once per leaving of the
watch, on the cold path: the last step's checks and the ranks' exit round
(agreement.py), a ``%nanwatch on`` cell's pause, and what an exception that
left the watch is explained by (a failed op's non-finite input, torch's anomaly
mode stopping a backward at a NaN). :class:`CycleExit` is the base
:class:`~nan_magic.hot.step_cycle.StepCycle` gets these methods from; the parts
they use are the cycle's, set by its ``__init__`` (declared here for the type checker).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch

from nan_magic.distributed.agreement import Agreement
from nan_magic.distributed.lockstep import Lockstep
from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.hot.checks.backward.gradient_checks import GradientChecks
from nan_magic.hot.checks.hosts import OriginFinder, WhenJudged
from nan_magic.hot.checks.optimizer.step_checks import OptimizerChecks
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.records import Note, Phase, TensorRef, TensorRole

__all__ = ["CycleExit", "Outcome"]


class Outcome(Protocol):
    """What the step cycle asks of the watch's outcome (lifecycle/events.py): whether the checks stand
    down, and where the ranks agree (agreement.py) on what to raise."""

    @property
    def stopped(self) -> bool: ...

    @property
    def agreement(self) -> Agreement: ...

    def agreement_point(self, opened: bool) -> AbstractContextManager[None]: ...

    def check_peers(self) -> None: ...

    def leave(self, together: bool) -> None: ...

    def left_by(self, exception: BaseException, together: bool, explainable: bool) -> NonFiniteError | None: ...


class CycleExit:
    """The cycle's end as the watch is left (its parts: :class:`StepCycle`'s, set by its ``__init__``)."""

    open: bool
    timing: WhenJudged
    gradients: GradientChecks
    optimizers: OptimizerChecks
    origins: OriginFinder
    outcome: Outcome
    lockstep: Lockstep
    held: HeldBatch
    _emit: Callable[[Finding], None]

    if TYPE_CHECKING:  # (StepCycle's own)

        @property
        def step(self) -> int: ...

        def training(self) -> bool: ...

        def sync(self) -> list[float]: ...

        def end_step(self, step: int) -> None: ...

        def _end_update(self) -> None: ...

        def _check_unstepped_gradients(self, leaving: bool = False) -> None: ...

    def leave(self) -> None:
        """The watch is left normally: the last step's checks, then the ranks' exit round (agreement.py)."""
        self._end_update()
        self.sync()
        if self.open and not self.training():
            self.end_step(self.step)  # the last inference step: nothing calls its first module again
        self.optimizers.flush()
        unstepped = bool(self.open and self.gradients.backward_runs)  # a backward no optimizer step followed
        if unstepped:
            self.optimizers.on_step_boundary(leaving=True)
        if self.gradients.backward_runs:
            self._check_unstepped_gradients(leaving=unstepped)
        if not self.outcome.stopped:
            self.held.settle()  # a batch of a step no optimizer step closed, handled
        self.outcome.leave(self._leave_together())

    def pause(self) -> None:
        """A part of the run ends (a ``%nanwatch on`` cell): its values are judged now; the step stays open."""
        self.sync()
        self.optimizers.flush()

    def left_by(self, exc: BaseException, explained: NonFiniteError | None) -> NonFiniteError | None:
        """The watch is left by ``exc``: what to raise from it (``explained``: a failed forward's event, events.py)."""
        # An error of the user's code (not ours, not an interrupt) may have a non-finite cause.
        explainable = isinstance(exc, Exception) and not isinstance(exc, NonFiniteError)
        if explained is None and explainable:
            explained = (self.timing.pending_at_exit(self) or self._raise_held_overflow(exc)
                         or self._explain_failed_op(exc) or self._explain_anomaly(exc)
                         or (None if self.outcome.stopped else self.held.explain(exc)))  # (held_batch.py)
        # Every exception exit takes its part in the ranks' exit round (agreement.py), ours included.
        left = self.outcome.left_by(exc, self._leave_together(), explainable and explained is None)
        return explained or left

    def _raise_held_overflow(self, exc: BaseException) -> NonFiniteError | None:
        """A backward event a GradScaler held when reading those gradients raised before the scaler decided
        on the step (``clip_grad_norm_(error_if_nonfinite=True)`` after ``unscale_``): raised as it was found. Any
        other error of the user's (logging, an early stop, the data running out) is theirs: the held overflow may be
        the scaler's usual one, which it would have skipped."""
        if self.optimizers.pending_overflow is None or self.outcome.stopped or not _from_clipping(exc):
            return None
        finding, self.optimizers.pending_overflow = self.optimizers.pending_overflow, None
        try:
            self._emit(finding)
        except NonFiniteError as error:
            return error
        return None

    def _explain_failed_op(self, exc: BaseException) -> NonFiniteError | None:
        """An op raised on a non-finite input no boundary judged (multinomial on NaN probabilities): report it."""
        if self.outcome.stopped:
            return None
        finding = self.origins.explain_failure(exc)
        if finding is None:
            return None
        try:
            self._emit(finding)
        except NonFiniteError as error:
            return error
        return None

    def _explain_anomaly(self, exc: BaseException) -> NonFiniteError | None:
        """torch's anomaly mode (``detect_anomaly``) stopped a backward at a NaN: the step's backward, replayed, names
        the producer, its op and line (torch's own error, kept as the cause, names only the autograd node)."""
        if self.outcome.stopped or not (isinstance(exc, RuntimeError) and _ANOMALY in str(exc)):
            return None
        # A live op tracer (ops=True) saw the op start the value; no boundary claimed it before the error.
        traced = self.origins.anomaly_finding()
        finding = traced or Finding(Phase.BACKWARD, None, TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output"))
        finding.notes.append(Note.raised("anomaly-raised", exc))
        gradients = self.gradients
        loss = gradients.loss_record.ref() if gradients.loss_record is not None else None
        # The loss code's backward first (it runs before the models'), as its recorded ops replay it; else the step
        # replay of the models' calls (events.py), or the per-module watch's replay of the calls (replay_anomaly).
        with torch.autograd.set_detect_anomaly(False):  # (or its replay would stop as the user's backward did)
            claimed = traced is None and self.origins.claim_loss_backward(finding, loss, gradients.loss_key)
            if not claimed and traced is None and gradients.replay_anomaly is not None:
                gradients.replay_anomaly(finding)  # per-module: the calls whose backward was running, replayed
        if claimed and gradients.loss_record is not None:
            finding.call = gradients.loss_record.call  # named: the loss's call, which no model replay stands for
        try:
            self._emit(finding)
        except NonFiniteError as error:
            return error
        return None

    def _leave_together(self) -> bool:
        """Whether the exit is a round with the other ranks (lockstep.py); one process walks no model for it."""
        return self.outcome.agreement.several and self.lockstep.meets_at_exit()


#: What torch's anomaly mode says as it stops a backward at a NaN ("Function 'SqrtBackward0' returned nan values in
#: its 0th output."): torch's message, not one of ours.
_ANOMALY = "returned nan values in its"


#: torch's gradient clipping, whose ``error_if_nonfinite`` raises on the gradients a scaler's overflow made.
_CLIP_GRAD = os.path.join("torch", "nn", "utils", "clip_grad.py")


def _from_clipping(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside torch's gradient clipping (reading the held gradients)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_CLIP_GRAD):
            return True
        tb = tb.tb_next
    return False
