"""The producer rule: whether a non-finite module output was made by its call or passed on.

PRODUCT.md: the producer is where the *first* non-finite value appeared.
:meth:`ProducerRule.judge` decides it for one output of one call, at once
(immediate mode) or at the deferred check, from what the call received (in
place aware), what its children made, and the deliberate infinities (masks)
it may consume. A value that no checked call returned was made by a caller's
own code (:meth:`ProducerRule._blame_own_code`): that caller is the producer.

Who calls whom: the forward hooks (forward.py) own the module stack and
call :meth:`~ProducerRule.judge`, as does the watch's deferred check. The
rule calls down only: the call replay (replay/producer_call.py) to name a producer's
op, the op origins (op_origins.py) in ops mode, and ``emit``. It never calls
the forward hooks or the gradient checks.

What a call received (its inputs' kinds, its parameters, the deliberate masks among them) is
:mod:`~nan_magic.localize.producer_inputs`, a mixin of :class:`ProducerRule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nan_magic.errors.warning_lines import heard_in_the_step
from nan_magic.hot.kept.call_records import Call, Frame, TensorRecord, argument_tensors, array_values
from nan_magic.hot.kept.finding import Finding, mark_deliberate, named_inputs, record_ref
from nan_magic.hot.kept.held import running_arguments
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.reads import is_checkable, relevant_kinds, version_of
from nan_magic.hot.stats import kinds_of, tensor_stats
from nan_magic.hot.wrapped import unwrapped, wraps_a_parameter
from nan_magic.localize.op_origins import OpOrigins
from nan_magic.localize.ops.masks import DeliberateMasks
from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.producer_inputs import CallInputs, _detached
from nan_magic.localize.replay.calls_named import caller_named
from nan_magic.localize.replay.outward import CHANGED, replay_around_a_pick, replay_outward
from nan_magic.localize.replay.producer_call import CallReplay
from nan_magic.localize.swapped import SwappedTensors, stand_ins
from nan_magic.options import WatchConfig
from nan_magic.records import Note, Phase, TensorRef, TensorRole

__all__ = ["ProducerRule"]


class ProducerRule(CallInputs):
    """The producer rule of one watch, and the deliberate masks it has seen.

    ``stack`` is the forward hooks' module stack (read only here): a call
    still running is replayed from its frame's arguments.
    """

    def __init__(
        self,
        config: WatchConfig,
        log: StepLog,
        emit: Callable[[Finding], None],
        replayer: CallReplay,
        origins: OpOrigins,
        stack: list[Frame],
        held: HeldBatch,
    ) -> None:
        self.kinds = config.kinds
        self._log = log
        self._emit = emit
        self.replayer = replayer
        self.origins = origins
        #: The finding of the loop's code that assigned a parameter a forward read non-finite (``p.data = v``), by
        #: the op that made its memory (LoopWrites.claim_assigned), or None; asked at that event only.
        self.assigned: Callable[[str, torch.Tensor], Finding | None] | None = None
        #: Report the optimizer step that left a parameter a forward read non-finite, where its check was skipped as
        #: bounded (OptimizerChecks.check_unchecked_of); True where it did. Asked at that event only.
        self.unchecked_step: Callable[[torch.Tensor], bool] | None = None
        self.stack = stack
        #: The step's non-finite batch, held until the step shows whether the program handled it (held_batch.py).
        self.held = held
        # Infinite mask tensors given as arguments or held as buffers (ops/masks.py).
        self.deliberate = DeliberateMasks()
        # Keyword-argument data records judged ahead of their turn (_keyword_data_first), by id; the running
        # top-level call whose keyword arguments were judged so.
        self._keyword_judged: dict[int, TensorRecord] = {}
        self._keywords_of: Call | None = None
        # What functional_call swapped into a call's parameter slots, for the deferred check (swapped.py); the
        # watch's mode holds the patch that tells it (modes.py).
        self.swapped = origins.swapped = SwappedTensors(log)

    def take_as_deliberate(self, tensor: torch.Tensor) -> None:
        """``tensor``'s infinities are a deliberate mask where they enter (replay/tiered/root_calls.rerun)."""
        self.deliberate.give(tensor)

    def judge(
        self,
        call: Call,
        record: TensorRecord,
        detected_at: Note | None = None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None = None,
        _first: bool = False,
    ) -> None:
        """Producer or propagator? The one rule, for immediate and deferred checks.

        PRODUCT.md: the producer is where the *first* non-finite value
        appeared. A call that received one (before the call: in-place
        aware), or inside which a child made one, passes it on, even where
        it makes a new kind of it (inf - inf). Only a deliberate infinity
        (a mask, see :meth:`CallReplay.replay_into`) may come in: then the call is the
        producer of a kind it did not receive (softmax of a fully masked
        row). A non-finite parameter or buffer it read is reported as such.
        """
        out_kinds = relevant_kinds(record.kinds, self.kinds)
        if not out_kinds:
            return
        if call.phase == Phase.FORWARD and call.parent is not None and self._keyword_data_first(call):
            record.status = "propagated"
            return
        tensor = record.live()
        if call.phase == Phase.DATA:
            if not _first and self._keyword_judged and self._keyword_judged.pop(id(record), None) is record:
                return  # judged already, ahead of its turn (_keyword_data_first)
            if self.is_benign_input(call, str(record.path), record.argument, tensor, record):
                self._note_mask(call, record, tensor)
                return
            if record.inner is not None and record.inner.status == "benign" and record.kinds <= record.inner.kinds:
                # Another watched model's output, its infinities judged deliberate there (a policy's -inf fill)
                # and passed on: benign while this model keeps them so (its softmax over a fully masked row is not).
                # Only the kinds judged there: the loop's in-place shift of it (-inf - -inf) made a NaN since.
                record.status = "benign"
                return
            finding = Finding(Phase.DATA, call, record_ref(record, TensorRole.INPUT), bad=_detached(tensor),
                              record=record, bad_stats=record.stats() if tensor is None else None, inputs_finite=False)
            if self.origins.outside is not None or self.origins.tracer is not None:
                self.origins.add_op_origin(finding, tensor)  # a batch the loop computed: its op and line
            if "nan" not in out_kinds and ("+inf" in out_kinds or record.high not in (0.0, -math.inf)):
                # A +inf entering is an overflow, and a -inf among values above 0 (the log of a count of 0) is no
                # mask the model could open: an event where it enters, as before.
                self._emit(finding)
                return
            # NaN, the code of a missing value: held for the step, an event if anything else of it goes non-finite,
            # benign if the program handles it (a model that imputes its missing values: held_batch.py). So is -inf
            # that the mask rule (ops/masks.py) did not take as a mask as it entered (all -inf: a static KV cache's
            # bias, whose slots the model opens in place before its attention reads it; or read after that write,
            # only its probe left): benign at the step's end only where it was opened into a mask so (held_batch.py).
            self.held.hold(finding)
            return
        if self.origins.tracer is not None and self._judged_by_tracer(call, record, tensor):
            return
        if tensor is not None:
            out_kinds = relevant_kinds(tensor_stats(tensor).kinds, self.kinds)
        input_kinds, deliberate = self.input_kinds(call)
        parent = call.parent
        if parent is not None:
            parent.inner_kinds |= call.inner_kinds
            parent.deliberate_kinds |= call.deliberate_kinds
        if input_kinds or call.inner_kinds:
            record.status = "propagated"
            if self.held.finding is not None:
                self.held.release()  # a non-finite batch came in this step: it is the event (held_batch.py)
            if input_kinds and not call.inner_kinds:
                self._blame_own_code(call, detected_at)
            return
        produced = out_kinds - deliberate - call.deliberate_kinds
        if produced and call.module is not None:
            # A -inf from a mask buffer it holds is passed on, like one from a mask argument (ops/masks.py).
            produced -= self._mask_buffer_kinds(call)
        if not produced:
            record.status = "benign"  # passes on the deliberate infinity it received
            return
        benign = self._report_producer(call, record, tensor, produced, detected_at, replay)
        if parent is not None:
            if benign:
                parent.deliberate_kinds |= produced
            else:
                parent.inner_kinds |= produced

    def _report_producer(
        self,
        call: Call,
        record: TensorRecord,
        tensor: torch.Tensor | None,
        produced: frozenset[str],
        detected_at: Note | None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None,
    ) -> bool:
        """Emit the finding of a producer call, replayed for its op; True when it proved benign."""
        inputs = named_inputs(call)
        if self._stand_in_made_by_loop(call, detected_at):
            return False
        bad_parameter = self._bad_parameter(call)
        if bad_parameter is not None:
            ref, parameter = bad_parameter
            name = ref.name
            # The loop's code may have assigned it (``p.data = v``): then that code's op and line are the finding.
            assigned = self.assigned(name, parameter) if self.assigned is not None and name is not None else None
            if assigned is not None:
                finding = assigned
            elif self.unchecked_step is not None and self.unchecked_step(parameter):
                return False  # the step that made it is the event (its state was non-finite before it)
            else:
                finding = Finding(Phase.FORWARD, call, ref, bad=parameter.detach(), record=record, inputs=inputs)
                finding.notes.append(Note.of("already-bad", name=name, module=call.name))
        else:
            finding = Finding(
                Phase.FORWARD,
                call,
                record_ref(record),
                bad=_detached(tensor),
                record=record,
                bad_stats=None if tensor is not None else record.stats(),
                inputs=inputs,
            )
            if replay is not None:
                finding.rng_state = replay[0].rng_state
                with heard_in_the_step():  # (the user's call run again: its warnings were said as it ran)
                    # (A max's pick of a mask that another call passed on, which this call made a new kind of.)
                    picked = replay_around_a_pick(self.replayer, finding, call, self.stack)
                    if not picked and self.replayer.replay_into(finding, produced, *replay):
                        return True
                    if not picked:
                        self._replay_outward(finding, call)
            elif self.replayer.replays_kept and self.replayer.replay_deferred(finding, produced, call):
                return True
        if detected_at:
            finding.notes.append(detected_at)
        self._emit(finding)
        return False

    def _stand_in_made_by_loop(self, call: Call, detected_at: Note | None) -> bool:
        """A non-finite tensor that ``functional_call`` swapped in for a parameter of ``call``: reported (whether one).

        It is not the module's parameter but an input the loop's code made (MAML's ``p - g * lr``): phase
        forward, no module, the op and line that made it (the recorder of the loop's code, or the op tracer).
        """
        found = self._bad_stand_in(call)
        if found is None:
            return False
        name, tensor = found
        finding = Finding(Phase.FORWARD, None, TensorRef(TensorRole.INPUT, None, name), bad=tensor.detach())
        finding.notes.append(Note.of("swapped-in", name=name))
        self.origins.add_op_origin(finding, tensor)
        if detected_at:
            finding.notes.append(detected_at)
        self._emit(finding)
        return True

    def _bad_stand_in(self, call: Call) -> tuple[str, torch.Tensor] | None:
        """The first non-finite tensor ``functional_call`` swapped in for a parameter of ``call``, named; or None.

        Inside the swap, the module holds them; after it (the deferred check), what was kept for the call that
        ``functional_call`` ran: ``call`` or an enclosing one (``functional_call(model, fast, ...)`` swaps the
        root's slots, and the check judges the child whose output went bad), named from the model's root.
        """
        if call.module is None:
            return None
        prefix = f"{call.name}." if call.name else ""
        found = stand_ins(call.module, prefix)
        swapped: Call | None = call
        while swapped is not None:
            outer = f"{swapped.name}." if swapped.name else ""
            found += [(outer + name, tensor) for name, tensor in self.swapped.of(swapped)
                      if (outer + name).startswith(prefix)]  # (the slots of call's own module and below)
            swapped = swapped.parent
        for name, tensor in found:
            # (Inside torch.func.grad or vmap the slots hold the transform's wrappers of the loop's tensors: read
            # and named by the loop's tensor itself.)
            if wraps_a_parameter(tensor):
                continue  # (the model's own weight under a transform: a parameter, not the loop's tensor)
            if (inner := unwrapped(tensor)) is not None:
                tensor = inner
            if is_checkable(tensor) and relevant_kinds(kinds_of(tensor), self.kinds):
                return name, tensor
        return None

    def _blame_own_code(self, call: Call, detected_at: Note | None) -> None:
        """``call`` received a non-finite input that no checked call returned: its caller's own code made it.

        The value was computed between the children of an enclosing call
        (``h = h / x[:, :1]; return self.b(h)``), so the enclosing call is the
        producer: the innermost one whose own inputs were finite. Its forward
        is replayed, from its running frame's arguments (immediate mode) or
        what it kept (deferred), to name the op and line.
        """
        consumer, origin = call, self._made_by_caller(call)
        enclosing = call.parent
        while origin is not None and enclosing is not None and self.input_kinds(enclosing)[0]:
            # The enclosing call received it too: look further out.
            consumer, origin, enclosing = enclosing, self._made_by_caller(enclosing), enclosing.parent
        if origin is None or enclosing is None or enclosing.info is None:
            return  # a value entering the watched code is judged as data, where it enters
        path, tensor = origin
        if enclosing.parent is None and self._entered_by_keyword(enclosing, tensor):
            return
        kinds = relevant_kinds(kinds_of(tensor), self.kinds)
        # Its own output check, later, must see a propagator.
        enclosing.inner_kinds |= kinds
        # The value its own code made is the producer's row of the layer table
        # (the enclosing call may never return: the event stops it).
        log = self._log
        record = log.record_output(enclosing, TensorRef(TensorRole.INPUT, consumer.name, path), tensor)
        if record.pending:
            log.resolve()  # deferred mode, at the check: read it now
        finding = Finding(
            Phase.FORWARD, enclosing, record_ref(record), bad=tensor.detach(), record=record,
            inputs=named_inputs(enclosing),
        )
        finding.notes.append(Note.of("own-code", module=enclosing.name, consumer=consumer.name, path=path))
        if detected_at:
            finding.notes.append(detected_at)
        if not self._replay_enclosing(finding, kinds, enclosing):
            self._emit(finding)

    def _entered_by_keyword(self, top: Call, tensor: torch.Tensor,
                            entry: tuple[str, int | str, torch.Tensor] | None = None) -> bool:
        """Judge ``tensor`` as data where a keyword argument of the running top-level call ``top`` holds it.

        Global pre-hooks never see keyword arguments (``model(input_ids=x)``): the
        watch notes them as the call returns, after its children ran. An event
        inside the call (the immediate mode) finds them in the call's frame. ``entry``: where it was found already
        (:func:`_keyword_batch`: a numpy array's tensor is made anew at each look).
        """
        if entry is None:
            passed = running_arguments(top.module)
            if passed is None:
                return False
            entry = next((found for found in argument_tensors(passed[1], "kwargs") if found[2] is tensor), None)
            if entry is None:
                return False
        path, argument, _tensor = entry
        log = self._log
        call = log.new_call(Phase.DATA, top.info, top.module, None)
        record = log.record_output(call, path, tensor)
        record.argument = argument
        log.finish(call)
        self.judge(call, record)
        return self._released(record) or record.status != "benign"  # (a mask passed by keyword is no event)

    def _released(self, record: TensorRecord) -> bool:
        """Whether ``record`` is the batch held (held_batch.py), now the event: a value of its step went non-finite."""
        return self.held.finding is not None and self.held.finding.record is record and self.held.release()

    def _keyword_data_first(self, call: Call) -> bool:
        """Judge the keyword-argument batch of ``call``'s top-level call first, where it holds a non-finite value.

        A batch is judged first in a step (PRODUCT.md: phase data), but global pre-hooks never see a call's keyword
        arguments (``model(**batch)``, ``model(pixel_values=(x - mean) / std)``): the watch notes them as the call
        returns, after its children's outputs. A child judged before them would be named the producer (the op
        tracer's origin of its input, the loop's division, in forward; the deferred check's child whose input it
        freed) where the batch came in non-finite. True where the batch was the event.
        """
        top = call
        while top.parent is not None:
            top = top.parent
        if top.info is None:
            return False
        if top.finished < 0:  # running (the immediate check): its keyword arguments are in its frame
            if self._keywords_of is top:
                return False
            self._keywords_of = top  # (once per call: judge runs at each non-finite record)
            passed = running_arguments(top.module)
            entering = _keyword_batch(passed[1]) if passed is not None else []
            return any(is_checkable(entry[2]) and relevant_kinds(kinds_of(entry[2]), self.kinds)
                       and self._entered_by_keyword(top, entry[2], entry) for entry in entering)
        for path, _argument, _record, ref, _version in top.inputs:  # returned (the deferred check): recorded then
            tensor = ref()
            record = self._log.lookup(tensor) if tensor is not None and path.startswith("kwargs") else None
            if (record is None or record.call is None or record.call.phase != Phase.DATA or not record.kinds
                    or self._keyword_judged.get(id(record)) is record):
                continue
            self._keyword_judged[id(record)] = record
            self.judge(record.call, record, _first=True)
            if self._released(record) or record.status != "benign":
                return True
        return False

    def _made_by_caller(self, call: Call) -> tuple[str, torch.Tensor] | None:
        """A non-finite input of ``call`` not returned non-finite by any checked call (nor the data).

        Inputs a checked call (or the data check) returned non-finite were
        judged there. One with no record, or whose record was finite but
        which is non-finite now (changed in place since), was made by the
        caller's own code.
        """
        for path, argument, record, ref, version in call.inputs:
            if record is not None and record.call is not None and record.kinds:
                continue
            tensor = ref()
            if tensor is None or version_of(tensor) != version or not is_checkable(tensor):
                continue
            # A deliberate mask the caller made is no fault of its own code.
            if relevant_kinds(kinds_of(tensor), self.kinds) and not self.is_benign_input(
                call, path, argument, tensor, record
            ):
                return path, tensor
        return None

    def _replay_enclosing(self, finding: Finding, kinds: frozenset[str], enclosing: Call) -> bool:
        """Replay the enclosing call for its op (the notes say why it cannot be); True when it proved benign."""
        if not self.replayer.can_replay:
            return False
        if self.replayer.replays_kept:
            arguments = self.replayer.kept_arguments(enclosing)
            if isinstance(arguments, Note):
                finding.notes.append(Note.of("arguments-gone", module=finding.module, reason=arguments.pair))
                return False
            frame = Frame(enclosing.module, enclosing.info, enclosing, enclosing.rng_state)  # type: ignore[arg-type]
            finding.rng_state = enclosing.rng_state
            return self.replayer.replay_into(finding, kinds, frame, arguments.args, arguments.kwargs)
        running = next((frame for frame in reversed(self.stack) if frame.call is enclosing), None)
        passed = running_arguments(enclosing.module)
        if running is None or passed is None:
            return False
        finding.rng_state = running.rng_state
        # What its __call__ got, before the module's own pre-hooks (forward.py keeps it): the replay runs them again.
        args = passed[0] if running.args is None else running.args
        if self.replayer.replay_into(finding, kinds, running, args, passed[1]):
            return True
        self._replay_outward(finding, enclosing)
        return False

    def _replay_outward(self, finding: Finding, call: Call) -> None:
        """The producer's replay began from an object its call had changed (a KV cache): replay the calls around it."""
        if finding.op is None and finding.notes and finding.notes[-1].kind == CHANGED:
            replay_outward(self.replayer, finding, call, self.stack)

    # -- op-level tracing (ops=True) --------------------------------------------------

    def _judged_by_tracer(self, call: Call, record: TensorRecord, tensor: torch.Tensor | None) -> bool:
        """Ops mode: a module output whose non-finite values the tracer saw start; True when it did.

        An op's origin is the event, reported at this boundary; a deliberate
        infinity is recorded as benign (once per module). A value the tracer
        saw come from outside (a parameter, the batch) or not at all (a
        kernel it cannot see) is left to the module-level rule. ``tensor`` is
        None where the deferred check comes after it was freed: its record's
        weak reference finds its origin.
        """
        assert self.origins.tracer is not None
        origin = self.origins.tracer.claim(tensor, record.ref)
        if origin is None:
            return False
        if isinstance(origin, OpFinding):
            if call.name == origin.module:
                self.origins.report_op(origin, call, record)
                return True
            enclosing = caller_named(call, origin.module)
            if enclosing is None:
                # An op of the loop's code: where it reached the module as a functional_call stand-in, say so,
                # as the module-level rule does (_stand_in_made_by_loop).
                stand_in = self._bad_stand_in(call) if origin.module is None else None
                notes = (Note.of("swapped-in", name=stand_in[0]),) if stand_in is not None else ()
                self.origins.report_op(origin, None, record, notes)
                return True
            # The op ran in an enclosing call's own code, which passed the value here: that call's
            # row of the layer table is the producer's (as the module-level rule records it).
            record.status = "propagated"
            own = None if tensor is None else self._log.record_output(
                enclosing, TensorRef(TensorRole.INPUT, call.name, str(record.path)), tensor)
            self.origins.report_op(origin, enclosing, own)
            return True
        received, deliberate = self.input_kinds(call)
        if received or deliberate or self._mask_buffer_kinds(call):
            return False  # a mask it was given or holds: the module-level rule records that mask's event
        record.status = "benign"
        if id(call.module) not in self.replayer.masks:
            self.replayer.masks.add(id(call.module))
            finding = Finding(Phase.FORWARD, call, record_ref(record), bad=_detached(tensor), record=record,
                              bad_stats=record.stats() if tensor is None else None)
            self._emit(mark_deliberate(finding, "scalar"))
        return True


def _keyword_batch(kwargs: dict[str, Any]) -> list[tuple[str, int | str, torch.Tensor]]:
    """What a running top-level call's keyword arguments bring in as its batch, as checks/forward.py's ``record_data``
    reads it as the call returns: tensors, an object's own tensors, numpy arrays (call_records.array_values)."""
    return [*argument_tensors(kwargs, "kwargs", attributes=True), *array_values(kwargs, "kwargs")]
