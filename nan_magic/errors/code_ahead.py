"""Whether the user's code around the running call goes on to train: read from its bytecode, never run.

A step opened before any optimizer has stepped is provisional (hot/step_cycle.py): the first module called again may
begin the loop's next inference step, or be the same iteration's second call (SimCLR's second view, a rollout's next
step), whose backward and optimizer step are still to come. The code that is still to run tells which: the loop
around the call (the outermost loop of the first of the user's frames, from the call outwards, that runs one) calls
a ``backward`` (``loss.backward()``, ``torch.autograd.backward``, accelerate's ``accelerator.backward``, Lightning's
``manual_backward``) *and* an optimizer's ``step`` (``opt.step()``, ``scaler.step(opt)``, ``xm.optimizer_step``): a
training iteration. An inference loop that takes a saliency map's backward every few images calls no step: its steps
stay one a call. A frame with no loop around its call (a helper the loop calls) is read from its current instruction
to its end, then its caller, what it calls counted with the caller's loop; a comprehension (its own frame, or inlined
in its function's code as Python 3.12 does) is passed over: its loop is the call's own. No name is resolved (an
attribute or global named so is enough), and a branch the loop does not take is read too: an eval loop that trains
only under a flag it never sets counts as training (its steps then say 0 until an optimizer steps). A backward or a
step called through a helper of the user's (``update(loss)``) is not seen: the steps stay one a call, as before.
"""

from __future__ import annotations

import dis
from collections.abc import Iterator
from types import CodeType, FrameType

from nan_magic.errors.frames import is_library_code

__all__ = ["BACKWARD", "STEP", "calls_ahead"]

#: The names whose call runs a backward.
BACKWARD = frozenset({"backward", "manual_backward"})
#: The names whose call steps an optimizer.
STEP = frozenset({"step", "optimizer_step"})
_NAMED = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME"})
#: Every jump; one whose target lies before it closes a loop (``JUMP_BACKWARD``, 3.11's ``POP_JUMP_BACKWARD_IF_TRUE``
#: closing a ``while``, 3.10's ``POP_JUMP_IF_TRUE`` to an earlier offset), whatever the Python version calls it.
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})
#: At most this many (code, instruction) answers are kept; past it they are read again (a cell's code is new each run).
_KEPT = 4096
# (id(code), instruction) -> (code, the names of each group found ahead, whether a loop decides there)
_READ: dict[tuple[int, int], tuple[CodeType, tuple[bool, ...], bool]] = {}


def calls_ahead(frame: FrameType | None, *groups: frozenset[str]) -> bool:
    """Whether the user's code running ``frame`` (or its callers) goes on to call a name of every one of ``groups``
    in the loop around the call (the module docstring)."""
    found = [False] * len(groups)
    for user in _user_frames(frame):
        if user.f_code.co_name in _COMPREHENSIONS:
            continue  # (a rollout's ``[critic(s) for s in states]``: its loop is the call's own, the caller's goes on)
        here, decided = _read(user.f_code, user.f_lasti, groups)
        found = [before or now for before, now in zip(found, here)]
        if all(found):
            return True
        if decided:
            return False  # the loop around the call is the iteration: it does not call them all
    return False


def _read(code: CodeType, at: int, groups: tuple[frozenset[str], ...]) -> tuple[tuple[bool, ...], bool]:
    """What ``code`` calls ahead of instruction ``at``, per group, and whether a loop around ``at`` bounds it."""
    key = (id(code), at)
    kept = _READ.get(key)
    if kept is not None and kept[0] is code and len(kept[1]) == len(groups):
        return kept[1], kept[2]
    instructions = list(dis.get_instructions(code))
    loops = [(jump.argval, jump.offset) for jump in instructions
             if _closes_loop(jump) and jump.argval <= at <= jump.offset and not _comprehension(instructions, jump)]
    start, end = (min(begin for begin, _ in loops), max(stop for _, stop in loops)) if loops else (at, None)
    names = {instruction.argval for instruction in instructions if instruction.opname in _NAMED
             and start <= instruction.offset and (end is None or instruction.offset <= end)}
    answer = tuple(bool(group & names) for group in groups), bool(loops)
    if len(_READ) >= _KEPT:
        _READ.clear()
    _READ[key] = (code, *answer)
    return answer


def _closes_loop(jump: dis.Instruction) -> bool:
    return jump.opcode in _JUMPS and isinstance(jump.argval, int) and jump.argval <= jump.offset


def _comprehension(instructions: list[dis.Instruction], jump: dis.Instruction) -> bool:
    """Whether the loop ``jump`` closes is a comprehension inlined in its function (Python 3.12+, PEP 709): its
    iteration variable is saved by ``LOAD_FAST_AND_CLEAR`` just before the loop starts."""
    first = next((index for index, instruction in enumerate(instructions) if instruction.offset >= jump.argval), 0)
    return any(instruction.opname == "LOAD_FAST_AND_CLEAR" for instruction in instructions[max(first - 5, 0):first])


def _user_frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        if not is_library_code(frame.f_code):
            yield frame
        frame = frame.f_back
