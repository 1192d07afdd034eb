"""The watch: hooks that exist only while the watched code runs.

Mechanisms, and why none of them changes what the model computes:

* Forward: *global* module hooks (``register_module_forward_pre_hook`` and
  ``register_module_forward_hook``), filtered to the watched modules. Hooks on
  a module instance would make ``nn.TransformerEncoderLayer`` skip its fused
  inference path; global hooks do not. The post hook is ``always_call`` so the
  module stack unwinds when a forward raises.
* Loss: ``torch.Tensor.backward`` is wrapped while the watch is active (and
  restored in ``finally``) to check the tensor backward starts from.
* GradScaler: ``scale`` and ``step`` are wrapped the same way, so a scaler
  that was not passed is seen in use and its skipped steps are benign
  (scaler_patch.py).
* Backward: a tensor hook on each watched module's floating outputs sees the
  gradient flowing into that module, in backward execution order. No
  ``register_full_backward_hook`` (it breaks in-place ops on outputs).
* Optimizer: global optimizer step pre/post hooks check gradients before a
  step and parameters after it; a post-accumulate-grad hook on each large
  CPU parameter measures its gradient early, while it is in cache (optim.py).

Every handle lives in an ``ExitStack`` closed in ``finally``: after the watch,
whatever way it ends, no hook of ours remains and the user's hooks were never
touched.

This module owns the lifecycle, the step counter and the deferred check
(one transfer per step); the checks themselves live in ``forward.py`` (with
the producer rule, ``producer.py``), ``gradients.py`` and ``optim.py``; the
outcome (the report, the events, how the run stops) in ``events.py``, which
gets callables, not the watch.

Who may call whom. The watch builds every part in :meth:`Watch._reset_state`
and hands each the narrow services it uses; no checker reaches another
checker through the watch. Services first, which call no checker:
``op_tracing.py`` (the op behind a boundary's value) and ``call_replay.py``
(replays of one module call). Then the checkers, which call only services
and the watch's own lifecycle: the gradient checks get the op origins and
the backward replay; the optimizer checks get ``add_op_origin``; the forward
hooks get the call replay, the op origins, and the gradient checks'
``hook_output`` as a plain callable. Where the last forward ended is data in
the step log (``StepLog.last_forward_seq``), written by the forward hooks and
read by the gradient checks. Two parts still reach through the watch: the
tiered watch's step replays (``watch.replays``: the forward hooks give them
each top-level call, the gradient checks its output gradients) and the code
recorder (``watch.outside``, switched at the boundaries the hooks see).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from types import FrameType, TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.optim import optimizer as optimizer_hooks

from nan_magic.engine import backward_patch, scaler_patch
from nan_magic.engine.call_replay import CallReplay
from nan_magic.engine.calls import StepLog
from nan_magic.engine.distributed import (
    data_parallel_paths,
    launched,
    stamp,
    user_name,
)
from nan_magic.engine.early import EarlyWarnings
from nan_magic.engine.errors import NanMagicWarning, NonFiniteError
from nan_magic.engine.events import EventContext, Events
from nan_magic.engine.findings import Finding, build_report
from nan_magic.engine.forward import ForwardChecks
from nan_magic.engine.gradients import GradientChecks, check_parameter_grads
from nan_magic.engine.held import running_arguments
from nan_magic.engine.lockstep import Lockstep
from nan_magic.engine.module_hooks import GlobalModuleHooks
from nan_magic.engine.op_tracing import OpOrigins
from nan_magic.engine.optim import OptimizerChecks
from nan_magic.engine.outside import OutsideRecorder
from nan_magic.engine.scene import record_scene
from nan_magic.engine.snapshot import LastGood
from nan_magic.engine.stats import read_scalars
from nan_magic.engine.step_replay import Producer, StepReplays
from nan_magic.engine.targets import ModuleInfo, Targets, refuse_compiled, resolve_targets
from nan_magic.records import EarlyWarning, Phase, Report, StepSummary, WatchConfig

__all__ = ["Watch", "watch"]

F = TypeVar("F", bound=Callable[..., Any])

# Watches currently entered, outermost first.
_ACTIVE: list[Watch] = []


class Watch:
    """A watch over models, optimizers and GradScalers; see :func:`watch`.

    Usable as a context manager (``with watch(model) as w:``) and as a
    decorator. ``report`` is the Report of the first non-benign event (or
    None); ``events`` every event seen, benign ones included, in order;
    ``skipped`` how many floating tensors it could not read and left
    unchecked, by reason (``{"nested": 12}``; see ``stats.unreadable_reason``),
    also carried by each Report as ``report.skipped``.
    """

    def __init__(
        self,
        targets: Iterable[Any] = (),
        *,
        labels: Iterable[str | None] | None = None,
        config: WatchConfig | None = None,
        name_new_target: Callable[[Any], str | None] | None = None,
        replay_of: Watch | None = None,
    ) -> None:
        self.config = config or WatchConfig()
        #: The tiered watch whose failing step this watch replays (step_replay.py): it runs inside
        #: that watch, which stands aside, instead of taking over from it.
        self.replay_of = replay_of
        # Resolving validates the targets now, so bad input fails before any
        # user code runs and before anything is attached.
        self.targets: Targets = resolve_targets(targets, labels, self.config)
        # Which module first called at top level, or optimizer first seen
        # stepping, joins the watch, and under what label (None: it stays
        # unwatched). By default: every module when no module was given
        # (discovery), nothing else.
        self._name_new_target = name_new_target
        self.history: deque[StepSummary] = deque(maxlen=self.config.history)
        self.warnings: deque[EarlyWarning] = deque(maxlen=self.config.max_events)
        self._active = False
        self._step_open = False
        self._exit_stack: ExitStack | None = None
        self._thread: int | None = None
        self._suspended: list[Watch] = []
        # Serialises the decorator's check-and-enter (:meth:`__call__`).
        self._entering = threading.Lock()
        self._reset_state()

    # -- public state -----------------------------------------------------------

    @property
    def report(self) -> Report | None:
        """The Report of the first non-benign event, or None (events.py)."""
        return self.outcome.report

    @property
    def events(self) -> list[Report]:
        """Every event seen, benign ones included, in order."""
        return self.outcome.events

    @property
    def raised(self) -> NonFiniteError | None:
        """The NonFiniteError this watch raised, once it has (the magics adopt its traceback)."""
        return self.outcome.raised

    @property
    def producer_frame(self) -> FrameType | None:
        """The frame that ran the first real event's producing op, where a replay named it (for %debug)."""
        return self.outcome.producer_frame

    @property
    def producer_position(self) -> tuple[int, int] | None:
        return self.outcome.producer_position

    @property
    def active(self) -> bool:
        return self._active

    @property
    def step(self) -> int:
        """The 0-based step an event now belongs to (PRODUCT.md).

        The training iterations completed: the steps of the optimizer seen
        stepping most often (passed to the watch or not; every optimizer
        steps once an iteration). Before any optimizer is seen (inference,
        or the first iteration of a loop whose optimizer was not passed):
        the index of the latest top-level forward call started, so the loss
        and backward of the first iteration are step 0.
        """
        if self.optimizer_in_use():
            return self.optimizers.steps
        return max(self.forward_starts - 1, 0)

    @property
    def steps_taken(self) -> int:
        """Training iterations completed, or top-level forward calls started where no optimizer stepped."""
        return self.optimizers.steps if self.optimizer_in_use() else self.forward_starts

    # -- lifecycle ----------------------------------------------------------------

    def __enter__(self) -> Watch:
        if self._active:
            raise RuntimeError("this watch is already active; nested use of one watch is not supported")
        self._reset_state()
        self.history.clear()
        self.warnings.clear()
        # A watch nested over the same modules takes over from the outer one
        # (whose hooks are removed until this one exits): never two sets of
        # our hooks on one model.
        self._suspended = [] if self.replay_of else [outer for outer in _ACTIVE if outer._overlaps(self)]
        for outer in self._suspended:
            outer._detach()
        try:
            self._attach()
        except BaseException:
            self._resume_outer()
            raise
        self._thread = threading.get_ident()
        self._active = True
        _ACTIVE.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if self.outside is not None:
            self.outside.stop()
        self.outcome.leaving = exc is not None  # an event found now raises at once, from ``exc``
        explained = None
        try:
            explained = self.outcome.explain(exc)
            if exc is None:
                self.sync()
                self.optimizers.flush()
                if self._step_open and self.gradients.backward_runs:
                    self.optimizers.on_step_boundary()
                if self.gradients.backward_runs:
                    self._check_unstepped_gradients()
                self.outcome.leave(self._leave_together())
            else:
                # An error of the user's code (not ours, not an interrupt) may have a non-finite cause.
                explainable = isinstance(exc, Exception) and not isinstance(exc, NonFiniteError)
                if explained is None and explainable:
                    explained = self._judge_pending()
                # Every exception exit takes its part in the ranks' exit round (agreement.py), ours included.
                left = self.outcome.left_by(exc, self._leave_together(), explainable and explained is None)
                explained = explained or left
        finally:
            self._active = False
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            self._detach()
            self._forget_tensors()
            self._resume_outer()
            if self.report is None:
                # Nothing to roll back to: do not keep a copy of the model alive.
                self.last_good = LastGood(self.config.keep_last_good)
        if explained is not None:
            self.adopt_traceback(explained, tb)
            raise explained from exc
        if isinstance(exc, NonFiniteError):
            self.adopt_traceback(exc, tb)
        return False

    def _attach(self) -> None:
        stack = ExitStack()
        try:
            self.module_hooks.attach(stack)
            stack.enter_context(optimizer_hooks.register_optimizer_step_pre_hook(self._on_step_pre))
            stack.enter_context(optimizer_hooks.register_optimizer_step_post_hook(self._on_step_post))
            stack.enter_context(backward_patch.watch_backward(self.gradients.on_backward_start))
            optimizers = self.optimizers
            stack.enter_context(scaler_patch.watch_scalers(scaler_patch.ScalerCallbacks(
                optimizers.on_scale, optimizers.before_scaler_step, optimizers.after_scaler_step
            )))
            for _label, root in self.targets.roots:
                for handle in self.optimizers.arm(root):
                    stack.callback(handle.remove)
            if self.config.ops:
                # The tracer names the innermost watched module running, from the forward hooks' stack.
                tracer = self.origins.make_tracer(self.config.kinds, self.forward.current_module_name, self._phase_hint)
                stack.enter_context(tracer)
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack

    def _detach(self) -> None:
        if self.outside is not None:
            self.outside.stop()
        if self._exit_stack is not None:
            stack, self._exit_stack = self._exit_stack, None
            stack.close()

    def _resume_outer(self) -> None:
        for outer in self._suspended:
            if outer._active:
                # The steps taken while this watch had taken over are the outer watch's steps too.
                outer.optimizers.absorb_steps(self.optimizers)
                outer.forward_starts += self.forward_starts
                outer._attach()
        self._suspended = []

    def _overlaps(self, other: Watch) -> bool:
        if self.targets.discover or other.targets.discover:
            return True
        return not self.targets.modules.keys().isdisjoint(other.targets.modules.keys())

    def __call__(self, function: F) -> F:
        """Use the watch as a decorator: each outermost call of ``function`` runs under it.

        The watch is entered once per outermost call and left when that call
        returns. A call made while it is active does not enter it again:

        * on the watching thread (recursion, or the function calling itself
          through other code), the inner call simply runs inside the watch
          already active, and is watched as part of it;
        * on another thread, the call runs unwatched by this watch. Its
          module hooks are global but act only for the thread that entered
          the watch (:meth:`mine`): the step counter, the module stack and
          the deferred check belong to one thread's sequence of steps, and
          interleaving a second thread's calls into them would attribute
          one thread's values to the other's step. Give each thread a watch
          of its own (``with watch(model):`` inside the thread) to watch both.

        ``with w:`` on a watch already active still raises, as before: that is
        a nesting the code asked for explicitly.
        """

        @functools.wraps(function)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self._entering:
                # Checked and entered under one lock: two threads calling at
                # once must not both try to enter.
                entered = None if self._active else ExitStack()
                if entered is not None:
                    entered.enter_context(self)
            if entered is None:
                return function(*args, **kwargs)
            with entered:  # leaves the watch with the call's exception, as ``with self:`` does
                return function(*args, **kwargs)

        return watched  # type: ignore[return-value]

    # -- state ---------------------------------------------------------------------

    def _reset_state(self) -> None:
        self.defer = self._wants_defer()
        self.log = StepLog(self.config.max_layers, self.defer)
        # The tiered watch records the code between the models' calls (the loss, data code in the loop), to
        # replay it at an event (the deferred check, judging at the optimizer step, records the loss only).
        self.outside: OutsideRecorder | None = OutsideRecorder(self.config.kinds) if self.config.tiered else None
        # Services, built first: the checkers below receive them, never each other.
        self.origins = OpOrigins(self.outside, self.emit, self.on_gradient_event, self.targets.info_by_name)
        self.call_replay = CallReplay(self.config, self.defer, self.log, self.emit)
        replay_backward = self.call_replay.replay_backward_into if self.call_replay.keeps_calls else None
        self.gradients = GradientChecks(self, self.origins, replay_backward)
        self.optimizers = OptimizerChecks(self, self.origins.add_op_origin)
        self.early = EarlyWarnings()
        self.last_good = LastGood(self.config.keep_last_good)
        hook_gradient = self.gradients.hook_output if self.config.backward else None
        self.forward = ForwardChecks(self, self.call_replay, self.origins, hook_gradient)
        self.module_hooks = GlobalModuleHooks(self.forward.on_forward_pre, self.forward.on_forward)
        # The tiered watch checks only top-level calls, except on a per-module step (begin_step_if_needed).
        self.replays = StepReplays(self) if self.config.tiered and self.config.replay else None
        self.full_step = not self.config.tiered
        self._steps_opened = 0
        self.lockstep: Lockstep = Lockstep(lambda: (root for _label, root in self.targets.roots))
        self.forward_starts = 0
        self._step_open = False
        #: Floating tensors the watch could not read and skipped, by reason (stats.unreadable_reason).
        self.skipped: Counter[str] = Counter()
        self.outcome: Events = Events(self.config, EventContext(
            build=self._build_report,
            localize=self.replays.localize if self.replays is not None else _nothing_replayed,
            record_scene=functools.partial(record_scene, self),
            traced=lambda: self.origins.tracer is not None and self.origins.tracer.finding is not None,
            lockstep=self._lockstep,
            skipped=self.skipped,
        ), alone=self.replay_of is not None)

    def _wants_defer(self) -> bool:
        """Deferred checks by default where the models live on a GPU, and under a process group.

        Under a process group, every check of a step is then judged at the
        optimizer step's pre-hook, the one point where all ranks can agree
        to stop (agreement.py).
        """
        if self.config.defer is not None:
            return self.config.defer
        return launched() or any(
            parameter.device.type != "cpu" for _label, root in self.targets.roots for parameter in root.parameters()
        )

    def _forget_tensors(self) -> None:
        self.forward.stack.clear()
        if self.outside is not None:
            self.outside.forget()
        if self.replays is not None:
            self.replays.clear()
        self.log.clear()
        if self.origins.tracer is not None:
            self.origins.tracer.reset()  # its origins hold frames and tensors of the last step

    def module_info(self, module: nn.Module) -> ModuleInfo | None:
        """How a called module is named, or None when it is not watched."""
        info = self.targets.modules.get(id(module))
        if info is None and not self.forward.stack:
            label = self._new_root_label(module)
            if label is None:
                return None
            # A module called at top level becomes a root, named as its own
            # ``named_modules()`` would name it; the full watch refuses a
            # compiled one here, where it is called, not wherever it merely exists.
            if not self.config.tiered:
                refuse_compiled(module, label)
            self.targets.add_root(module, label, self.config)
            self.lockstep.forget()  # a new model may be data-parallel
            info = self.targets.modules[id(module)]
            if self._exit_stack is not None:
                for handle in self.optimizers.arm(module):
                    self._exit_stack.callback(handle.remove)
        return info

    def _new_root_label(self, module: nn.Module) -> str | None:
        if self._name_new_target is not None:
            return self._name_new_target(module)
        return type(module).__name__ if self.targets.discover else None

    def admit_optimizer(self, opt: torch.optim.Optimizer) -> bool:
        """Whether an optimizer that is not a target joins the watch (see ``name_new_target``)."""
        if self._name_new_target is None or self._name_new_target(opt) is None:
            return False
        self.targets.optimizers.append(opt)
        return True

    def mine(self) -> bool:
        """Hooks are global: act only for the thread that entered the watch, not during a replay."""
        return self.listening() and threading.get_ident() == self._thread

    def listening(self) -> bool:
        """:meth:`mine` for hooks that only the watched code reaches, from any thread.

        The gradient hooks on its outputs and parameters and the op tracer it
        entered run inside its backward, and autograd runs a CUDA backward
        on a thread of its own (one per device), not on the thread that
        called ``backward()``.
        """
        return self._active and not self.call_replay.replaying

    # -- backward and optimizer (see gradients.py, optim.py) -------------------------

    def _phase_hint(self) -> Phase | None:
        """The op tracer's phase for an op outside the autograd engine: the optimizer's while it steps."""
        return Phase.OPTIMIZER if self.optimizers.in_step else None

    def optimizer_in_use(self) -> bool:
        return bool(self.optimizers.steps or self.targets.optimizers)

    def on_finite_step(self) -> None:
        """An optimizer step ended with finite parameters (hook for the roll-back snapshot)."""
        self.last_good.capture(self)

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
        with self.outcome.agreement_point(self.mine() and self._agrees_at(optimizer)):
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
        self._step_open = False

    def _leave_together(self) -> bool:
        """Whether the exit is a round with the other ranks (lockstep.py); one process walks no model for it."""
        return self.outcome.agreement.several and self.lockstep.meets_at_exit()

    def _lockstep(self) -> bool:
        """Whether this watch's ranks step together now (lockstep.py): an event found on one rank then waits.

        Asked only under a process group (Agreement.hold), so one process walks no model for it.
        """
        return self.lockstep.in_step(self.optimizer_in_use())

    def _agrees_at(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt``'s step is an agreement point: under a process group, for a DDP or FSDP model's optimizer."""
        return self.outcome.agreement.several and self.lockstep.agrees_at(opt)

    def check_peers(self) -> None:
        """After an inference step under a process group: stop if another rank posted an event (agreement.py)."""
        self.outcome.check_peers()

    def _check_unstepped_gradients(self) -> None:
        """The tiered watch, where no optimizer steps: the parameter gradients a backward left.

        The per-module watch sees a backward producer in the gradients
        flowing into each module; the tiered watch sees the gradients into
        the model's outputs, then the parameter gradients when an optimizer
        is about to step. A backward with no optimizer after it (saliency,
        a gradient check, the last backward of a watched cell) has its
        parameter gradients read here instead, when the next forward starts
        or the watch ends.
        """
        if (not self.config.tiered or not self.config.backward or self.optimizer_in_use() or self.outcome.stopped
                or self.optimizers.scaler_active()):
            return  # an optimizer's check reads them, or a GradScaler settles them (a skipped step)
        named: list[tuple[str, torch.Tensor]] = [
            (user_name(name, data_parallel_paths(root)), parameter)
            for _label, root in self.targets.roots
            for name, parameter in root.named_parameters()
        ]
        finding = check_parameter_grads(
            named, "no optimizer stepped after this backward: its parameter gradients were read when it ended",
            self.config.kinds,
        )
        if finding is not None:
            self.optimizers.attribute(finding)
            self.emit(finding)

    def _on_step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer step's checks, then this step's agreement with the other ranks (agreement.py)."""
        if self.mine() and self.outside is not None:
            self.outside.stop()
        try:
            with self.outcome.agreement_point(self.mine() and self._agrees_at(opt)):
                self.optimizers.on_step_pre(opt, args, kwargs)
        finally:
            if self.outside is not None and self.mine():
                self.outside.forget()  # the step is judged (the deferred check too): the loss code's records go

    def _on_step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self.optimizers.on_step_post(opt, args, kwargs)
        finally:
            if self.replays is not None and self.mine():
                # Its models' calls can need no replay now, nor stay alive.
                self.replays.release_stepped(opt)
        if self.outside is not None and self.mine() and not self.defer:
            # The code until the next model call: data loading, within a budget. (The deferred check judges
            # the batch at the optimizer step, after the loss region replaced these records.)
            self.outside.start("data")

    def on_forward_failed(self, module: nn.Module, call: Any) -> None:
        """A top-level forward raised: when a replay finds a non-finite value came first, report it.

        Called from the forward hook while the exception propagates. torch
        silences what a hook raises then, so in ``raise`` mode the
        NonFiniteError is raised when the watch is left, from the original
        exception (events.py); ``warn``/``log`` record it now.
        """
        if self.replays is None:
            return
        explained = self.replays.explain_failure(module, call, running_arguments(module))
        if explained is None:
            return
        report, producer, error = explained
        self.outcome.hold_explained(Finding(Phase.FORWARD, call, "output"), (report, producer), error)

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

    def on_gradient_event(self, finding: Finding) -> None:
        """A non-finite gradient in backward: held while a GradScaler may skip the step."""
        if not self.optimizers.hold_gradient_event(finding):
            self.emit(finding)

    # -- steps ----------------------------------------------------------------------

    def begin_step_if_needed(self) -> None:
        if self._step_open and self.gradients.backward_runs:
            self._settle_backward()
        elif self.gradients.backward_runs and not self.optimizer_in_use():
            self._check_unstepped_gradients()  # inference steps end with their forward; a backward followed
            self.gradients.backward_runs = 0
        if not self._step_open:
            self.log.clear()
            if self.replays is not None:
                # Training: a call waits for the optimizer of its model (a GAN's G across D's step),
                # see _on_step_post. Inference: each forward is a step of its own.
                self.replays.new_step(self.optimizer_in_use())
            # The tiered watch's second step, and every ``full_every``-th after it, checks every module
            # call: the per-layer history and early warnings come from those steps.
            every = self.config.full_every
            self.full_step = (not self.config.tiered or self._steps_opened % every == min(1, every - 1)
                              or self.lockstep.sharded())
            self._steps_opened += 1
            self.gradients.backward_runs = 0
            self.optimizers.in_step = False
            if self.origins.tracer is not None:
                self.origins.tracer.reset()
            self._step_open = True

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
        )
        if self.history and self.history[-1].step == step:
            # Closed once already: the first forward of a loop whose optimizer
            # was not passed looks like inference until the optimizer steps.
            self.history.pop()
        self.history.append(summary)
        self.warn(self.early.observe_step(summary))
        self._step_open = False

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
                        self.forward.rule.judge(call, record, "detected at the deferred check")
            if self.outcome.stopped:
                break
        return values

    # -- events ---------------------------------------------------------------------

    def emit(self, finding: Finding, replayed: tuple[Report, Producer] | None = None) -> None:
        """Record an event; raise or warn for the first non-benign one as configured (events.py)."""
        self.outcome.emit(finding, replayed)

    def _build_report(self, finding: Finding) -> Report:
        """``finding``'s report as the step's boundary saw it: this step's log, history and warnings."""
        return stamp(build_report(
            finding,
            step=self.step if finding.step is None else finding.step,
            log=self.log,
            history=tuple(self.history),
            warnings=tuple(self.warnings),
            max_layers=self.config.max_layers,
            sample_size=self.config.sample_size,
        ))

    def adopt_traceback(self, error: NonFiniteError, tb: TracebackType | None) -> None:
        """Cut ``tb`` after the user's frame and record that frame in the report (events.py)."""
        self.outcome.adopt_traceback(error, tb)


