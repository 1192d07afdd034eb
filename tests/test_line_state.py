"""The frame %debug opens at a producing op: its line, with the locals that line left (errors/line_state.py)."""

from __future__ import annotations

import io
import pdb
import sys
from types import FrameType, TracebackType
from typing import Any

import torch

from nan_magic.errors.line_state import LineEnd, after_line

ARMED: list[LineEnd] = []


def _arm_here() -> torch.Tensor:
    """Stands for the op tracer seeing the producing op: arms its caller's frame, mid-line."""
    ARMED.append(after_line(sys._getframe(1)))
    return torch.full((2,), float("inf"))


def forward(x: torch.Tensor) -> torch.Tensor:
    scores = x + _arm_here()  # producing line
    scores.sub_(scores)  # inf - inf: NaN, in place
    out = scores.softmax(-1)
    return out


def _run() -> tuple[FrameType, tuple[int, int]]:
    ARMED.clear()
    forward(torch.ones(2))
    (line,) = ARMED
    return line.where()


def test_the_stand_in_is_at_the_line_with_the_locals_it_left() -> None:
    frame, (lasti, lineno) = _run()
    assert (frame.f_code.co_name, frame.f_lineno, lineno) == ("forward", forward.__code__.co_firstlineno + 1, lineno)
    assert frame.f_code.co_filename == __file__ and lasti == frame.f_lasti
    assert set(frame.f_locals) == {"x", "scores"}  # out, assigned later, is absent
    assert bool(frame.f_locals["scores"].isinf().all())  # cloned: the later in-place NaN did not reach it
    assert sys.gettrace() is None  # the trace is gone with the line


def test_pdb_lists_and_stands_at_the_producing_line() -> None:
    frame, (lasti, lineno) = _run()
    out = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO("p scores\nll\nwhere\nq\n"), stdout=out)
    debugger.use_rawinput = False
    debugger.reset()
    debugger.interaction(None, TracebackType(None, frame, lasti, lineno))
    printed = out.getvalue()
    assert "tensor([inf, inf])" in printed
    # where's "-> line" and ll's "25  ->\tline"
    arrows = [line for line in printed.splitlines() if line.startswith("-> ") or "->\t" in line]
    assert len(arrows) == 3 and all("producing line" in line for line in arrows), printed


def test_a_tracer_already_running_keeps_tracing_the_frame() -> None:
    events: list[tuple[str, int]] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        events.append((event, frame.f_lineno))
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is forward.__code__ else None

    sys.settrace(global_)
    try:
        frame, _ = _run()
    finally:
        sys.settrace(None)
    first = forward.__code__.co_firstlineno
    assert [line for event, line in events if event == "line"] == [first + 1, first + 2, first + 3, first + 4]
    assert set(frame.f_locals) == {"x", "scores"}
