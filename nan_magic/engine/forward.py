"""The forward pass: module hooks, the producer rule, replay and op-level glue.

Global module hooks call :meth:`ForwardChecks.on_forward_pre` and
:meth:`ForwardChecks.on_forward` for every module; only watched modules are
recorded. Each floating output gets one probe; the producer rule
(:meth:`ForwardChecks.judge`) runs on the few that are non-finite, at once or
at the deferred check. A forward producer is then replayed alone under the op
tracer to name its op and line (:meth:`ForwardChecks.replay_into`); at the
deferred check, from the arguments its call kept
(:meth:`ForwardChecks.replay_deferred`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nan_magic.engine.calls import Alias, Call, KnownFinite, TensorRecord, version_of
from nan_magic.engine.findings import Finding, apply_op_finding
from nan_magic.engine.held import Resolved, hold_arguments
from nan_magic.engine.masks import DeliberateMasks, argument_name
from nan_magic.engine.module_hooks import is_compiled, may_step_aside
from nan_magic.engine.op_origins import OpFinding
from nan_magic.engine.ops import OpTracer
from nan_magic.engine.replay import (
    RngState,
    capture_autocast,
    capture_rng_state,
    recompute,
    replay_backward,
    replay_module,
    run_again,
)
from nan_magic.engine.stats import is_checkable, iter_tensors, kinds_of, relevant_kinds, tensor_stats
from nan_magic.engine.targets import ModuleInfo
from nan_magic.engine.transparent import output_bound, passes_through, passes_through_unseen
from nan_magic.records import Phase

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.engine.watch import Watch

__all__ = ["REGENERATE_DEPTH", "ForwardChecks"]

#: How many calls back a backward replay recomputes freed inputs from.
REGENERATE_DEPTH = 3


class Frame:
    """A watched module call in progress (the module stack).

    A passed-through call (transparent.py) has no ``call``; ``through`` is
    the input it received.
    """

    __slots__ = ("call", "info", "known", "module", "rng_state", "through")

    def __init__(
        self,
        module: nn.Module,
        info: ModuleInfo,
        call: Call | None,
        rng_state: RngState | None,
        through: torch.Tensor | None = None,
        known: KnownFinite | None = None,
    ) -> None:
        self.module = module
        self.info = info
        self.call = call
        self.rng_state = rng_state
        self.through = through
        #: What was known of ``through`` when the call began.
        self.known = known


class ForwardChecks:
    """Forward-pass checks of one watch: the module stack and the producer rule."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.stack: list[Frame] = []
        # Modules whose infinities a replay showed to be deliberate (masks).
        self.masks: set[int] = set()
        # Infinite mask tensors given as arguments or held as buffers (masks.py).
        self.deliberate = DeliberateMasks()
        self.replaying = False
        config = watch.config
        # The tiered watch replays the whole failing step instead (step_replay.py).
        self.can_replay = config.replay and not config.ops and not config.tiered
        # A backward producer is replayed from the gradient hook, after its
        # forward returned, and in deferred mode any producer is replayed at
        # the check: calls keep their arguments (weakly) and RNG state.
        self.keeps_calls = self.can_replay and (config.backward or watch.defer)
        self.tracer: OpTracer | None = None
        self.last_forward_seq = 0

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """The watch's hooks ignore the calls a replay makes (:meth:`Watch.mine`); nests."""
        was, self.replaying = self.replaying, True
        try:
            yield
        finally:
            self.replaying = was

    def make_tracer(self) -> OpTracer:
        """The op tracer of ops mode, naming modules from this stack."""
        self.tracer = OpTracer(
            kinds=self.watch.config.kinds,
            module_name=self.current_module_name,
            phase_hint=self.phase_hint,
            at_boundary=True,
        )
        return self.tracer

    def on_forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not self.watch.mine():
            return
        info = self.watch.module_info(module)
        if info is None or (self.stack and not self.watch.full_step):
            return  # unwatched, or inside a top-level call of a tiered step (only its boundaries are checked)
        if info.transparent is not None and self.stack and len(args) == 1 and type(args[0]) is torch.Tensor:
            known = self.watch.log.known_finite(args[0])
            if known is not None and passes_through(info.transparent, module, args[0], known[1], known[2]):
                # Cannot make its finite input non-finite: nothing to check (transparent.py).
                rng = capture_rng_state() if info.transparent == "dropout" and self.keeps_calls else None
                self.stack.append(Frame(module, info, None, rng, through=args[0], known=known))
                return
            if known is None and self._computed_by_parent(args[0]) and passes_through_unseen(info.transparent, args[0]):
                # Its parent's check covers it (transparent.py); nothing stands for its output.
                self.stack.append(Frame(module, info, None, None))
                return
        top_level = not self.stack
        if top_level:
            if self.watch.outside is not None:
                self.watch.outside.stop()
            self.watch.begin_step_if_needed()
            self.watch.forward_starts += 1
            if is_compiled(module) or (not self.watch.full_step and may_step_aside(module)):
                # Only this call's boundaries are checked: its submodules' calls need no hook at all.
                self.watch.module_hooks.step_aside_for(module)
        parent = self.stack[-1].call if self.stack else None
        call = self.watch.log.new_call(Phase.FORWARD, info, module, parent)
        if top_level and self.watch.replays is not None:
            self.watch.replays.begin(module, info, call, args)
        self._note_inputs(call, args, "input")
        # The generators' state before the call, so a replay draws the same
        # dropout mask (a few microseconds; only where a replay can happen and
        # the module may draw random numbers).
        rng = capture_rng_state() if self.can_replay and not info.deterministic else None
        self.stack.append(Frame(module, info, call, rng))
        if top_level or info.is_root:
            self.record_data(info, module, args, "input")
        if top_level and self.watch.outside is not None:
            self.watch.outside.forget()  # the batch is judged: what the loop computed need not stay alive

    def on_forward(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        # always_call hooks are called with (module, args, output) when the
        # forward raised, and with (module, args, kwargs, output) otherwise.
        if not self.watch.mine():
            return
        if not self.stack or self.stack[-1].module is not module:
            return
        frame = self.stack.pop()
        if len(rest) != 2:
            if not self.stack and frame.call is not None:
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
        if not self.stack and self.watch.replays is not None:
            self.watch.replays.finish(module, kwargs)
        if kwargs:
            # Global pre-hooks never see kwargs, so they are noted on return.
            self._note_inputs(call, kwargs, "kwargs")
            if not self.stack or frame.info.is_root:
                self.record_data(frame.info, module, kwargs, "kwargs")
        log = self.watch.log
        if frame.info.watched:
            hook_gradients = self.watch.config.backward
            anchor = None
            for path, tensor in iter_tensors(output, "output", self.watch.skipped):
                record = log.record_output(call, path, tensor)
                if hook_gradients:
                    self.watch.gradients.hook_output(record, tensor)
                if anchor is None and tensor.grad_fn is not None:
                    anchor = tensor
            if self.keeps_calls and (anchor is not None or self.watch.defer):
                # Without a graph (no_grad) only the deferred check replays the call: held weakly.
                call.held = hold_arguments(args, kwargs, self._classify, anchor)
                call.rng_state = frame.rng_state
                call.autocast = capture_autocast()
        log.finish(call)
        if frame.info.watched and not self.watch.defer:
            for record in call.outputs:
                if record.kinds:  # finite outputs (the hot path) need no judging
                    self.judge(call, record, replay=(frame, args, kwargs))
        if not self.stack:
            # Autograd nodes created from here on belong to the code outside the modules (loss_region.py).
            self.last_forward_seq = torch._C._autograd._get_sequence_nr()
            if not self.watch.optimizer_in_use():
                # Inference (no optimizer seen): a top-level forward is a step.
                self.watch.sync()
                self.watch.end_step(self.watch.step)
                self.watch.check_peers()  # another rank's event, where no optimizer step lets the ranks agree
            if self.watch.outside is not None:
                self.watch.outside.start("loss")

    def _note_inputs(self, call: Call, values: Any, prefix: str) -> None:
        """Note a call's tensor arguments, adopting outputs of pass-throughs left to their parent.

        Forward, the parent's check and replay cover such a pass-through. In
        backward, the gradient this call computes for its output must still
        be checked where it appears, to name this call as its producer.
        """
        log = self.watch.log
        if prefix == "input" and len(values) == 1 and type(values[0]) is torch.Tensor:
            # The hot path, ``module(x)``: no walk of the arguments.
            found = [("input[0]", values[0])] if is_checkable(values[0]) else []
        else:
            found = iter_tensors(values, prefix)
        for path, tensor in found:
            if log.is_unseen(tensor):
                record = log.adopt(tensor)
                if self.watch.config.backward:
                    self.watch.gradients.hook_output(record, tensor)
            log.note_input(call, path, tensor)

    def _computed_by_parent(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a value of the running parent's own code, which a replay can reach.

        No watched call returned it (it has no record, and is no
        pass-through's output), the parent is a checked call, and its replay
        runs (immediate mode, see :func:`transparent.passes_through_unseen`).
        """
        parent = self.stack[-1]
        return (
            self.can_replay
            and not self.watch.defer
            and parent.call is not None
            and parent.info.watched
            and self.watch.log.lookup(tensor) is None
            and self.watch.log.alias_of(tensor) is None
        )

    def record_data(self, info: ModuleInfo, module: nn.Module, values: Any, prefix: str) -> None:
        """Tensors entering a watched model from outside, as a ``data`` call.

        Judged like any call (immediately, or at the deferred check), first in
        order, so a NaN already in the batch is reported as phase ``data``.
        """
        tensors = list(iter_tensors(values, prefix, self.watch.skipped))
        if not tensors:
            return
        call = self.watch.log.new_call(Phase.DATA, info, module, None)
        for path, tensor in tensors:
            self.watch.log.record_output(call, path, tensor)
        self.watch.log.finish(call)
        if not self.watch.defer:
            for record in call.outputs:
                self.judge(call, record)
            for (path, tensor), record in zip(tensors, call.outputs):
                if record.status == "benign":
                    continue  # a deliberate mask is no batch to warn about
                probe = (record.low, record.high)
                self.watch.warn(self.watch.early.observe_batch(self.watch.step, path, tensor, probe))

    def judge(
        self,
        call: Call,
        record: TensorRecord,
        detected_at: str | None = None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None = None,
    ) -> None:
        """Producer or propagator? The one rule, for immediate and deferred checks.

        PRODUCT.md: the producer is where the *first* non-finite value
        appeared. A call that received one (before the call: in-place
        aware), or inside which a child made one, passes it on, even where
        it makes a new kind of it (inf - inf). Only a deliberate infinity
        (a mask, see :meth:`replay_into`) may come in: then the call is the
        producer of a kind it did not receive (softmax of a fully masked
        row). A non-finite parameter or buffer it read is reported as such.
        """
        out_kinds = relevant_kinds(record.kinds, self.watch.config.kinds)
        if not out_kinds:
            return
        tensor = record.live()
        if call.phase == Phase.DATA:
            if self.is_benign_input(call, record.path, tensor, record):
                self._note_mask(call, record, tensor, "an infinite mask given as an argument")
                return
            finding = Finding(Phase.DATA, call, record.path, bad=_detached(tensor), record=record,
                              bad_stats=record.stats() if tensor is None else None, inputs_finite=False)
            if self.watch.outside is not None:
                self.add_op_origin(finding, tensor)  # a batch the loop computed: its op and line
            self.watch.emit(finding)
            return
        if tensor is not None and self.tracer is not None and self._judged_by_tracer(call, record, tensor):
            return
        if tensor is not None:
            out_kinds = relevant_kinds(tensor_stats(tensor).kinds, self.watch.config.kinds)
        input_kinds, deliberate = self.input_kinds(call)
        parent = call.parent
        if parent is not None:
            parent.inner_kinds |= call.inner_kinds
            parent.deliberate_kinds |= call.deliberate_kinds
        if input_kinds or call.inner_kinds:
            record.status = "propagated"
            if input_kinds and not call.inner_kinds:
                self._blame_own_code(call, detected_at)
            return
        produced = out_kinds - deliberate - call.deliberate_kinds
        if produced and call.module is not None:
            # A -inf from a mask buffer it holds is passed on, like one from a mask argument (masks.py).
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
        detected_at: str | None,
        replay: tuple[Frame, tuple[Any, ...], dict[str, Any]] | None,
    ) -> bool:
        """Emit the finding of a producer call, replayed for its op; True when it proved benign."""
        named_inputs = self._named_inputs(call)
        bad_parameter = self._bad_parameter(call)
        if bad_parameter is not None:
            name, parameter = bad_parameter
            finding = Finding(Phase.FORWARD, call, f"parameter {name}", bad=parameter.detach(), record=record,
                              inputs=named_inputs)
            finding.notes.append(f"{name} was already non-finite when {call.name or 'the root module'} read it")
        else:
            finding = Finding(
                Phase.FORWARD,
                call,
                record.path or "output",
                bad=_detached(tensor),
                record=record,
                bad_stats=None if tensor is not None else record.stats(),
                inputs=named_inputs,
            )
            if replay is not None:
                finding.rng_state = replay[0].rng_state
                if self.replay_into(finding, produced, *replay):
                    return True
            elif self.watch.defer and self.keeps_calls and self.replay_deferred(finding, produced, call):
                return True
        if detected_at:
            finding.notes.append(detected_at)
        self.watch.emit(finding)
        return False

    def _blame_own_code(self, call: Call, detected_at: str | None) -> None:
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
        kinds = relevant_kinds(kinds_of(tensor), self.watch.config.kinds)
        # Its own output check, later, must see a propagator.
        enclosing.inner_kinds |= kinds
        # The value its own code made is the producer's row of the layer table
        # (the enclosing call may never return: the event stops it).
        log = self.watch.log
        record = log.record_output(enclosing, f"{path} of {consumer.name}", tensor)
        if record.pending:
            log.resolve()  # deferred mode, at the check: read it now
        finding = Finding(
            Phase.FORWARD, enclosing, record.path, bad=tensor.detach(), record=record,
            inputs=self._named_inputs(enclosing),
        )
        finding.notes.append(
            f"{enclosing.name or 'the root module'}'s own code made it, and passed it to {consumer.name} as {path}"
        )
        if detected_at:
            finding.notes.append(detected_at)
        if not self._replay_enclosing(finding, kinds, enclosing):
            self.watch.emit(finding)

    def _made_by_caller(self, call: Call) -> tuple[str, torch.Tensor] | None:
        """A non-finite input of ``call`` not returned non-finite by any checked call (nor the data).

        Inputs a checked call (or the data check) returned non-finite were
        judged there. One with no record, or whose record was finite but
        which is non-finite now (changed in place since), was made by the
        caller's own code.
        """
        for path, record, ref, version in call.inputs:
            if record is not None and record.call is not None and record.kinds:
                continue
            tensor = ref()
            if tensor is None or version_of(tensor) != version or not is_checkable(tensor):
                continue
            # A deliberate mask the caller made is no fault of its own code.
            if relevant_kinds(kinds_of(tensor), self.watch.config.kinds) and not self.is_benign_input(
                call, path, tensor, record
            ):
                return path, tensor
        return None

    def _replay_enclosing(self, finding: Finding, kinds: frozenset[str], enclosing: Call) -> bool:
        """Replay the enclosing call for its op (the notes say why it cannot be); True when it proved benign."""
        if not self.can_replay:
            return False
        if self.watch.defer:
            arguments = self._kept_arguments(enclosing)
            if isinstance(arguments, str):
                finding.notes.append(f"{finding.module or 'the root module'}'s arguments are gone by the deferred "
                                     f"check ({arguments}); watch with ops=True (%%nantrace --ops) for the op and line")
                return False
            frame = Frame(enclosing.module, enclosing.info, enclosing, enclosing.rng_state)  # type: ignore[arg-type]
            finding.rng_state = enclosing.rng_state
            return self.replay_into(finding, kinds, frame, arguments.args, arguments.kwargs)
        running = next((frame for frame in reversed(self.stack) if frame.call is enclosing), None)
        passed = running_arguments(enclosing.module)
        if running is None or passed is None:
            return False
        finding.rng_state = running.rng_state
        return self.replay_into(finding, kinds, running, *passed)

    def replay_into(
        self, finding: Finding, produced: frozenset[str], frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Replay the producer module under the op tracer to name its op and line.

        Returns True when the replay shows a deliberate infinity instead (an
        op given an infinite scalar, e.g. ``masked_fill(mask, -inf)``): that
        is recorded as benign and not raised; a consumer that turns it into a
        NaN is the producer then.
        """
        if not self.can_replay or frame.call is None or not _replayable(frame.call, frame.rng_state):
            return False
        if id(frame.module) in self.masks:
            finding.record.status = "benign"  # type: ignore[union-attr]
            return True
        if any(_mutated(ref(), version) for _path, _record, ref, version in frame.call.inputs):
            finding.notes.append(
                f"{frame.info.name or 'the root module'} changed its input in place, so a replay cannot start "
                "from the values it received; watch with ops=True (%%nantrace --ops) for the op and line"
            )
            return False
        with self.standing_aside():
            result = replay_module(
                frame.module, args, kwargs, rng_state=frame.rng_state, kinds=self.watch.config.kinds,
                module_name=frame.info.name, autocast=frame.call.autocast,
            )
        if result.finding is not None:
            op = result.finding
            apply_op_finding(finding, op, result.tensors)
            finding.frame = result.frame
            finding.notes.append(
                f"replay of {frame.info.name or 'the root module'} on its inputs found the op: replay reproduced "
                f"{op.nan} nan, {op.posinf} +inf, {op.neginf} -inf in {op.op}"
            )
            if op.module is not None and op.module != frame.info.name:
                # A child without a check of its own (a pass-through, transparent.py).
                finding.notes.append(f"{op.op} ran inside {op.module}, which is not checked on its own")
            return False
        if result.held_by_inputs and produced <= {"+inf", "-inf"}:
            self.masks.add(id(frame.module))
            self._record_deliberate(finding, "an op inside was given an infinite scalar, e.g. masked_fill(mask, -inf)")
            return True
        if result.note:
            finding.notes.append(result.note)
        return False

    def replay_deferred(self, finding: Finding, produced: frozenset[str], call: Call) -> bool:
        """Name the op and line of a producer found at the deferred check, long after its call.

        Its arguments come from what the call kept (held.py), a freed one
        recomputed from the call that returned it. When they cannot be had
        (a value of its parent's own code that is gone), the nearest
        enclosing call whose arguments can is replayed instead, and its op
        is taken only if it ran inside the producer. Returns what
        :meth:`replay_into` returns.
        """
        label = call.name or "the root module"
        nearest = self._nearest_kept(call)
        if isinstance(nearest, str):
            finding.notes.append(
                f"{label}'s arguments are gone by the deferred check ({nearest}); "
                "watch with ops=True (%%nantrace --ops) for the op and line"
            )
            return False
        enclosing, arguments, missing = nearest
        if enclosing is call:
            finding.rng_state = call.rng_state
            self._recompute_freed(finding, call, arguments)
            frame = Frame(call.module, call.info, call, call.rng_state)  # type: ignore[arg-type]
            return self.replay_into(finding, produced, frame, arguments.args, arguments.kwargs)
        outer = enclosing.name or "the root module"
        with self.standing_aside():
            result = replay_module(
                enclosing.module, arguments.args, arguments.kwargs, rng_state=enclosing.rng_state,
                kinds=self.watch.config.kinds, module_name=enclosing.name or "", autocast=enclosing.autocast,
            )
        op = result.finding
        within = op is not None and _within(op.module, call.name or "")
        if not within and produced <= {"+inf", "-inf"} and (call.name or "") in result.benign_modules:
            return self._deliberate_in_replay(finding, call, outer)
        if op is not None and within:
            apply_op_finding(finding, op, result.tensors)
            finding.frame = result.frame
            finding.notes.append(
                f"{label}'s own arguments are gone by the deferred check ({missing}); a replay of {outer}, which "
                f"called it, found the op in {op.module or label}: {op.nan} nan, {op.posinf} +inf, "
                f"{op.neginf} -inf in {op.op}"
            )
            return False
        caller = _caller_named(call, op.module) if op is not None else None
        if op is not None and caller is not None:
            # The first non-finite value was made by the own code of a call
            # enclosing the one whose output was found: that caller is the producer.
            self._move_to(finding, caller, f"output of {op.op}")
            finding.rng_state = caller.rng_state
            apply_op_finding(finding, op, result.tensors)
            finding.frame = result.frame
            finding.notes.append(
                f"a replay of {outer} found the first non-finite value in {op.module or 'the root module'}'s own "
                f"code ({op.op}), before {label}, which passed it on"
            )
            return False
        found = f"found {op.op} in {op.module}, not in {label}" if op is not None else (result.note or "stayed finite")
        finding.notes.append(
            f"{label}'s own arguments are gone by the deferred check ({missing}), and a replay of {outer} {found}; "
            "watch with ops=True (%%nantrace --ops) for the op and line"
        )
        return False

    def _move_to(self, finding: Finding, caller: Call, tensor: str) -> None:
        """Make ``finding`` name ``caller`` (an enclosing call) as the producer of ``tensor``, with its inputs.

        The output first found (a child's) only passed the value on: it is
        no longer the finding's tensor, nor its layer row the producer's.
        """
        if finding.record is not None:
            finding.record.status = "propagated"
        finding.tensor, finding.record = tensor, None
        finding.call = caller
        finding.module, finding.module_type = caller.name, caller.module_type
        finding.model = caller.info.model if caller.info is not None else None
        finding.inputs = self._named_inputs(caller)
        finding.bad, finding.bad_stats = None, None

    def _deliberate_in_replay(self, finding: Finding, call: Call, outer: str) -> bool:
        """A replay of the enclosing call showed ``call``'s infinity to be deliberate: recorded as benign."""
        if call.module is not None:
            self.masks.add(id(call.module))
        self._record_deliberate(
            finding, f"a replay of {outer} showed an op of {call.name or 'the root module'} given an infinite scalar"
        )
        return True

    def _nearest_kept(self, call: Call) -> tuple[Call, Resolved, str | None] | str:
        """The call itself or its nearest enclosing call whose arguments can be had, with them.

        Also why the call's own arguments cannot be had (None when they can);
        only that reason when no enclosing call's can either.
        """
        missing: str | None = None
        enclosing: Call | None = call
        while enclosing is not None:
            arguments = self._kept_arguments(enclosing)
            if isinstance(arguments, Resolved):
                return enclosing, arguments, missing
            missing = missing or arguments
            enclosing = enclosing.parent
        return missing or "its arguments were not kept"

    def _kept_arguments(self, call: Call) -> Resolved | str:
        """A finished call's arguments again, from what it kept; or why not, in a few words."""
        if call.held is None or call.module is None or call.phase != Phase.FORWARD:
            return "its arguments were not kept"
        if not _replayable(call, call.rng_state):
            return "its random state was not kept"
        with self.standing_aside():  # a freed argument is recomputed by running its call again
            return call.held.resolve(self._regenerate)

    def _recompute_freed(self, finding: Finding, call: Call, arguments: Resolved) -> None:
        """Give a finding whose tensors were freed before the deferred check exact values again.

        The producer's inputs (for the report and the scene) are the ones
        resolved for the replay; its output is recomputed by running the
        call again, and used only if it holds the kinds the probe saw.
        """
        if not finding.inputs:
            for path, held_record, ref, _version in call.inputs:
                tensor = ref()
                if tensor is None and held_record is not None:
                    tensor = arguments.by_record.get(id(held_record))
                if tensor is not None:
                    finding.inputs.append((path, tensor.detach()))
        record = finding.record
        if finding.bad is not None or record is None:
            return
        with self.standing_aside():
            output = run_again(call.module, arguments.args, arguments.kwargs, call.rng_state, call.autocast)
        again = next((tensor for path, tensor in iter_tensors(output, "output") if path == record.path), None)
        if again is not None and record.kinds and record.kinds <= kinds_of(again):
            finding.bad, finding.bad_stats = again, None
            finding.notes.append(
                f"{record.path} was freed before the deferred check: its counts and values are from "
                f"running {call.name or 'the root module'} again on the same inputs"
            )

    def _classify(self, tensor: torch.Tensor) -> tuple[TensorRecord | Alias | None, bool]:
        """A call input's record, and whether holding it until its gradient is computed adds no memory.

        Holding is free when something besides its Python object holds the
        tensor (``_use_count() > 1``: autograd saved it for the backward)
        and it is a recorded output with our gradient hook, which releases
        it (:meth:`GradientChecks.release`) as soon as its gradient is
        complete. Other inputs are held weakly, and recomputed from their
        record if a replay needs them (:meth:`_regenerate`).
        """
        record = self.watch.log.lookup(tensor)
        if record is None:
            return self.watch.log.alias_of(tensor), False
        return record, tensor.requires_grad and _held_elsewhere(tensor)

    def _regenerate(self, record: TensorRecord | Alias, depth: int = 0) -> torch.Tensor | None:
        """A freed module output, recomputed by replaying the call that returned it.

        Its own freed inputs are recomputed the same way, up to
        :data:`REGENERATE_DEPTH` calls back. The value is the one the
        consumer saw only when the tensor was not changed in place in
        between; :meth:`HeldArguments.resolve` checked the version.
        """
        if depth >= REGENERATE_DEPTH:
            return None
        if isinstance(record, Alias):
            # A passed-through call's output: run that module again on its input.
            source = record.input() or self._regenerate(record.origin, depth + 1)
            return None if source is None else run_again(record.module, (source,), {}, record.rng_state)
        call = record.call
        if call is None or call.phase != Phase.FORWARD:
            return None
        if call.held is None or call.module is None or not _replayable(call, call.rng_state):
            return None
        output = recompute(
            call.module, call.held, call.rng_state, lambda inner: self._regenerate(inner, depth + 1), call.autocast
        )
        for path, tensor in iter_tensors(output, "output"):
            if path == record.path:
                return tensor
        return None

    def replay_backward_into(self, finding: Finding, consumer: Call, target: TensorRecord) -> None:
        """Replay the consumer whose backward made a gradient non-finite, to name the op and line.

        Called from the gradient hook (immediate mode) while the consumer's
        arguments may still be alive: autograd saves most of them for its
        backward. ``target`` is the consumer's input whose gradient went bad.
        """
        label = consumer.name or "the root module"
        if consumer.held is None or not _replayable(consumer, consumer.rng_state):
            finding.notes.append(
                f"{label}'s arguments were not kept, so its backward cannot be replayed; "
                "watch with ops=True (%%nantrace --ops) for the op and line"
            )
            return
        chain: list[TensorRecord | Alias] = list(target.outward())
        # The consumer may have received it through a pass-through (a dropout, an activation).
        mine = {id(record) for record in chain}
        chain += [held for held in consumer.held.records() if isinstance(held, Alias) and id(held.record) in mine]
        with self.standing_aside():
            result = replay_backward(
                consumer.module, consumer.held, chain, rng_state=consumer.rng_state, regenerate=self._regenerate,
                kinds=self.watch.config.kinds, module_name=consumer.name or "", autocast=consumer.autocast,
            )
        if result.finding is None:
            finding.notes.append(f"{result.note}; watch with ops=True (%%nantrace --ops) for the op and line")
            return
        apply_op_finding(finding, result.finding)
        finding.notes.append(
            f"replay of {label}'s forward and backward (a gradient of ones into its outputs) found the op: "
            f"{result.finding.op} in the backward of {result.finding.autograd_node or 'an autograd node'}"
        )

    def input_kinds(self, call: Call) -> tuple[frozenset[str], frozenset[str]]:
        """Kinds the call's inputs held *before* the call (in-place aware): ``(passed on, deliberate)``.

        The second holds the kinds of deliberate infinities (a mask) that the
        call may consume: inputs recorded as benign, and masks (masks.py).
        """
        kinds: set[str] = set()
        deliberate: set[str] = set()
        for path, record, ref, version in call.inputs:
            tensor = ref()
            if tensor is not None and version_of(tensor) == version:
                found = kinds_of(tensor)
            elif record is not None and not record.pending:
                # Mutated in place by this module: its value before the call is
                # what the producer rule compares against, and the probe of the
                # call that made it still knows it.
                found, tensor = record.kinds, None
            else:
                continue
            if not found:
                continue
            if (record is not None and record.status == "benign") or self.is_benign_input(call, path, tensor, record):
                deliberate |= found
            else:
                kinds |= found
        wanted = self.watch.config.kinds
        return relevant_kinds(frozenset(kinds), wanted), relevant_kinds(frozenset(deliberate), wanted)

    def _named_inputs(self, call: Call) -> list[tuple[str, torch.Tensor]]:
        named = []
        for path, _record, ref, _version in call.inputs:
            tensor = ref()
            if tensor is not None:
                named.append((path, tensor.detach()))
        return named

    def _bad_parameter(self, call: Call) -> tuple[str, torch.Tensor] | None:
        """A non-finite parameter or buffer of the called module (recursively); deliberate masks excepted."""
        prefix = f"{call.name}." if call.name else ""
        module = call.module
        masks = {id(buffer) for _name, buffer in self.deliberate.buffers(module, prefix)}
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if id(tensor) in masks:
                continue
            if is_checkable(tensor) and relevant_kinds(kinds_of(tensor), self.watch.config.kinds):
                return prefix + name, tensor
        return None

    # -- deliberate infinities (masks.py) ---------------------------------------------

    def is_benign_input(
        self, call: Call, path: str, tensor: torch.Tensor | None, record: TensorRecord | None = None
    ) -> bool:
        """Whether a non-finite argument of ``call`` (at ``path``) is a deliberate mask (masks.py).

        ``tensor`` is the live value; when it is gone, ``record``'s probe
        decides, which takes a name that says mask.
        """
        name = argument_name(call.module, path) if call.module is not None else None
        if tensor is not None:
            return self.deliberate.is_mask(tensor, name, first=path == "input[0]")
        return record is not None and self.deliberate.probe_is_mask(record.low, record.high, name)

    def _mask_buffer_kinds(self, call: Call) -> frozenset[str]:
        """The kinds the call's deliberate mask buffers hold; each is recorded once as a benign event."""
        prefix = f"{call.name}." if call.name else ""
        kinds: set[str] = set()
        for name, buffer in self.deliberate.buffers(call.module, prefix):
            kinds |= kinds_of(buffer)
            if self.deliberate.first_sighting(call.name, name):
                finding = Finding(Phase.FORWARD, call, f"buffer {name}", bad=buffer.detach())
                self._record_deliberate(finding, f"{name} is an infinite mask held as a buffer")
        return frozenset(kinds)

    def _note_mask(self, call: Call, record: TensorRecord, tensor: torch.Tensor | None, what: str) -> None:
        """Mark a deliberate mask benign; the first sighting at its place is recorded as a benign event."""
        record.status = "benign"
        if not self.deliberate.first_sighting(call.name, record.path):
            return
        finding = Finding(call.phase, call, record.path, bad=_detached(tensor), record=record,
                          bad_stats=record.stats() if tensor is None else None, inputs_finite=False)
        self._record_deliberate(finding, f"{record.path} is {what}")

    def _record_deliberate(self, finding: Finding, how: str) -> None:
        """Record ``finding`` as a benign event (PRODUCT.md): ``how`` says what made the deliberate infinity."""
        finding.benign = True
        finding.notes.append(f"a deliberate infinity ({how}): benign while what consumes it stays finite")
        self.watch.emit(finding)


    # -- op-level tracing (ops=True) --------------------------------------------------

    def current_module_name(self) -> str | None:
        """The innermost watched module running (``exclude``/``include`` leave modules unwatched)."""
        for frame in reversed(self.stack):
            if frame.info.watched:
                return frame.info.name
        return None

    def phase_hint(self) -> Phase | None:
        return Phase.OPTIMIZER if self.watch.optimizers.in_step else None

    def _judged_by_tracer(self, call: Call, record: TensorRecord, tensor: torch.Tensor) -> bool:
        """Ops mode: a module output whose non-finite values the tracer saw start; True when it did.

        An op's origin is the event, reported at this boundary; a deliberate
        infinity is recorded as benign (once per module). A value the tracer
        saw come from outside (a parameter, the batch) or not at all (a
        kernel it cannot see) is left to the module-level rule.
        """
        assert self.tracer is not None
        origin = self.tracer.claim(tensor)
        if origin is None:
            return False
        if isinstance(origin, OpFinding):
            if call.name == origin.module:
                self.report_op(origin, call, record)
                return True
            enclosing = _caller_named(call, origin.module)
            if enclosing is None:
                self.report_op(origin, None, record)
                return True
            # The op ran in an enclosing call's own code, which passed the value here: that call's
            # row of the layer table is the producer's (as the module-level rule records it).
            record.status = "propagated"
            own = self.watch.log.record_output(enclosing, f"{record.path} of {call.name}", tensor)
            self.report_op(origin, enclosing, own)
            return True
        received, deliberate = self.input_kinds(call)
        if received or deliberate or self._mask_buffer_kinds(call):
            return False  # a mask it was given or holds: the module-level rule records that mask's event
        record.status = "benign"
        if id(call.module) not in self.masks:
            self.masks.add(id(call.module))
            finding = Finding(Phase.FORWARD, call, record.path or "output", bad=tensor.detach(), record=record)
            self._record_deliberate(finding, "an infinite scalar, e.g. masked_fill(mask, -inf), or a mask carried on")
        return True

    def add_op_origin(self, finding: Finding, tensor: torch.Tensor | None) -> None:
        """Add the op that started a non-finite boundary tensor (loss, gradient, parameter, batch).

        Ops mode traces everything; the tiered mode records the code outside
        the models (outside.py), where the loss and data code run.
        """
        outside = self.watch.outside
        if tensor is None:
            return
        if self.tracer is not None:
            origin = self.tracer.claim(tensor)
        elif outside is not None:
            origin = outside.claim(tensor)
            untraced = outside.note()
            if untraced is not None and finding.module is None:
                finding.notes.append(untraced)
        else:
            return
        if isinstance(origin, OpFinding):
            attach_origin(finding, origin)

    def report_op(self, op_finding: OpFinding, call: Call | None = None, record: TensorRecord | None = None) -> None:
        """Report the op that started a non-finite value that reached a module's output."""
        if call is None and record is not None:
            # The op ran in another module's code than the boundary's: this boundary passed it on.
            record.status, record = "propagated", None
        finding = Finding(op_finding.phase, call, f"{op_finding.tensor} of {op_finding.op}", record=record)
        tracer = self.tracer
        tensors = tracer.producer_tensors if tracer is not None and tracer.finding is op_finding else ()
        apply_op_finding(finding, op_finding, tensors)
        if record is not None and finding.phase == Phase.FORWARD:
            # The module output where the op's value reached the boundary, beside the op's own output.
            live = record.live()
            finding.module_output = (record.path or "output", tensor_stats(live) if live is not None
                                     else record.stats(), live)
        if tracer is not None:
            finding.frame, finding.frame_position = tracer.frame_of(op_finding)  # %debug opens where the op ran
        if finding.module is not None and finding.module_type is None:
            info = self.watch.targets.info_by_name(finding.module)
            if info is not None:
                finding.module_type, finding.model = info.module_type, info.model
        if finding.phase == Phase.BACKWARD:
            self.watch.on_gradient_event(finding)
        else:
            self.watch.emit(finding)


#: The code objects of ``nn.Module.__call__``'s frames, which hold a running call's arguments.
_CALL_CODES = frozenset(
    code for code in (getattr(getattr(nn.Module, name, None), "__code__", None)
                      for name in ("_call_impl", "_wrapped_call_impl")) if code is not None
)


def attach_origin(finding: Finding, origin: OpFinding) -> None:
    """Add the op that started a boundary's non-finite value to its finding.

    The event is the boundary tensor (the loss, a parameter, a gradient):
    the report keeps it and its counts, and the op adds its name, line and
    operands.
    """
    kept = finding.tensor, finding.bad, finding.bad_stats
    apply_op_finding(finding, origin)
    (finding.tensor, finding.bad, finding.bad_stats), finding.module_output = kept, None


def running_arguments(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of ``module``'s call that is running now, from its ``__call__`` frame.

    Global forward pre-hooks never see keyword arguments, so a call still in
    progress (a parent whose own code made a value its child received) has
    them only in the frame of ``Module._call_impl`` (the innermost such
    frame: the arguments after the module's own pre-hooks). Only read on an
    event, never on the hot path. None when no such frame is found.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            local = frame.f_locals
            if local.get("self") is module and "args" in local:
                return tuple(local["args"]), dict(local.get("kwargs") or {})
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _caller_named(call: Call, module: str | None) -> Call | None:
    """The call enclosing ``call`` (not ``call`` itself) of the module named ``module``, if any."""
    caller = call.parent
    while caller is not None:
        if caller.name == module:
            return caller
        caller = caller.parent
    return None


def _within(module: str | None, producer: str) -> bool:
    """Whether the module named ``module`` is ``producer`` or one of its submodules (qualified names)."""
    if module is None:
        return False
    return not producer or module == producer or module.startswith(producer + ".")


def _replayable(call: Call, rng_state: RngState | None) -> bool:
    """Whether the call's RNG state is known: saved, or not needed (the module draws no random numbers)."""
    return rng_state is not None or (call.info is not None and call.info.deterministic)


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """More than one owner of the tensor (its Python object and, say, autograd's saved copy)."""
    use_count = getattr(tensor, "_use_count", None)  # a private torch method: absent, hold nothing
    return use_count is not None and use_count() > 1


def _mutated(tensor: torch.Tensor | None, version: int) -> bool:
    """Whether a still-alive tensor was written in place since ``version``."""
    return tensor is not None and version_of(tensor) != version


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach() if tensor is not None else None