def _nothing_replayed(finding: Finding, report: Report) -> None:
    return None


def watch(
    *targets: Any,
    on_detect: str = "raise",
    mode: str = "tiered",
    full_every: int = 50,
    kinds: Iterable[str] = ("nan", "inf"),
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    types: Iterable[str] = (),
    log_file: str | None = None,
    defer: bool | None = None,
    ops: bool = False,
    replay: bool = True,
    backward: bool = True,
    history: int = 200,
    sample_size: int = 4096,
    max_layers: int = 2000,
    max_events: int = 100,
    dump: str | None = None,
    keep_last_good: bool | str | None = None,
    labels: Iterable[str | None] | None = None,
) -> Watch:
    """Watch models, optimizers and GradScalers for the first non-finite value.

    Parameters
    ----------
    *targets
        ``nn.Module``, ``torch.optim.Optimizer`` or ``GradScaler`` objects. With
        no module, every module called at top level is watched.
    on_detect, mode, full_every, kinds, include, exclude, types, log_file, defer, ops, replay,
    backward, history, sample_size, max_layers, max_events, dump
        See :class:`nan_magic.WatchConfig`.
    keep_last_good
        ``True`` or ``"cpu"``: keep the last finite step's state on the CPU;
        ``"device"``: where the model lives. ``report.restore()`` puts it back.
    labels
        Names for the targets (the magics pass variable names), one per target.

    Returns
    -------
    Watch
        A context manager and decorator; ``.report`` and ``.events`` afterwards.

    Examples
    --------
    >>> with nan_magic.watch(model) as w:          # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    """
    config = WatchConfig(
        on_detect=on_detect,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        full_every=full_every,
        kinds=frozenset(kinds),
        include=tuple(include),
        exclude=tuple(exclude),
        types=tuple(types),
        log_file=log_file,
        defer=defer,
        ops=ops,
        replay=replay,
        backward=backward,
        history=history,
        sample_size=sample_size,
        max_layers=max_layers,
        max_events=max_events,
        dump=dump,
        keep_last_good="cpu" if keep_last_good is True else (keep_last_good or None),
    )
    return Watch(targets, labels=labels, config=config)

