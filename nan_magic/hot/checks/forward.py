"""The forward pass: the global module hooks that record each watched call.

Global module hooks call :meth:`ForwardChecks.on_forward_pre` and
:meth:`ForwardChecks.on_forward` for every module; only watched modules are
recorded, on a module stack of :class:`~nan_magic.hot.kept.call_records.Frame`.
Each floating output gets one probe; the producer rule (producer.py) runs on
the few that are non-finite, at once or at the deferred check. A forward
producer is then replayed alone under the op tracer to name its op and line
(localize/replay/producer_call.py).

Who calls whom: the watch wires these hooks to their services at
construction, and nothing here reaches another checker through the watch.
The hooks call down into the producer rule (which they own, sharing the
module stack with it read-only), the call replay (whether calls keep their
arguments), and ``hook_gradient``: the gradient checks' hook on a module
output, given by the watch as a plain callable (None without backward
checks), so this module does not know the gradient checks. Top-level
calls open and (in inference) close the watch's steps, through its step
cycle (``watch.cycle``, step_cycle.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nan_magic.hot.checks.early import BATCH_RULE_EVERY, EXTREME_INPUT
from nan_magic.hot.checks.hosts import CallReplayer, ForwardHost, ProducerJudge
from nan_magic.hot.kept.call_records import (
    FIRST_ARGUMENT,
    Call,
    Frame,
    TensorRecord,
    argument_tensors,
    array_values,
    nested_values,
    plain_arguments,
)
from nan_magic.hot.kept.generators import states_of
from nan_magic.hot.kept.held import hold_arguments
from nan_magic.hot.kept.rng import capture_autocast, capture_rng_state
from nan_magic.hot.reads import is_checkable, iter_tensors, unread_parts
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.hot.watched.transparent import output_bound, passes_through, passes_through_unseen
from nan_magic.records import Phase

__all__ = ["ForwardChecks", "HookGradient"]

#: Arms the gradient check on one module output (:meth:`GradientChecks.hook_output`).
HookGradient = Callable[[TensorRecord, torch.Tensor], None]


class ForwardChecks:
    """Forward-pass checks of one watch: the module stack, and the producer rule it owns (:attr:`rule`)."""

    def __init__(
        self, watch: ForwardHost, replayer: CallReplayer, rule: ProducerJudge, stack: list[Frame],
        hook_gradient: HookGradient | None, keeps_plain: bool = False,
    ) -> None:
        self.watch = watch
        # ops=True judged at the step's end (defer): no call holds its arguments, so each keeps its plain ones.
        self._keeps_plain = keeps_plain
        #: The module stack, shared with the producer rule ``rule`` (the watch builds both).
        self.stack = stack
        self.replayer = replayer
        self._hook_gradient = hook_gradient
        self.rule = rule

    def on_forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        if not self.watch.here.mine or (self.stack and not self.watch.cycle.full_step):
            return  # inside a top-level call of a tiered step, only its boundaries are checked
        task = torch._C._current_graph_task_id()
        recomputing = task != self.watch.graph_task  # (Recomputing, below)
        if recomputing and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            # Non-reentrant checkpointing regenerates saved tensors under its saved-tensor hooks and
            # throws the graph away: the original forward's graph, with our hooks, is the one backward runs.
            # Recording it (probes, a replay of its early stop) would save tensors it does not expect.
            return
        info = self.watch.targets.modules.get(id(module))  # (module_info's lookup first: every module call)
        if info is None and (info := self.watch.module_info(module)) is None:
            return  # unwatched
        if info.compiled and self.watch.cycle.coverage.runs_compiled_eagerly:
            self._run_eagerly(info)
        if info.transparent is not None and self.stack and len(args) == 1 and type(args[0]) is torch.Tensor:
            known = self.watch.log.known_finite(args[0])
            if known is not None and passes_through(info.transparent, module, args[0], known[1], known[2]):
                # Cannot make its finite input non-finite: nothing to check (transparent.py).
                rng = capture_rng_state() if info.transparent == "dropout" and self.replayer.keeps_calls else None
                self.stack.append(Frame(module, info, None, rng, through=args[0], known=known, task=task))
                return
            if known is None and self._computed_by_parent(args[0]) and passes_through_unseen(info.transparent, args[0]):
                # Its parent's check covers it (transparent.py); nothing stands for its output.
                self.stack.append(Frame(module, info, None, None, task=task))
                return
        # A recompute's first call has an empty stack, but starts no step and brings no batch.
        top_level = not self.stack and not recomputing
        # A model call inside a backward pass (a reentrant checkpoint recomputing its forward) is no
        # boundary of the code outside the models: that code's records stay, and nothing of the backward
        # is recorded as loss code.
        outside = self.watch.outside if task == -1 else None
        if top_level:
            if outside is not None:
                outside.stop()
            tracer = self.watch.origins.tracer
            self.watch.cycle.forward_started(module, [t for _, t in iter_tensors(args, "input")] if tracer else ())
            cycle = self.watch.cycle
            if cycle.coverage.steps_aside(info.compiled, cycle.full_step, module):
                # Only this call's boundaries are checked: its submodules' calls need no hook at all.
                self.watch.module_hooks.step_aside_for(module)
        parent = self.stack[-1].call if self.stack else None
        call = self.watch.log.new_call(Phase.FORWARD, info, module, parent)
        # ``model(x)``: whether the batch is read, asked once for the replay's material, the inputs and the data call.
        checkable = is_checkable(args[0]) if len(args) == 1 and type(args[0]) is torch.Tensor else None
        # The generators' state before the call, so a replay draws the same
        # dropout mask (a few microseconds; only where a replay can happen and
        # the module may draw random numbers). A top-level call's is the step replay's.
        rng = None
        if top_level and self.watch.replays is not None:
            rng = self.watch.replays.begin(module, info, call, args, checkable)
        log = self.watch.log
        if checkable and not log._unseen:  # (``model(x)``, nothing left unseen: _note_inputs' one note)
            # (StepLog.note_input, inlined: every checked call. The record of its tensor, or of the pass-throughs'
            # input it stands for, names this call its consumer.)
            tensor = args[0]
            record = log._by_id.get(id(tensor))
            if record is None or record.ref() is not tensor:
                alias = log.alias_of(tensor) if log._aliases else None
                record = alias.record if alias is not None else None
            if record is not None:
                record.consumers.append(call)
            try:  # (version_of, inlined)
                version = tensor._version
            except RuntimeError:  # an inference tensor has none
                version = 0
            call.inputs.append((FIRST_ARGUMENT, 0, record, weakref.ref(tensor), version))
        else:
            self._note_inputs(call, args, "input", checkable)
        if rng is None and self.replayer.can_replay and not info.deterministic:
            rng = capture_rng_state()
            if info.generators:  # (a module holding a generator of its own: its state too, hot/kept/generators.py)
                rng = rng._replace(others=states_of(info.generators))
        self.stack.append(Frame(module, info, call, rng, task=task, args=args))
        if top_level or (info.is_root and not recomputing):
            self.record_data(info, module, args, "input", call if top_level else None, checkable)
        if top_level and outside is not None:
            # The batch is judged (or held for the check): what the loop computed can go, but the loss code a
            # training step computed before this call (recorder.start).
            outside.batch_entered(goes_on=self._loss_goes_on)

    def _run_eagerly(self, info: ModuleInfo) -> None:
        """A full watch calls a compiled model: its original module's code runs instead (module_hooks.py)."""
        config = self.watch.config
        mode = None if self.watch.replay_of is not None else ("ops=True" if config.ops else 'mode="full"')
        # The notice points at the call: this hook, torch's _call_impl and _wrapped_call_impl, then
        # OptimizedModule.__call__ where the model is the one called at top level.
        self.watch.module_hooks.run_eagerly(info.name or info.model or info.module_type, mode,
                                            stacklevel=5 if self.stack else 7)

    def on_forward(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        __tracebackhide__ = True  # (as on_forward_pre)
        # always_call hooks are called with (module, args, output) when the
        # forward raised, and with (module, args, kwargs, output) otherwise.
        if not self.watch.here.mine:
            return
        if not self.stack or self.stack[-1].module is not module:
            return
        frame = self.stack.pop()
        # A recompute's calls are recorded for their gradients only (see Recomputing). (The task the call began in:
        # a call returns in the graph task it started in.)
        task = frame.task
        recomputing = task != self.watch.graph_task  # (Recomputing, below)
        top_level = not self.stack and not recomputing
        if len(rest) != 2:
            if top_level and frame.call is not None:
                self.watch.on_forward_failed(module, frame.call)
            return
        kwargs, output = rest
        call = frame.call
        if call is None:
            if type(output) is not torch.Tensor:
                return
            if frame.through is None:
                self.watch.log.unseen(output)
            elif output is not frame.through and frame.known is not None and frame.info.transparent is not None:
                _record, low, high, _origin = frame.known
                bound = output_bound(frame.info.transparent, module, low, high)
                self.watch.log.alias(output, frame.through, module, frame.rng_state, bound, frame.known)
            return
        if top_level and self.watch.replays is not None:
            self.watch.replays.finish(module, kwargs, output)
        if kwargs:
            # Global pre-hooks never see kwargs, so they are noted on return.
            self._note_inputs(call, kwargs, "kwargs")
            if top_level or (frame.info.is_root and not recomputing):
                self.record_data(frame.info, module, kwargs, "kwargs", call if top_level else None)
        log = self.watch.log
        if frame.args is not args and frame.args is not None:
            # The module's own forward pre-hooks replaced the arguments (torch runs the watch's global pre-hook
            # first, these hooks' output is what this hook gets): a replay calls the module, so those hooks run
            # again, and on what they received, not on their own output (a normalising hook's 0 / 0 is its op).
            args = frame.args
        if frame.info.watched:
            hook_gradient = self._hook_gradient
            anchor = None
            # (A bare checkable tensor, the usual output, without iter_tensors' call: every checked call.)
            outputs = ([("output", output)] if type(output) is torch.Tensor and is_checkable(output)
                       else iter_tensors(output, "output", self.watch.skipped, attributes=True))
            for path, tensor in outputs:
                record = log.record_output(call, path, tensor)
                if hook_gradient is not None:
                    hook_gradient(record, tensor)
                if anchor is None and tensor.grad_fn is not None:
                    anchor = tensor
            if not call.outputs and output is not None:  # (nothing read: a vmap's value, an object; rare)
                call.unread = unread_parts(output)
            if (anchor is not None and self.replayer.keeps_calls) or self.replayer.replays_kept:
                # Without a graph (no_grad) only the deferred check replays the call: held weakly.
                call.held = hold_arguments(args, kwargs, self.replayer.classify, anchor)
                call.rng_state = frame.rng_state
                call.autocast = capture_autocast()
            elif self._keeps_plain:  # (the scene of the producer's call: model(xs, step)'s step)
                call.plain = plain_arguments(args, kwargs)
        call.finished = log.finished_count  # (log.finish, inlined: every checked call)
        log.finished_count += 1
        if frame.info.watched and not recomputing:  # (a recompute's values are the original forward's, judged then)
            for record in call.outputs:
                if record.kinds:  # finite outputs (the hot path, and every pending probe) need no judging
                    self.watch.timing.now(self._judge_outputs, call, frame, args, kwargs)
                    break
        if not self.stack:
            # Autograd nodes created from here on belong to the code outside the modules (loss_region.py).
            self.watch.log.last_forward_seq = torch._C._autograd._get_sequence_nr()
            cycle = self.watch.cycle
            if not (cycle.trains or cycle.training()):
                # Inference (no optimizer seen): the step's values are judged as each top-level call ends; the
                # step itself ends when its first top-level module is called again (step_cycle.forward_started).
                # Before the loss code: a training step's first call is judged here too (timing.py's judging).
                timing = self.watch.timing
                timing.judging = "model-return"
                try:
                    cycle.sync()
                finally:
                    timing.judging = None
                cycle.batch_arrays = []  # (its numpy batch judged)
                cycle.check_peers()  # another rank's event, where no optimizer step lets the ranks agree
            # A training loop's validation call (the trained model in eval mode, under no_grad): no loss code of its
            # own follows for a backward, so what runs until the next call is the next step's data code.
            cycle.validated = validated = not torch.is_grad_enabled() and self._validation(module)
            if self.watch.outside is not None and task == -1:
                # (Not in a backward pass, see on_forward_pre. A training step's loss code may go on across
                # another model call: recorder.start.)
                if validated:
                    self.watch.outside.start("data")
                else:
                    self.watch.outside.start("loss", goes_on=self._loss_goes_on)

    def _validation(self, module: nn.Module) -> bool:
        """Whether a no-grad top-level call of ``module`` is a training loop's validation: the model is in eval mode
        and an optimizer the watch has seen trains it (not a frozen teacher, nor an EMA copy of the model)."""
        cycle = self.watch.cycle
        return not module.training and (cycle.trains or cycle.training()) and cycle.optimized(module)

    def _loss_goes_on(self) -> bool:
        """Whether loss code recorded before a top-level call may go on after it: a training step's, with grad on."""
        return ((cycle := self.watch.cycle).trains or cycle.training()) and torch.is_grad_enabled()

    def _judge_outputs(self, call: Call, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for record in call.outputs:
            if record.kinds:  # finite outputs (the hot path) need no judging
                self.rule.judge(call, record, replay=(frame, args, kwargs))

    # Recomputing (``task != watch.graph_task``, inlined in both hooks): whether autograd runs a backward pass
    # the watch was not entered in: activation checkpointing's recompute. ``torch.utils.checkpoint`` calls the
    # checkpointed modules again inside backward. That is no new call of the user's: no step starts, no batch
    # enters, and its values are the original forward's, judged then. Taken for a top-level call, the
    # non-reentrant form's early stop (``_StopRecomputationError``) was "explained" by a replay, which saved
    # tensors the checkpoint counts, and backward failed. The reentrant form (a custom Function's backward)
    # builds the graph backward then runs, so its calls are recorded for their gradients. A CUDA backward runs on
    # autograd's own thread, where the watch's hooks ignore every call (hot/watched/owner.py). ``task`` is the
    # current autograd graph task (``-1`` outside backward).

    def _note_inputs(self, call: Call, values: Any, prefix: str, checkable: bool | None = None) -> None:
        """Note a call's tensor arguments, adopting outputs of pass-throughs left to their parent.

        Forward, the parent's check and replay cover such a pass-through. In
        backward, the gradient this call computes for its output must still
        be checked where it appears, to name this call as its producer.
        ``checkable``: ``module(x)``'s ``is_checkable(x)``, asked already (None: not that form).
        """
        log = self.watch.log
        if prefix == "input" and checkable is not None:
            # The hot path, ``module(x)``: no walk of the arguments.
            found: list[tuple[str, int | str, torch.Tensor]] = [(FIRST_ARGUMENT, 0, values[0])] if checkable else []
        else:
            found = argument_tensors(values, prefix)
        for path, argument, tensor in found:
            if log._unseen and log.is_unseen(tensor):  # (none, the usual case: no call)
                record = log.adopt(tensor)
                if self._hook_gradient is not None:
                    self._hook_gradient(record, tensor)
            log.note_input(call, path, argument, tensor)

    def _computed_by_parent(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a value of the running parent's own code, which a replay can reach.

        No watched call returned it (it has no record, and is no
        pass-through's output), the parent is a checked call, and its replay
        runs from its running frame (immediate mode, see :func:`transparent.passes_through_unseen`).
        """
        parent = self.stack[-1]
        return (
            self.replayer.replays_running
            and parent.call is not None
            and parent.info.watched
            and self.watch.log.lookup(tensor) is None
            and self.watch.log.alias_of(tensor) is None
        )

    def record_data(self, info: ModuleInfo, module: nn.Module, values: Any, prefix: str,
                    consumer: Call | None = None, checkable: bool | None = None) -> None:
        """Tensors entering a watched model from outside, as a ``data`` call.

        Judged like any call (immediately, or at the deferred check), first in
        order, so a NaN already in the batch is reported as phase ``data``.
        ``consumer`` is the top-level call they enter: the gradient its
        backward computes for one that requires gradients (an adversarial
        perturbation, a saliency map, another model's output) is a boundary
        too, judged as that call's backward (a frozen model has no parameter
        gradient to show it). ``checkable``: as for :meth:`_note_inputs`.
        """
        tensors: list[tuple[str, int | str, torch.Tensor]]
        if prefix == "input" and checkable is not None:  # model(x)
            batch = values[0]
            if not (batch.dtype.is_floating_point or batch.dtype.is_complex):
                return  # token ids: nothing to read, nothing the watch cannot read
            tensors = [(FIRST_ARGUMENT, 0, batch)] if checkable else argument_tensors(
                values, prefix, self.watch.skipped)
        else:
            # A batch object of the user's class (a graph library's ``Data``: ``model(data)``, its features
            # ``data.x``) brings its tensor attributes in, as a dataclass's fields do: a NaN there is data, not the
            # first line of the model's code that reads it.
            tensors = argument_tensors(values, prefix, self.watch.skipped, attributes=True)
        skipped = self.watch.skipped
        if skipped and "nested" in skipped:  # (no call unless a nested tensor was met: a dict's truth and `in`)
            tensors += nested_values(values, prefix)  # a jagged batch's values, read as its own (call_records.py)
        if checkable is None and (arrays := array_values(values, prefix)):  # (not ``model(x)`` of a tensor)
            tensors += arrays
            # Its records hold them weakly, and the deferred check reads them after the call: the step holds them
            # (every call's: ``model(a, w=w)`` records two), until it ends (step_cycle.py's release_arrays).
            self.watch.cycle.batch_arrays += [tensor for _path, _argument, tensor in arrays]
        if not tensors:
            return
        log = self.watch.log
        if consumer is not None and (prefix == "kwargs" or (checkable is None and len(tensors) > len(consumer.inputs))):
            # What _note_inputs left out of the call's inputs (an object's tensors, a numpy array's, a list of numbers
            # made a tensor): the call consumed them, as a tensor batch (its output propagated their NaN, it did not
            # produce it: the layer table's status); the deferred check looks for the keyword batch among them
            # (localize/producer.py's _keyword_data_first). (Compared by count first: ``model(x, mask)`` notes none.)
            noted = {input_path for input_path, *_rest in consumer.inputs}
            for path, argument, tensor in tensors:
                if path not in noted:
                    log.note_input(consumer, path, argument, tensor)
        if len(tensors) == 1:  # (``model(x)``, every step: the call made, recorded and returned in one)
            path, argument, tensor = tensors[0]
            call = log.one_call(Phase.DATA, info, module, path, tensor)
            record = call.outputs[0]
            record.argument = argument
            if consumer is not None and self._hook_gradient is not None and tensor.grad_fn is not None:
                record.consumers.append(consumer)  # (as below)
                self._hook_gradient(record, tensor)
            if (not record.kinds and -EXTREME_INPUT <= record.low <= record.high <= EXTREME_INPUT
                    and self.watch.cycle.step % BATCH_RULE_EVERY):
                # A finite batch read at once, with no extreme value, on a step the per-feature rule does not run:
                # _judge_data would find nothing to judge and the early warnings nothing to say (most steps). A
                # pending probe (deferred) has NaN bounds: the timing's ``now`` is asked, and holds it for the check.
                return
        else:
            call = log.new_call(Phase.DATA, info, module, None)
            for path, argument, tensor in tensors:
                record = log.record_output(call, path, tensor)
                record.argument = argument
                if consumer is not None and self._hook_gradient is not None and tensor.grad_fn is not None:
                    # Only a tensor with a graph: a hook on a leaf (a parameter, the user's perturbation)
                    # would stay on it after the watch.
                    record.consumers.append(consumer)
                    self._hook_gradient(record, tensor)
            log.finish(call)
        self.watch.timing.now(self._judge_data, call, tensors)

    def _judge_data(self, call: Call, tensors: list[tuple[str, int | str, torch.Tensor]]) -> None:
        """The data call's verdict, and the early warnings of its batch (the deferred mode's come with the step's)."""
        for record in call.outputs:
            if record.kinds:  # (a finite batch, every step's, has no verdict to give: the rule's first test)
                self.rule.judge(call, record)
        for (path, _argument, tensor), record in zip(tensors, call.outputs):
            if record.status == "benign":
                continue  # a deliberate mask is no batch to warn about
            probe = (record.low, record.high)
            cycle = self.watch.cycle
            if early := cycle.early.observe_batch(cycle.step, path, tensor, probe):
                cycle.warn(early)

    def current_module_name(self) -> str | None:
        """The innermost watched module running (``exclude``/``include`` leave modules unwatched)."""
        for frame in reversed(self.stack):
            if frame.info.watched:
                return frame.info.name
        return None
