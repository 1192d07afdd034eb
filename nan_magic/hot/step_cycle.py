"""A watch's steps: where one opens and closes, what it counts, and the deferred check.

A step opens at its first top-level forward call (:meth:`StepCycle.forward_started`)
and closes at the optimizer step's post-hook, at the end of a top-level
forward where no optimizer steps (inference: each forward is a step), where
a backward is settled without a step (a GradScaler's skip, gradients
accumulating) or when the watch is left. Closing a step keeps its
:class:`StepSummary` in the history and feeds the early warnings. In deferred
mode the checks' probes stay on the device until :meth:`StepCycle.sync`
reads them in one transfer, at the optimizer step's pre-hook: under a process
group that is the step's agreement with the other ranks (agreement.py,
lockstep.py), and so is a step a GradScaler skipped.

Who calls whom: the watch builds the cycle after the checkers and hands it
the parts a step's boundaries coordinate, explicitly: the step log, the
gradient and optimizer checks, the forward checks' producer rule (as a
callable), the step replays, the op origins, the code recorder, the outcome
and the lockstep facts. The checkers, built first, reach the cycle as
``watch.cycle``: the forward hooks open and close steps, the optimizer checks
read the deferred check and close steps, both add early warnings.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from nan_magic.distributed.agreement import Agreement
from nan_magic.distributed.lockstep import Lockstep
from nan_magic.distributed.ranks import data_parallel_paths, launched, user_name
from nan_magic.errors.exceptions import NanMagicWarning, NonFiniteError
from nan_magic.hot.call_records import Call, TensorRecord
from nan_magic.hot.early import EarlyWarnings
from nan_magic.hot.finding import Finding
from nan_magic.hot.gradients import GradientChecks, check_parameter_grads
from nan_magic.hot.optim import OptimizerChecks
from nan_magic.hot.stats import read_scalars
from nan_magic.hot.step_log import StepLog
from nan_magic.localize.op_origins import OpOrigins
from nan_magic.localize.outside import OutsideRecorder
from nan_magic.localize.step_replay import StepReplays
from nan_magic.options import WatchConfig
from nan_magic.records import EarlyWarning, Phase, StepSummary

__all__ = ["Outcome", "StepCycle", "wants_defer"]


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

#: The forward checks' producer rule on one output at the deferred check (:meth:`ProducerRule.judge`).
JudgeForward = Callable[[Call, TensorRecord, str], None]


def wants_defer(config: WatchConfig, roots: Iterable[nn.Module]) -> bool:
    """Deferred checks by default where the models (``roots``) live on a GPU, and under a process group.

    Under a process group, every check of a step is then judged at the
    optimizer step's pre-hook, the one point where all ranks can agree
    to stop (agreement.py).
    """
    if config.defer is not None:
        return config.defer
    return launched() or any(parameter.device.type != "cpu" for root in roots for parameter in root.parameters())


class StepCycle:
    """The step counter and the step's boundaries of one entry of a watch (see the module docstring).

    ``history`` and ``kept_warnings`` are the watch's (they outlive the entry);
    ``roots`` gives the watched models; ``emit`` and ``mine`` are the
    watch's (:meth:`Watch.emit`, :meth:`Watch.mine`).
    """

    def __init__(
        self,
        config: WatchConfig,
        defer: bool,
        log: StepLog,
        history: deque[StepSummary],
        kept_warnings: deque[EarlyWarning],
        *,
        roots: Callable[[], Iterable[nn.Module]],
        gradients: GradientChecks,
        optimizers: OptimizerChecks,
        judge_forward: JudgeForward,
        replays: StepReplays | None,
        origins: OpOrigins,
        outside: OutsideRecorder | None,
        outcome: Outcome,
        lockstep: Lockstep,
        emit: Callable[[Finding], None],
        mine: Callable[[], bool],
    ) -> None:
        self.config = config
        self.defer = defer
        self.log = log
        self.history = history
        self.warnings = kept_warnings
        self._roots = roots
        self.gradients = gradients
        self.optimizers = optimizers
        self._judge_forward = judge_forward
        self.replays = replays
        self.origins = origins
        self.outside = outside
        self.outcome = outcome
        self.lockstep = lockstep
        self._emit = emit
        self._mine = mine
        self.early = EarlyWarnings()
        # The tiered watch checks only top-level calls, except on a per-module step (forward_started).
        self.full_step = not config.tiered
        self._steps_opened = 0
        self.forward_starts = 0
        self.open = False

    # -- the counter --------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The 0-based step an event now belongs to (PRODUCT.md).

        The training iterations completed: an iteration is complete when
        every optimizer taking part in it has stepped (passed to the watch or
        not: a GAN's two; iterations.py). Before any optimizer is seen (inference,
        or the first iteration of a loop whose optimizer was not passed):
        the index of the latest top-level forward call started, so the loss
        and backward of the first iteration are step 0.
        """
        if self.training():
            return self.optimizers.steps
        return max(self.forward_starts - 1, 0)

    def training(self) -> bool:
        """Whether an optimizer is in use: a step then ends at its optimizer step, not with its forward."""
        return self.optimizers.in_use()

    @property
    def steps_taken(self) -> int:
        """Training iterations completed, or top-level forward calls started where no optimizer stepped."""
        return self.optimizers.steps if self.training() else self.forward_starts

    def absorb(self, inner: StepCycle) -> None:
        """The steps taken while a nested watch had taken over from this one are this watch's steps too."""
        self.optimizers.absorb_steps(inner.optimizers)
        self.forward_starts += inner.forward_starts

    # -- opening and closing ----------------------------------------------------------------

    def forward_started(self, entering: Sequence[torch.Tensor] = ()) -> None:
        """A top-level forward call starts: it opens a step where none is open, and is counted.

        ``entering``: the call's tensor arguments, whose origins in the op
        tracer (ops mode) outlive the new step's reset: a batch the loop
        computed is judged as the call starts.
        """
        if self.open and self.gradients.backward_runs:
            self._settle_backward()
        elif self.gradients.backward_runs and not self.training():
            self._check_unstepped_gradients()  # inference steps end with their forward; a backward followed
            self.gradients.backward_runs = 0
        if not self.open:
            self.log.clear()
            if self.replays is not None:
                # Training: a call waits for the optimizer of its model (a GAN's G across D's step),
                # see on_step_post. Inference: each forward is a step of its own.
                self.replays.new_step(self.training())
            # The tiered watch's second step, and every ``full_every``-th after it, checks every module
            # call: the per-layer history and early warnings come from those steps.
            every = self.config.full_every
            self.full_step = (not self.config.tiered or self._steps_opened % every == min(1, every - 1)
                              or self.lockstep.sharded())
            self._steps_opened += 1
            self.gradients.backward_runs = 0
            self.optimizers.in_step = False
            if self.origins.tracer is not None:
                self.origins.tracer.reset(keep=entering)
            self.open = True
        self.forward_starts += 1

    def end_step(self, step: int) -> None:
        """Close step ``step``, which just completed."""
        absmax, data_absmax, headroom, grad_headroom = self.log.summary()
        if self.optimizers.scaler_active():
            grad_headroom = None  # scaled gradients overflow by design: the scaler's job
        summary = StepSummary(
            step=step,
            loss=self.gradients.last_loss,
            absmax=absmax,
            grad_norm=self.optimizers.last_grad_norm,
            headroom=headroom[0] if headroom else None,
            headroom_module=headroom[1] if headroom else None,
            headroom_dtype=headroom[2] if headroom else None,
            grad_headroom=grad_headroom[0] if grad_headroom else None,
            grad_headroom_module=grad_headroom[1] if grad_headroom else None,
            grad_headroom_dtype=grad_headroom[2] if grad_headroom else None,
            input_absmax=data_absmax,
            # Reading the scale is a host sync: only where syncs are free.
            scale=self.optimizers.scale() if not self.defer else None,
            full=self.full_step,
        )
        if self.history and self.history[-1].step == step:
            # Closed once already: the first forward of a loop whose optimizer
            # was not passed looks like inference until the optimizer steps.
            self.history.pop()
        self.history.append(summary)
        self.warn(self.early.observe_step(summary))
        self.open = False

    def warn(self, early: list[EarlyWarning]) -> None:
        """Keep early warnings for the report; in ``warn`` mode also show them now."""
        for warning in early:
            self.warnings.append(warning)
            if self.config.on_detect == "warn":
                warnings.warn(warning.message, NanMagicWarning, stacklevel=3)

    def sync(self, extra: list[torch.Tensor] | None = None) -> list[float]:
        """Read pending probes (deferred mode) and ``extra`` scalars in one transfer.

        In deferred mode, the calls are then judged in the order they
        returned. Returns the values of ``extra``.
        """
        if not self.defer or self.outcome.stopped:
            return read_scalars(extra) if extra else []
        values = self.log.resolve(extra)
        for call in self.log.finished():
            if call.phase == Phase.BACKWARD:
                self.gradients.judge(call)
            elif call.info is None:
                self.gradients.judge_loss(call)
            else:
                for record in call.outputs:
                    if record.status == "ok":
                        self._judge_forward(call, record, "detected at the deferred check")
            if self.outcome.stopped:
                break
        return values

    def check_peers(self) -> None:
        """After an inference step under a process group: stop if another rank posted an event (agreement.py)."""
        self.outcome.check_peers()

    # -- the optimizer step (see optim.py) -----------------------------------------------------

    def on_step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer step's checks, then this step's agreement with the other ranks (agreement.py)."""
        if self._mine() and self.outside is not None:
            self.outside.stop()
        try:
            with self.outcome.agreement_point(self._mine() and self._agrees_at(opt)):
                self.optimizers.on_step_pre(opt, args, kwargs)
        finally:
            if self.outside is not None and self._mine():
                self.outside.forget()  # the step is judged (the deferred check too): the loss code's records go

    def on_step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self.optimizers.on_step_post(opt, args, kwargs)
        finally:
            if self.replays is not None and self._mine():
                # Its models' calls can need no replay now, nor stay alive.
                self.replays.release_stepped(opt)
        if self.outside is not None and self._mine() and not self.defer:
            # The code until the next model call: data loading, within a budget. (The deferred check judges
            # the batch at the optimizer step, after the loss region replaced these records.)
            self.outside.start("data")

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """A GradScaler skipped ``optimizer``'s step (optim.py): the step's backward is settled now.

        In deferred mode the backward's probes are read first (the read the
        skipped step's optimizer hook would have made), so the held event
        names where the gradients overflowed.
        """
        if not self.gradients.backward_runs:
            return  # settled already (a second optimizer's skip of the same backward)
        # Like the step it replaces, an agreement point (agreement.py): every rank skips the same step (DDP's
        # gradients, and so the scaler's found_inf, are the same on all; FSDP's ShardedGradScaler all-reduces it).
        with self.outcome.agreement_point(self._mine() and self._agrees_at(optimizer)):
            self._settle_backward(optimizer)

    def _settle_backward(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A backward ran and no optimizer step followed it: a skipped step, or gradients accumulating.

        What the deferred check has not judged yet is judged now (the step's
        log is about to be cleared), then the GradScaler rule settles a skip.
        """
        self.sync()
        self.optimizers.on_step_boundary(optimizer)
        self._check_unstepped_gradients()
        self.gradients.backward_runs = 0
        self.open = False

    def _agrees_at(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt``'s step is an agreement point: under a process group, for a DDP or FSDP model's optimizer."""
        return self.outcome.agreement.several and self.lockstep.agrees_at(opt)

    def _check_unstepped_gradients(self, leaving: bool = False) -> None:
        """The parameter gradients a backward left with no optimizer step after it.

        The per-module watch sees a backward producer in the gradients
        flowing into each module; the tiered watch sees the gradients into
        the model's outputs, then the parameter gradients when an optimizer
        is about to step. A backward with no optimizer after it (saliency,
        a gradient check, the last backward of a watched cell) has its
        parameter gradients read here instead, when the next forward starts
        or the watch ends. ``leaving``: the watch ends after a backward that
        no step followed, optimizer or not (a cell that runs ``backward()``
        and leaves ``opt.step()`` to the next cell); a gradient only its
        parameter's own formula made non-finite is seen by no other check,
        in either mode.
        """
        if not self.config.backward or self.outcome.stopped or self.optimizers.scaler_active():
            return  # a GradScaler settles them (a skipped step)
        if not leaving and (not self.config.tiered or self.training()):
            return  # an optimizer's check reads them
        named: list[tuple[str, torch.Tensor]] = [
            (user_name(name, data_parallel_paths(root)), parameter)
            for root in self._roots()
            for name, parameter in root.named_parameters()
        ]
        why = ("the watch ended after this backward, before an optimizer step: its parameter gradients were read "
               "then") if leaving and self.training() else (
               "no optimizer stepped after this backward: its parameter gradients were read when it ended")
        finding = check_parameter_grads(named, why, self.config.kinds)
        if finding is not None:
            self.optimizers.attribute(finding)
            self.origins.add_op_origin(finding, finding.bad)  # the op, where the op tracer saw it start
            self._emit(finding)

    # -- leaving the watch ------------------------------------------------------------------------

    def leave(self) -> None:
        """The watch is left normally: the last step's checks, then the ranks' exit round (agreement.py)."""
        self.sync()
        self.optimizers.flush()
        unstepped = bool(self.open and self.gradients.backward_runs)  # a backward no optimizer step followed
        if unstepped:
            self.optimizers.on_step_boundary()
        if self.gradients.backward_runs:
            self._check_unstepped_gradients(leaving=unstepped)
        self.outcome.leave(self._leave_together())

    def left_by(self, exc: BaseException, explained: NonFiniteError | None) -> NonFiniteError | None:
        """The watch is left by ``exc``: what to raise from it (``explained``: a failed forward's event, events.py)."""
        # An error of the user's code (not ours, not an interrupt) may have a non-finite cause.
        explainable = isinstance(exc, Exception) and not isinstance(exc, NonFiniteError)
        if explained is None and explainable:
            explained = self._judge_pending()
        # Every exception exit takes its part in the ranks' exit round (agreement.py), ours included.
        left = self.outcome.left_by(exc, self._leave_together(), explainable and explained is None)
        return explained or left

    def _leave_together(self) -> bool:
        """Whether the exit is a round with the other ranks (lockstep.py); one process walks no model for it."""
        return self.outcome.agreement.several and self.lockstep.meets_at_exit()

    def _judge_pending(self) -> NonFiniteError | None:
        """An exception is leaving the watch: a non-finite value made before it and not judged yet comes first.

        The deferred mode judges a step's values at the optimizer step; an
        exception that stops the step before (``torch.multinomial`` on NaN
        probabilities in the loop) is then raised ``from`` by the event.
        """
        if not self.defer or self.outcome.stopped:
            return None
        try:
            self.sync()
        except NonFiniteError as error:
            return error
        return None
