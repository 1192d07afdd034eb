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
