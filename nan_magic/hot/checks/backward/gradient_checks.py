"""Backward-phase checks: the loss, and the gradient flowing through each module.

The gradient of a module's output is computed by the backward of whatever
*consumed* that output in forward. So the first non-finite output gradient,
in backward execution order, names its consumer as the backward producer: the
gradient flowing into the consumer was finite (it came earlier and was
checked), the one it computed is not. Reporting the first non-finite
gradient's *owner* instead, as gradient-hook tools do, blames a module
downstream of the cause.

Only tensor hooks on module outputs are used: ``register_full_backward_hook``
wraps outputs in a view that breaks in-place ops.

Who calls whom: the forward hooks arm :meth:`GradientChecks.hook_output`, a plain callable the watch hands them;
the gradient checks know no forward checker in return. What they need of the forward side comes at construction:
the op origins (op_origins.py), and ``replay_backward``, :meth:`CallReplay.replay_backward_into` where calls keep
their arguments (localize/replay/producer_call.py). The step log carries where the last forward ended
(:attr:`StepLog.last_forward_seq`).
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nan_magic.errors.frames import pointer_at, user_line
from nan_magic.hot.checks.backward.filled import dropped_by_its_fill
from nan_magic.hot.checks.backward.loss_region import loss_region_nodes, loss_region_note
from nan_magic.hot.checks.backward.output_grad_hooks import judged_weakly
from nan_magic.hot.checks.hosts import CodeRecorder, GradientHost, LossCodeReads, OriginFinder
from nan_magic.hot.kept.call_records import Call, TensorRecord, consumer_of, gradient_label
from nan_magic.hot.kept.finding import Finding, record_ref
from nan_magic.hot.reads import BATCHED_GRADS, is_checkable, norms, read_scalars, relevant_kinds
from nan_magic.hot.stats import kinds_of
from nan_magic.records import LOSS, Note, Phase, SourcePointer, TensorRef, TensorRole

#: The gradient the loop gave a backward, ``out.backward(gradient)`` (logged beside the loss it starts from).
GIVEN_GRADIENT = TensorRef(TensorRole.INPUT, path="gradient given to backward()")

__all__ = ["GradientChecks", "ReplayBackward", "check_parameter_grads"]

#: How many of the user's non-finite variables a report names as suspects beside a loss code not recorded.
_SUSPECTS = 3
# Autograd node types that have ``_register_hook_dict`` (a C++ node's do; a custom Function's backward does not),
# and those that have not: asked once per type (_has_hook_dict), not with hasattr() at every output.
_HOOK_DICT_NODES: set[type] = set()
_OTHER_NODES: set[type] = set()


def _has_hook_dict(node: type, grad_fn: Any) -> bool:
    (_HOOK_DICT_NODES if (has := hasattr(grad_fn, "_register_hook_dict")) else _OTHER_NODES).add(node)
    return has
#: Replays the consumer whose backward made a gradient non-finite (:meth:`CallReplay.replay_backward_into`).
ReplayBackward = Callable[[Finding, Call, TensorRecord], None]


class GradientChecks:
    """Loss and per-module gradient checks of one watch (``replay_backward``: None where calls keep no arguments)."""

    def __init__(self, watch: GradientHost, origins: OriginFinder, loss_code: LossCodeReads,
                 replay_backward: ReplayBackward | None,
                 replay_anomaly: Callable[[Finding], bool] | None = None) -> None:
        self.watch = watch
        self._weakly = weakref.ref(self)
        self.origins = origins
        self._loss_code = loss_code
        self._replay_backward = replay_backward
        #: Where torch's anomaly mode stopped a backward that no check saw go non-finite, the module calls whose
        #: backward was running replayed (:meth:`CallReplay.replay_anomaly`); None where calls keep no arguments.
        self.replay_anomaly = replay_anomaly
        self.loss_record: TensorRecord | None = None
        # The id of the tensor the last backward started from: the deferred check's replay of the loss
        # code finds its records by it once it is freed (localize/outside/recorder.py).
        self.loss_key: int | None = None
        # The user's line of the last backward given a gradient (``user_line``), for a report of that gradient.
        self.given_line: tuple[Any, int, dict[str, Any]] | None = None
        # Deferred mode: the loss code's autograd nodes, described before
        # backward frees them (a backward producer there is found after).
        self.loss_region: Note | None = None
        self.reported_this_pass = False
        self.forget_queued = False
        self.backward_runs = 0
        # Deferred mode: leaves the loss code saved, held weakly until the check (localize/outside/entering.py).
        # (None: the loss code was recorded, and what it read is found in its records at the check.)
        self.loss_data: list[tuple[TensorRef, weakref.ref[torch.Tensor], SourcePointer | None]] | None = []
        # Deferred mode, the loss code recorded: the loss's autograd node and where the loss code began, for a walk
        # at an event (loss_region.py); dropped once the step is judged (forget_loss_graph).
        self.loss_graph: tuple[Any, int] | None = None
        # Deferred mode, the loss code not recorded: whether ``loss_region`` describes it (taken at backward).
        self.region_described = False
        # Deferred mode: where the loop called the last backward, ``(code, f_lasti, f_lineno)`` (no frame held: its
        # locals would stay alive), for %debug at that line as where a gradient is judged at once (Deferred).
        self.backward_caller: tuple[Any, int, int] | None = None

    def hook_output(self, record: TensorRecord, tensor: torch.Tensor) -> None:
        """Arm a gradient check on one module output (called from the forward hook).

        A tensor a child call returned first (``record.inner``) already has
        our hook, and :func:`~nan_magic.hot.kept.call_records.consumer_of` follows it outwards.
        """
        if record.inner is None:
            grad_fn = tensor.grad_fn  # None also when the tensor does not require grad
            if grad_fn is None:
                return
            hook = functools.partial(judged_weakly, self._weakly, record)  # (why weakly: output_grad_hooks.py)
            # (_register_grad_hook's fast path, inlined: every output of every checked call; whether a node type
            # has _register_hook_dict asked once per type)
            if (type(tensor) is torch.Tensor and tensor._backward_hooks is None
                    and ((node := type(grad_fn)) in _HOOK_DICT_NODES
                         or (node not in _OTHER_NODES and _has_hook_dict(node, grad_fn)))):
                tensor._backward_hooks = OrderedDict(nan_magic=hook)
                grad_fn._register_hook_dict(tensor)
            else:
                _register_grad_hook(tensor, grad_fn, hook)

    def on_backward_start(self, loss: torch.Tensor, retained: Any = False, gradient: Any = None) -> None:
        """Called by the wrapped ``Tensor.backward`` before autograd runs.

        The tensor backward starts from (the loss) is logged like a module output of code outside every module,
        and judged now or at the deferred check. ``retained``: the backward keeps the graph
        (``l1.backward(retain_graph=True); l2.backward()``): the loss code's records stay past it, for the next
        loss's judgement. ``gradient``: the one the loop gave the backward (``out.backward(grad)``: a policy
        gradient, a pipeline stage's gradient from the next), logged beside the loss: a value no watched code
        produced, judged as data.
        """
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        watch = self.watch
        if not watch.here.mine:
            return
        if watch.outside is not None:
            watch.outside.stop()  # the backward, the model's included, is not traced
        if not is_checkable(loss):
            return
        self.reported_this_pass = False
        self.forget_queued = retained  # (not queued for a graph kept for another backward)
        self.backward_runs += 1
        self.loss_key = id(loss)
        if gradient is not None and isinstance(gradient, torch.Tensor) and is_checkable(gradient):
            call = watch.log.new_call(Phase.FORWARD, None, None, None)
            self.loss_record = watch.log.record_output(call, LOSS, loss)
            watch.log.record_output(call, GIVEN_GRADIENT, gradient)
            self.given_line = user_line(sys._getframe(1))
            watch.log.finish(call)
        else:  # (``loss.backward()``, every step: the loss's call made, recorded and returned in one)
            self.loss_record = (call := watch.log.one_call(Phase.FORWARD, None, None, LOSS, loss)).outputs[0]
        watch.timing.loss_logged(self, call, loss)  # judged now, or kept for the step's check (hot/timing.py)

    def _node_origin(self) -> Callable[[Any], tuple[str | None, SourcePointer | None]] | None:
        """ops=True: the tracer names a node's saved tensor by the forward op that made the node, with its line."""
        tracer = self.origins.tracer
        return tracer.node_sources.forward_op if tracer is not None else None

    def keep_loss_code(self, loss: torch.Tensor) -> None:
        """Keep what the deferred check needs of the loss code that made ``loss``, before backward frees it."""
        watch = self.watch
        if watch.outside is not None and watch.outside.made(loss):
            # The loss code was recorded: its records tell at the check what data it read, and its nodes are
            # walked only at an event there, from the loss's node (held until then: once backward ran it holds
            # no saved tensor). Per op of loss code, walking and naming them now cost more than recording it.
            self.loss_region, self.loss_data, self.region_described = None, None, False
            self.loss_graph = (loss.grad_fn, watch.log.last_forward_seq)
        else:  # a few nodes, walked once per backward
            nodes = loss_region_nodes(loss.grad_fn, watch.log.last_forward_seq)
            self.loss_region, self.region_described = loss_region_note(nodes), True
            # Backward frees what they saved; the data among it is judged at the check.
            self.loss_data = self._loss_code.saved_leaves(nodes, self._node_origin())
            self.loss_graph = None

    def forget_loss_graph(self) -> None:
        """The step is judged (or the watch ends): the loss's autograd graph need not stay."""
        self.loss_graph = None

    @property
    def last_loss(self) -> float | None:
        """The last scalar loss, once its probe has been read."""
        record = self.loss_record
        if record is None or record._probe is not None or (record.shape and math.prod(record.shape) != 1):
            return None  # (a scalar's shape is (): no product; pending read directly, as the log does)
        return record.low

    def judge_loss(self, call: Call) -> None:
        """A non-finite loss: produced by the code outside the modules when they were all finite.

        A non-finite gradient the loop gave the backward (logged after the loss) is data, at its op if seen, where the
        loss is finite: a non-finite loss came first (the seed enters at the backward; ``softmax(losses.detach())``).
        """
        watch, kinds = self.watch, self.watch.config.kinds
        given, record = call.outputs[-1], call.outputs[0]
        loss_finite = record.status != "ok" or not relevant_kinds(record.kinds, kinds)
        if given.path == GIVEN_GRADIENT and given.status == "ok" and relevant_kinds(given.kinds, kinds) and loss_finite:
            tensor = given.live()
            finding = Finding(Phase.DATA, None, GIVEN_GRADIENT, bad=tensor.detach() if tensor is not None else None,
                              bad_stats=None if tensor is not None else given.stats(), record=given,
                              source=pointer_at(*self.given_line) if self.given_line is not None else None)
            finding.notes.append(Note("given-gradient"))
            self.origins.add_op_origin(finding, tensor)  # (the loop's op that made it: ``w / w.sum()``, all 0)
            watch.emit(finding)
            return
        if loss_finite:
            return
        every_output_finite = all(
            not output.kinds
            for other in watch.log.calls
            if other.info is not None and other.phase == Phase.FORWARD  # at the deferred check, gradients are in
            for output in other.outputs
            if not output.pending
        )
        # Calls whose output the watch could not read (a model called inside torch.func.vmap, an object holding
        # no tensor of its own): "every module output was finite" would claim reads it never made.
        unread = unread_note(watch.log.calls)
        tensor = record.live()
        suspects: list[Note] = []
        # ops=True: where no traced op made the loss non-finite (freed by the deferred check, a temporary, it is known
        # by its record's reference), what the traced loss code read from outside the trace counts as its data, as the
        # recorder's reads do in the tiered modes (a -inf log prior added to the logits, in a closure no frame shows).
        freed = record.ref if tensor is None else None
        traced = self.origins.tracer is not None and not self.origins.made_by_recorded_code(tensor, freed)
        if every_output_finite and self._given_to_the_loss(tensor, suspects, unread, traced, freed):
            return
        finding = Finding(
            Phase.FORWARD,
            None,
            LOSS,
            bad=tensor.detach() if tensor is not None else None,
            bad_stats=None if tensor is not None else record.stats(),
            record=record,
            inputs_finite=every_output_finite,
        )
        finding.notes.append(Note("outputs-were-bad") if not every_output_finite else unread or Note("outside-made-it"))
        finding.notes.extend(suspects)
        # A loss that was a temporary (``loss_fn(out, y).backward()``) is gone by the deferred check: its
        # records still know it by the id it had.
        self.origins.add_op_origin(finding, tensor, self.loss_key if record is self.loss_record else None)
        watch.on_loss_event(finding, tensor)  # (held where a GradScaler's scale made it: lifecycle/watch_events.py)

    def _given_to_the_loss(self, loss: torch.Tensor | None, suspects: list[Note], unread: Note | None = None,
                           traced: bool = False, freed: weakref.ref[torch.Tensor] | None = None) -> bool:
        """Report non-finite data that entered the loss code (a NaN label) as phase data; whether one did.

        Where the loss code ran over the recorder's budget, a non-finite tensor only the user's variables hold
        is added to ``suspects`` as a note, not reported as data: nothing tells whether the loss read it.
        ``unread``: the step's outputs-unread note, said with data the loss code met outside the models.
        ``traced``: the op tracer's reads of such tensors count too (for a gradient no op explained). ``freed``: the
        loss's record's weak reference, where the loss is gone by the deferred check.
        """
        watch = self.watch
        # What the recorded loss code read comes first, named by its op in either mode; then (deferred, where it
        # was not recorded) what its nodes saved.
        recorded = self._loss_code.recorded_leaves(self.loss_key) if self.loss_key is not None else None
        kept = [(label, tensor, line) for label, ref, line in self.loss_data or () if (tensor := ref()) is not None]
        # (ops=True: the tracer keeps what its forward ops read from outside it into a non-finite output.)
        tracer_read = list(self.origins.tracer.entered_data) if traced and self.origins.tracer is not None else []
        saved = (recorded or []) + kept + tracer_read
        # A tensor the loss code itself made non-finite from finite values (recorded, or traced) is that
        # code's product, not data, even where it needs no gradient (computed from a detached model output).
        def seen(tensor: torch.Tensor) -> bool:
            return watch.log.lookup(tensor) is not None

        # Recorded in full, the loss code read only what its records hold: a NaN lying in the user's
        # namespace is not the step's data.
        read_all = self.loss_key is not None and recorded is not None and self._loss_code.recorded_in_full(
            self.loss_key, seen)
        # So where the traced code made the loss non-finite from finite values (ops=True: an overflowing exp): no
        # data entered along that path, and a NaN kept from an earlier run in the user's variables is not it.
        read_all = read_all or self.origins.made_by_recorded_code(loss, freed)
        unrecorded = recorded is None and self._loss_code.unrecorded()
        entered = [
            (label, tensor, line)
            for label, tensor, line in self._loss_code.entering_tensors(
                loss, watch.log.last_forward_seq, seen, saved, read_all or unrecorded, self._node_origin()
            )
            if not self.origins.made_by_recorded_code(tensor) and not self.origins.made_deliberately_by_recorded_code(
                tensor)
        ]
        tracer = self.origins.tracer
        if tracer is not None and len(entered) > 1:
            # ops=True: a tensor the traced loss code read comes before one only the user's variables hold (a NaN
            # label read by ``(out - y) ** 2``, whose nodes save nothing of it, beside a NaN left from an earlier run).
            # A view the traced code took of a data tensor (``weight.unsqueeze(0)``) comes after the tensor itself:
            # the one the user made, and the one the deferred check (which keeps only what nodes saved) names.
            bases = {id(tensor) for _label, tensor, _line in entered}
            entered.sort(key=lambda item: (id(item[1]._base) in bases, tracer.known.get(item[1]) is None))
        if not entered and unrecorded:
            named = [label for label, _tensor, _line in self._loss_code.entering_tensors(
                loss, watch.log.last_forward_seq, seen, saved, False, self._node_origin())]
            if named:
                labels = tuple(str(ref) for ref in named[:_SUSPECTS])  # (str: render's tensor_label)
                suspects.append(Note.of("loss-unrecorded-suspects", tensors=labels))
        if not entered:
            return False
        given, tensor, line = entered[0]
        finding = Finding(Phase.DATA, None, given, bad=tensor.detach(), inputs_finite=False, source=line)
        finding.notes.append(
            Note("entered-outside") if unread is None else Note("entered-outside-unread", unread.facts))
        watch.emit(finding)
        return True

    def _on_output_grad(self, record: TensorRecord, grad: torch.Tensor) -> None:
        __tracebackhide__ = True  # an interrupt landing in a watch hook: IPython shows the user's frames, not ours
        watch = self.watch
        if not watch.listening() or grad is None or BATCHED_GRADS.running or not is_checkable(grad):
            return
        # The hook sits on the innermost call that returned the tensor (hook_output): on a per-module step a model's
        # output is its last layer's, the model's own record the outermost. A model that returns its loss (``model(x,
        # y).backward()``) hands its output on to the loss's record, of no model call: the model's output gradient.
        handed_on = record
        # (Not to a record of the tensor entering another model, ``head(body(x))``: its ``argument`` is set.)
        while ((outer := handed_on.outer) is not None and outer.argument is None and outer.call is not None
               and outer.call.info is not None):
            handed_on = outer
        returned_by = handed_on.call
        if returned_by is not None and returned_by.parent is None:
            if watch.replays is not None:
                # Kept for a replay of this step's backward (replay/tiered/step.py), until the step ends.
                watch.replays.capture_gradient(returned_by, str(handed_on.path), grad)
            if watch.outside is not None and not self.forget_queued:
                # The loss code's records serve its backward, which runs before this gradient arrives: judged as
                # they come, they go when this backward pass ends (after every such hook judged). The deferred check
                # reads them at the optimizer step, which lets them go (timing.step_judged).
                watch.timing.now(self._forget_after_backward, watch.outside)
        log = watch.log
        # The hot path: a gradient found finite by a sum, judged as it comes, is only noted.
        recorded, known = log.gradient_seen(grad)
        if not recorded and watch.timing.finite_by_sum(grad, known):
            log.finite_gradient(record, grad)
            if record.consumers or record.outer is not None:  # (none: a model's output the loss took, no call)
                self.release(record)
            return
        if (tracer := self.origins.tracer) is not None:
            tracer.gradient_recorded(grad)  # (ops mode, deferred: counted where an op's origin reached it)
        consumer = consumer_of(record)
        call = log.one_call(Phase.BACKWARD, consumer.info if consumer else None, None, gradient_label(record, consumer),
                            grad, ranged=False)
        call.consumer = consumer
        # The backward that made it: judged at the deferred check after another (``l1.backward(retain_graph=True);
        # l2.backward()``), its own loss's code is the one described and replayed, its line where %debug opens (judge).
        # (Not the loss's autograd graph: held here, it would outlive the step that forget_loss_graph ends.)
        call.loss_of = self.loss_record, self.loss_key, self.backward_caller
        call.target = record
        watch.timing.now(self.judge, call, record)
        self.release(record)

    def _forget_after_backward(self, outside: CodeRecorder) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(outside.forget)
        self.forget_queued = True

    @staticmethod
    def release(record: TensorRecord) -> None:
        """The gradient of this tensor is complete: its consumers need not hold it any more."""
        tensor = record.ref()
        if tensor is None:
            return
        current: TensorRecord | None = record
        while current is not None:  # record.outward(), without a generator: this runs for every gradient
            for consumer in current.consumers:
                if consumer.held is not None and consumer.held.kept is not None:
                    consumer.held.release(tensor)
            current = current.outer

    def judge(self, call: Call, target: TensorRecord | None = None) -> None:
        """Report the first non-finite gradient of a backward pass.

        ``target`` (immediate mode) is the forward tensor whose gradient
        this is: the consumer's backward can then be replayed for its op.
        """
        watch = self.watch
        record = call.outputs[0]
        tensor = record.live()
        if self.reported_this_pass or record.status == "benign" or not relevant_kinds(record.kinds, watch.config.kinds):
            return
        if dropped_by_its_fill(tensor, target if target is not None else getattr(call, "target", None)):
            record.status = "benign"  # (judged: not again at a later check, where the output may be gone)
            return
        self.reported_this_pass = True
        finding = Finding(
            Phase.BACKWARD,
            call,
            record_ref(record, TensorRole.OUTPUT_GRADIENT),
            bad=tensor.detach() if tensor is not None else None,
            bad_stats=None if tensor is not None else record.stats(),
            record=record,
        )
        loss_record, finding.loss_key, finding.backward_caller = getattr(call, "loss_of", None) or (
            self.loss_record, self.loss_key, self.backward_caller)
        loss_graph = self.loss_graph if loss_record is self.loss_record else None  # (else: the loss's own node)
        if call.info is None:
            finding.notes.append(Note("outside-backward"))
            if self.region_described:
                region = self.loss_region
            else:
                loss = loss_record.ref() if loss_record is not None else None
                start, boundary = loss_graph or (getattr(loss, "grad_fn", None), watch.log.last_forward_seq)
                region = loss_region_note(loss_region_nodes(start, boundary))
            if region:
                finding.notes.append(region)
            # Its recorded ops, replayed with their backward, name the backward op and its forward line.
            loss = loss_record.ref() if loss_record is not None else None
            if not self.origins.claim_loss_backward(finding, loss, finding.loss_key):
                # The gradient of a model's output: its hook sees the whole gradient of that tensor, which the
                # model's own backward adds to where the model also consumed it (an output_hidden_states), or
                # another model's backward made (a GAN's discriminator, during the generator's update). The
                # step replay tries the model calls before the code outside them is blamed (replay/tiered/step.py).
                # (Judged at the deferred check, the tensor is the one its hook kept: a user's gradient hook on a model
                # output, registered in its forward, ran before ours and made it.)
                returned = target if target is not None else getattr(call, "target", None)
                finding.unconfirmed_outside = returned is not None and _returned_by_a_model(returned)
                if self.origins.tracer is None:
                    finding.notes.append(Note("ops-for-forward-line"))
        else:
            mark = len(finding.notes)
            finding.notes.append(Note.of("module-backward", module=call.info.name))
            if target is not None and call.consumer is not None and self._replay_backward is not None:
                self._replay_backward(finding, call.consumer, target)
            if finding.op is None and self.origins.tracer is None:
                # Not the module's own backward: the loss code's, where a double backward of its autograd.grad
                # (create_graph: a WGAN-GP penalty's) reaches the module through the module's graph first. Claimed
                # there, the notes on the module's backward and its replay go.
                loss = loss_record.ref() if loss_record is not None else None
                said, finding.notes[mark:] = finding.notes[mark:], [Note("outside-backward")]
                if not self.origins.claim_loss_backward(finding, loss, finding.loss_key):
                    finding.notes[mark:mark + 1] = said
        self.origins.add_op_origin(finding, tensor)
        if call.info is None and finding.op is None:
            # No op of the loss code made it from finite values (recorded, replayed or traced): non-finite data
            # the loss code read and hid in its forward (``torch.where(known, (out - y) ** 2, 0)`` over NaN-coded
            # missing labels) reaches the gradient through the backward (0 * NaN). That data is the producer, as
            # it is of a non-finite loss.
            loss = loss_record.ref() if loss_record is not None else None
            if self._given_to_the_loss(loss, [], None, True, loss_record.ref if loss is None and loss_record else None):
                return
        watch.on_gradient_event(finding)


