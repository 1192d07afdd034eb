"""A replayed call stopped where a line makes its autograd node (localize/replay/line_replay.py)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

from nan_magic.localize.replay.line_replay import LineStop, nodes_made


def block(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    r = h.sqrt()  # the line
    h = h + 1  # rebinds h: the stand-in keeps what the line read
    return r + h


LINE = block.__code__.co_firstlineno + 2


def _model(x: torch.Tensor) -> torch.Tensor:
    return block(block(x))  # the line runs twice per call


def _node_offsets() -> list[int]:
    """The offsets, from the call's start, of the nodes the line makes (its sqrt's), as a replay would count."""
    x = torch.ones(3, requires_grad=True)
    start = nodes_made()
    out = _model(x)
    offsets, node, seen = [], out.grad_fn, set()
    stack = [node]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "SqrtBackward0":
            offsets.append(node._sequence_nr() - start)
        stack.extend(parent for parent, _index in node.next_functions)
    return sorted(offsets)


def _stop_at(offset: int) -> LineStop:
    stop = LineStop(block.__code__, LINE, offset)
    with stop.armed():
        _model(torch.ones(3, requires_grad=True))
    return stop


def test_the_run_of_the_line_that_makes_the_node_is_the_one_stopped_at() -> None:
    first, second = _node_offsets()
    for offset, expected in ((first, 2.0), (second, 2 * (2**0.5 + 3))):
        stop = _stop_at(offset)
        assert stop.frame is not None and stop.position is not None
        assert (stop.frame.f_code.co_name, stop.position[1]) == ("block", LINE)
        assert set(stop.frame.f_locals) == {"x", "h", "r"}
        assert torch.allclose(stop.frame.f_locals["h"], torch.full((3,), expected))  # before ``h = h + 1``
    assert sys.gettrace() is None


def test_a_node_the_line_never_makes_stops_nowhere() -> None:
    stop = _stop_at(10_000)
    assert stop.frame is None and sys.gettrace() is None


def test_a_tracer_already_running_keeps_tracing() -> None:
    lines: list[int] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            lines.append(frame.f_lineno)
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is block.__code__ else None

    offset = _node_offsets()[0]
    sys.settrace(calls)
    try:
        stop = _stop_at(offset)
    finally:
        sys.settrace(None)
    assert stop.frame is not None
    first = block.__code__.co_firstlineno
    assert lines == [first + 1, first + 2, first + 3, first + 4] * 2
