"""How a watch names the op behind an event: one object per mode, chosen once (:func:`localizing`).

* :class:`Tiered` (the default, ``mode="tiered"``): steps are checked at their
  boundaries; the code between the model calls is recorded (outside/), a
  failing step's model calls are run again (replay/tiered/step.py), an optimizer
  step is run again on copies (replay/optimizer.py).
* :class:`PerCall` (``mode="full"``): every module call is checked; the
  producer's call is run again (replay/producer_call.py), the code between
  the model calls recorded as the tiered watch records it (a module's replay
  reaches no code outside the modules), an optimizer step run on copies.
* :class:`Traced` (``ops=True``, either mode): the op tracer watches every op
  of every step; nothing is run again to name the op.

Every mode keeps the step's top-level model calls (``kept``, replay/tiered/step.py's
begin at a top-level call's pre-hook) where the first real event's remedies are
tried on a replay of the failing step (fixes/runner.py); only the tiered watch
also localizes with them. The per-call and traced watches pay a check or a
traced op per call already: the kept call adds one RNG capture and one buffer
copy per top-level call.

The watch asks its mode for these parts and calls it at its own boundaries
(entering, pausing, attaching its hooks, forgetting a step), so no other
place tests which mode it is in for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch

from nan_magic.hot.checks.optimizer.step_reports import ReplayStep
from nan_magic.hot.watched.eager_stance import eager_stance
from nan_magic.localize.op_origins import OpOrigins
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.localize.replay.line_replay import ForwardLines
from nan_magic.localize.replay.optimizer import name_optimizer_op
from nan_magic.localize.replay.tiered.root_calls import NestedWatch
from nan_magic.localize.replay.tiered.step import ReplayHost, StepReplays
from nan_magic.options import WatchConfig
from nan_magic.patches.backward import marked_graph_grads, unrecorded_input_grads
from nan_magic.patches.copies import unhooked_copies
from nan_magic.patches.functional_calls import noted_swaps
from nan_magic.patches.inference_blocks import balanced_inference_blocks
from nan_magic.patches.loaders import unrecorded_batches
from nan_magic.patches.loads import noted_loads
from nan_magic.patches.saved_hooks import listed_saved_hooks
from nan_magic.patches.scripting import quiet_tracing, unhooked_scripting
from nan_magic.patches.swaps import forgotten_before_swaps, unrecorded_swaps
from nan_magic.patches.zero_grad import unrecorded_zero_grad
from nan_magic.records import Phase

__all__ = ["Localizing", "PerCall", "Recording", "Tiered", "Traced", "localizing"]


class Localizing:
    """What every mode shares: no recorder, no step replays, no module-call replays, no tracer."""

    #: Whether the op tracer watches every op (the report says the op was traced, not replayed).
    traces = False

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        #: The recorder of the code between the model calls (all but ops mode).
        self.recorder: OutsideRecorder | None = None
        #: What a replay of the failing step's model calls keeps (tiered, ``replay=True`` only).
        self.replays: StepReplays | None = None
        #: Whether the producer's module call is run again (per-call, ``replay=True`` only).
        self.replays_calls = False
        #: The step's top-level calls kept for the fix trials (the tiered watch's are ``replays``).
        self.kept: StepReplays | None = None

    def optimizer_replay(self) -> ReplayStep | None:
        """How an optimizer step's op is named: by running the step again on copies."""
        return functools.partial(name_optimizer_op, kinds=self.kinds)

    def update_tracer(self, origins: OpOrigins) -> Callable[[], OpTracer | None] | None:
        """The tracer that already saw the loop's update code (outside/loop_writes.py), if any."""
        return None

    def enter(self, resume: bool) -> None:
        """The watch is entered (``resume``: a paused run goes on)."""

    def attach(
        self, stack: ExitStack, origins: OpOrigins, module_name: Callable[[], str | None],
        phase_hint: Callable[[], Phase | None],
    ) -> None:
        """The watch's hooks go on; what ``stack`` holds comes off with them."""
        # torch.jit.script of a model inside the watch compiles it without the hook the tiered watch puts on a
        # model it steps aside for (TorchScript cannot compile it), and torch.jit.trace without the TracerWarnings
        # the watch's own reads raise: patches/scripting.py.
        stack.enter_context(unhooked_scripting())
        stack.enter_context(quiet_tracing())
        # A deep copy or pickle of a model made inside the watch carries none of its hooks (patches/copies.py).
        stack.enter_context(unhooked_copies())
        # A non-finite value loaded by load_state_dict (a checkpoint saved after the run went bad): its line.
        stack.enter_context(noted_loads())
        # The saved-tensor hooks each call starts under, for its replay after the user's ``with`` (saved_hooks.py).
        stack.enter_context(listed_saved_hooks())
        if origins.swapped is not None:
            # functional_call's stand-ins for parameters, kept for the deferred check (swapped.py).
            stack.enter_context(noted_swaps(origins.swapped.returned))

    def pause(self) -> None:
        """The watch is left, for now or for good."""

    def detach(self) -> None:
        """The watch's hooks come off."""

    def forget(self) -> None:
        """A step is over: what was kept for its replay goes."""


