"""The loop's line that set a non-finite learning rate no recorded op made: a number computed in Python, or a tensor
made before the records that reach the step (its op is then not named, only the line).

A rate the loop computes in Python (``lr = base * done / warmup`` with numpy numbers, ``lr = 1e200 * 1e200``) runs no
op; one kept as a tensor in ``param_groups`` was made before the regions whose records reach the step. No record
names either. The loop's frame still binds the rate to a name: the local whose value is the group's ``lr`` object
itself (or, a float read from a tensor, the same non-finite number) names it (a name the code stores into a
group's ``"lr"``, not one it only read the rate into), and the last store to that name before the frame's current
instruction (else its last one: set at the end of the previous iteration) is the line that set it. Asked at such
an event only.
"""

from __future__ import annotations

import dis
import math
import sys
from itertools import pairwise
from types import CodeType, FrameType
from typing import TYPE_CHECKING

import torch

from nan_magic.errors.frames import is_library_code, pointer_at
from nan_magic.hot.kept.finding import Finding
from nan_magic.localize.ops.origins import OpFinding, attach_origin
from nan_magic.records import Note, Phase

if TYPE_CHECKING:
    from nan_magic.localize.ops.tracer import OpTracer
    from nan_magic.localize.outside.update_recorder import UpdateRecorder

__all__ = ["LrLine", "lr_line", "name_lr", "name_lr_line", "number_counts", "same_number"]

_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_FAST_STORE_FAST"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST"})

_NONE = object()
#: Instructions that compute a new object on a line (an operator, a call): what such a line stores is not a name's.
_COMPUTES = ("BINARY_OP", "UNARY_", "CALL", "PRECALL", "COMPARE_OP")

#: ``(frame, name, line, offset)``: the loop's frame, the name bound to the rate, and the store that bound it.
LrLine = tuple[FrameType, str, int, int]


def name_lr(finding: Finding, lr: float, raw: object, tracer: OpTracer | None, recorder: UpdateRecorder | None
            ) -> bool:
    """:meth:`LoopWrites.name_lr`: the op of the update code (ops mode: ``tracer``'s origins; else ``recorder``'s
    records) that made the non-finite rate ``lr``, else the loop's line that set it; True when one was named."""
    origin: OpFinding | None = None
    if tracer is not None:  # (ops mode: the step's origins, latest first, but the step's own and backward's)
        origin = next((found for found in reversed(tracer.started) if found.phase is Phase.FORWARD
                       and found.numel == 1 and same_number(found.nan, found.posinf, found.neginf, lr)), None)
        frame, position = tracer.frame_of(origin) if origin is not None else (None, None)
        calls: tuple[tuple[FrameType, int, int], ...] = ()
    elif recorder is not None:
        if recorder._ring:
            recorder._record_ring()
        for op in reversed(recorder._ops):
            out = op.out
            if (type(out) is torch.Tensor and out.is_floating_point() and out.numel() == 1
                    and same_number(*number_counts(float(out)), lr)):
                origin = recorder.claim(out)
                break
        _tensors, frame, position = recorder.witness(origin) if origin is not None else ((), None, None)
        calls = recorder.calls_to(frame) if frame is not None else ()
    if origin is None:
        return name_lr_line(finding, lr, raw)
    attach_origin(finding, origin)
    finding.notes.append(Note.of("lr-made-by-loop", lr=lr, op=origin.op,  # (with its output's counts: the cause's)
                                 line=origin.source.lineno if origin.source is not None else None,
                                 nan=origin.nan, posinf=origin.posinf, neginf=origin.neginf))
    if frame is not None:
        finding.frame, finding.frame_position, finding.frame_calls = frame, position, calls
    return True


def name_lr_line(finding: Finding, lr: float, raw: object) -> bool:
    """Name the loop's line that set the non-finite rate ``lr`` no recorded op made; True where it was found."""
    found = lr_line(lr, raw)
    if found is None:
        _note_lr_store(finding, lr)
        return False
    frame, name, line, offset = found
    finding.source = pointer_at(frame.f_code, line, frame.f_globals)
    finding.notes.append(Note.of("lr-set-by-loop", lr=lr, name=name, line=line))
    finding.frame, finding.frame_position = frame, (offset, line)  # (%debug at that line, in the loop's frame)
    return True


