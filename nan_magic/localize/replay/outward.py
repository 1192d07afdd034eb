"""A producer whose own replay cannot repeat its call: replay the running calls around it instead.

A call that changes an object it was given (a Hugging Face attention layer appends its keys to the
``DynamicCache`` passed down to it) cannot be replayed from its arguments once it has run: the replay would start
from the cache as the call left it (module_run.py says so, ``replay-arguments-changed``). The call that made that
object, further out, can: a decoder model creates its cache inside its own ``forward``. The running calls that
enclose the producer are replayed from their own arguments, innermost first, until one repeats the call, and the
op is taken only if it ran inside the producer.

A producer that consumed a deliberate infinity another call returned (a head fed a masked max pool's -inf over a
fully padded sequence) is first looked at from around both: the per-module watch judged that call's output benign
by a replay of its call alone, and a replay of the consumer alone sees the -inf enter from outside. The op tracer,
seeing the max pick it and the consumer make a new kind of it, names the max (ops/origins.Picked), as ops=True
does; a consumer that is the producer of what it makes of it (a softmax) is taken from its own replay, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nan_magic.hot.kept.call_records import Call, Frame
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.held import running_arguments
from nan_magic.localize.ops.origins import apply_op_finding
from nan_magic.localize.replay.calls_named import _replayable, _within
from nan_magic.localize.replay.module_run import replay_module
from nan_magic.localize.replay.producer_call import CallReplay
from nan_magic.records import Note, TensorRef

__all__ = ["CHANGED", "replay_around_a_pick", "replay_outward"]

#: The note of a replay that found its arguments changed by the call it replays (module_run.py).
CHANGED = "replay-arguments-changed"


def replay_outward(replayer: CallReplay, finding: Finding, call: Call, stack: Sequence[Frame]) -> None:
    """Name ``finding``'s op by replaying the running calls around ``call`` (the module stack ``stack``)."""
    for frame in reversed(stack):
        outer = frame.call
        if outer is None or outer is call or not _encloses(outer, call):
            continue
        passed = running_arguments(frame.module)
        if passed is None or not _replayable(outer, frame.rng_state):
            return
        with replayer.standing_aside():
            args = passed[0] if frame.args is None else frame.args  # before the module's own pre-hooks (forward.py)
            result = replay_module(frame.module, args, passed[1], rng_state=frame.rng_state, kinds=replayer.kinds,
                                   module_name=outer.name or "", autocast=outer.autocast)
        op = result.finding
        if op is not None and _within(op.module, call, outer):
            apply_op_finding(finding, op, result.tensors)
            finding.frame = result.frame
            finding.notes.extend([result.debug_note] if result.debug_note is not None else [])
            finding.notes.append(Note.of("found-in-running", module=call.name, outer_module=outer.name,
                                         op_module=op.module, nan=op.nan, posinf=op.posinf, neginf=op.neginf,
                                         op=op.op))
            return
        if result.note is None or result.note.kind != CHANGED:
            return  # it repeated the call and found nothing inside the producer: stop at the nearest


def _encloses(outer: Call, call: Call) -> bool:
    parent = call.parent
    while parent is not None:
        if parent is outer:
            return True
        parent = parent.parent
    return False


def replay_around_a_pick(replayer: CallReplay, finding: Finding, call: Call, stack: Sequence[Frame]) -> bool:
    """Name ``finding``'s op where ``call`` consumed a deliberate infinity another call returned (a max pool's -inf):
    a replay of the nearest running call enclosing both names the max, where it picked what the consumer made a new
    kind of; whether it did (the finding then names that call). Nothing changes where it names another op.
    """
    makers = [record.call for _path, _argument, record, _ref, _version in call.inputs
              if record is not None and record.status == "benign" and record.call is not None
              and record.call.module is not None]
    if not makers:
        return False
    for frame in reversed(stack):
        outer = frame.call
        if outer is None or outer is call or not _encloses(outer, call) or not any(
                _encloses(outer, maker) for maker in makers):
            continue
        passed = running_arguments(frame.module)
        if passed is None or not _replayable(outer, frame.rng_state):
            return False
        with replayer.standing_aside():
            args = passed[0] if frame.args is None else frame.args  # before the module's own pre-hooks (forward.py)
            result = replay_module(frame.module, args, passed[1], rng_state=frame.rng_state, kinds=replayer.kinds,
                                   module_name=outer.name or "", autocast=outer.autocast,
                                   saving=torch.is_grad_enabled())  # (the forward's mode: its call runs still)
        op = result.finding
        maker = next((maker for maker in makers if op is not None and _encloses(outer, maker)
                      and _within(op.module, maker, outer)), None)
        if op is None or maker is None:
            return False
        replayer.move_to(finding, maker, TensorRef.op_output(op.op))
        apply_op_finding(finding, op, result.tensors)
        finding.frame = result.frame
        finding.notes.extend([result.debug_note] if result.debug_note is not None else [])
        finding.notes.append(Note.of("found-picked", module=call.name, outer_module=outer.name,
                                     op_module=op.module, nan=op.nan, posinf=op.posinf, neginf=op.neginf, op=op.op))
        return True
    return False