class Recording(Localizing):
    """The modes that record the code between the model calls, to run its ops again at an event."""

    def __init__(self, config: WatchConfig, optimizers: Sequence[object], holds_data: bool) -> None:
        super().__init__(config.kinds)
        # keep_last_good: the last step's loss code is kept for a fix trial at the next forward event; with an
        # optimizer given, a step's loss code is held until its step (fixes/loss.py); holds_data (the deferred
        # check): a data region's records are held until the check has judged the batch they made.
        self.recorder = self._recording = OutsideRecorder(config.kinds, config.keep_last_good is not None,
                                                          bool(optimizers), holds_data)

    def enter(self, resume: bool) -> None:
        if not resume:
            # The first batch may be computed in the loop before the first model call, as each later one is
            # after an optimizer step (step_cycle.on_step_post): its op and line are named at step 0 too.
            self._recording.start("data", entry=True)
        else:
            self._recording.resume()  # the code the last part ended in (the next batch, after an optimizer step)

    def attach(
        self, stack: ExitStack, origins: OpOrigins, module_name: Callable[[], str | None],
        phase_hint: Callable[[], Phase | None],
    ) -> None:
        super().attach(stack, origins, module_name, phase_hint)
        # zero_grad() runs none of the loop's code: the recorder steps aside for it (its ops cost the dispatch
        # mode's trampoline each, and set_to_none=False's would overrun the data region's budget).
        recorder = self._recording
        stack.enter_context(unrecorded_zero_grad(recorder.step_aside, recorder.step_back))
        # Nor for a swap_tensors (model.to() under the swap future): the view it records would hold the parameter,
        # and the swap refuse it (patches/swaps.py).
        stack.enter_context(unrecorded_swaps(recorder.step_aside, recorder.step_back))
        # An autograd.grad by no parameter (an attack's input gradient) is loop code, not a loss's backward: the
        # code around it is recorded on as one region, its backward's ops not (patches/backward.py).
        stack.enter_context(unrecorded_input_grads(recorder.step_aside, recorder.step_back))
        # A double backward in the loop's code (MAML's inner step): its gradient formulas' ops are recorded at the
        # line of its autograd.grad, which the recorder notes (what they made is a backward's: replay/tiered/step.py).
        stack.enter_context(marked_graph_grads(recorder.graph_grad_begins))
        # An evaluation under inference_mode: the recorder steps aside at its model calls as it does outside one
        # (the block's end would put torch's Python key back over an empty stack: patches/inference_blocks.py).
        stack.enter_context(balanced_inference_blocks())
        # A DataLoader's batch fetched inside a data region that once ran over its budget (recorder.py).
        stack.enter_context(unrecorded_batches(recorder.step_aside_for_batch, recorder.step_back))

    def pause(self) -> None:
        self._recording.pause()

    def detach(self) -> None:
        self._recording.take_off()

    def forget(self) -> None:
        self._recording.forget(last=True)


class Tiered(Recording):
    """Boundaries only; the failing step replayed at an event."""

    def __init__(self, config: WatchConfig, optimizers: Sequence[object], holds_data: bool, watch: ReplayHost,
                 nested: NestedWatch) -> None:
        super().__init__(config, optimizers, holds_data)
        self.replays = self.kept = StepReplays(watch, nested) if config.replay else None

    def forget(self) -> None:
        super().forget()
        if self.replays is not None:
            self.replays.clear()


