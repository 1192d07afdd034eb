"""Replaying one module call: to name the op and line inside a producer, forward or backward.

A producer found at a module's boundary is run again alone under the op tracer (replay/module_run.py): from its
running frame's arguments (immediate mode), or from what its call kept (held.py) at the deferred check, a freed
argument recomputed from the call that returned it (or from its enclosing call). A backward producer's forward
and backward are replayed from the gradient hook that found it.

Who calls whom: the forward hooks (forward.py) ask :class:`CallReplay` whether calls keep their arguments
(:attr:`~CallReplay.keeps_calls`, :meth:`~CallReplay.classify`); the producer rule (producer.py) replays a forward
producer (:meth:`~CallReplay.replay_into`, :meth:`~CallReplay.replay_deferred`); the gradient checks
(gradient_checks.py) receive :meth:`~CallReplay.replay_backward_into` as a callable from the watch; the step replay and
:meth:`Watch.listening` use :meth:`~CallReplay.standing_aside`. This module calls none of them: it gets the step's
log, the config and ``emit`` at construction.

The backward replays live beside it in :mod:`~nan_magic.localize.replay.call_backward` (a mixin of
:class:`CallReplay`), and the log's call lookups in :mod:`~nan_magic.localize.replay.calls_named`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from nan_magic.distributed.ranks import user_type
from nan_magic.hot.kept.call_records import Alias, Call, Frame, TensorRecord
from nan_magic.hot.kept.finding import Finding, mark_deliberate, named_inputs
from nan_magic.hot.kept.held import Resolved
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.hot.reads import iter_tensors, version_of
from nan_magic.hot.stats import kinds_of
from nan_magic.hot.timing import Timing
from nan_magic.hot.watched.owner import HookOwner
from nan_magic.localize.ops.origins import apply_op_finding
from nan_magic.localize.replay.call_backward import BackwardCallReplays
from nan_magic.localize.replay.calls_named import (
    _call_named,
    _replayable,
    _within,
    caller_named,
    run_without_a_call,
)
from nan_magic.localize.replay.fused import apart_note, fast_path_off, is_fused
from nan_magic.localize.replay.module_run import (
    copy_tensors,
    enclosing_output,
    recompute,
    replay_module,
    run_again,
)
from nan_magic.localize.replay.untouched import user_generators
from nan_magic.options import WatchConfig
from nan_magic.records import KINDS, Note, Phase, TensorRef

__all__ = ["REGENERATE_DEPTH", "CallReplay"]

#: How many calls back a backward replay recomputes freed inputs from.
REGENERATE_DEPTH = 3


class CallReplay(BackwardCallReplays):
    """Replays of single module calls for one watch, and the flag that makes its hooks stand aside."""

    def __init__(
        self, config: WatchConfig, replays: bool, timing: Timing, log: StepLog, emit: Callable[[Finding], None],
        here: HookOwner | None = None,
    ) -> None:
        self.kinds = config.kinds
        self._log = log
        self._emit = emit
        # Modules whose infinities a replay showed to be deliberate (masks).
        self.masks: set[int] = set()
        self.replaying = False
        self._here = here  # the watch's hooks read it (hot/watched/owner.py): off while a replay runs
        # Per-call mode only (modes.py): the tiered watch replays the whole failing step (replay/tiered/step.py).
        self.can_replay = replays
        # A backward producer is replayed from the gradient hook, after its
        # forward returned, and in deferred mode any producer is replayed at
        # the check: calls keep their arguments (weakly) and RNG state.
        self.keeps_calls = self.can_replay and (config.backward or timing.deferred)
        #: Whether a producer is replayed at the deferred check, from what its call kept: then every call keeps
        #: its arguments, one with no autograd graph (no_grad) too.
        self.replays_kept = self.can_replay and timing.deferred
        #: Whether a producer is replayed as it is judged, from its running frame's arguments (immediate mode).
        self.replays_running = self.can_replay and not timing.deferred
        #: A top-level call's inputs as they were before its forward wrote them in place, by id, where the step's
        #: kept calls hold them (tiered/step_keeping.inputs_before_of, for the fix trials); None: none kept.
        self.inputs_before: Callable[[Call], dict[int, torch.Tensor]] | None = None

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """The watch's hooks ignore the calls a replay makes (``Watch.here.mine``), and the user's Python and numpy
        random generators are as they were after it (untouched.user_generators); nests."""
        was, self.replaying = self.replaying, True
        here = self._here if self._here is not None and self._here.mine else None
        if here is not None:
            here.mine = False  # (this thread's: another thread's is False already)
        try:
            with contextlib.nullcontext() if was else user_generators():
                yield
        finally:
            self.replaying = was
            if here is not None:
                here.mine = True

    def classify(self, tensor: torch.Tensor) -> tuple[TensorRecord | Alias | None, bool]:
        """A call input's record, and whether holding it until its gradient is computed adds no memory.

        Holding is free when something besides its Python object holds the tensor (``_use_count() > 1``: autograd
        saved it for the backward) and it is a recorded output with our gradient hook, which releases it
        (:meth:`GradientChecks.release`) as soon as its gradient is complete. Other inputs are held weakly, and
        recomputed from their record if a replay needs them (:meth:`_regenerate`).
        """
        record = self._log.lookup(tensor)
        if record is None:
            base = tensor._base
            if base is not None and _whole_view(tensor, base) and (record := self._log.lookup(base)) is not None:
                return record, False  # a full backward hook's (Opacus', captum's) view of it: the same values
            return self._log.alias_of(tensor), False
        return record, tensor.requires_grad and _held_elsewhere(tensor)

    def replay_into(
        self, finding: Finding, produced: frozenset[str], frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any],
        draws_again: bool = False,
    ) -> bool:
        """Replay the producer module under the op tracer to name its op and line.

        Returns True when the replay shows a deliberate infinity instead (an op given an infinite scalar, e.g.
        ``masked_fill(mask, -inf)``): that is recorded as benign and not raised; a consumer that turns it into a NaN
        is the producer then. ``draws_again``: replay a call whose random state was not kept, drawing numbers of its
        own.
        """
        if not self.can_replay or frame.call is None:
            return False
        if not draws_again and not _replayable(frame.call, frame.rng_state):
            return False
        if id(frame.module) in self.masks and produced <= {"+inf", "-inf"}:
            # (A module that made a deliberate infinity before is taken at its word for infinities only: a NaN is
            # never deliberate, and one it makes later, a row with no unmasked entry, is replayed.)
            finding.record.status = "benign"  # type: ignore[union-attr]
            return True
        mutated = [id(ref()) for _path, _argument, _record, ref, version in frame.call.inputs
                   if _mutated(ref(), version)]
        if mutated:
            # A forward that writes its input in place (``x /= x.norm(...)``) left the NaN it wrote there: replayed
            # from the input's value before the call where the model was seen writing it before (input_writes.py).
            before = self.inputs_before(frame.call) if self.inputs_before is not None else {}
            if not all(key in before for key in mutated):
                finding.notes.append(Note.of("input-mutated", module=frame.info.name))
                return False
            with torch.no_grad():
                copies = dict(before)
                args, kwargs = copy_tensors(args, copies), copy_tensors(kwargs, copies)
        with self.standing_aside():
            result = replay_module(
                frame.module, args, kwargs, rng_state=frame.rng_state, kinds=self.kinds,
                module_name=frame.info.name, autocast=frame.call.autocast,
            )
            if result.finding is not None and is_fused(fused := result.finding.op):
                with fast_path_off():  # a fused inference layer, taken apart (replay/fused.py)
                    apart = replay_module(frame.module, args, kwargs, rng_state=frame.rng_state, kinds=self.kinds,
                                          module_name=frame.info.name, autocast=frame.call.autocast)
                if apart.finding is not None:
                    result = apart
                    finding.notes.append(apart_note(fused))
        if result.finding is not None:
            op = result.finding
            inner = _call_named(self._log, frame.call, op.module) if op.module != frame.info.name else None
            if inner is not None:
                # A checked child ran it, after its output was checked: a user's forward hook (torch runs the
                # watch's global hooks first) rewrote the output. Its module, as ops=True names it.
                self.move_to(finding, inner, TensorRef.op_output(op.op))
                finding.notes = [note for note in finding.notes if note.kind != "own-code"]
            elif (uncalled := run_without_a_call(frame.module, frame.info.name, op.module)) is not None:
                # A child's code run with no call of it (``self.act.forward(h)``): its module, as the tiered watch
                # and ops=True name it.
                finding.module, finding.module_type = op.module, user_type(uncalled)
            apply_op_finding(finding, op, result.tensors)
            finding.frame, finding.frame_calls = result.frame, result.calls
            finding.notes.extend([result.debug_note] if result.debug_note is not None else [])
            finding.notes.append(Note.of("replay-found", module=frame.info.name, nan=op.nan, posinf=op.posinf,
                                         neginf=op.neginf, op=op.op))
            if op.module is not None and op.module != finding.module:
                # A child without a check of its own (a pass-through, transparent.py).
                finding.notes.append(Note.of("ran-inside", op=op.op, op_module=op.module))
            return False
        if result.held_by_inputs and produced <= {"+inf", "-inf"}:
            self.masks.add(id(frame.module))
            self._emit(mark_deliberate(finding, "scalar-inside"))
            return True
        if result.note:
            finding.notes.append(result.note)
        return False

    def explain_failure(self, module: nn.Module, call: Call, running: tuple[tuple[Any, ...], dict[str, Any]] | None
                        ) -> Finding | None:
        """A top-level forward raised (multinomial on NaN probabilities): the op that made a value non-finite first.

        The per-module watch's counterpart of the tiered step replay's: the call runs again under the op tracer, which
        stops at the first op that makes a non-finite value; None where none does before the exception.
        """
        error = sys.exc_info()[1]
        if not self.can_replay or error is None or running is None or call.info is None:
            return None  # (our NonFiniteError on its way out and linalg's verdicts are not replayed: raised.py)
        finding = Finding(Phase.FORWARD, call, TensorRef.output())
        frame = Frame(module, call.info, call, call.rng_state)
        self.replay_into(finding, frozenset(KINDS), frame, *running, draws_again=True)
        if finding.op is None:
            return None
        if not _replayable(call, call.rng_state):
            # Its generators were not kept (no backward or deferred check would replay it): the user's stay as
            # they are, and the replay draws numbers of its own.
            finding.notes.append(Note("rng-redrawn"))
        finding.notes.append(Note.raised("forward-raised", error))
        return finding

    def replay_deferred(self, finding: Finding, produced: frozenset[str], call: Call) -> bool:
        """Name the op and line of a producer found at the deferred check, long after its call.

        Its arguments come from what the call kept (held.py), a freed one recomputed from the call that returned it.
        When they cannot be had (a value of its parent's own code that is gone), the nearest enclosing call whose
        arguments can is replayed instead, and its op is taken only if it ran inside the producer. Returns what
        :meth:`replay_into` returns.
        """
        nearest = self._nearest_kept(call)
        if isinstance(nearest, Note):
            finding.notes.append(Note.of("arguments-gone", module=call.name, reason=nearest.pair))
            return False
        enclosing, arguments, missing = nearest
        if enclosing is call:
            finding.rng_state = call.rng_state
            self._recompute_freed(finding, call, arguments)
            frame = Frame(call.module, call.info, call, call.rng_state)  # type: ignore[arg-type]
            return self.replay_into(finding, produced, frame, arguments.args, arguments.kwargs)
        outer = enclosing.name
        with self.standing_aside():
            result = replay_module(
                enclosing.module, arguments.args, arguments.kwargs, rng_state=enclosing.rng_state,
                kinds=self.kinds, module_name=enclosing.name or "", autocast=enclosing.autocast,
            )
        op = result.finding
        within = op is not None and _within(op.module, call, enclosing)
        if not within and produced <= {"+inf", "-inf"} and (call.name or "") in result.benign_modules:
            return self._deliberate_in_replay(finding, call, outer)
        if op is not None and within:
            apply_op_finding(finding, op, result.tensors)
            finding.frame, finding.frame_calls = result.frame, result.calls
            finding.notes.extend([result.debug_note] if result.debug_note is not None else [])
            finding.notes.append(Note.of(
                "found-in-enclosing", module=call.name, reason=missing.pair if missing else None, outer_module=outer,
                op_module=op.module or call.name, nan=op.nan, posinf=op.posinf, neginf=op.neginf, op=op.op,
            ))
            return False
        caller = caller_named(call, op.module) if op is not None else None
        if op is not None and caller is not None:
            # The first non-finite value was made by the own code of a call
            # enclosing the one whose output was found: that caller is the producer.
            self.move_to(finding, caller, TensorRef.op_output(op.op))
            apply_op_finding(finding, op, result.tensors)
            finding.frame, finding.frame_calls = result.frame, result.calls
            finding.notes.extend([result.debug_note] if result.debug_note is not None else [])
            finding.notes.append(Note.of("found-in-caller", outer_module=outer, op_module=op.module, op=op.op,
                                         module=call.name))
            return False
        finding.notes.append(Note.of(
            "enclosing-missed", module=call.name, reason=missing.pair if missing else None, outer_module=outer,
            op=op.op if op is not None else None, op_module=op.module if op is not None else None,
            replay=result.note.pair if result.note else None,
        ))
        return False

    def move_to(self, finding: Finding, caller: Call, tensor: TensorRef) -> None:
        """Make ``finding`` name ``caller`` (an enclosing call, or a child) the producer of ``tensor``, with its inputs.

        The output first found (a child's, or its parent's) only passed the value on: it is
        no longer the finding's tensor, nor its layer row the producer's.
        """
        if finding.record is not None:
            finding.record.status = "propagated"
        finding.tensor, finding.record = tensor, None
        finding.call, finding.rng_state = caller, caller.rng_state
        finding.module, finding.module_type = caller.name, caller.module_type
        finding.model = caller.info.model if caller.info is not None else None
        finding.inputs = named_inputs(caller)
        finding.bad, finding.bad_stats = None, None

    def _deliberate_in_replay(self, finding: Finding, call: Call, outer: str | None) -> bool:
        """A replay of the enclosing call showed ``call``'s infinity to be deliberate: recorded as benign."""
        if call.module is not None:
            self.masks.add(id(call.module))
        self._emit(mark_deliberate(finding, "scalar-in-replay", outer_module=outer, module=call.name))
        return True

    def _nearest_kept(self, call: Call) -> tuple[Call, Resolved, Note | None] | Note:
        """The call itself or its nearest enclosing call whose arguments can be had, with them.

        Also why the call's own arguments cannot be had (None when they can);
        only that reason when no enclosing call's can either.
        """
        missing: Note | None = None
        enclosing: Call | None = call
        while enclosing is not None:
            arguments = self.kept_arguments(enclosing)
            if isinstance(arguments, Resolved):
                return enclosing, arguments, missing
            missing = missing or arguments
            enclosing = enclosing.parent
        return missing or Note("not-kept")

    def kept_arguments(self, call: Call) -> Resolved | Note:
        """A finished call's arguments again, from what it kept; or why not (a note)."""
        if call.held is None or call.module is None or call.phase != Phase.FORWARD:
            return Note("not-kept")
        if not _replayable(call, call.rng_state):
            return Note("rng-not-kept")
        with self.standing_aside():  # a freed argument is recomputed by running its call again
            return call.held.resolve(self._regenerate)

    def _recompute_freed(self, finding: Finding, call: Call, arguments: Resolved) -> None:
        """Give a finding whose tensors were freed before the deferred check exact values again.

        The producer's inputs (for the report and the scene) are the ones resolved for the replay; its output is
        recomputed by running the call again, and used only if it holds the kinds the probe saw.
        """
        if not finding.inputs:
            for path, _argument, held_record, ref, _version in call.inputs:
                tensor = ref()
                if tensor is None and held_record is not None:
                    tensor = arguments.by_record.get(id(held_record))
                if tensor is not None:
                    finding.inputs.append((TensorRef.argument(path), tensor.detach()))
        record = finding.record
        if finding.bad is not None or record is None:
            return
        with self.standing_aside():
            output = run_again(call.module, arguments.args, arguments.kwargs, call.rng_state, call.autocast)
        again = next((tensor for path, tensor in iter_tensors(output, "output", attributes=True)
                      if path == record.path), None)
        if again is not None and record.kinds and record.kinds <= kinds_of(again):
            finding.bad, finding.bad_stats = again, None
            finding.notes.append(Note.of("freed-recomputed", path=str(record.path), module=call.name))

    def _regenerate(self, record: TensorRecord | Alias, depth: int = 0) -> torch.Tensor | None:
        """A freed module output, recomputed by replaying the call that returned it, else its enclosing call.

        Its own freed inputs are recomputed the same way, up to :data:`REGENERATE_DEPTH` calls back; one made in
        the enclosing call's own code (a block's residual sum, freed by gradient checkpointing) by replaying that
        call. The value is the one the consumer saw only when the tensor was not changed in place in between;
        :meth:`HeldArguments.resolve` checked the version.
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
        if output is None:
            output = enclosing_output(call, self._log.calls, lambda inner: self._regenerate(inner, depth + 1))
        for path, tensor in iter_tensors(output, "output", attributes=True):
            if path == record.path:
                return tensor
        return None

def _whole_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` sees exactly ``base``'s elements, in the same layout."""
    return view.dtype == base.dtype and (view.shape, view.stride(), view.storage_offset()) == (
        base.shape, base.stride(), base.storage_offset())


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """More than one owner of the tensor (its Python object and, say, autograd's saved copy)."""
    use_count = getattr(tensor, "_use_count", None)  # a private torch method: absent, hold nothing
    return use_count is not None and use_count() > 1


def _mutated(tensor: torch.Tensor | None, version: int) -> bool:
    """Whether a still-alive tensor was written in place since ``version``."""
    return tensor is not None and version_of(tensor) != version
