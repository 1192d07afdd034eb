"""A report reopened from its scene (a new kernel, after a restart) does not say where ``%debug`` opens.

The saved report kept "%debug opens a replay of step 0's model call, at the report's line ...": true in the session
that stopped, but the reopened notebook has no traceback, so ``%debug`` there opens nothing (hunt-c-s41, session 11).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nan_magic


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.log(self.fc1(x).abs()))


def test_a_reopened_scene_says_nothing_of_debug(tmp_path: Path) -> None:
    model = LogNet()
    with torch.no_grad():
        model.fc1.bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, dump=str(tmp_path)):
        model(torch.zeros(8, 4)).sum().backward()
    said = caught.value.report
    assert "debug-in-replay" in [note.kind for note in said.note_facts]  # the session that stopped: true there
    (path,) = tmp_path.glob("*.pt")
    reopened = nan_magic.load_scene(path).report
    assert "debug-in-replay" not in [note.kind for note in reopened.note_facts]
    assert not any("%debug" in note for note in reopened.notes), reopened.notes
    assert (reopened.op, reopened.source, reopened.step) == (said.op, said.source, said.step)


class SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).abs().sqrt().sum(-1, keepdim=True)


def test_a_reopened_scene_says_nothing_of_where_pdb_opened(tmp_path: Path) -> None:
    """A backward event under ops=True: "pdb.pm() opens where the step was judged" (review of hunt-c-s41)."""
    torch.manual_seed(0)
    model = SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, ops=True, fixes=False,
                                                                             dump=str(tmp_path)):
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.lin.weight.zero_()
                    model.lin.bias.zero_()
            loss = ((model(torch.randn(8, 4)) - torch.rand(8, 1)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "debug-not-replayed" in [note.kind for note in caught.value.report.note_facts]
    (path,) = tmp_path.glob("*.pt")
    reopened = nan_magic.load_scene(path).report
    assert [note.kind for note in reopened.note_facts] == ["module-backward", "autograd-backward"]
