"""A watch's steps: where one opens and closes, what it counts, and the deferred check.

A step opens at its first top-level forward call (:meth:`StepCycle.forward_started`) and closes at the optimizer
step's post-hook; where no optimizer steps (inference), when the step's first top-level module is called again
(so ``vae.decode(z)``, calling ``post_quant_conv`` then ``decoder``, is one step); where a backward is settled
without a step (a GradScaler's skip, gradients accumulating); or when the watch is left. Closing a step keeps its
:class:`StepSummary` in the history and feeds the early warnings. In deferred mode the checks' probes stay on the
device until :meth:`StepCycle.sync` reads them in one transfer, at the optimizer step's pre-hook: under a process
group that is the step's agreement with the other ranks (agreement.py, lockstep.py), and so is a step a
GradScaler skipped.

Who calls whom: the watch builds the cycle after the checkers and hands it the parts a step's boundaries coordinate,
explicitly: the step log, the gradient and optimizer checks, the forward checks' producer rule (as a callable), the
step replays, the op origins, the code recorder, the outcome and the lockstep facts. The checkers, built first,
reach the cycle as ``watch.cycle``: the forward hooks open and close steps, the optimizer checks read the deferred
check and close steps, both add early warnings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from nan_magic.distributed.lockstep import Lockstep
from nan_magic.distributed.ranks import data_parallel_paths, user_name
from nan_magic.errors.exceptions import NanMagicWarning
from nan_magic.errors.frames import place_at_user
from nan_magic.errors.warning_lines import warn_at_user
from nan_magic.hot.checks.backward.gradient_checks import GradientChecks, check_parameter_grads
from nan_magic.hot.checks.early import EarlyWarnings
from nan_magic.hot.checks.hosts import CodeRecorder, OriginFinder, StepReplayer, WhenJudged
from nan_magic.hot.checks.optimizer.step_checks import OptimizerChecks
from nan_magic.hot.cycle_exit import CycleExit, Outcome
from nan_magic.hot.kept.call_records import Call, TensorRecord
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.watched.coverage import coverage_for
from nan_magic.hot.watched.owner import HookOwner
from nan_magic.options import WatchConfig
from nan_magic.records import EarlyWarning, Note, StepSummary

__all__ = ["StepCycle", "UpdateCode"]


class UpdateCode(Protocol):
    """The loop code between ``backward()`` and the next step (localize/outside/loop_writes.py): parameters it wrote."""

    def begin(self) -> None: ...

    def end(self, step: int | None = None) -> list[torch.Tensor]: ...

    def judge(self, values: list[float]) -> None: ...

    def forget(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


#: The forward checks' producer rule on one output at the deferred check (:meth:`ProducerRule.judge`).
JudgeForward = Callable[[Call, TensorRecord, Note], None]


class StepCycle(CycleExit):
    """The step counter and the step's boundaries of one entry of a watch (see the module docstring); its end as
    the watch is left is :class:`CycleExit`'s (cycle_exit.py).

    ``history`` and ``kept_warnings`` are the watch's (they outlive the entry);
    ``roots`` gives the watched models; ``emit`` and ``here`` are the
    watch's (:meth:`Watch.emit`, :attr:`Watch.here`: whether a hook's call is its own).
    """

    def __init__(
        self,
        config: WatchConfig,
        timing: WhenJudged,
        log: StepLog,
        history: deque[StepSummary],
        kept_warnings: deque[EarlyWarning],
        *,
        roots: Callable[[], Iterable[nn.Module]],
        gradients: GradientChecks,
        optimizers: OptimizerChecks,
        judge_forward: JudgeForward,
        replays: StepReplayer | None,
        origins: OriginFinder,
        outside: CodeRecorder | None,
        outcome: Outcome,
        lockstep: Lockstep,
        emit: Callable[[Finding], None],
        here: HookOwner,
        held: HeldBatch,
        update_code: UpdateCode | None = None,
    ) -> None:
        self.config = config
        self.timing = timing
        self.log = log
        self.history = history
        self.warnings = kept_warnings
        self._roots = roots
        self.gradients = gradients
        self.optimizers = optimizers
        self.judge_forward = judge_forward
        self.replays = replays
        self.origins = origins
        self.outside = outside
        self.outcome = outcome
        self.lockstep = lockstep
        self._emit = emit
        self._here = here
        self.update_code = update_code
        #: The step's non-finite batch, held until the step ends (held_batch.py): then the program handled it.
        self.held = held
        #: The tensors over the step's numpy batches (forward.py's record_data), kept for its check, released as
        #: the step ends: the user's array is theirs again (``buf.resize(refcheck=True)`` before the next step).
        self.batch_arrays: list[torch.Tensor] = []
        # The norms of the parameters the loop's code wrote, read with the deferred check's transfer, and how
        # many of the first ran before the calls it judges (their region ended as a model call began).
        self._written: list[torch.Tensor] = []
        self._written_first = 0
        self.early = EarlyWarnings()
        # The tiered watch checks only top-level calls, except on a per-module step (forward_started).
        #: Which module calls a step checks (watched/coverage.py: the mode's).
        self.coverage = coverage_for(config)
        self.full_step = self.coverage.every_call
        #: Steps opened (a nested watch's included: absorb); where no optimizer steps, they are the steps.
        self.steps_opened = 0
        # The open step's first top-level module: where no optimizer steps, its next call begins the next step.
        self._first: nn.Module | None = None
        # The step whose top-level model calls the log counts (StepLog.model_calls): an iteration completed, or minus
        # the steps opened before any optimizer stepped (forward_started); None, none yet.
        self._counted_step: int | None = None
        self.open = False
        self.trains = False  #: :meth:`training` found an optimizer in use (read first: four times a step)
        #: The last top-level call was a validation call (checks/forward.py): the loop's data code runs after it.
        self.validated = False
        # An optimizer's closure called a model inside its step (LBFGS): see on_step_post.
        self._closure_ran = False
        self._data_mark = (False, False, 0)  # the data region as the user's step post-hooks began (data_mark)

    # -- the counter --------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The 0-based step an event now belongs to (PRODUCT.md).

        The training iterations completed: an iteration is complete when
        every optimizer taking part in it has stepped (passed to the watch or
        not: a GAN's two; iterations.py). Before any optimizer is seen (inference,
        or the first iteration of a loop whose optimizer was not passed): the index of the step opened last (a step
        begins when the first top-level module of the one before is called again), so the loss and backward of the
        first iteration are step 0.
        """
        if self.trains or self.training():  # (trains read first, as the hot path does)
            return self.optimizers.iterations.completed  # (optimizers.steps, inlined: read at every batch)
        return max(self.steps_opened - 1, 0)

    def training(self) -> bool:
        """Whether an optimizer is in use: a step then ends at its optimizer step, not with its forward."""
        if not self.trains:  # (once in use, an optimizer stays so: the hot path reads ``trains`` first)
            self.trains = self.optimizers.in_use()
        return self.trains

    @property
    def steps_taken(self) -> int:
        """Training iterations completed, or steps begun where no optimizer stepped."""
        return self.optimizers.steps if self.training() else self.steps_opened

    def absorb(self, inner: StepCycle) -> None:
        """The steps taken while a nested watch had taken over from this one are this watch's steps too."""
        self.optimizers.absorb_steps(inner.optimizers)
        self.steps_opened += inner.steps_opened

    # -- opening and closing ----------------------------------------------------------------

    def in_data_region(self) -> bool:
        """Whether the loop's data code runs now (ops mode's tracer asks, at an op that starts a non-finite value): no
        step is open, or a backward ran with no optimizer step since (accumulation's next micro-batch), or the last
        top-level call was a validation call (checks/forward.py)."""
        return not self.open or bool(self.gradients.backward_runs) or self.validated

    def optimized(self, module: nn.Module) -> bool:
        """Whether an optimizer the watch has seen trains a parameter of ``module`` (read at a no-grad call only)."""
        trained = {id(p) for opt in self.optimizers.seen for group in opt.param_groups for p in group["params"]}
        return any(id(p) in trained for p in module.parameters())

    def forward_started(self, module: nn.Module, entering: Sequence[torch.Tensor] = ()) -> None:
        """A top-level call of ``module`` starts: it opens a step where none is open.

        Where no optimizer steps, the open step ends here when ``module`` is its first top-level module (PRODUCT.md's
        step rule). ``entering``: the call's tensor arguments, whose origins in the op tracer (ops mode) outlive the
        new step's reset: a batch the loop computed is judged as the call starts.
        """
        # (_end_update, inlined, ended by a call: every top-level call.)
        if self.update_code is not None and (written := self.update_code.end()):
            self.timing.update_code_ended(self, written, True)
        if self.optimizers.in_step:
            self._closure_ran = True
        training = self.trains or self.training()
        if self.open and self.gradients.backward_runs and training:
            # The update code just ended ran after every call the step's log holds: it is judged after them.
            self._written_first = False
            self._settle_backward()
        elif self.gradients.backward_runs and not training:
            self._check_unstepped_gradients()  # an inference step's backward (a saliency map): no optimizer reads it
            self.gradients.backward_runs = 0
        if self.open and not training and module is self._first:
            self.end_step(self.step)
        if not self.open:
            self._first = module
            self.log.clear()
            self.batch_arrays = []
            if self.replays is not None:
                # Training: a call waits for the optimizer of its model (a GAN's G across D's step),
                # see on_step_post. Inference: the last step's calls go as its first module is called again.
                self.replays.new_step(training)
            # The tiered watch's second step, and every ``full_every``-th after it, checks every module
            # call: the per-layer history and early warnings come from those steps.
            self.full_step = self.coverage.per_module_step(self.steps_opened, self.lockstep.sharded)
            self.steps_opened += 1
            self.gradients.backward_runs = 0
            self.optimizers.in_step = False
            if self.origins.tracer is not None:
                self.origins.tracer.reset(keep=entering)
            self.open = True
        # Which of the step's model calls this is (a report names the micro-batch of gradient accumulation by it):
        # the steps opened count a call of each micro-batch, the iterations completed only the optimizer's steps.
        # The steps opened are counted negative: the first iteration of a loop whose optimizer was not passed opens
        # steps 1, 2, ... before its optimizer steps, and the iterations it then completes (1, 2, ...) are not those
        # steps' further calls (an overflow at step 1 read "the step's 2nd model call: its 2nd micro-batch").
        step = self.optimizers.iterations.completed if training else -self.steps_opened
        if step != self._counted_step:
            self._counted_step, self.log.model_calls = step, 1
        else:
            self.log.model_calls += 1

    def end_step(self, step: int) -> None:
        """Close step ``step``, which just completed."""
        absmax, data_absmax, headroom, grad_headroom = self.log.summary()
        scalers = bool(self.optimizers.scalers)  # (none, most loops: neither asked)
        if scalers and self.optimizers.scaler_active():
            grad_headroom = None  # scaled gradients overflow by design: the scaler's job
        # (Not the frozen dataclass's __init__, a call per field: 5.8 us against 0.4. tests/test_step_summary.py)
        (summary := object.__new__(StepSummary)).__dict__.update(
            step=step, loss=self.gradients.last_loss,
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
            scale=self.timing.free_read(self.optimizers.scale) if scalers else None,
            full=self.full_step,
            layers=self.log.module_magnitudes() if self.full_step else (),
        )
        if self.history and self.history[-1].step == step:
            # Closed once already: the first forward of a loop whose optimizer
            # was not passed looks like inference until the optimizer steps.
            self.history.pop()
        self.history.append(summary)
        self.batch_arrays = []  # (judged: the deferred check ran at the optimizer's step, or as the call returned)
        if early := self.early.observe_step(summary):  # (none, most steps: no call)
            self.warn(early)
        self.open = False
        if self.held.finding is not None and self.optimizers.carried is None:  # (none, every healthy step: no call)
            # Its outputs, loss, gradients and parameters finite: the batch was handled (benign). Where the deferred
            # check reads the step's parameters with the next step's, that check settles it (timing.py).
            self.held.settle()

    def warn(self, early: list[EarlyWarning]) -> None:
        """Keep early warnings for the report; in ``warn`` mode also show them now."""
        for warning in early:
            self.warnings.append(warning)
            if self.config.on_detect == "warn":
                # At the user's line (``opt.step()``), as the events' warnings are: a fixed level named a line of
                # ours (optimizer/step_checks.py), its source printed under it, and a filter by module missed it.
                try:
                    warn_at_user(warning.message)
                except NanMagicWarning as raised:  # (-W error: raised at that line too, not in our hook's frames)
                    place_at_user(raised)
                    raise

    def sync(
        self, extra: list[torch.Tensor] | None = None, first: Callable[[list[float]], None] | None = None
    ) -> list[float]:
        """The step's check: read ``extra`` scalars, and what the step left pending (hot/timing.py), in one transfer.

        ``first`` judges the values of ``extra`` before any call is (the previous optimizer step's result: a step that
        made a parameter non-finite comes before the forward that then read it). Returns the values of ``extra``.
        """
        return self.timing.check(self, extra or [], first)

    def take_written(self) -> tuple[list[torch.Tensor], int]:
        """The norms held for the check (the loop's code's writes), and how many of the first ran before the calls."""
        written, first, self._written, self._written_first = self._written, self._written_first, [], 0
        return written, first

    def hold_written(self, written: list[torch.Tensor], by_a_call: bool) -> None:
        """Hold the norms (those held before first) for the check (deferred): ``by_a_call``, ended as a call began."""
        self._written, self._written_first = written, len(written) if by_a_call else self._written_first

    def judge_written(self, values: list[float]) -> None:
        """Judge the norms of the parameters the update code wrote, read."""
        if self.update_code is not None:
            self.update_code.judge(values)

    # -- the update code (localize/outside/loop_writes.py) ---------------------------------------------------

    def backward_finished(self, _loss: torch.Tensor) -> None:
        """``backward()`` returned: the update code begins.

        Inside an optimizer's closure (LBFGS) the step's check runs now, its gradients' too: the step writes the
        parameters once the closure returns, from those gradients, and a replay of the closure's model call must read
        the parameters as that call did.
        """
        if self._closure_ran and self._here.mine and not self.outcome.stopped:
            self.optimizers.closure_gradients()
        if self.update_code is not None and self._here.mine:
            self.update_code.begin()

    def _end_update(self) -> None:
        """The update code ends (an optimizer step, the watch's end): check what it wrote.

        (A model call ends it too: inlined in its hook, where the deferred check judges it before the call's outputs.)
        """
        if self.update_code is not None and (written := self.update_code.end()):
            self.timing.update_code_ended(self, written, False)

    def check_peers(self) -> None:
        """After an inference step under a process group: stop if another rank posted an event (agreement.py)."""
        self.outcome.check_peers()

    # -- the optimizer step (see step_checks.py) -----------------------------------------------------

    def on_step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer step's checks, then this step's agreement with the other ranks (agreement.py)."""
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        mine = self._here.mine
        if mine and self.outside is not None and self.outside.pushed:  # (stopped at backward, usually)
            self.outside.stop()
        try:
            if not self.outcome.agreement.several:
                # One process: no point ever opens (agreement.open), and one that is not open settles nothing,
                # so the checks run as they are (a context manager and its settling are a dozen calls a step).
                if mine and self.update_code is not None and (written := self.update_code.end()):
                    self.timing.update_code_ended(self, written, False)  # (_end_update, inlined: every step)
                self.optimizers.on_step_pre(opt, args, kwargs)
                return
            with self.outcome.agreement_point(mine and self.lockstep.agrees_at(opt)):
                if mine:
                    self._end_update()
                self.optimizers.on_step_pre(opt, args, kwargs)
        finally:
            if self.outside is not None and self._here.mine:
                # The step is judged (the deferred check too): the loss code's records go (the update code's that read
                # a number stay through the step, and with another optimizer to step, to its check: recorder.forget;
                # at the first step of a watch given no optimizer, one not seen stepping yet may follow).
                optimizers = self.optimizers
                self.outside.forget(stepping=True, others=len(optimizers.seen) > 1 or (
                    optimizers.step_calls == 1 and not optimizers.watch.targets.optimizers))
                self.gradients.loss_graph = None  # (forget_loss_graph, inlined: every step)

    def on_step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        __tracebackhide__ = True  # (as on_step_pre)
        if self._closure_ran:
            # The step's closure ran the forward and backward (LBFGS) after the pre-hook's check: what they
            # computed came before the parameters the step then wrote (recorded as update code since the
            # closure's backward), and is judged first (the deferred check).
            self._closure_ran = False
            self._end_update()
            self.sync()
        try:
            self.optimizers.on_step_post(opt, args, kwargs)
        finally:
            if self.replays is not None and self._here.mine:
                # Its models' calls can need no replay now, nor stay alive (its pre-hook's layout's parameters).
                ids = self.optimizers.step_ids if self.optimizers.step_ids_of is opt else None
                self.replays.release_stepped(opt, ids)
        if self.outside is not None and self._here.mine:
            self.timing.step_judged(self.outside)

    def step_hooks_begin(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``opt``'s step check, seated before the user's post-hooks (patches/step_hooks.py), which the data region it
        begins then records."""
        __tracebackhide__ = True  # (as on_step_pre)
        self.on_step_post(opt, args, kwargs)
        # (The data region's budget as they begin: the hooks' ops are not to spend the data code's.)
        if self.outside is not None and self._here.mine:  # (another thread's seated step: not this watch's region)
            self._data_mark = self.outside.data_mark()

    def step_hooks_ran(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The user's post-hooks of ``opt``'s step ran, after its check: the parameters they wrote, recorded as the
        data code after the step, are judged as written by that step (a max-norm projection of the weights, an EMA
        teacher's update): phase ``optimizer``, at the step whose ``opt.step()`` ran them. The loop's data code after
        them keeps its budget whatever ops the hooks ran (data_after_hooks)."""
        __tracebackhide__ = True  # (as on_step_pre)
        if self.update_code is None or not self._here.mine:
            return
        outside = self.outside
        # (The data region's recorder records on past this: not the reads here.)
        aside = outside is not None and outside.step_aside()
        held = False
        try:
            if written := self.update_code.end(self.optimizers.last_step):
                # (Held for the deferred check as code before its calls: it ran before the next step's.)
                held = self.timing.update_code_ended(self, written, True)
        finally:
            if outside is not None:
                # (Their records kept only where what they wrote is judged later, named from them then.)
                outside.data_after_hooks(self._data_mark, held, aside)

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """A GradScaler skipped ``optimizer``'s step (step_checks.py): the step's backward is settled now.

        In deferred mode the backward's probes are read first (the read the skipped step's optimizer hook would have
        made), so the held event names where the gradients overflowed.
        """
        if not self.gradients.backward_runs:
            return  # settled already (a second optimizer's skip of the same backward)
        # Like the step it replaces, an agreement point (agreement.py): every rank skips the same step (DDP's
        # gradients, and so the scaler's found_inf, are the same on all; FSDP's ShardedGradScaler all-reduces it).
        with self.outcome.agreement_point(self._here.mine and self._agrees_at(optimizer)):
            self._settle_backward(optimizer)

    def _settle_backward(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A backward ran and no optimizer step followed it: a skipped step, or gradients accumulating.

        What the deferred check has not judged yet is judged now (the step's
        log is about to be cleared), then the GradScaler rule settles a skip.
        """
        self.sync()
        self.batch_arrays = []  # (judged: a micro-batch's, before the next one's buffer is refilled)
        self.optimizers.on_step_boundary(optimizer)
        self._check_unstepped_gradients()
        self.gradients.backward_runs = 0
        self.open = False

    def _agrees_at(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt``'s step is an agreement point: under a process group, for a DDP or FSDP model's optimizer."""
        return self.outcome.agreement.several and self.lockstep.agrees_at(opt)

    def _check_unstepped_gradients(self, leaving: bool = False) -> None:
        """The parameter gradients a backward left with no optimizer step after it.

        The per-module watch sees a backward producer in the gradients flowing into each module; the tiered watch sees
        the gradients into the model's outputs, then the parameter gradients when an optimizer is about to step. A
        backward with no optimizer after it (saliency, a gradient check, the last backward of a watched cell) has its
        parameter gradients read here instead, when the next forward starts or the watch ends. ``leaving``: the watch
        ends after a backward that no step followed, optimizer or not (a cell that runs ``backward()`` and leaves
        ``opt.step()`` to the next cell); a gradient only its parameter's own formula made non-finite is seen by no
        other check, in either mode.
        """
        if not self.config.backward or self.outcome.stopped or self.optimizers.scaler_active():
            return  # a GradScaler settles them (a skipped step)
        if not leaving and not self.coverage.reads_unstepped_gradients(self.training()):
            return  # an optimizer's check reads them, or the per-module checks saw them
        named: list[tuple[str, torch.Tensor]] = [
            (user_name(name, data_parallel_paths(root)), parameter)
            for root in self._roots()
            for name, parameter in root.named_parameters()
        ]
        why = Note("grads-read-at-exit" if leaving and self.training() else "grads-read-unstepped")
        finding = check_parameter_grads(named, why, self.config.kinds)
        if finding is not None:
            self.optimizers.reports.attribute(finding)
            self.origins.add_op_origin(finding, finding.bad)  # the op, where the op tracer saw it start
            self._emit(finding)