def _kept(config: WatchConfig, watch: ReplayHost, nested: NestedWatch, trials: bool) -> StepReplays | None:
    """The step's top-level calls, kept for the fix trials of a per-call or traced watch (``trials``: it runs them)."""
    return StepReplays(watch, nested) if trials and config.fixes and config.replay else None


class PerCall(Recording):
    """Every module call checked; the producer's call replayed."""

    def __init__(self, config: WatchConfig, optimizers: Sequence[object], holds_data: bool, kept: StepReplays | None
                 ) -> None:
        super().__init__(config, optimizers, holds_data)
        self.replays_calls = config.replay
        self.kept = kept

    def forget(self) -> None:
        super().forget()
        if self.kept is not None:
            self.kept.clear()


class Traced(Localizing):
    """Every op traced; nothing replayed."""

    traces = True

    def __init__(self, kinds: frozenset[str], kept: StepReplays | None, trials: bool = False,
                 deferred: bool = False) -> None:
        super().__init__(kinds)
        self.kept = kept
        self._deferred = deferred  # (its tracer keeps the counts of what an origin reached: a boundary freed by then)
        # A user's watch that keeps no calls (fixes=False, replay=False) says why %debug stays where the step was
        # judged; a step replay's nested watch (no trials) says nothing: its report is the replay's.
        self._says_unkept = trials and kept is None

    def forget(self) -> None:
        if self.kept is not None:
            self.kept.clear()

    def optimizer_replay(self) -> ReplayStep | None:
        return None  # the tracer saw the step's ops

    def update_tracer(self, origins: OpOrigins) -> Callable[[], OpTracer | None] | None:
        return lambda: origins.tracer

    def attach(
        self, stack: ExitStack, origins: OpOrigins, module_name: Callable[[], str | None],
        phase_hint: Callable[[], Phase | None],
    ) -> None:
        super().attach(stack, origins, module_name, phase_hint)
        # The tracer names the innermost watched module running, from the forward hooks' stack.
        stack.enter_context(origins.make_tracer(self.kinds, module_name, phase_hint, self._deferred))
        # With the tracer (a dispatch mode) on the stack dynamo runs every frame eagerly, and torch.compile's
        # fullgraph=True raises where a call compiled no frame, unless the stance says eager (the user's stance
        # as they set it after: eager_stance.py).
        stack.enter_context(eager_stance())
        # The tracer's weak references to the tensors it read would make the user's swap_tensors (model.to() under
        # the swap future) raise: they go first (patches/swaps.py).
        stack.enter_context(forgotten_before_swaps(lambda tensor: _forget_known(origins, tensor)))
        if self.kept is not None:
            kept = self.kept
            origins.forward_line = ForwardLines(kept, lambda: kept.watch.step)
        elif self._says_unkept:
            origins.forward_line = ForwardLines(None, lambda: 0)


def _forget_known(origins: OpOrigins, tensor: torch.Tensor) -> None:
    if origins.tracer is not None:
        origins.tracer.known.forget(tensor)
        if origins.tracer.derived is not None:
            origins.tracer.derived.forget(tensor)


def localizing(
    config: WatchConfig, watch: ReplayHost, nested: NestedWatch, optimizers: Sequence[object], holds_data: bool,
    trials: bool = True,
) -> Localizing:
    """The mode ``config`` asks for (``optimizers``: those given to the watch; ``holds_data``: the deferred check's
    judging the batch after the next model call, with the data code's records held for it; ``trials``: the watch
    tries remedies at its first event, a step replay's nested watch does not)."""
    if config.ops:
        kept = _kept(config, watch, nested, trials)
        if kept is not None:
            kept.counts_nodes = True  # (a backward op's forward line, replayed from its call: line_replay.py)
        return Traced(config.kinds, kept, trials, deferred=holds_data)
    if config.tiered:
        return Tiered(config, optimizers, holds_data, watch, nested)
    return PerCall(config, optimizers, holds_data, _kept(config, watch, nested, trials))
