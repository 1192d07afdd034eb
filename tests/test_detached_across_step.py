"""What the recorded modes keep of a loss region's detached outputs for the next data region (recorded_ops.
detached_from_model): weak references only, none past the watch."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic


def _self_training(model: nn.Module, opt: torch.optim.Optimizer, kept: dict[str, torch.Tensor]) -> None:
    """Three steps whose targets are the last step's prediction, detached by the loss code."""
    for x in [torch.randn(5, 6) for _ in range(3)]:
        target = kept["p"] / kept["p"].sum(-1, keepdim=True)
        out = model(x)
        kept["p"] = out.detach().square()
        loss = F.mse_loss(out.softmax(-1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("defer", [False, True])
def test_a_detached_output_the_loop_keeps_is_held_weakly_and_let_go_as_the_watch_ends(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = {"p": torch.full((5, 3), 1.0)}
    with nan_magic.watch(model, opt, defer=defer):
        _self_training(model, opt, kept)
        held = kept["p"]
        assert weakref.getweakrefcount(held) == 1  # (for the next data region's claim)
    assert weakref.getweakrefcount(held) == 0  # (no weak reference stays on the user's tensors: calm_s27)


@pytest.mark.parametrize("defer", [False, True])
def test_nothing_of_the_watch_keeps_a_detached_output_alive(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = {"p": torch.full((5, 3), 1.0)}
    with nan_magic.watch(model, opt, defer=defer):
        _self_training(model, opt, kept)
        freed = weakref.ref(kept.pop("p"))
        gc.collect()
        assert freed() is None
