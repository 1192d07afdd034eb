"""The watch's events: how a finding becomes a report, is localized by a replay, and gets its scene and fixes.

Apart from watch.py, which owns the lifecycle (entering and leaving, attaching
the hooks, building every part in ``Watch._reset_state``), because this is the
cold path an event takes once a check found one: the replays that name its op
(the batch's samples, the tiered step replay, a buffer's writer), the fixes'
trials, the crash scene, and the report built from what the step's boundary
saw. :class:`WatchEvents` is the base :class:`~nan_magic.lifecycle.watch.Watch`
gets these methods from; the parts they use are the watch's, built by its
``_reset_state`` (declared here for the type checker).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.distributed.ranks import stamp
from nan_magic.errors.exceptions import NonFiniteError
from nan_magic.fixes.runner import KeptStep, LossSource, untried, with_fixes
from nan_magic.hot.checks.backward.gradient_checks import GradientChecks
from nan_magic.hot.checks.forward import ForwardChecks
from nan_magic.hot.checks.optimizer.step_checks import OptimizerChecks
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.held import running_arguments
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.step_cycle import StepCycle
from nan_magic.hot.timing import Timing
from nan_magic.hot.watched.targets import Targets
from nan_magic.lifecycle.events import Events, Replayed
from nan_magic.lifecycle.findings import build_report
from nan_magic.lifecycle.nesting import Nesting
from nan_magic.localize.modes import Localizing
from nan_magic.localize.ops.sources import Caller
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.localize.raised import RaisedForwards
from nan_magic.localize.replay.buffer_writes import buffer_written
from nan_magic.localize.replay.per_call import replayed_from_the_step
from nan_magic.localize.replay.producer_call import CallReplay
from nan_magic.localize.replay.samples import Samples
from nan_magic.localize.replay.tiered.step import Producer, StepReplays
from nan_magic.options import WatchConfig
from nan_magic.patches.scaler import scaled_from_finite
from nan_magic.records import EarlyWarning, Phase, Report, StepSummary, TensorRef, TensorRole
from nan_magic.scene.dump import SceneSource, record_scene
from nan_magic.scene.last_good import LastGood

__all__ = ["WatchEvents"]


class WatchEvents:
    """An event's way from a finding to its report (the watch's parts: :class:`Watch`'s, set by ``_reset_state``)."""

    config: WatchConfig
    targets: Targets
    replay_of: object | None
    history: deque[StepSummary]
    warnings: deque[EarlyWarning]
    timing: Timing
    log: StepLog
    localizing: Localizing
    outside: OutsideRecorder | None
    call_replay: CallReplay
    gradients: GradientChecks
    optimizers: OptimizerChecks
    last_good: LastGood
    forward: ForwardChecks
    replays: StepReplays | None
    samples: Samples
    outcome: Events
    cycle: StepCycle
    raised_forwards: RaisedForwards
    _nesting: Nesting
    #: A non-finite loss held where ``scaler.scale`` made it (:meth:`on_loss_event`), until the scaler's step.
    held_loss: Finding | None = None

    if TYPE_CHECKING:  # (Watch's own)

        @property
        def step(self) -> int: ...

        def _roots(self) -> Iterator[nn.Module]: ...

    def _localize(self, finding: Finding, seen: Report) -> Replayed | None:
        """An event's replay (a bad batch's samples fetched again, else the tiered step replay, else a buffer's
        writer found on the kept calls); its fixes' trials."""
        replays, replayed = self.localizing.replays, None
        after_loss = self.timing.judging == "check"  # (read before a replay's model calls run: timing.py)
        for keeper in (replays, self.localizing.kept):  # (which top-level call this event's replay ran, or None)
            if keeper is not None:
                keeper.replayed = None
        if finding.phase == Phase.DATA and finding.op is None:
            replayed = self.samples.localize(finding, seen, self._build_report)  # None: no DataLoader gave it
        if replayed is None and replays is not None:
            replayed = replays.localize(finding, seen)
        # (%debug's frame, lifecycle/events.py: a batch whose samples were fetched again from its DataLoader too.)
        # ops=True, deferred: the tracer named the op, no step replay ran; the calls kept for the fix trials still
        # say where the loop called the model, where %debug opens as where the call's return is judged.
        if after_loss and finding.phase in (Phase.FORWARD, Phase.DATA) and (
                keeper := replays if replays is not None else self.localizing.kept) is not None:
            finding.model_caller = _model_caller(keeper, finding)
        if after_loss and finding.phase == Phase.DATA and finding.module is None and finding.backward_caller is None:
            # Data the loss code read, judged with the loss at the check: %debug opens where the loop called backward
            # (as where the loss is judged as backward starts), where that frame still runs (lifecycle/events.py).
            finding.backward_caller = self.gradients.backward_caller
        loss = LossSource(self.outside, _loss_key(finding, self.gradients.loss_key, self.outside),
                          self.optimizers.scalers, after_loss)
        stops = self.config.on_detect == "raise"  # (an interrupt during the fix trials then ends only them)
        kept = KeptStep.of(self.localizing, finding.call, loss, self.call_replay.standing_aside)  # fixes/kept.py
        if replayed is None and kept.replays is not None and self.localizing.replays_calls and (
                finding.call is not None or finding.phase == Phase.BACKWARD or finding.in_graph_grad):
            # (mode="full": what a module replay cannot vouch for, a call that wrote its own state, a gradient of ones,
            # a formula the loop's own autograd.grad(create_graph=True) ran)
            replayed = replayed_from_the_step(kept.replays, finding, seen)
        if replays is None and kept.replays is not None and finding.tensor.role is TensorRole.BUFFER and (
                finding.call is None):
            # (kept.aside: the op tracer and the recorder do not see the replay's ops, as in a fix trial)
            replayed = buffer_written(kept.replays.calls, finding, seen, kept.aside), (finding.frame, None)
        if replays is None and self.config.fixes and self.outcome.report is None and self.replay_of is None:
            return untried(seen, replayed, finding.frame, kept, self.optimizers.seen, self._roots(), self.last_good,
                           stops)
        if replayed is None or replays is None:
            return replayed
        report, producer = replayed
        if not self.config.fixes or report.benign or self.outcome.report is not None:
            return replayed  # trials for the first real event only (warn/log mode goes on after it)
        return with_fixes(report, replays, self.optimizers.seen, self._roots(), self.last_good,
                          self.call_replay.standing_aside, loss, stops), producer

    def _record_scene(self, finding: Finding, report: Report) -> Report:
        """At the first real event: the scene (dump.py) from what this watch holds."""
        config = self.config
        if not config.dump and (folder := self._nesting.outer_dump()) is not None:
            # A script's own watch inside ``python -m nan_magic run --dump DIR`` (the pytest marker's): the outer
            # watch gets this event (nesting.py) but saw none of its step; the scene is saved here, to its folder.
            config = dataclasses.replace(config, dump=folder)
        source = SceneSource(
            config=config,
            roots=self.targets.roots,
            optimizers=self.optimizers.seen, scalers=self.optimizers.scalers, calls=lambda: self.log.calls,
            arguments=lambda call: self.replays.arguments_of(call) if self.replays is not None else None,
            running_rng=self.forward.stack[0].rng_state if self.forward.stack else None,
            last_good=self.last_good,
        )
        return record_scene(source, finding, report)

    def on_forward_failed(self, module: nn.Module, call: Any) -> None:
        """A top-level forward raised: when a replay finds a non-finite value came first, report it.

        Called from the forward hook while the exception propagates. torch
        silences what a hook raises then, so in ``raise`` mode the
        NonFiniteError is raised when the watch is left, from the original
        exception (events.py); ``warn``/``log`` record it now. Not replayed where the exception is the user's
        own control flow, no bad value's (raised.py: the replay would run their hooks and code again).
        """
        error = sys.exc_info()[1]
        if error is not None and not self.raised_forwards.worth_replaying(error):
            return
        if self.localizing.replays is None:
            finding = self.call_replay.explain_failure(module, call, running_arguments(module))
            if finding is not None:
                replayed = (self._build_report(finding), (finding.frame, None))
                self.outcome.hold_explained(finding, replayed, sys.exc_info()[1])  # type: ignore[arg-type]
            elif error is not None:
                self.raised_forwards.found_healthy(error)
            return
        explained = self.localizing.replays.explain_failure(module, call, running_arguments(module))
        if explained is None:
            if error is not None:
                self.raised_forwards.found_healthy(error)
            return
        report, producer, error = explained
        self.outcome.hold_explained(Finding(Phase.FORWARD, call, TensorRef.output()), (report, producer), error)

    def on_gradient_event(self, finding: Finding) -> None:
        """A non-finite gradient in backward: held while a GradScaler may skip the step."""
        if not self.optimizers.hold_gradient_event(finding):
            self.emit(finding)

    def on_loss_event(self, finding: Finding, loss: torch.Tensor | None) -> None:
        """A non-finite loss (``loss``: the tensor, where alive; else found by its record): held as a backward event
        where it is what ``scaler.scale`` returned for finite losses, or only combined from such (``/ 2``, a sum),
        and the scale overflowed it (the scaled gradients overflow and the scaler skips the step, PRODUCT.md's
        benign; patches/scaler.py's scaled_from_finite); any other is emitted. Held,
        it is emitted still if the optimizer step runs after all (:meth:`on_step_ran`): only a skip makes it benign."""
        freed = finding.record.ref if loss is None and finding.record is not None else None
        if not (self.optimizers.scaler_active() and scaled_from_finite(loss, freed)
                and self.optimizers.hold_gradient_event(finding)):
            self.emit(finding)
            return
        if finding.step is None:
            finding.step = self.step
        self.held_loss = finding

    def on_step_ran(self, held: Finding | None) -> None:
        """The optimizer step ran with ``held`` (a backward event a scaler might have skipped) still held: a held
        loss (:meth:`on_loss_event`) is emitted, as it would have been without the scaler."""
        if held is not None and held is self.held_loss:
            self.held_loss = None
            self.emit(held)

    # -- events ---------------------------------------------------------------------

    def emit(self, finding: Finding, replayed: tuple[Report, Producer] | None = None) -> None:
        """Record an event; raise or warn for the first non-benign one as configured (events.py)."""
        self.outcome.emit(finding, replayed)

    def _build_report(self, finding: Finding) -> Report:
        """``finding``'s report as the step's boundary saw it: this step's log, history and warnings."""
        return stamp(dataclasses.replace(build_report(
            finding,
            step=self.step if finding.step is None else finding.step,
            log=self.log,
            history=tuple(self.history),
            warnings=tuple(self.warnings),
            max_layers=self.config.max_layers,
            sample_size=self.config.sample_size,
            modules=self.targets.infos(),
            per_module=self.cycle.full_step,
            ops=self.localizing.traces and self.replay_of is None,
            optimizers=self.targets.optimizers,
        ), models_watched=len(self.targets.roots)))

    def adopt_traceback(self, error: NonFiniteError, tb: TracebackType | None) -> None:
        """Cut ``tb`` after the user's frame and record that frame in the report (events.py)."""
        self.outcome.adopt_traceback(error, tb)


