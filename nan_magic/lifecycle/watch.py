"""The watch: hooks that exist only while the watched code runs.

Mechanisms, and why none of them changes what the model computes:

* Forward: *global* module hooks (``register_module_forward_pre_hook`` and ``register_module_forward_hook``),
  filtered to the watched modules. Hooks on a module instance would make ``nn.TransformerEncoderLayer`` skip its
  fused inference path; global hooks do not. The post hook is ``always_call`` so the module stack unwinds when a
  forward raises.
* Loss and GradScaler: ``torch.Tensor.backward``, ``GradScaler.scale`` and ``step`` are wrapped while the watch is
  active (patches/registry.py), to check the tensor backward starts from and see a scaler's skipped steps.
* Backward: a tensor hook on each watched output sees the gradient flowing into it (no
  ``register_full_backward_hook``: it breaks in-place ops on outputs).
* Optimizer: global step pre/post hooks check gradients before a step and parameters after it; a large CPU
  parameter's gradient is measured in cache.

Every handle lives in an ``ExitStack`` closed in ``finally``: no hook of ours outlives the watch, and the user's
hooks are never touched.

This module owns the lifecycle: entering and leaving (pausing and resuming for ``%nanwatch on``), attaching and
removing the hooks, and building every part in :meth:`Watch._reset_state`, each handed the narrow callables it
uses. An event's way to its report (its replays, scene and fixes) is watch_events.py's :class:`WatchEvents`, this
class's base. The step cycle and the checks are in hot/, the event's replays in localize/, the outcome in ``events.py``;
docs/how-it-watches.md draws who may call whom.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from types import FrameType, TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from nan_magic.distributed.lockstep import Lockstep
from nan_magic.distributed.ranks import data_parallel_paths, user_name
from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.errors.frames import cut_at_placed, cut_where_passed_through, leaving_entry
from nan_magic.explain.norm_stats import nonfinite_norm_stats
from nan_magic.hot.checks.backward.gradient_checks import GradientChecks
from nan_magic.hot.checks.forward import ForwardChecks
from nan_magic.hot.checks.hosts import LossCodeReads
from nan_magic.hot.checks.optimizer.step_checks import OptimizerChecks
from nan_magic.hot.kept.call_records import Frame
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.step_cycle import StepCycle
from nan_magic.hot.timing import Timing, timing_for
from nan_magic.hot.watched.module_hooks import GlobalModuleHooks
from nan_magic.hot.watched.owner import HookOwner
from nan_magic.hot.watched.targets import ModuleInfo, Targets, resolve_targets
from nan_magic.lifecycle.events import EventContext, Events
from nan_magic.lifecycle.filters import warn_unmatched_filters
from nan_magic.lifecycle.nesting import Nesting
from nan_magic.lifecycle.users_modes import keep_apart_from_users_modes
from nan_magic.lifecycle.watch_events import WatchEvents
from nan_magic.localize.modes import Localizing, localizing
from nan_magic.localize.op_origins import OpOrigins
from nan_magic.localize.ops.derived import ModelDerived
from nan_magic.localize.ops.masks import opened_in_place
from nan_magic.localize.ops.owners import root_hook_module
from nan_magic.localize.outside import entering
from nan_magic.localize.outside.loop_writes import LoopWrites
from nan_magic.localize.producer import ProducerRule
from nan_magic.localize.raised import RaisedForwards
from nan_magic.localize.replay.producer_call import CallReplay
from nan_magic.localize.replay.samples import Samples
from nan_magic.options import WatchConfig
from nan_magic.patches import backward as backward_patch
from nan_magic.patches import loaders as loaders_patch
from nan_magic.patches import scaler as scaler_patch
from nan_magic.patches.loads import forget_loads
from nan_magic.patches.step_hooks import optimizer_step_hooks
from nan_magic.records import EarlyWarning, Phase, Report, StepSummary
from nan_magic.scene.last_good import LastGood

__all__ = ["Watch"]

F = TypeVar("F", bound=Callable[..., Any])


class Watch(WatchEvents):
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
        #: The tiered watch whose failing step this watch replays (replay/tiered/step.py): it runs inside
        #: that watch, which stands aside, instead of taking over from it.
        self.replay_of = replay_of
        # Resolving validates the targets now, so bad input fails before any
        # user code runs and before anything is attached.
        self.targets: Targets = resolve_targets(targets, labels, self.config, name_new_target)
        self.history: deque[StepSummary] = deque(maxlen=self.config.history)
        self.warnings: deque[EarlyWarning] = deque(maxlen=self.config.max_events)
        self._active = False
        self._exit_stack: ExitStack | None = None
        self._paused = False  # left by pause() with the run going on: resume() continues it
        #: :meth:`mine` as an attribute the hot path reads (hot/watched/owner.py).
        self.here = HookOwner()
        #: The autograd backward pass the watch was entered in (-1: none; a replay's watch is entered
        #: inside the backward it localizes). A module call inside any other one is a recomputation.
        self.graph_task = -1
        self._nesting = Nesting(self, self._attach, self._detach)
        self._reset_state()

    # -- public state -----------------------------------------------------------

    @property
    def defer(self) -> bool:
        """Whether this watch judges a step's values at its check, not as they are made (hot/timing.py)."""
        return self.timing.deferred

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
    def producer_calls(self) -> tuple[tuple[FrameType, int, int], ...]:
        return self.outcome.producer_calls

    @property
    def active(self) -> bool:
        return self._active

    @property
    def step(self) -> int:
        """The 0-based step an event now belongs to (PRODUCT.md; :attr:`StepCycle.step`)."""
        return self.cycle.step

    def parameters_before_update(self) -> dict[int, torch.Tensor]:
        """The watched parameters the current update region wrote in place, as they were before (a step replay's)."""
        return self.update_code.parameters_before()

    def values_before_update(self) -> dict[int, tuple[torch.Tensor, int]]:
        """What the current update region wrote in place that is no parameter, as it was before, with its version."""
        return self.update_code.values_before()

    @property
    def steps_taken(self) -> int:
        """Training iterations completed, or top-level forward calls started where no optimizer stepped."""
        return self.cycle.steps_taken

    # -- lifecycle ----------------------------------------------------------------

    def __enter__(self) -> Watch:
        return self._enter(resume=False)

    def resume(self) -> Watch:
        """Enter again, the run :meth:`pause` left going on: its step counter, open step, history and warnings
        (``%nanwatch on`` runs each cell as a part of one run). A watch not paused is entered afresh."""
        return self._enter(resume=self._paused)

    def pause(self, exc: BaseException | None = None) -> None:
        """``__exit__`` (``exc``: what ended this part), keeping the run and its step for :meth:`resume`."""
        self._leave(exc, None if exc is None else exc.__traceback__, pause=True)

    @property
    def paused(self) -> bool:
        return self._paused

    def _enter(self, resume: bool) -> Watch:
        if self._active:
            raise RuntimeError("this watch is already active; nested use of one watch is not supported")
        if not resume:
            self._reset_state()
            self.history.clear()
            self.warnings.clear()
            # A replay's own watch (same options) said nothing new: its user heard it once, from the watch it replays.
            self._filters_judged = self.replay_of is not None or warn_unmatched_filters(self.targets, self.config)
        self._paused = self.outcome.leaving = False  # (a part the user's own error ended left it set)
        self._nesting.attach()  # its hooks, taking over from an outer watch over the same modules (nesting.py)
        self.graph_task = torch._C._current_graph_task_id()
        self._active = self.here.mine = True
        self._nesting.entered()
        self.localizing.enter(resume)
        if resume and self.cycle.update_code is not None:
            self.cycle.update_code.resume()  # a part that ended between backward() and the step (split cells)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return self._leave(exc, tb, pause=False)

    def _leave(self, exc: BaseException | None, tb: TracebackType | None, pause: bool) -> Literal[False]:
        self.localizing.pause()
        if self.cycle.update_code is not None:
            self.cycle.update_code.pause()
        self.outcome.leaving = exc is not None  # an event found now raises at once, from ``exc``
        explained = judged = None
        try:
            explained = self.outcome.explain(exc)
            if exc is None and pause:
                self.cycle.pause()
            elif exc is None:
                try:
                    self.cycle.leave()
                except NonFiniteError as error:
                    judged = error  # (its traceback adopted below, once the watch's hooks are off)
            else:
                explained = self.cycle.left_by(exc, explained)
        finally:
            self._active = self.here.mine = False
            self._nesting.left()
            self._detach()
            self._paused = pause and not self.outcome.stopped and explained is None
            self._forget_tensors(keep_step=self._paused)
            self._nesting.hand_back()
            if self.report is None and not self._paused:
                # Nothing to roll back to: do not keep a copy of the model alive.
                self.last_good = LastGood(self.config.keep_last_good)
        if judged is not None:
            # Judged at the exit (the deferred check's last step, an unstepped accumulation tail): no exception of
            # the user's holds the loop's frames, so the with statement's stands for them; the producer's frame is
            # appended to it, and %debug opens where the immediate mode raised (events.py adopt_traceback).
            # The traceback it was raised with ends in our code (the check at the exit): the with statement's entry
            # holds it instead, so that after this raise its last entry is the producer's line (a script's pdb.pm()).
            if (entry := leaving_entry(sys._getframe(1))) is not None:
                judged.__traceback__ = entry
            self.adopt_traceback(judged, entry)
            judged.note_report()
            raise judged
        if not self._filters_judged:  # the models the cell used, now known (filters.py): said in the cell that ran
            self._filters_judged = self._judge_filters(explained or exc)  # (once for the run)
        self._said(self.outcome.say_repeated, explained or exc)  # (warn: the events not warned of again, counted)
        if explained is not None:
            self.adopt_traceback(explained, tb)
            explained.note_report()
            raise explained from exc
        if isinstance(exc, NonFiniteError):
            self.adopt_traceback(exc, tb)
            exc.note_report()
        elif isinstance(exc, Exception) and not cut_at_placed(exc, tb):
            # The user's own error (a shape mismatch in the loop's code, passed on by the watch's dispatch mode):
            # its traceback, and %debug or pdb.pm(), stop at the user's line, as unwatched (frames.py). An
            # interrupt is not cut: where it landed is shown, our hooks' frames skipped as hidden (IPython's rule).
            # (A warning of ours a filter made an error in a hook, -W error: cut at the user's line it names.)
            cut_where_passed_through(tb)
        return False

    def _judge_filters(self, leaving: BaseException | None) -> bool:
        """warn_unmatched_filters as the watch is left; where a filter makes the warning an error (``-W error``)
        while ``leaving`` propagates (the event), the warning joins it as a note rather than replacing it."""
        return self._said(lambda: warn_unmatched_filters(self.targets, self.config), leaving)

    @staticmethod
    def _said(say: Callable[[], bool | None], leaving: BaseException | None) -> bool:
        """``say()``, a warning given as the watch is left; one a filter made an error while ``leaving``
        propagates joins it as a note, where it would replace it."""
        try:
            return bool(say())
        except Warning as warning:
            if leaving is None:
                raise
            if hasattr(leaving, "add_note"):  # (Python 3.11+)
                leaving.add_note(f"{type(warning).__name__}: {warning}")
            return True

    def _attach(self) -> None:
        stack = ExitStack()
        try:
            keep_apart_from_users_modes(self, stack)  # the watch's ops unseen by the user's dispatch modes
            self.module_hooks.attach(stack)
            stack.enter_context(optimizer_step_hooks(self.cycle.on_step_pre, self.cycle.on_step_post,
                                                     self.cycle.step_hooks_begin, self.cycle.step_hooks_ran))
            stack.enter_context(backward_patch.watch_backward(self._loss_starts))  # (first: called first)
            stack.enter_context(backward_patch.watch_backward(self.gradients.on_backward_start,
                                                              self.cycle.backward_finished))
            stack.enter_context(loaders_patch.watch_batches(self.samples.on_batch))
            stack.enter_context(register_module_parameter_registration_hook(self.update_code.on_registered))
            optimizers = self.optimizers
            stack.enter_context(scaler_patch.watch_scalers(scaler_patch.ScalerCallbacks(
                optimizers.on_scale, optimizers.before_scaler_step, optimizers.after_scaler_step
            )))
            for _label, root in self.targets.roots:
                for handle in self.optimizers.arm(root):
                    stack.callback(handle.remove)
            self.localizing.attach(stack, self.origins, self.forward.current_module_name, self._phase_hint)
            if self.origins.tracer is not None and self.replay_of is None:
                # Ops mode's live tracer carries which tensors the model made, to tell the loop's data code
                # (phase data) from the loss code: a replay's runs a model call or its loss code, never the data code.
                self.origins.tracer.derived = ModelDerived()
                self.origins.tracer.data_region = self.cycle.in_data_region
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack

    def _detach(self) -> None:
        self.localizing.detach()
        if self._exit_stack is not None:
            stack, self._exit_stack = self._exit_stack, None
            stack.close()

    def __call__(self, function: F) -> F:
        """Use the watch as a decorator: each outermost call of ``function`` runs under it (nesting.py's
        ``decorate``: a call made while the watch is active, on this thread or another, does not enter it again)."""
        return self._nesting.decorate(function)

    # -- state ---------------------------------------------------------------------

    def _reset_state(self) -> None:
        #: When values are read and judged: as they are made, or at the step's check (hot/timing.py).
        self.timing: Timing = timing_for(self.config, self._roots())
        self.log = StepLog(self.config.max_layers, self.timing.holds_probes)
        # How this mode names an event's op (modes.py): but in ops mode the code between the models' calls (the
        # loss, data code in the loop) is recorded, and the tiered watch replays the failing step.
        self.localizing: Localizing = localizing(self.config, self, self._nested, self.targets.optimizers,
                                                 self.timing.holds_probes, trials=self.replay_of is None)
        self.outside = self.localizing.recorder
        # Services, built first: the checkers below receive them, never each other.
        self.origins = OpOrigins(self.outside, self.emit, self.on_gradient_event, self.targets.info_by_name,
                                 self.targets.infos, lambda key: self.targets.modules.get(key))
        if self.outside is not None:  # a root's own forward hook ran after the post-hook began the loss region
            self.outside.root_hook = lambda code, frame: root_hook_module(
                code, frame, (module for _label, module in self.targets.roots), self.origins.named)
            self.outside.benign_input = lambda tensor: (
                (record := self.log.lookup(tensor)) is not None and record.status == "benign")
        self.call_replay = CallReplay(self.config, self.localizing.replays_calls, self.timing, self.log, self.emit,
                                      self.here)
        self.raised_forwards = RaisedForwards()  # the places a forward raised from that a replay found healthy
        replay_backward = self.call_replay.replay_backward_into if self.call_replay.keeps_calls else None
        self.origins.owner_replay = (lambda: self.log.calls, replay_backward) if replay_backward is not None else None
        loss_code = LossCodeReads(saved_leaves=entering.saved_leaves, entering_tensors=entering.entering_tensors,
                                  recorded_leaves=functools.partial(entering.recorded_leaves, self.outside),
                                  recorded_in_full=functools.partial(entering.recorded_in_full, self.outside),
                                  unrecorded=functools.partial(entering.unrecorded, self.outside))
        self.gradients = GradientChecks(self, self.origins, loss_code, replay_backward,
                                        self.call_replay.replay_anomaly if replay_backward is not None else None)
        self.optimizers = OptimizerChecks(self, self.origins, self.localizing.optimizer_replay())
        self.origins.last_loss = lambda: (self.gradients.loss_record.ref() if self.gradients.loss_record else None,
                                          self.gradients.loss_key)
        self.last_good = LastGood(self.config.keep_last_good)
        hook_gradient = self.gradients.hook_output if self.config.backward else None
        stack: list[Frame] = []  # the module stack: the forward checks push it, the producer rule reads it
        held = HeldBatch(lambda: self.step, self.emit, lambda finding: self.outcome.handled(finding), opened_in_place)
        rule = ProducerRule(self.config, self.log, self.emit, self.call_replay, self.origins, stack, held)
        self.forward = ForwardChecks(self, self.call_replay, rule, stack, hook_gradient,
                                     keeps_plain=self.config.ops and self.timing.deferred and self.replay_of is None)
        self.module_hooks = GlobalModuleHooks(self.forward.on_forward_pre, self.forward.on_forward)
        self.replays = self.localizing.kept  # the step's top-level calls (the hooks keep them; modes.py)
        if self.replays is not None:  # (a per-module watch's replay of a call that wrote its input in place)
            self.call_replay.inputs_before = self.replays.inputs_before_of
            if self.outside is not None and self.timing.deferred:  # (a batch written after the call, before the check)
                self.outside.input_written = self.replays.input_written
        #: The latest DataLoader batch's samples, fetched again at a data event (localize/replay/samples.py).
        self.samples = Samples(self.config.kinds)
        self.lockstep = Lockstep(self._roots, self.optimizers.in_use)
        #: Floating tensors the watch could not read and skipped, by reason (stats.unreadable_reason).
        self.skipped: Counter[str] = Counter()
        self.outcome: Events = Events(self.config, EventContext(
            build=self._build_report,
            localize=self._localize,
            record_scene=self._record_scene,
            traced=lambda: self.origins.tracer is not None and self.origins.tracer.finding is not None,
            lockstep=self.lockstep.in_step,
            skipped=self.skipped,
            nonfinite_stats=lambda: nonfinite_norm_stats(self.targets.roots),
            settle_last_good=self.optimizers.settle_last_good,
        ), held, alone=self.replay_of is not None)
        self.update_code = LoopWrites(self.config.kinds, self._named_parameters,
                                      self.optimizers.reports.attribute, self.emit, lambda: self.step,
                                      tracer=self.localizing.update_tracer(self.origins), data=self.outside)
        self.origins.written_gradient = self.update_code.claim_gradient
        self.origins.lr_source = self.update_code.name_lr
        rule.assigned = self.update_code.claim_assigned  # (a parameter the loop assigned: outside/assigned.py)
        rule.unchecked_step = self.optimizers.check_unchecked_of  # (a bounded step's skipped check: step_checks.py)
        self.cycle: StepCycle = StepCycle(
            self.config, self.timing, self.log, self.history, self.warnings, roots=self._roots,
            gradients=self.gradients, optimizers=self.optimizers, judge_forward=self.forward.rule.judge,
            replays=self.replays, origins=self.origins, outside=self.outside, outcome=self.outcome,
            lockstep=self.lockstep, emit=self.emit, here=self.here, update_code=self.update_code, held=held,
        )

    def _loss_starts(self, _loss: torch.Tensor, _retained: Any, _gradient: Any) -> None:
        """A backward starts while the update region records (not on the usual step: one call): that code was a
        second loss's, and goes on as the loss region's (LoopWrites.loss_starts), before the loss is judged."""
        if (recorder := self.update_code.recorder) is not None and recorder.pushed and self.here.mine and (
                written := self.update_code.loss_starts()):
            self.timing.update_code_ended(self.cycle, written, False)

    def _roots(self) -> Iterator[nn.Module]:
        """The watched models (a model called at top level joins them: module_info)."""
        return (root for _label, root in self.targets.roots)

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The watched models' parameters under the user's names."""
        for root in self._roots():
            data_parallel = data_parallel_paths(root)
            for name, parameter in root.named_parameters():
                yield user_name(name, data_parallel), parameter

    def _forget_tensors(self, keep_step: bool = False) -> None:
        self.forward.stack.clear()
        if keep_step:
            return  # a paused run's open step: its records and replays are the next part's
        if self.cycle.update_code is not None:
            self.cycle.update_code.forget()
        self.localizing.forget()
        forget_loads()  # (what load_state_dict loaded: kept while a %nanwatch on run is paused, for its next cell)
        self.gradients.forget_loss_graph()
        self.log.clear()
        self.cycle.batch_arrays = []
        self.samples.forget()
        if self.origins.tracer is not None:
            self.origins.tracer.reset(ended=True)  # its origins hold frames and tensors of the last step

    def module_info(self, module: nn.Module) -> ModuleInfo | None:
        """How a called module is named, or None when it is not watched."""
        info = self.targets.modules.get(id(module))
        if info is None and self.forward.stack:
            return self.targets.adopt(module, self.config)  # a submodule added since the watch began
        if info is None:
            info = self.targets.join(module, self.config)  # a module called at top level may join (targets.py)
            if info is None:
                return None
            self.lockstep.forget()  # a new model may be data-parallel
            if self._exit_stack is not None:
                for handle in self.optimizers.arm(module):
                    self._exit_stack.callback(handle.remove)
        return info

    def listening(self) -> bool:
        """``here.mine`` for hooks that only the watched code reaches, from any thread.

        The gradient hooks on its outputs and parameters and the op tracer it entered run inside its backward,
        and autograd runs a CUDA backward on a thread of its own (one per device), not the one that called it.
        """
        return self._active and not self.call_replay.replaying

    # -- backward and optimizer (see gradient_checks.py, step_checks.py) -------------------------

    def _phase_hint(self) -> Phase | None:
        """The op tracer's phase for an op outside the autograd engine: the optimizer's while it steps."""
        return Phase.OPTIMIZER if self.optimizers.in_step else None

    def on_finite_step(self) -> None:
        """An optimizer step ended with finite parameters (hook for the roll-back snapshot)."""
        self.last_good.capture(self.targets.roots, self.optimizers.seen, self.step, right_after=self.optimizers.in_step)

    def on_step_to_judge(self) -> None:
        """An optimizer step whose result the next check judges (deferred): its state copied now, kept if finite."""
        self.last_good.stage(self.targets.roots, self.optimizers.seen, self.step)

    def _nested(self, model: nn.Module, label: str | None, config: WatchConfig) -> Watch:
        """The full watch a step replay runs ``model`` under (replay/tiered/step.py): a watch like any other."""
        # The whole model is watched, so that a submodule called at top level keeps its qualified name; so are the
        # other watched models, after it (its names first): one its forward calls (a GAN's ``D`` called in ``G``'s
        # forward, held by no attribute) is named in its own model, not as the replayed model's own code.
        others = [(other_label, root) for other_label, root in self.targets.roots if root is not model]
        inner = Watch([model, *(root for _label, root in others)], labels=[label, *(other for other, _root in others)],
                      config=config, replay_of=self)
        # It measures every call, a ReLU's too, which the watch passes through on a finite input (transparent.py):
        # the report's layer table lists every module of the step with its numbers.
        for key, info in (modules := inner.targets.modules).items():
            modules[key] = dataclasses.replace(info, transparent=None)
        return inner
