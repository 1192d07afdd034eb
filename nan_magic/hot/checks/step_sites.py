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

from nan_magic.errors.frames import is_library_code, user_call

__all__ = ["Chain", "call_chain", "continues_iteration", "loops_of", "site", "stepped_nearby", "steps_another_outside"]


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
            # (POP_JUMP_BACKWARD_IF_*, Python 3.11: a while loop's test at its end)
            if "JUMP_BACKWARD" in instruction.opname and isinstance(instruction.argval, int):
                ends[instruction.argval] = max(ends.get(instruction.argval, 0), instruction.offset)
        _LOOPS[code] = list(ends.items())
    return _LOOPS[code]


#: The code of a comprehension (its own frame, Python 3.11): its calls are a loop inside its caller's.
_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>"})


Chain = tuple[tuple[CodeType, int], ...]


def call_chain() -> Chain:
    """The user's frames calling a model now, innermost first, as ``(code, f_lasti)`` (kept: no frame)."""
    frame: FrameType | None = sys._getframe(1)
    chain: list[tuple[CodeType, int]] = []
    while frame is not None and len(chain) < _MOST:
        if not is_library_code(frame.f_code):
            chain.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(chain)


#: The answers of :func:`continues_iteration`, by the two chains (an inference loop asks the same at every step).
_CONTINUES: dict[tuple[Chain, Chain], bool] = {}
_MOST = 8


def continues_iteration(opened: Chain, now: Chain) -> bool:
    """:func:`_continues`, its answer kept for the two chains."""
    answer = _CONTINUES.get((opened, now))
    if answer is None:
        if len(_CONTINUES) > 4096:
            _CONTINUES.clear()
        answer = _CONTINUES[opened, now] = _continues(opened)
    return answer


def _continues(opened: Chain) -> bool:
    """Whether a model called again now, no optimizer stepped yet, is the same iteration of the loop as the call from
    ``opened`` (:func:`call_chain`) that opened the step (step_cycle.py): called from another place of a loop that
    calls an optimizer's ``step()`` (SimCLR's second view), or from the same place in a loop inside one that does (a
    rollout, in the loop's body, a comprehension or a helper), where an inference loop's next iteration calls its
    model from where it did."""
    now = _user_frames(sys._getframe(2))
    if not now or not opened:
        return False
    for was, (frame, at) in zip(reversed(opened), reversed(now), strict=False):  # from the outermost frame in
        if was != (frame.f_code, at):
            return was[0] is frame.f_code and _steps_in_loop(frame.f_code, at, frame, None)
    inner: tuple[int, int] | None = None  # the same place: a loop inside one that steps an optimizer?
    for frame, at in now:
        if frame.f_code.co_name in _COMPREHENSIONS:
            inner = (-1, -1)
            continue
        for loop in sorted((loop for loop in loops_of(frame.f_code) if loop[0] <= at <= loop[1]),
                           key=lambda loop: loop[1] - loop[0]):
            if inner is not None and _steps_in_loop(frame.f_code, at, frame, loop, inner):
                return True
            inner = loop
        inner = (-1, -1) if inner is not None else None  # (a caller's loop: the whole of its body is outside)
    return False


def _user_frames(frame: FrameType | None) -> list[tuple[FrameType, int]]:
    found: list[tuple[FrameType, int]] = []
    while frame is not None and len(found) < _MOST:
        if not is_library_code(frame.f_code):
            found.append((frame, frame.f_lasti))
        frame = frame.f_back
    return found


def _steps_in_loop(code: CodeType, at: int, frame: FrameType, loop: tuple[int, int] | None,
                   outside: tuple[int, int] = (-1, -1)) -> bool:
    """Whether ``loop`` (None: the innermost loop around ``at``) calls an optimizer's ``step()`` outside ``outside``."""
    if loop is None:
        around = sorted((each for each in loops_of(code) if each[0] <= at <= each[1]),
                        key=lambda each: each[1] - each[0])
        if not around:
            return False
        loop = around[0]
    start, end = loop
    instructions = _instructions(code)
    return any(instruction.argval == "step" and instruction.opname in ("LOAD_METHOD", "LOAD_ATTR")
               and start <= instruction.offset <= end and not outside[0] <= instruction.offset <= outside[1]
               and isinstance(_named(instructions, index - 1, frame), torch.optim.Optimizer)
               for index, instruction in enumerate(instructions))