def _model_caller(replays: StepReplays, finding: Finding) -> Caller | None:
    """Where the loop called the model whose call a forward or data event of the deferred check came from: the call
    the replay named it in, or the one ``finding.call`` is (a forward event's), or the model's call nearest it (a
    batch's: its data call is made as the model is called)."""
    if replays.replayed is not None:
        return replays.replayed.caller
    call = finding.call
    if call is None:
        return None
    roots = [root for root in replays.calls if root.call is call or (
        call.phase == Phase.DATA and root.call is not None and root.call.module is call.module)]
    root = min(roots, key=lambda root: abs(root.call.index - call.index) if root.call is not None else 0, default=None)
    if root is None:
        # A submodule's call (ops=True: no step replay named its top-level call): the top-level call it ran in, the
        # last one begun before it.
        root = max((root for root in replays.calls if root.call is not None and root.call.index <= call.index),
                   key=lambda root: root.call.index if root.call is not None else 0, default=None)
    return root.caller if root is not None else None


def _loss_key(finding: Finding, last: int | None, outside: OutsideRecorder | None) -> int | None:
    """The id of the loss whose code the fix trials run: the backward's that made a gradient (``finding.loss_key``:
    ``l1.backward(retain_graph=True); l2.backward()``, l1's judged after l2's), where this step's recorded code made
    it; else the last backward's (``last``). A gradient made outside any backward (the loss code's own
    ``autograd.grad``: an R1 penalty) noted the loss of the backward before it, the last step's."""
    key = finding.loss_key
    if key is None or key == last or outside is None or outside.loss_code(key, False) is None:
        return last
    return key
