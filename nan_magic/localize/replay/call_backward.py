"""Replaying one module call's backward: the gradient hook's replay of a consumer, and anomaly mode's.

:class:`BackwardCallReplays` holds the backward half of :class:`~nan_magic.localize.replay.producer_call.CallReplay`
(which mixes it in): a backward producer's forward and backward are replayed from what its call kept, where the
forward replays (producer_call.py) run a call's forward alone. Apart so that each half reads in one sitting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from nan_magic.hot.kept.call_records import Alias, Call, TensorRecord
from nan_magic.hot.kept.finding import Finding, named_inputs
from nan_magic.hot.kept.step_log import StepLog
from nan_magic.localize.ops.origins import apply_op_finding
from nan_magic.localize.replay.calls_named import _call_named, _replayable
from nan_magic.localize.replay.module_run import replay_backward
from nan_magic.records import Note, Phase, TensorRef

__all__ = ["BackwardCallReplays"]


class BackwardCallReplays:
    """The backward replays of :class:`~nan_magic.localize.replay.producer_call.CallReplay`."""

    # Set by the class that mixes this in.
    kinds: frozenset[str]
    keeps_calls: bool
    _log: StepLog
    standing_aside: Callable[[], contextlib.AbstractContextManager[None]]
    _regenerate: Callable[[TensorRecord | Alias], torch.Tensor | None]

    def replay_backward_into(self, finding: Finding, consumer: Call, target: TensorRecord | None) -> None:
        """Replay the consumer whose backward made a gradient non-finite, to name the op and line.

        Called from the gradient hook (immediate mode) while the consumer's arguments may still be alive:
        autograd saves most of them for its backward. ``target`` is the consumer's input whose gradient went
        bad; None: its parameters' (a parameter whose own gradient alone went bad, op_origins.py).
        """
        if consumer.held is None or not _replayable(consumer, consumer.rng_state):
            finding.notes.append(Note.of("backward-not-kept", module=consumer.name))
            return
        chain: list[TensorRecord | Alias] = list(target.outward()) if target is not None else []
        # The consumer may have received it through a pass-through (a dropout, an activation).
        mine = {id(record) for record in chain}
        chain += [held for held in consumer.held.records() if isinstance(held, Alias) and id(held.record) in mine]
        with self.standing_aside():
            result = replay_backward(
                consumer.module,
                consumer.held,
                chain,
                rng_state=consumer.rng_state,
                regenerate=self._regenerate,
                kinds=self.kinds,
                module_name=consumer.name or "",
                autocast=consumer.autocast,
            )
        if result.finding is None:
            if result.note is not None:
                finding.notes.append(result.note.adding(ops_hint=True))
            return
        apply_op_finding(finding, result.finding)
        finding.notes.append(
            Note.of(
                "backward-replay-found", module=consumer.name, op=result.finding.op, node=result.finding.autograd_node
            )
        )
        if result.debug_note is not None:  # the forward line's frame, in a replay of the call (replay/line_replay.py)
            finding.frame = result.frame
            finding.notes.append(result.debug_note)
        inner = _call_named(self._log, consumer, result.finding.module) if result.finding.module else None
        if inner is not None and inner.info is not None:  # the op ran in a child's own code: the child is named
            if finding.record is not None:
                finding.record.status, finding.record = "propagated", None
            finding.module, finding.module_type, finding.model = inner.name, inner.module_type, inner.info.model

    def replay_anomaly(self, finding: Finding) -> bool:
        """torch's anomaly mode stopped the backward before any check saw a non-finite gradient (per-module watch).

        The backward was running inside the call that returned the tensor whose gradient arrived last (finite), or
        inside one of its enclosing calls (the ops between submodules are the container's). Each, from that call
        outwards, is replayed (forward and backward, anomaly mode off): the first whose replay makes a non-finite
        value in its backward is the producer. False where none does: nothing is claimed then, and ``finding`` gets
        the note of the call whose backward was running.
        """
        if not self.keeps_calls:
            return False
        last = _last_gradient_target(self._log)
        call = last.call if last is not None else None
        running = call
        while call is not None:
            if (
                call.phase == Phase.FORWARD
                and call.module is not None
                and call.held is not None
                and _replayable(call, call.rng_state)
            ):
                with self.standing_aside():
                    result = replay_backward(
                        call.module,
                        call.held,
                        (),
                        rng_state=call.rng_state,
                        regenerate=self._regenerate,
                        kinds=self.kinds,
                        module_name=call.name or "",
                        autocast=call.autocast,
                        anomaly=True,
                    )
                op = result.finding
                if op is not None:
                    # The call replayed is the producer: its own code, or a child's inside it (named by the op).
                    inner = call if op.module in (None, call.name) else _call_named(self._log, call, op.module) or call
                    finding.call, finding.record = inner, None
                    finding.module, finding.module_type = inner.name, inner.module_type
                    finding.model = inner.info.model if inner.info is not None else None
                    finding.tensor = TensorRef.op_output(op.op)
                    finding.rng_state = inner.rng_state
                    finding.inputs = named_inputs(inner)
                    apply_op_finding(finding, op, result.tensors)
                    finding.frame = result.frame
                    finding.notes.append(
                        Note.of("backward-replay-found", module=call.name, op=op.op, node=op.autograd_node)
                    )
                    if result.debug_note is not None:
                        finding.notes.append(result.debug_note)
                    if op.module is not None and op.module != inner.name:
                        finding.notes.append(Note.of("ran-inside", op=op.op, op_module=op.module))
                    return True
            call = call.parent
        if running is not None and running.info is not None:
            finding.notes.append(Note.of("anomaly-unreplayed", module=running.name))
        return False


def _last_gradient_target(log: StepLog) -> TensorRecord | None:
    """The recorded tensor whose gradient arrived last this step (cold: read at an event, from the log's calls).

    A gradient's call names the tensor by its consumer's argument, else by the
    call that returned it and its path (call_records.gradient_label).
    """
    calls = log.calls
    gradient = next((call for call in reversed(calls) if call.phase == Phase.BACKWARD and call.outputs), None)
    if gradient is None:
        return None
    label = gradient.outputs[0].path
    if not isinstance(label, TensorRef):
        return None
    if gradient.consumer is not None and label.name is None:
        return next(
            (
                record
                for path, _argument, record, _ref, _version in gradient.consumer.inputs
                if path == label.path and record is not None
            ),
            None,
        )
    for call in reversed(calls):
        if call.phase == Phase.FORWARD and call.index < gradient.index and call.name == label.name:
            found = next((record for record in call.outputs if str(record.path) == label.path), None)
            if found is not None:
                return found
    return None