def _note_lr_store(finding: Finding, lr: float) -> None:
    """Where no name holds the rate (``group["lr"] = float(lrs[step])``, ``= float("nan")``): the one line of the
    loop's frame that writes a group's ``"lr"``, noted as where to look (``lr-stored-by-loop``), not as the line that
    set it: the rate may have come in otherwise (given to the optimizer), so the report's line is not moved there."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return
    lines = sorted(_store_lines(frame.f_code))
    if len(lines) == 1:
        pointer = pointer_at(frame.f_code, lines[0], frame.f_globals)
        finding.notes.append(Note.of("lr-stored-by-loop", lr=lr, line=lines[0],
                                     text=pointer.line if pointer is not None else None))


def _store_lines(code: CodeType) -> set[int]:
    """The lines of ``code`` that store into a subscript ``"lr"`` (``group["lr"] = ...``)."""
    return {line for (previous, _), (instruction, line) in pairwise(_lined(code))
            if instruction.opname == "STORE_SUBSCR" and previous.opname == "LOAD_CONST" and previous.argval == "lr"
            and line is not None}


def lr_line(lr: float, raw: object) -> LrLine | None:
    """Where the user's innermost frame set the non-finite rate ``lr`` (``raw``: the group's own ``lr`` object)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return None
    lasti, code = frame.f_lasti, frame.f_code
    # (A name the loop only read the rate into, ``lr = sched.get_last_lr()[0]`` to log it, did not set it: the name
    # must be one the code stores into a group's ``"lr"``. Only those are read: in a notebook the loop's locals are
    # the user's globals, any tensor among them.)
    settable = [(name, value) for name in _set_as_lr(code) if (value := frame.f_locals.get(name, _NONE)) is not _NONE]
    names = [name for name, value in settable if value is raw and not isinstance(raw, bool)]
    if not names:  # (a float the group holds from a tensor's .item(): the same non-finite number)
        names = [name for name, value in settable if _holds(value, lr)]
    if not names and isinstance(raw, torch.Tensor):
        # A tensor rate the loop makes anew each step, judged a step late (the deferred check reads a step's result
        # with the next step's transfer): the one name the loop stores into a group's "lr" holding a tensor holds
        # the next step's rate now, and set this one at the same line.
        # Only a name stored as it is (``group["lr"] = lr_t``): of ``base_lr * warm`` the constant base is no rate.
        direct = _set_as_lr(code, directly=True)
        rebound = [name for name, value in settable if isinstance(value, torch.Tensor)]
        names = rebound if len(rebound) == 1 and rebound[0] in direct else []
    found = [(*store, name) for name in names if (store := _last_store(code, name, lasti)) is not None]
    if not found:
        return None
    # (Of several names holding it, the one stored last before this instruction: ``lr = base * ratio`` over ratio.)
    offset, line, name = max(found, key=lambda store: (store[0] < lasti, store[0]))
    return frame, name, line, offset


def _holds(value: object, lr: float) -> bool:
    """Whether ``value`` is a Python number, or a one-element floating tensor, holding the non-finite ``lr``."""
    if isinstance(value, torch.Tensor):
        if (value.numel() != 1 or not value.is_floating_point() or value.is_meta or value.is_nested
                or value.layout is not torch.strided):
            return False
        try:
            value = float(value)
        except Exception:  # (a tensor subclass that will not give a number: not the rate)
            return False
    if not isinstance(value, float):
        return False
    return (math.isnan(value) and math.isnan(lr)) or value == lr


def _set_as_lr(code: CodeType, directly: bool = False) -> set[str]:
    """The names loaded on a line of ``code`` that stores into a subscript ``"lr"`` (``group["lr"] = lr``);
    ``directly``: only on such a line that computes nothing (no operator, no call: the name's own object is stored)."""
    instructions = _lined(code)
    lines = _store_lines(code)
    if directly:
        lines -= {line for instruction, line in instructions if instruction.opname.startswith(_COMPUTES)}
    return {name for instruction, line in instructions if instruction.opname in _LOADS and line in lines
            for name in _names(instruction)}


def _lined(code: CodeType) -> list[tuple[dis.Instruction, int | None]]:
    """``code``'s instructions with the line each is on (``positions`` from Python 3.11; 3.10's ``starts_line``
    marks only a line's first instruction)."""
    lined, line = [], None
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)
        if positions is not None:
            line = positions.lineno
        elif instruction.starts_line is not None and not isinstance(instruction.starts_line, bool):
            line = instruction.starts_line
        lined.append((instruction, line))
    return lined


def _names(instruction: dis.Instruction) -> tuple[str, ...]:
    """The names an instruction loads or stores (Python 3.13's superinstructions, ``LOAD_FAST_LOAD_FAST``, two)."""
    argval = instruction.argval
    return tuple(argval) if isinstance(argval, tuple) else (argval,)


def _last_store(code: CodeType, name: str, lasti: int) -> tuple[int, int] | None:
    """``(offset, line)`` of the last store to ``name`` before instruction ``lasti``, else of its last store."""
    stores = [(instruction.offset, line) for instruction, line in _lined(code)
              if line is not None and name in _stored(instruction)]
    before = [store for store in stores if store[0] < lasti]
    return max(before or stores, default=None)


def _stored(instruction: dis.Instruction) -> tuple[str, ...]:
    """The names an instruction stores (3.13's ``STORE_FAST_LOAD_FAST`` stores its first, loads its second)."""
    if instruction.opname == "STORE_FAST_LOAD_FAST":
        return _names(instruction)[:1]
    return _names(instruction) if instruction.opname in _STORES else ()


def number_counts(value: float) -> tuple[int, int, int]:
    """``(nan, posinf, neginf)`` of one number."""
    return int(math.isnan(value)), int(value == math.inf), int(value == -math.inf)


def same_number(nan: int | None, posinf: int | None, neginf: int | None, lr: float) -> bool:
    """Whether one element counted ``nan``, ``posinf``, ``neginf`` is the non-finite ``lr``."""
    return (nan, posinf, neginf) == number_counts(lr)
