"""The line a frame is at, kept by instruction.

``frame.f_lineno`` scans the code object's line table from its start at each read (CPython's ``PyCode_Addr2Line``):
0.3 us in a short function, 2 us in a short script's top level, 11 us at the end of a 600-line function (a
notebook cell's training loop, a script's). The loss-code and update recorders read it at every op of the loop's
code, and the step replay at every model call, each step from the same instructions. The line of an instruction is a
function of the code's line table, its first line and the instruction's offset alone, so it is kept by those three:
no code object is held, and a code object made again (a cell run again) finds its lines. Under a tracer (pdb,
coverage) ``f_lineno`` is the tracer's and is read as it is.
"""

from __future__ import annotations

from types import FrameType

__all__ = ["LINES", "line_at"]

#: ``(co_linetable, co_firstlineno, f_lasti)`` -> the line (cleared past :data:`_MOST` entries). Read with ``[]``,
#: not ``get()``: the recorders' per-op lookup is then no call.
LINES: dict[tuple[bytes, int, int], int] = {}
_MOST = 1 << 14


def line_at(frame: FrameType) -> int:
    """``frame.f_lineno``, read once per instruction."""
    if frame.f_trace is not None:  # (a tracer may have set the frame's line: pdb's jump)
        return frame.f_lineno
    code = frame.f_code
    key = (code.co_linetable, code.co_firstlineno, frame.f_lasti)
    try:
        return LINES[key]
    except KeyError:
        line = frame.f_lineno
        if line is not None:  # (an instruction with no line: asked again each time)
            if len(LINES) >= _MOST:
                LINES.clear()
            LINES[key] = line
        return line
