"""The text report names the debugger the reader has: ``%debug`` in IPython, ``pdb.pm()`` in a script or CI log.

A CI log or a script's output said "%debug opens in train.py:12, in step", which means nothing outside IPython
(user24 found it). The frame is the same; the words name what opens it there.
"""

from __future__ import annotations

import IPython
import pytest
import torch
from torch import nn
from watching import raised


def _report():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def run() -> None:
        for step in range(3):
            p = model(x) * (0 if step == 2 else 1)
            loss = -torch.log(p).mean()  # producer
            opt.zero_grad()
            loss.backward()
            opt.step()

    return raised(run, model, opt)


@pytest.mark.parametrize(("shell", "words"), [(None, "pdb.pm() opens in"), (object(), "%debug opens in")])
def test_the_debug_line_names_the_debugger_of_the_session(monkeypatch, shell, words) -> None:
    report = _report()
    assert report.debug_frame is not None and report.debug_frame.lineno == report.source.lineno
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    text = str(report)
    assert f"{words} {report.debug_frame}" in text
    assert ("%debug" in text) == (shell is not None)


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.fc(x).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1)  # producer: every position of a row masked


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize(("shell", "words"), [(None, "pdb.pm()"), (object(), "%debug")])
def test_the_notes_name_the_debugger_of_the_session_too(monkeypatch, defer, shell, words) -> None:
    """The note on where the debugger opens (a replay of the model call, here) names the same debugger as the line
    under it: a script's log said "%debug opens a replay of step 1's model call" above "pdb.pm() opens in"."""
    torch.manual_seed(0)
    model = _Softmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run() -> None:
        for step in range(3):
            mask = torch.ones(2, 4, dtype=torch.bool)
            mask[1] = step != 1
            loss = model(torch.randn(2, 4), mask).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, defer=defer)
    assert report.op == "aten._softmax.default" and report.step == 1
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    said = [note for note in report.notes if "opens a replay of step 1's model call, at the report's line" in note]
    assert [note.split(" opens ")[0] for note in said] == [words], report.notes
    text = str(report)
    assert f"note        {words} opens a replay of step 1's model call" in text
    assert ("%debug" in text) == (shell is not None), text
