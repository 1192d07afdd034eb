"""Whether the user's code around the running model call goes on to a backward: read from its bytecode, at an event.

A step opened before any optimizer has stepped is provisional (hot/step_cycle.py): the first module called again may
begin the loop's next inference step, or be the same iteration's second call (SimCLR's second view, a rollout's next
step), whose backward and optimizer step are still to come. Where an event comes before them, the code that is still
to run tells which: the loop around the call (the outermost loop of the first of the user's frames, from the call
outwards, that runs one) calls a ``backward`` (``loss.backward()``, ``torch.autograd.backward``, accelerate's
``accelerator.backward``, Lightning's ``manual_backward``). A frame with no loop around its call (a helper the loop
calls) is read from its current instruction to its end, then its caller; a comprehension's frame is passed over.
Nothing is run, and no name is resolved: the instructions are read (an attribute or global named so). A branch the
loop does not take is read too: an eval loop that calls ``backward`` only under a flag it never sets counts as one
that trains (its steps then say 0 until an optimizer steps).
"""

from __future__ import annotations

import dis
from collections.abc import Iterator
from types import CodeType, FrameType

from nan_magic.errors.frames import is_library_code

__all__ = ["backward_ahead"]

#: The names whose call runs a backward.
_BACKWARD = frozenset({"backward", "manual_backward"})
_NAMED = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME"})
_BACK_JUMPS = frozenset({"JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE"})
_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})
# id(code) -> (code, its instructions): an event asks a frame's code once per watch's life, not per frame.
_READ: dict[int, tuple[CodeType, list[dis.Instruction]]] = {}


def backward_ahead(frame: FrameType | None) -> bool:
    """Whether the user's code running ``frame`` (or its callers) goes on to a backward (the module docstring)."""
    for user in _user_frames(frame):
        if user.f_code.co_name in _COMPREHENSIONS:
            continue  # (a rollout's ``[critic(s) for s in states]``: its loop is the call's own, the caller's goes on)
        instructions = _instructions(user.f_code)
        at = user.f_lasti
        loops = [(_target(jump), jump.offset) for jump in instructions
                 if jump.opname in _BACK_JUMPS and _target(jump) <= at <= jump.offset]
        start, end = (min(begin for begin, _ in loops), max(stop for _, stop in loops)) if loops else (at, None)
        if any(start <= instruction.offset and (end is None or instruction.offset <= end)
               and instruction.opname in _NAMED and instruction.argval in _BACKWARD for instruction in instructions):
            return True
        if loops:
            return False  # the loop around the call is the iteration: it runs no backward
    return False


def _user_frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        if not is_library_code(frame.f_code):
            yield frame
        frame = frame.f_back


def _instructions(code: CodeType) -> list[dis.Instruction]:
    entry = _READ.get(id(code))
    if entry is None:
        entry = _READ[id(code)] = (code, list(dis.get_instructions(code)))
    return entry[1]


def _target(jump: dis.Instruction) -> int:
    target = jump.argval
    return target if isinstance(target, int) else jump.offset
