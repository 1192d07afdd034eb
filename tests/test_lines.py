"""The lines the recorders and the step replay note are the frames' own, read once per instruction (hot/kept/lines.py).

``frame.f_lineno`` scans the code's line table at each read; the line of an op of the loop's code, and of the loop's
call of the model, is kept by code object and instruction, so a later step's op at the same instruction reads it
from there: the report still names the line that ran the op.
"""

from __future__ import annotations

import sys
from types import FrameType

import pytest
import torch
from faults import marked_line
from torch import nn

import nan_magic
from nan_magic.hot.kept import lines
from nan_magic.hot.kept.lines import line_at
from nan_magic.records import Phase


def _run(defer: bool) -> nan_magic.NonFiniteError | None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        with nan_magic.watch(model, opt, defer=defer):
            for step in range(6):
                out = model(torch.randn(8, 4))
                h = out.abs().mean() + 1.0
                shift = 0.0 if step < 4 else 1e6
                loss = torch.log(h - shift) + out.pow(2).mean()  # producer: log
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error
    return None


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_a_loss_op_at_an_instruction_healthy_steps_ran_is_named_at_its_line(defer: bool) -> None:
    error = _run(defer)
    assert error is not None
    report = error.report
    assert (report.phase, report.step, report.op) == (Phase.FORWARD, 4, "aten.log.default")
    assert report.source is not None and report.source.lineno == marked_line("log", where=_run)


def _where() -> tuple[int, int]:
    caller = sys._getframe(1)
    return line_at(caller), caller.f_lineno


def test_line_at_is_f_lineno_at_each_instruction_read_again() -> None:
    seen = []
    for _ in range(2):  # (the second time from the cache)
        seen.append(_where())
        seen.append(
            _where()
        )
    assert all(cached == read for cached, read in seen)
    assert seen[0][0] != seen[1][0] and seen[0] == seen[2] and seen[1] == seen[3]


class _Poisoned(dict):
    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        return -1  # a kept line no frame has: one read from here shows


def test_under_a_tracer_the_frames_own_line_is_read(monkeypatch) -> None:
    monkeypatch.setattr(lines, "LINES", _Poisoned())
    frame: FrameType = sys._getframe(0)
    assert line_at(frame) == -1  # (no tracer: what is kept is read)
    frame.f_trace = lambda *args: None
    try:
        assert line_at(frame) == frame.f_lineno
    finally:
        frame.f_trace = None
