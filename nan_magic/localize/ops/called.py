"""The torch function a user's line was calling when an op inside it made a non-finite value from a number.

``torch.logdet(w)`` is a C++ composite, ``where(sign == -1, nan, logabsdet)``: the NaN is a Python number torch
passes to ``aten.scalar_tensor`` itself, with no Python frame between the user's line and the op. The op tracer
sees the number as an argument, as it would one the code passed (``torch.where(mask, nan, x)``); what tells them
apart is the function the line called, read from its bytecode: the instruction at the frame's ``f_lasti`` is the
call, and the name loaded at the call's first column is its function. Read at an origin only (an op given a
non-finite number), never per op.
"""

from __future__ import annotations

import dis
import functools
from types import CodeType, FrameType

__all__ = ["OWN_NUMBERS", "own_number_of"]

#: Functions whose decomposition makes a non-finite value from a number of its own: logdet's NaN where det < 0.
OWN_NUMBERS = frozenset({"logdet"})

#: The instructions that load a call's function by name (3.11: LOAD_METHOD; 3.12: LOAD_ATTR with a method flag).
_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST"})


@functools.lru_cache(maxsize=64)
def _instructions(code: CodeType) -> tuple[dis.Instruction, ...]:
    return tuple(dis.get_instructions(code))


def called_function(frame: FrameType) -> str | None:
    """The name of the function the call running in ``frame`` called (``logdet`` of ``torch.logdet(w)``), or None."""
    instructions = _instructions(frame.f_code)
    at = next((index for index, instruction in enumerate(instructions) if instruction.offset == frame.f_lasti), None)
    start = getattr(instructions[at], "positions", None) if at is not None else None  # (3.11 on)
    if at is None or start is None or start.col_offset is None:
        return None
    for instruction in reversed(instructions[:at]):
        where = getattr(instruction, "positions", None)
        if (instruction.opname in _LOADS and where is not None
                and (where.lineno, where.col_offset) == (start.lineno, start.col_offset)):
            return instruction.argval if isinstance(instruction.argval, str) else None
    return None


def own_number_of(frame: FrameType | None) -> str | None:
    """The function of :data:`OWN_NUMBERS` the line in ``frame`` was calling, whose number an op inside it read."""
    name = called_function(frame) if frame is not None else None
    return name if name in OWN_NUMBERS else None
