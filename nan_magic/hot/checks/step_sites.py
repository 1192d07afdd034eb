"""Where the user's code calls ``step()`` and a model, read from its bytecode's loops (iterations.py, step_cycle.py).

Asked at an event of the step counting only (an optimizer's first step, the second of a run of one optimizer's steps;
a model called again before any optimizer stepped), never on a training step: a loop is a backward jump's range, a
call's place its frame's ``f_lasti``, and an optimizer named in the loop a variable (or its plain attributes) that
holds one in the frame. Frames are never kept: they hold the loop's tensors.
"""

from __future__ import annotations

import dis
import sys
from types import CodeType, FrameType

import torch

from nan_magic.errors.frames import user_call

__all__ = ["continues_iteration", "loops_of", "site", "stepped_nearby", "steps_another_outside"]


def site() -> tuple[CodeType, int, FrameType] | None:
    """The user's code calling ``step()`` now, where in it, and its frame (asked at an optimizer's first step, and
    at the second of a run of its steps; the frame is not kept: it holds the loop's tensors)."""
    found = user_call(sys._getframe(1))  # (the walk skips our frames and torch's: the user's call)
    return (found[1].f_code, found[2], found[1]) if found is not None else None


def steps_another_outside(site: tuple[CodeType, int, FrameType] | None, opt: torch.optim.Optimizer | None) -> bool:
    """Whether the loop around ``site`` (``opt``'s step call) sits in a loop whose code outside it calls ``step()`` of
    another optimizer, named by a variable or its attributes (a WGAN's generator step after the critic's loop)."""
    if site is None:
        return False
    code, at, frame = site
    around = sorted((loop for loop in loops_of(code) if loop[0] <= at <= loop[1]), key=lambda loop: loop[1] - loop[0])
    if len(around) < 2:
        return False
    (start, end), (outer_start, outer_end) = around[0], around[1]
    instructions = _instructions(code)
    for index, instruction in enumerate(instructions):
        if (instruction.argval == "step" and instruction.opname in ("LOAD_METHOD", "LOAD_ATTR")
                and outer_start <= instruction.offset <= outer_end and not start <= instruction.offset <= end):
            other = _named(instructions, index - 1, frame)
            if isinstance(other, torch.optim.Optimizer) and other is not opt:
                return True
    return False


def stepped_nearby(site: tuple[CodeType, int, FrameType]) -> list[object]:
    """The objects whose ``step()`` the innermost loop around ``site`` calls with no ``backward`` call between that
    call and ``site``'s."""
    code, at, frame = site
    around = sorted((loop for loop in loops_of(code) if loop[0] <= at <= loop[1]), key=lambda loop: loop[1] - loop[0])
    if not around:
        return []
    start, end = around[0]
    instructions = _instructions(code)
    backwards = [instruction.offset for instruction in instructions
                 if instruction.argval == "backward" and instruction.opname in ("LOAD_METHOD", "LOAD_ATTR")]
    found: list[object] = []
    for index, instruction in enumerate(instructions):
        if (instruction.argval == "step" and instruction.opname in ("LOAD_METHOD", "LOAD_ATTR")
                and start <= instruction.offset <= end
                and not any(min(at, instruction.offset) <= offset <= max(at, instruction.offset)
                            for offset in backwards)):
            found.append(_named(instructions, index - 1, frame))
    return found


def _named(instructions: list[dis.Instruction], index: int, frame: FrameType) -> object:
    """The object a chain of loads ending at ``instructions[index]`` reads in ``frame`` (plain attributes only: no
    property of the user's runs), or None."""
    attributes: list[str] = []
    while index >= 0 and instructions[index].opname == "LOAD_ATTR":
        attributes.append(str(instructions[index].argval))
        index -= 1
    if index < 0 or instructions[index].opname not in ("LOAD_FAST", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF"):
        return None
    name = str(instructions[index].argval)
    found = frame.f_locals.get(name, frame.f_globals.get(name))
    for attribute in reversed(attributes):
        found = getattr(found, "__dict__", {}).get(attribute)
    return found


_INSTRUCTIONS: dict[CodeType, list[dis.Instruction]] = {}


def _instructions(code: CodeType) -> list[dis.Instruction]:
    if code not in _INSTRUCTIONS:
        _INSTRUCTIONS[code] = list(dis.get_instructions(code))
    return _INSTRUCTIONS[code]


_LOOPS: dict[CodeType, list[tuple[int, int]]] = {}


def loops_of(code: CodeType) -> list[tuple[int, int]]:
    """The loops of ``code`` as bytecode offset ranges: a backward jump's target to the last jump there (a
    ``continue`` jumps back too)."""
    if code not in _LOOPS:
        ends: dict[int, int] = {}
        for instruction in _instructions(code):
            if instruction.opname.startswith("JUMP_BACKWARD") and isinstance(instruction.argval, int):
                ends[instruction.argval] = max(ends.get(instruction.argval, 0), instruction.offset)
        _LOOPS[code] = list(ends.items())
    return _LOOPS[code]


#: The code of a comprehension (its own frame, Python 3.11): its calls are a loop inside its caller's.
_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>"})


def continues_iteration(opened: tuple[CodeType, int] | None) -> bool:
    """Whether a model called again now, no optimizer stepped yet, is the same iteration of the loop as the call at
    ``opened`` that opened the step (step_cycle.py): called from another place of a loop that calls an optimizer's
    ``step()`` (SimCLR's second view), or from the same place in a loop inside one that does (a rollout), where an
    inference loop's next iteration calls its model from where it did."""
    found = user_call(sys._getframe(1))
    if found is None or opened is None:
        return False
    _, frame, at = found
    if (frame.f_code, at) != opened:
        return _steps_in_loop(frame.f_code, at, frame)
    if frame.f_code.co_name in _COMPREHENSIONS and (caller := frame.f_back) is not None:
        return _steps_in_loop(caller.f_code, caller.f_lasti, caller)
    return steps_another_outside((frame.f_code, at, frame), None)


def _steps_in_loop(code: CodeType, at: int, frame: FrameType) -> bool:
    """Whether the innermost loop around ``at`` calls an optimizer's ``step()``."""
    around = sorted((loop for loop in loops_of(code) if loop[0] <= at <= loop[1]), key=lambda loop: loop[1] - loop[0])
    if not around:
        return False
    start, end = around[0]
    instructions = _instructions(code)
    return any(instruction.argval == "step" and instruction.opname in ("LOAD_METHOD", "LOAD_ATTR")
               and start <= instruction.offset <= end
               and isinstance(_named(instructions, index - 1, frame), torch.optim.Optimizer)
               for index, instruction in enumerate(instructions))
