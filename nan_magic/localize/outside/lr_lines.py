"""The loop's line that set a non-finite learning rate no op made: a number computed in Python, or a tensor kept.

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

import torch

from nan_magic.errors.frames import is_library_code, pointer_at
from nan_magic.hot.kept.finding import Finding
from nan_magic.records import Note

__all__ = ["LrLine", "lr_line", "name_lr_line", "number_counts", "same_number"]

_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF"})

#: ``(frame, name, line, offset)``: the loop's frame, the name bound to the rate, and the store that bound it.
LrLine = tuple[FrameType, str, int, int]


def name_lr_line(finding: Finding, lr: float, raw: object) -> bool:
    """Name the loop's line that set the non-finite rate ``lr`` no recorded op made; True where it was found."""
    found = lr_line(lr, raw)
    if found is None:
        return False
    frame, name, line, offset = found
    finding.source = pointer_at(frame.f_code, line, frame.f_globals)
    finding.notes.append(Note.of("lr-set-by-loop", lr=lr, name=name, line=line))
    finding.frame, finding.frame_position = frame, (offset, line)  # (%debug at that line, in the loop's frame)
    return True


def lr_line(lr: float, raw: object) -> LrLine | None:
    """Where the user's innermost frame set the non-finite rate ``lr`` (``raw``: the group's own ``lr`` object)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return None
    names = [name for name, value in frame.f_locals.items() if value is raw and not isinstance(raw, bool)]
    if not names:  # (a float the group holds from a tensor's .item(): the same non-finite number)
        names = [name for name, value in frame.f_locals.items() if _holds(value, lr)]
    lasti, code = frame.f_lasti, frame.f_code
    # (A name the loop only read the rate into, ``lr = sched.get_last_lr()[0]`` to log it, did not set it: the name
    # must be the one the code stores into a group's ``"lr"``.)
    names = [name for name in names if name in _set_as_lr(code)]
    found = [(*store, name) for name in names if (store := _last_store(code, name, lasti)) is not None]
    if not found:
        return None
    # (Of several names holding it, the one stored last before this instruction: ``lr = base * ratio`` over ratio.)
    offset, line, name = max(found, key=lambda store: (store[0] < lasti, store[0]))
    return frame, name, line, offset


def _holds(value: object, lr: float) -> bool:
    """Whether ``value`` is a Python number, or a one-element floating tensor, holding the non-finite ``lr``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            return False
        value = float(value)
    if not isinstance(value, float):
        return False
    return (math.isnan(value) and math.isnan(lr)) or value == lr


def _set_as_lr(code: CodeType) -> set[str]:
    """The names loaded on a line of ``code`` that stores into a subscript ``"lr"`` (``group["lr"] = lr``)."""
    instructions = list(dis.get_instructions(code))
    lines = {_line(instruction) for previous, instruction in pairwise(instructions)
             if instruction.opname == "STORE_SUBSCR" and previous.opname == "LOAD_CONST" and previous.argval == "lr"}
    return {instruction.argval for instruction in instructions
            if instruction.opname in _LOADS and _line(instruction) in lines}


def _line(instruction: dis.Instruction) -> int | None:
    return instruction.positions.lineno if instruction.positions is not None else None


def _last_store(code: CodeType, name: str, lasti: int) -> tuple[int, int] | None:
    """``(offset, line)`` of the last store to ``name`` before instruction ``lasti``, else of its last store."""
    stores = [(instruction.offset, instruction.positions.lineno)
              for instruction in dis.get_instructions(code) if instruction.opname in _STORES
              and instruction.argval == name and instruction.positions is not None
              and instruction.positions.lineno is not None]
    before = [store for store in stores if store[0] < lasti]
    return max(before or stores, default=None)


def number_counts(value: float) -> tuple[int, int, int]:
    """``(nan, posinf, neginf)`` of one number."""
    return int(math.isnan(value)), int(value == math.inf), int(value == -math.inf)


def same_number(nan: int | None, posinf: int | None, neginf: int | None, lr: float) -> bool:
    """Whether one element counted ``nan``, ``posinf``, ``neginf`` is the non-finite ``lr``."""
    return (nan, posinf, neginf) == number_counts(lr)
