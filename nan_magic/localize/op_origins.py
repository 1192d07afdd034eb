"""The op behind a non-finite value: the service every checker asks, and that asks none of them.

Ops mode (``ops=True``) traces every op with an :class:`~nan_magic.localize.ops.tracer.OpTracer`;
the tiered watch records the code outside the models
(:class:`~nan_magic.localize.outside.recorder.OutsideRecorder`), where the loss and data
code run. :class:`OpOrigins` holds whichever of the two this watch has and
answers, for a non-finite tensor at a boundary (a module output, the loss, a
gradient, a parameter, the batch), which op started it.

Who calls whom: the producer rule (producer.py), the gradient checks
(gradient_checks.py), the optimizer checks (step_checks.py) and the step replay
(replay/tiered/step.py) call it; it calls back only the callables the watch gave it
(``emit``, ``on_gradient_event``, ``info_by_name``), never a checker.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch

from nan_magic.hot.kept.call_records import Call, TensorRecord
from nan_magic.hot.kept.finding import Finding, named_inputs, record_ref
from nan_magic.hot.reads import is_checkable, relevant_kinds
from nan_magic.hot.stats import tensor_stats
from nan_magic.hot.watched.targets import ModuleInfo
from nan_magic.localize.forward_called import in_forward_called, made_by_data_code
from nan_magic.localize.ops.origins import OpFinding, apply_op_finding, attach_origin
from nan_magic.localize.ops.reached import bad_origin, failed_ops
from nan_magic.localize.ops.tracer import OpTracer
from nan_magic.localize.outside.recorder import OutsideRecorder
from nan_magic.localize.raised import traceback_tensors
from nan_magic.localize.swapped import SwappedTensors
from nan_magic.records import Note, Phase, TensorRef, TensorRole, TensorStats

__all__ = ["OpOrigins"]


class OpOrigins:
    """Where a boundary tensor's non-finite values started, from the op tracer or the outside recorder.

    ``outside`` is the tiered watch's recorder of the code outside the models, or None; ``emit`` records an event
    (:meth:`Watch.emit`), ``on_gradient_event`` a backward one, held while a GradScaler may skip the step. The
    watched modules' infos come by qualified name (``info_by_name``), all together (``infos``: a direct child's
    backward node, :meth:`_within`) and by the module's ``id`` (``info_by_id``: which of several of a class,
    :meth:`_owned`).
    """

    def __init__(
        self,
        outside: OutsideRecorder | None,
        emit: Callable[[Finding], None],
        on_gradient_event: Callable[[Finding], None],
        info_by_name: Callable[..., ModuleInfo | None],  # (name, and the model's label or None)
        infos: Callable[[], Iterable[ModuleInfo]] | None = None,
        info_by_id: Callable[[int], ModuleInfo | None] | None = None,
    ) -> None:
        self.outside = outside
        self._emit = emit
        self._on_gradient_event = on_gradient_event
        self._info_by_name = info_by_name
        self._infos = infos
        self._info_by_id = info_by_id
        #: The op tracer of ops mode, once the watch is attached (:meth:`make_tracer`).
        self.tracer: OpTracer | None = None
        #: What functional_call swapped into the calls' parameter slots (the producer rule's: swapped.py).
        self.swapped: SwappedTensors | None = None
        #: Per-call watch: this step's calls, and the replay of a call's backward (CallReplay.replay_backward_into),
        #: for a parameter whose own gradient alone went bad (:meth:`_replay_owner`); None elsewhere.
        self.owner_replay: tuple[Callable[[], Iterable[Call]], Callable[[Finding, Call, None], None]] | None = None
        #: The tensor the step's last backward started from (None once freed) and its id then: a parameter's
        #: gradient no boundary explained is looked for in its loss code's backward first (:meth:`add_op_origin`).
        self.last_loss: Callable[[], tuple[torch.Tensor | None, int | None]] | None = None
        #: The op of the loop's update code that wrote a gradient, run again from what it read (LoopWrites), or None.
        self.written_gradient: Callable[[torch.Tensor], OpFinding | None] | None = None
        #: Names the op of the loop's update code that made a step's non-finite learning rate (LoopWrites.name_lr).
        self.lr_source: Callable[[Finding, float, object], bool] | None = None
        #: Ops mode: %debug at a backward op's forward line, by a replay of the step's kept call that made its node
        #: (replay/line_replay.ForwardLines); None elsewhere.
        self.forward_line: Callable[[OpTracer, OpFinding, Finding], None] | None = None

    def make_tracer(
        self,
        kinds: frozenset[str],
        module_name: Callable[[], str | None],
        phase_hint: Callable[[], Phase | None],
        counting: bool = False,
    ) -> OpTracer:
        """The op tracer of ops mode; ``module_name`` names the innermost watched module running; ``counting``: the
        deferred check's, which keeps the counts of what an origin reached (a boundary freed by the check)."""
        self.tracer = OpTracer(kinds=kinds, module_name=module_name, phase_hint=phase_hint, at_boundary=True,
                               counting=counting)
        self.tracer.enclosing = self._enclosing
        self.tracer.within = self._within
        self.tracer.owned = self._owned
        self.tracer.named = self.tracer.node_sources.named = self.named
        return self.tracer

    def _enclosing(self, name: str, module_type: str) -> str | None:
        """The nearest watched module of class ``module_type`` at or above module ``name``, by its path in its model."""
        info = self._info_by_name(name)
        path = info.path if info is not None else ()
        for end in range(len(path), -1, -1):
            above = self._info_by_name(".".join(path[:end]))
            if above is not None and above.module_type == module_type:
                return above.name
        return None

    def _within(self, name: str, module_type: str) -> str | None:
        """The only watched module of class ``module_type`` strictly below module ``name`` (None: none, or several)."""
        info = self._info_by_name(name)
        if info is None or info.module_type == module_type or self._infos is None:
            return None
        depth = len(info.path)
        below = [other.name for other in self._infos() if other.module_type == module_type
                 and other.model == info.model and len(other.path) > depth and other.path[:depth] == info.path]
        return below[0] if len(below) == 1 else None

    def _owned(self, name: str, owner: int) -> str | None:
        """The watched module whose id is ``owner``, where it lies strictly below module ``name`` (else None)."""
        info = self._info_by_name(name)
        below = self._info_by_id(owner) if self._info_by_id is not None and info is not None else None
        if below is None or info is None or below.model != info.model:
            return None
        depth = len(info.path)
        return below.name if len(below.path) > depth and below.path[:depth] == info.path else None

    def named(self, key: int) -> str | None:
        """The name of the watched module whose id is ``key``, else None."""
        info = self._info_by_id(key) if self._info_by_id is not None else None
        return info.name if info is not None else None

    def made_by_recorded_code(self, tensor: torch.Tensor | None, freed: weakref.ref[torch.Tensor] | None = None
                              ) -> bool:
        """Whether an op of the traced or recorded code made ``tensor``'s non-finite values from finite ones.

        Such a tensor has a producer there (a ``(adv - adv.mean()) / adv.std()`` in the loss code, on a
        value detached from a model output): it is not data, even where it needs no gradient. ``freed``: the
        weak reference of a boundary's record whose tensor the deferred check finds gone (a loss that was a
        temporary, ``loss_fn(out, y).backward()``): the op tracer knows it by that reference.
        """
        if self.tracer is not None:
            return isinstance(self.tracer.origin_of(tensor, freed), OpFinding)
        return tensor is not None and self.outside is not None and isinstance(self.outside.claim(tensor), OpFinding)

    def made_deliberately_by_recorded_code(self, tensor: torch.Tensor) -> bool:
        """Whether the recorded code made ``tensor``'s non-finite values from a deliberate infinity (a -inf fill):
        not data either, though no op is its producer (the tiered mode's records; the op tracer tells it itself)."""
        return self.tracer is None and self.outside is not None and self.outside.made_deliberately(tensor)

    def birth_order(self, tensor: torch.Tensor, name: str = "") -> tuple[int, bool]:
        """Where the op tracer's origin of ``tensor`` stands among this step's, the first born first (ops mode);
        after them all where it has none (the tiered mode's replay finds the first born itself). Of gradients one
        origin made NaN (clip_grad_norm_'s NaN total norm in each), its module's ``name`` first: the one it wrote."""
        tracer = self.tracer
        origin = tracer.origin_of(tensor) if tracer is not None else None
        started = tracer.started if tracer is not None else []
        index = next((index for index, finding in enumerate(started) if finding is origin), len(started))
        module = origin.module if isinstance(origin, OpFinding) else None
        return index, not (module is not None and name.startswith(f"{module}."))

    def add_lr_origin(self, finding: Finding, lr: float, raw: object = None) -> bool:
        """An optimizer step made ``finding``'s parameter non-finite with the non-finite learning rate ``lr`` (the
        group's ``raw`` value): the op of the loop's code that made it (the update region's), where one did, else
        the loop's line that set it; True when either was named."""
        return self.lr_source is not None and self.lr_source(finding, lr, raw)

    def add_op_origin(self, finding: Finding, tensor: torch.Tensor | None, key: int | None = None) -> None:
        """Add the op that started a non-finite boundary tensor (loss, gradient, parameter, batch).

        Ops mode traces everything; the tiered mode records the code outside
        the models (outside/recorder.py), where the loss and data code run. ``key``:
        the id a tensor freed since had when recorded (the deferred check of
        a loss that was a temporary), for the recorder. The tracer finds a
        tensor freed by the deferred check by its record's weak reference.
        """
        outside = self.outside
        freed = finding.record.ref if tensor is None and finding.record is not None else None
        # A batch no op made non-finite (phase data) may hold a number the loop wrote into it (``x[3, 2] = nan``):
        # that write is named where the live op tracer or the data region's records saw it. Live, the lift is not
        # made the tracer's finding, which would stop its checks: the batch's event may be benign (the model handles
        # NaN-coded missing values) and the loss code may then make the step's event (test_handled_inputs).
        written = finding.phase == Phase.DATA or finding.tensor.role is TensorRole.PARAMETER_GRADIENT  # (g[0] = inf)
        if self.tracer is not None and (tensor is not None or freed is not None):
            origin = self.tracer.claim(tensor, freed)
            if freed is not None and isinstance(origin, OpFinding) and finding.bad is None and (
                    counted := self.tracer.freed_stats(freed)) is not None:
                # Freed by the deferred check, its probe counted nothing: its counts as the op that made it left them
                # (the report names the boundary, as the immediate watch does, not the op's output).
                finding.bad_stats = counted
            if origin is None and written and tensor is not None:
                origin = self.tracer.written_into(tensor, take=False)
        elif outside is not None and self.tracer is None and (tensor is not None or key is not None) and (
                finding.op is None):  # (named by the loss code's backward: a gradient its own autograd.grad made)
            origin = outside.claim(tensor, key, written=written)
            finding.in_graph_grad = isinstance(origin, OpFinding) and outside.claimed_in_graph_grad
            untraced = outside.note()
            # Said where the event's tensor came from that code: the loss code's (outside every module), or a
            # batch the data code made (phase data, at the model's argument) where the data region went unrecorded.
            data = finding.phase == Phase.DATA and "data" in outside.untraced
            if untraced is not None and origin is None and (finding.module is None or data):
                finding.notes.append(untraced)
        else:
            return
        if not isinstance(origin, OpFinding) and finding.tensor.role is TensorRole.PARAMETER_GRADIENT and (
                outside is not None and self.tracer is None and self.last_loss is not None):
            # No model output's gradient showed it: the loss code's backward may reach the parameter by another
            # path (a gradient penalty's double backward through autograd.grad(create_graph=True) recorded there,
            # a parameter the loss code reads). Its recorded ops, run again with their backward, name that op.
            origin = outside.claim_backward(*self.last_loss(), last=True)
            if origin is None and self.written_gradient is not None and tensor is not None:
                # Then the update code between backward and the step (``p.grad.div_(p.grad.norm())``).
                origin = self.written_gradient(tensor)
        if not isinstance(origin, OpFinding):
            if self.owner_replay is not None and finding.tensor.role is TensorRole.PARAMETER_GRADIENT:
                self._replay_owner(finding)
            return
        if finding.phase == Phase.FORWARD and finding.call is None and origin.phase == Phase.FORWARD:
            # The loss code's op made it, as an op inside a module would: the report's counts, operands and
            # cause are the op's (log got 7 zeros), the loss stays beside it; %debug opens where the op ran.
            if self.tracer is not None:
                tensors = self.tracer.producer_tensors if self.tracer.finding is origin else ()
                frame, position = self.tracer.frame_of(origin)
            else:
                assert outside is not None
                tensors, frame, position = outside.witness(origin)
                if outside.frame_note is not None:  # %debug opens where the step was judged, or in a later pass
                    finding.notes.append(outside.frame_note)
            boundary = finding.tensor
            apply_op_finding(finding, origin, tensors)
            if finding.module_output is not None and _same_values(finding.module_output[1], origin.output_stats):
                # The op returned the loss itself (a cross_entropy whose every label is ignored): it keeps its name.
                finding.tensor, finding.module_output = boundary, None
            if (outside is not None and self.tracer is None and outside.claimed_from_data) or origin.from_data:
                # The data code built it from outside data alone (a target from the annotations): data (PRODUCT.md).
                # The recorded modes tell it from the data region's records; ops mode's live tracer by its taint.
                made_by_data_code(finding)
            if frame is not None:
                finding.frame, finding.frame_position = frame, position
                if outside is not None and self.tracer is None:
                    finding.frame_calls = outside.calls_to(frame)
                if _dataset_code(frame, finding.frame_calls):
                    # A Dataset's own code (``__getitem__``, an IterableDataset's ``__iter__``) made what the loss
                    # read: the targets given to the loss, which are data (PRODUCT.md: phase), not the loss code.
                    made_by_data_code(finding)
                in_forward_called(finding, self._info_by_id)  # unless a model's own forward ran it (model.forward(x))
            # The op may have run inside a module whose output no check read (a result object it returned): typed.
            self._name_type_and_model(finding)
            return
        attach_origin(finding, origin)
        if finding.phase == Phase.FORWARD and finding.call is None and origin.phase == Phase.BACKWARD and (
                self.tracer is not None):
            # The loss code's own ``autograd.grad(create_graph=True)`` ran a gradient formula that made it (a PINN's
            # derivative by its input, through sqrt at 0): a backward producer, at the node's forward line.
            finding.phase = Phase.BACKWARD
        if finding.phase == Phase.DATA and origin.phase != Phase.BACKWARD:
            # The loop's code made the batch non-finite (``x = (x - m) / x.std(0)`` before the model call): %debug
            # opens at that op's line, not at the later line where the batch reached a boundary.
            self._frame_of_loop_op(finding, origin)
            in_forward_called(finding, self._info_by_id)  # unless that line is a model's own (model.forward(x))
        elif origin.phase == Phase.BACKWARD and self.tracer is None:
            self._frame_of_loop_op(finding, origin)  # the loss code's node: where its forward line ran (a helper's)
        self._narrow_to_submodule(finding, origin)
        self._name_type_and_model(finding)  # (a Python backward's module may have replaced the owner's: origins.py)
        if origin.backward_code and self.tracer is not None:
            # A Python backward's frame ran the op (a custom Function's): %debug opens there.
            finding.frame, finding.frame_position = self.tracer.frame_of(origin)
        elif origin.phase == Phase.BACKWARD and self.tracer is not None and self.forward_line is not None:
            self.forward_line(self.tracer, origin, finding)  # autograd's formula: its forward line, replayed

    def _frame_of_loop_op(self, finding: Finding, origin: OpFinding) -> None:
        """Point ``finding``'s frame at where the loop's op ``origin`` ran, as far as it is still known."""
        if self.tracer is not None:
            frame, position = self.tracer.frame_of(origin)
            calls: tuple[tuple[FrameType, int, int], ...] = ()
        elif self.outside is not None:
            _tensors, frame, position = self.outside.witness(origin)
            calls = self.outside.calls_to(frame)
            if self.outside.frame_note is not None:  # %debug opens where the step was judged, or in a later pass
                finding.notes.append(self.outside.frame_note)
        else:
            return
        if frame is not None:
            finding.frame, finding.frame_position, finding.frame_calls = frame, position, calls

    def _replay_owner(self, finding: Finding) -> None:
        """A parameter's gradient no module's input gradient showed (per-call watch): its owner's call replayed.

        ``x * sqrt(s * s)`` at ``s = 0``: the gradient flowing to ``x`` is 0, only ``s``'s own is 0 / 0, first
        seen at the optimizer's pre-hook. The tiered watch's step replay names its op; here the owner's latest
        call of the step runs again from what it kept, forward then backward, for the backward op that made it.
        An owner whose replay stays finite, or that never ran this step, lent the parameter to an enclosing
        module's own code (``qr(self.linear.weight)`` in its parent's forward, a classifier tied to the input
        embedding, ``h @ self.embed.weight.T``): the enclosing modules that ran are replayed, innermost first, until
        one names the op (its module, where the node was made, is the producer: ops/origins.apply_op_finding). The
        notes of the replays that found nothing go then: the op is known.
        """
        assert self.owner_replay is not None
        calls, replay_backward = self.owner_replay
        info = self._info_by_name(finding.module) if finding.module is not None else None
        # The owner, then each module above it in its model (by its path: targets.py), innermost first.
        names = [".".join(info.path[:end]) for end in range(len(info.path), -1, -1)] if info is not None else [
            finding.module]
        forward = [call for call in calls() if call.phase == Phase.FORWARD and call.info is not None and (
            info is None or call.info.model == info.model)]
        mark = len(finding.notes)
        for name in names:
            owner = next((call for call in reversed(forward) if call.name == name and call.held is not None), None)
            if owner is None or finding.op is not None:
                continue
            tried = len(finding.notes)
            replay_backward(finding, owner, None)
            if finding.op is not None:
                del finding.notes[mark:tried]
                self._name_type_and_model(finding)  # (the module whose code ran the op, if not the owner)

    def claim_loss_backward(self, finding: Finding, loss: torch.Tensor | None, key: int | None) -> bool:
        """Add the backward op of the recorded loss code that made ``finding``'s gradient non-finite; whether one did.

        ``loss`` is what backward started from (None once freed: ``key``, its id then, finds its record).
        """
        outside, origin = self.outside, None
        if outside is None:
            return False
        gradient = finding.record.ref() if finding.record is not None else None
        if gradient is not None and outside.made(gradient) and (root := outside.grad_root()) is not None:
            # A gradient recorded ops made: the loss code's own autograd.grad (an R1 penalty's), judged as it ran or
            # at the deferred check, after the loss's backward began: replayed from that grad's output, not the loss.
            origin = outside.claim_backward(root)
        if origin is None:
            # (``last``: or in the loss region's records held as recorded since its first backward ended, where a
            # second loss computed before that backward is: ``l1.backward(); l2.backward()``.)
            origin = outside.claim_backward(loss, key, last=True)
        if origin is not None:
            attach_origin(finding, origin)
            if self.tracer is None:
                self._frame_of_loop_op(finding, origin)  # %debug at the node's forward line (a loss helper's)
        return origin is not None

    def explain_failure(self, error: BaseException) -> Finding | None:
        """The non-finite input of the op that raised ``error``, with the op that made it; None without one.

        ``torch.multinomial`` on NaN probabilities raises before any boundary
        sees them. The op that raised ran under our dispatch mode (the op
        tracer, or the recorder of the code outside the models), so its
        arguments are in the traceback (:func:`run_op`'s frame); a non-finite
        one is claimed as a boundary would claim it: the op that made it is
        the producer, and the failing op is said in a note.
        """
        recorder = self.tracer or self.outside
        if recorder is None:
            return None
        failed = list(failed_ops(error))
        for func, arguments in failed:
            for tensor in arguments:
                if is_checkable(tensor) and relevant_kinds(tensor_stats(tensor).kinds, recorder.kinds):
                    return self._failed_on(Finding(Phase.FORWARD, None, TensorRef.argument("input"),
                                                   bad=tensor.detach()), tensor, error, str(func))
                if self.tracer is not None and (origin := bad_origin(self.tracer, tensor)) is not None:
                    # an index or a mask made from a non-finite value (``emb(nan.long())``): the op that made it
                    finding = Finding(Phase.FORWARD, None, TensorRef.argument("input"))
                    return self._failed_on(finding, None, error, str(func), origin.finding)
        if failed:
            return None  # (an op raised on finite values: the user's own error, whatever NaN the step discarded)
        if self.tracer is not None:
            # Raised by Python code right after it read a value made from a non-finite one (``int(nan)``, a
            # distribution's argument validation, the user's ``if not isfinite(x).all(): raise``): reached.py.
            read = self.tracer.read_bad
            if read is None:
                return None
            finding = Finding(Phase.FORWARD, None, TensorRef.argument("input"))
            return self._failed_on(finding, None, error, None, read)
        # Raised by Python code, not by an op: a tensor a frame of the traceback holds that recorded code made
        # non-finite is claimed the same way, the function that held it said in the note.
        for function, tensor in traceback_tensors(error):
            if relevant_kinds(tensor_stats(tensor).kinds, recorder.kinds) and self.made_by_recorded_code(tensor):
                return self._failed_on(Finding(Phase.FORWARD, None, TensorRef.argument("input"),
                                               bad=tensor.detach()), tensor, error, function)
        return None

    def _failed_on(self, finding: Finding, tensor: torch.Tensor | None, error: BaseException, func: str | None,
                   origin: OpFinding | None = None) -> Finding:
        """``finding`` of the value that reached what raised ``error``, with the op that made it."""
        if origin is not None:
            attach_origin(finding, origin)
            # (the value that reached it is an index or a Python number made from the op's output: its counts)
            finding.bad_stats = origin.output_stats
        else:
            self.add_op_origin(finding, tensor)
        self._name_type_and_model(finding)
        if func is not None:
            finding.notes.append(Note.raised("op-raised", error, func=func))
        else:
            finding.notes.append(Note.raised("forward-raised", error))
        return finding

    def report_op(self, op_finding: OpFinding, call: Call | None = None, record: TensorRecord | None = None,
                  notes: tuple[Note, ...] = ()) -> None:
        """Report the op that started a non-finite value that reached a module's output (``notes``: said with it)."""
        finding = self._op_finding(op_finding, call, record)
        finding.notes.extend(notes)
        if finding.phase == Phase.BACKWARD:
            self._on_gradient_event(finding)
        else:
            self._emit(finding)

    def anomaly_finding(self) -> Finding | None:
        """Under a live op tracer (``ops=True``): the finding of the first op of this step's backward that made a
        non-finite value, where torch's anomaly mode stopped the backward before a boundary claimed it; None without
        one. The first, not the node torch names: anomaly mode looks for NaN only, and an inf born earlier (a sqrt's
        gradient at 0) becomes NaN in a later node (``PowBackward0``), which carries the inf's origin on."""
        started = [origin for origin in self.tracer.started if origin.phase == Phase.BACKWARD] if self.tracer else []
        return self._op_finding(started[0], None, None) if started else None

    def _op_finding(self, op_finding: OpFinding, call: Call | None, record: TensorRecord | None) -> Finding:
        """The finding of the op that started a non-finite value (``record``: the boundary it reached)."""
        if call is None and record is not None:
            # The op ran in another module's code than the boundary's: this boundary passed it on.
            record.status, record = "propagated", None
        finding = Finding(op_finding.phase, call, TensorRef.op_output(op_finding.op, op_finding.tensor), record=record)
        if call is not None and op_finding.phase == Phase.FORWARD:
            # The producer module's arguments, as a per-module check reports them (their histograms beside the
            # op's operands): the replay that named the op still holds them.
            finding.inputs = named_inputs(call)
        tracer = self.tracer
        tensors = tracer.producer_tensors if tracer is not None and tracer.finding is op_finding else ()
        apply_op_finding(finding, op_finding, tensors)
        if record is not None and finding.phase == Phase.FORWARD:
            # The module output where the op's value reached the boundary, beside the op's own output.
            live = record.live()
            finding.module_output = (record_ref(record), tensor_stats(live) if live is not None
                                     else record.stats(), live)
        if tracer is not None:
            finding.frame, finding.frame_position = tracer.frame_of(op_finding)  # %debug opens where the op ran
            if finding.frame is not None:
                # From the loop's line that called the model, through each forward of the replay that called the
                # next, to the op's: the traceback's frames in call order (errors/frames.end_at_producer).
                finding.frame_calls = tracer.witnesses.calls_of(op_finding)
        self._name_type_and_model(finding)
        return finding

    def _narrow_to_submodule(self, finding: Finding, origin: OpFinding) -> None:
        """Name the submodule whose own forward line made the node of backward op ``origin``, not the module whose
        gradient showed the value (it passed through that module's own code: ``self.act(self.second(h) - 2)``).

        Only where the line is in the submodule's ``forward``: a torch module's node (a Linear's matmul) has its
        caller's line, in the enclosing module's code, which stays the producer, as the line says.
        """
        call = finding.call
        if call is not None and call.module is None:
            call = call.consumer  # (a gradient's call: the forward call whose backward computed it)
        if origin.phase != Phase.BACKWARD or call is None or call.module is None or finding.module is None:
            return
        outer = self._info_by_name(finding.module)
        inner = self._info_by_name(origin.module) if origin.module is not None else None
        if outer is None or inner is None or inner is outer or inner.path[:len(outer.path)] != outer.path:
            return
        submodule = call.module
        for part in inner.path[len(outer.path):]:  # (the user's names from the enclosing module down: targets.py)
            submodule = submodule._modules.get(part)
            if submodule is None:
                return
        if not _holds_line(getattr(type(submodule).forward, "__code__", None), origin.forward_source):
            return
        if finding.record is not None:
            # The boundary's row (the enclosing module's gradient) carried on what the submodule made.
            finding.record.status, finding.record = "propagated", None
        finding.module, finding.module_type = inner.name, None  # (its type named again: _name_type_and_model)

    def _name_type_and_model(self, finding: Finding) -> None:
        """The type and model of the module the op tracer named (by its name, in the model named already if any)."""
        if finding.module is not None and finding.module_type is None:
            info = self._info_by_name(finding.module, finding.model) or self._info_by_name(finding.module)
            if info is not None:
                # (A module two models share is named once, under the first: the model its call named stays.)
                finding.module_type, finding.model = info.module_type, finding.model or info.model


def _holds_line(code: Any, source: Any) -> bool:
    """Whether ``source`` (a SourcePointer) is a line of the function whose code object is ``code``."""
    if code is None or source is None or os.path.abspath(code.co_filename) != os.path.abspath(source.filename):
        return False
    lines = [line for _start, _end, line in code.co_lines() if line is not None]
    return bool(lines) and min(lines) <= source.lineno <= max(lines)


def _same_values(boundary: TensorStats, output: TensorStats | None) -> bool:
    """Whether the op's output is, by its shape and counts, the boundary tensor itself."""
    return output is not None and (boundary.shape, boundary.nan, boundary.posinf, boundary.neginf) == (
        output.shape, output.nan, output.posinf, output.neginf)


def _dataset_code(frame: FrameType, calls: Iterable[tuple[FrameType, int, int]]) -> bool:
    """Whether ``frame``, or a frame that called it, is a method of a ``torch.utils.data.Dataset`` (its fetch)."""
    return any(isinstance(caller.f_locals.get("self"), torch.utils.data.Dataset)
               for caller in (frame, *(call[0] for call in calls)))
