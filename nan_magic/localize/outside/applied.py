"""A custom ``torch.autograd.Function`` the recorded code called: its backward replayed as the Function's own.

The recorder (recorder.py) sees the aten ops a Function's ``forward`` runs, one by
one (under no_grad, as ``apply`` runs it). Run again one by one with gradients
(region_records.claim_backward), their backward is aten's, not the Function's:
a backward by hand that divides by what the forward clamped (``grad / p``) never
runs, and the replay finds no op. So where the records' frames show a Function's
``apply`` (its forward's frame, or a helper's it called, called by
``Function.apply``), the backward replay calls that ``apply`` again, on the
replay's tensors, in place of the ops it ran: the Function's backward runs, under
the op tracer, at its own line. Noted as the frames are let go at ``backward()``'s
start (the usual loss, written in the loop's running frame, has none to look at);
the ``apply``'s arguments are held as the records are (:func:`held`: a large
tensor weakly).
"""

from __future__ import annotations

from types import CodeType, FrameType
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from nan_magic.hot.kept.lines import line_at
from nan_magic.localize.outside.recorded_ops import Gone, RecordedOp, alive, record_key, weak_record

__all__ = ["Applied", "applied_calls", "rerun_applied"]

#: ``Function.apply``'s code: the frame that called a Function's ``forward`` runs it.
APPLY_CODE = torch.autograd.function.Function.apply.__func__.__code__  # type: ignore[attr-defined]
#: How far up from a returned frame its ``apply`` is looked for (a forward's helpers, a Function inside another's).
_DEPTH = 8


class Applied(NamedTuple):
    """One ``Function.apply`` the recorded code made: its ops' span in the records, and the call again."""

    first: int  # the index of its first recorded op
    last: int  # of its last
    function: type  # the Function
    args: tuple[Any, ...]  # as apply took them, each tensor a WeakRecord (recorded_ops.weak_record)
    kwargs: dict[str, Any]
    code: CodeType | None  # the user's code that called apply, and its line: the line of the nodes it makes
    lineno: int


def applied_calls(ops: list[RecordedOp], returned: set[FrameType], running: set[FrameType],
                  calls: dict[FrameType, tuple[FrameType, int, int] | None]) -> dict[int, Applied]:
    """The ``apply`` calls that ran ``ops`` whose frames (``returned``, functions that returned) a Function's
    forward ran or called, each outermost one by the index of its first op; empty where none did.

    ``calls``: where each frame was called, as the recorder noted it at the frame's first op (the line that
    called ``apply``: its caller may have run on since).
    """
    applies: dict[FrameType, FrameType] = {}
    for frame in returned:
        outer, up, depth = None, frame.f_back, 0
        while up is not None and up not in running and depth < _DEPTH:
            if up.f_code is APPLY_CODE:
                outer = up
            up, depth = up.f_back, depth + 1
        if outer is not None:
            applies[frame] = outer
    if not applies:
        return {}
    spans: dict[FrameType, list[int]] = {}
    for index, op in enumerate(ops):
        apply = applies.get(op.frame)
        if apply is not None:
            spans.setdefault(apply, [index, index])[1] = index
    units: dict[int, Applied] = {}
    for apply, (first, last) in spans.items():
        local = apply.f_locals
        caller = apply.f_back
        units[first] = Applied(first, last, local["cls"], tree_map(held, tuple(local["args"])),
                               tree_map(held, dict(local["kwargs"])), caller.f_code if caller else None,
                               _called_at(apply, caller, ops[last + 1:], calls))
    return units


def _called_at(apply: FrameType, caller: FrameType | None, after: list[RecordedOp],
               calls: dict[FrameType, tuple[FrameType, int, int] | None]) -> int:
    """The line of ``caller`` that called ``apply``: as noted, else its next recorded op's (the rest of the
    expression, most often), else where it is now."""
    site = calls.get(apply)
    if site is not None:
        return site[2]
    line = next((op.lineno for op in after if op.frame is caller), None)
    if line is not None or caller is None:
        return line or 0
    return line_at(caller)


def held(value: Any) -> Any:
    """An ``apply`` argument as the records hold theirs through backward: a small tensor kept, a large one weakly."""
    if not isinstance(value, torch.Tensor):
        return value
    base = value._base
    try:
        small = (value if base is None else base).nbytes <= 1 << 20
    except RuntimeError:  # a sparse COO tensor (a graph's adjacency) has no nbytes: held weakly
        small = False
    return weak_record(value, keep=small)


def rerun_applied(unit: Applied, recorded: list[RecordedOp], ops: list[RecordedOp], copies: dict[int, torch.Tensor],
                  key: int) -> bool:
    """``unit``'s ``apply`` again on the replay's tensors (``copies``, by recorded id), its outputs put in
    ``copies`` under the ids of the tensors its recorded ops made that the later ``ops`` read (or the loss,
    ``key``): each by the recorded value it equals, else one to one in the order made; False where they do not
    pair, or the apply raised (its ops are then run one by one)."""
    span = recorded[unit.first: unit.last + 1]
    read_after = {record_key(value) for op in ops[unit.last + 1:] for value in tree_leaves((op.args, op.kwargs))}
    read_after.add(key)
    inside: dict[int, Any] = {}
    for op in span:
        for value in tree_leaves(op.out):
            if (made_key := record_key(value)) is not None:
                inside.setdefault(made_key, value)
    made = [made_key for made_key in inside if made_key in read_after]

    def swap(value: Any) -> Any:
        arg_key = record_key(value)
        if arg_key is None:
            return value
        # An argument no recorded op read (saved for backward only): its value, outside this replay's graph.
        return copies[arg_key] if arg_key in copies else alive(value).detach()

    try:
        out = unit.function.apply(*tree_map(swap, unit.args), **tree_map(swap, unit.kwargs))  # type: ignore[attr-defined]
    except Gone:
        raise
    except Exception:  # (a Function that cannot run twice, or not on copies: its ops are run one by one)
        return False
    outs = [value for value in tree_leaves(out) if isinstance(value, torch.Tensor)]
    # Each output paired with the value its forward's op made (the order made need not be the order returned;
    # ``a, _ = Pair.apply(p)`` leaves an output no later op read); else, one to one, in the order made.
    paired: dict[int, torch.Tensor] = {}
    for new in outs:
        match = next((made_key for made_key in made if made_key not in paired and _same(new, inside[made_key])), None)
        if match is not None:
            paired[match] = new
    if len(paired) < len(made):
        if len(outs) != len(made):
            return False
        paired = dict(zip(made, outs))
    copies.update(paired)
    return True


def _same(new: torch.Tensor, recorded: Any) -> bool:
    """Whether the replay's ``new`` holds what the recorded tensor holds (NaN equal to NaN), where it is known."""
    try:
        old = alive(recorded)
    except Gone:
        return False
    return (new.shape == old.shape and new.dtype == old.dtype
            and bool(torch.equal(torch.nan_to_num(new.detach()), torch.nan_to_num(old.detach()))))