def _returned_by_a_model(record: TensorRecord) -> bool:
    """Whether ``record``'s tensor was returned by a call of a watched module (not the batch, not the loss)."""
    while record.outer is not None:
        record = record.outer
    return record.call is not None and record.call.info is not None and record.call.phase == Phase.FORWARD


def check_parameter_grads(
    named: list[tuple[str, torch.Tensor]], context: Note, kinds: frozenset[str]
) -> Finding | None:
    """A finding for the first non-finite ``.grad`` among named parameters.

    A function, not a method: the optimizer checks use it too, without reaching the gradient checks.
    """
    grads: list[tuple[str, torch.Tensor]] = [
        (name, parameter.grad)
        for name, parameter in named
        if parameter.grad is not None and is_checkable(parameter.grad)
    ]
    # One norm each, read in one transfer per device (no per-tensor host read on a GPU); a norm that is not
    # finite is confirmed elementwise (huge finite values overflow it).
    for (name, grad), norm in zip(grads, read_scalars(norms([grad for _name, grad in grads]))):
        if not math.isfinite(norm) and relevant_kinds(kinds_of(grad), kinds):
            finding = Finding(Phase.BACKWARD, None, TensorRef.gradient(name), bad=grad.detach())
            finding.notes.append(context)
            return finding
    return None


