"""A data helper the loop calls before the model (``x = prepare(x)``) returns; its large temporaries must not live on.

The data region's records serve the loss region that follows (the loss code may read what the data code made: an
unwatched teacher's soft targets), so both modes hold them through the model call and its loss code. A returned
helper's frame among them kept its locals alive, a large temporary with them, through the forward and backward in
the immediate modes (the deferred one let go of such frames already). Its small frames stay: %debug opens there.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import nan_magic

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}}


@pytest.mark.parametrize("mode", MODES)
def test_a_returned_data_helper_s_large_temporary_is_freed_before_the_model_runs(mode: str) -> None:
    temporaries: list[weakref.ref[torch.Tensor]] = []
    alive_in_forward: list[bool] = []

    def prepare(x: torch.Tensor) -> torch.Tensor:
        tiled = x.repeat(16384, 1) * 2.0  # 16384 x 8 x 8 floats (4 MB): the data code's large temporary
        temporaries.append(weakref.ref(tiled))
        return x + tiled.mean()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            alive_in_forward.append(temporaries[-1]() is not None)
            return self.fc(x)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, **MODES[mode]) as watch:
        for _ in range(4):
            x = prepare(torch.randn(8, 8))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert watch.report is None
    assert alive_in_forward == [False] * 4
