"""The frame ``%debug`` opens at a producing op: its line, with the locals as that line left them.

A replay (or the op tracer of ``ops=True``) sees the producing op run in the
user's frame, and the frame then runs on: to the end of ``forward``, where
its locals are no longer the state the op saw (``att`` already the NaN after
the softmax, later variables defined) and its current line is no longer the
op's. So when the op runs, :func:`after_line` arms a trace on that one frame
(the way ``pdb.set_trace`` traces a frame already running): when the op's
line ends (the next line starts, or the frame returns or raises), the locals
are copied, the tensors the line names cloned (a later in-place op must not
change them). No other frame is traced, and the trace is removed there.

A frame object cannot be rewound, so ``%debug`` is given a stand-in (the
technique Jinja2 uses to put template lines in tracebacks): a code object
with the producer's file, function name and first line, that raises at the
op's line, run with the copied locals and the frame's own globals. pdb's
``where``, ``ll`` and ``p``, and ``%tb``, then agree on the line, and show
the state the line left. A debugger or a coverage tool tracing the program
keeps its trace of that frame: it is called on, before the copy.
"""

from __future__ import annotations

import linecache
import re
import sys
from types import FrameType
from typing import Any

import torch

__all__ = ["LineEnd", "after_line", "one_call", "state_left_by"]

_NAME = re.compile(r"[A-Za-z_]\w*")


class LineEnd:
    """The locals of ``frame`` as its line ``lineno`` (running now) leaves them; the local trace function."""

    def __init__(self, frame: FrameType) -> None:
        self.frame = frame
        self.lasti, self.lineno = frame.f_lasti, frame.f_lineno
        self.stand_in: FrameType | None = None
        self._previous = frame.f_trace  # a debugger's or coverage tool's trace of this frame
        self._previous_lines = frame.f_trace_lines
        self._installed = sys.gettrace() is None
        if self._installed:
            sys.settrace(_no_new_frames)  # frames are traced only while a global trace function is set
        frame.f_trace_lines = True
        frame.f_trace = self

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        # Any event of this frame after the op ends its line: the next line, a return, an exception passing.
        frame.f_trace, frame.f_trace_lines = self._previous, self._previous_lines
        if self._installed and sys.gettrace() is _no_new_frames:
            sys.settrace(None)
        try:
            self.stand_in = _stand_in(frame, self.lineno, _copied_locals(frame, self.lineno))
        except Exception:  # raised from a trace function, it would stop all tracing, and the program
            self.stand_in = None  # %debug then opens in the frame as it ran on
        return self._previous(frame, event, arg) if self._previous is not None else None

    def where(self) -> tuple[FrameType, tuple[int, int]]:
        """The frame for %debug and its ``(f_lasti, f_lineno)``: the stand-in once the line ended, else the frame
        at the op (the line still runs: the event stops the program inside it)."""
        if self.stand_in is not None:
            return self.stand_in, (self.stand_in.f_lasti, self.lineno)
        return self.frame, (self.lasti, self.lineno)


def after_line(frame: FrameType) -> LineEnd:
    """Copy ``frame``'s locals when the line it runs now ends (see the module docstring)."""
    armed = frame.f_trace
    if isinstance(armed, LineEnd) and armed.stand_in is None and armed.lineno == frame.f_lineno:
        return armed  # a second op of the same line
    return LineEnd(frame)


def state_left_by(frame: FrameType, lineno: int) -> FrameType | None:
    """A stand-in of ``frame`` at ``lineno`` with its locals now (that line has just ended), or None.

    For a trace function of its own that knows when the line ended (replay/line_replay.py).
    """
    return _stand_in(frame, lineno, _copied_locals(frame, lineno))


def _no_new_frames(frame: FrameType, event: str, arg: Any) -> None:
    return None


def _copied_locals(frame: FrameType, lineno: int) -> dict[str, Any]:
    """The frame's locals, the tensors its line ``lineno`` names cloned."""
    named = set(_NAME.findall(linecache.getline(frame.f_code.co_filename, lineno, frame.f_globals)))
    values = dict(frame.f_locals)
    for name in named & values.keys():
        value = values[name]
        if isinstance(value, torch.Tensor):
            values[name] = value.detach().clone()
    return values


def _raise_at(line: str, below: int) -> str:
    """Source whose ``raise`` is ``below`` lines down, at the column of ``line``'s code, ending a line further.

    A traceback takes the raise's columns as the line's failing part: Python 3.11's marks them with carets under
    the source line, which for a bare ``raise LookupError`` at column 0 underlined 17 characters of the user's line
    from its indentation. Started at the line's indentation and ended on the next line, the raise spans the whole
    line, and no caret is drawn (as for any statement that failed as a whole).
    """
    indent = line[:len(line) - len(line.lstrip())] if line.strip() else ""
    if not indent:
        return "\n" * below + "raise LookupError(\n)"
    if below < 1:  # (no line above it to open an indented block: the op on the def line itself, a lambda; at
        return "raise LookupError(\n)"  # column 0 and spanning two lines, it marks no columns of the user's line)
    return "\n" * (below - 1) + "if 1:\n" + indent + "raise LookupError(\n)"


def _stand_in(frame: FrameType, lineno: int, values: dict[str, Any]) -> FrameType | None:
    """A frame of ``frame``'s function stopped at ``lineno``, its locals ``values`` (see the module docstring)."""
    code = frame.f_code
    first = code.co_firstlineno
    if lineno < first:
        return None
    # Compiled from line 1, then moved to the function's first line: its lines are the function's.
    raising = compile(_raise_at(linecache.getline(code.co_filename, lineno, frame.f_globals), lineno - first),
                      code.co_filename, "exec")
    raising = raising.replace(co_name=code.co_name, co_qualname=code.co_qualname, co_firstlineno=first)
    try:
        exec(raising, frame.f_globals, values)
    except LookupError as stopped:
        traceback = stopped.__traceback__
        if traceback is not None and traceback.tb_next is not None:
            return traceback.tb_next.tb_frame
    return None


def one_call(live: FrameType, replayed: FrameType) -> bool:
    """Whether the traceback's last user frame and a replay's producer frame (or its stand-in, above) are one
    call run twice (``mode="full"`` checked a child's input while it ran; its replay named the frame): appended, the
    function stood twice in the short error, ``%tb`` and ``where``. The same function with alike arguments; a
    recursion's depth or a helper called per layer differs: both stay. (A cell's top level keeps both.)"""
    code, other = live.f_code, replayed.f_code
    if (code.co_filename, code.co_firstlineno, code.co_qualname) != (
            other.co_filename, other.co_firstlineno, other.co_qualname):
        return False
    mine, theirs = live.f_locals, replayed.f_locals
    return all(_alike(mine.get(name), theirs.get(name))
               for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])


def _alike(mine: Any, theirs: Any) -> bool:
    """One argument of two calls (a replay's tensors are copies, its modules the same; a list is not compared)."""
    if isinstance(mine, torch.nn.Module) or isinstance(theirs, torch.nn.Module):
        return mine is theirs
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        return (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype)
    if isinstance(mine, _PLAIN) or isinstance(theirs, _PLAIN):
        return type(mine) is type(theirs) and mine == theirs
    return True


_PLAIN = (int, float, str, bool, type(None))