def _register_grad_hook(tensor: torch.Tensor, grad_fn: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """``tensor.register_hook(hook)``, for a tensor without hooks at about 60% of its cost.

    This runs once per module output. ``Tensor.register_hook`` makes a ``RemovableHandle`` (never used here: the
    hook dies with the tensor) and goes through the ``__torch_function__`` check; a plain tensor without hooks gets
    the same hook dictionary attached directly, the way ``register_hook`` attaches it. Any other tensor: the public
    path.
    """
    if type(tensor) is torch.Tensor and tensor._backward_hooks is None:
        register_dict = getattr(grad_fn, "_register_hook_dict", None)
        if register_dict is not None:
            # An OrderedDict, as torch makes it: a RemovableHandle the user
            # registers later holds a weak reference to it.
            tensor._backward_hooks = OrderedDict(nan_magic=hook)
            register_dict(tensor)
            return
    tensor.register_hook(hook)


def unread_note(calls: Iterable[Call]) -> Note | None:
    """The ``outputs-unread`` note of a step's forward calls whose output gave nothing to read, None if none.

    Facts: ``modules`` (their qualified names, the first few) and ``reasons`` (reads.unread_parts' words).
    """
    unread = [call for call in calls if call.unread and call.info is not None and call.phase == Phase.FORWARD]
    if not unread:
        return None
    modules = tuple(dict.fromkeys(call.name or "" for call in unread))
    reasons = tuple(dict.fromkeys(reason for call in unread for reason in call.unread))
    return Note.of("outputs-unread", modules=modules[:_SUSPECTS], more=max(0, len(modules) - _SUSPECTS),
                   reasons=reasons)
