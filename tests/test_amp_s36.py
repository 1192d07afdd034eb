"""A GradScaler loop leaves no trace (session 36).

Memory: the watch kept the tensors ``scaler.scale`` returned (and the losses given to it) for two steps, to tell a
scale's overflow at a later non-finite loss; AMP's several-losses recipe
(``scaler.scale(l1).backward(retain_graph=True); scaler.scale(l2).backward()``) then kept the last two steps' ``l1``
graphs alive, activations and all, which the unwatched loop frees as it leaves the step. They are dropped when the
scaler's step returns now.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn

import nan_magic


def _several_losses(watched: dict[str, object] | None) -> tuple[list[int], list[bool], list[torch.Tensor]]:
    """AMP's several-losses recipe, healthy: how many earlier steps' ``l1``-only activations (retained by
    ``backward(retain_graph=True)``) are alive as each step's forward has run, and which are freed after the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    head = nn.Linear(8, 4096)  # (its activation, 2 MiB, is over what the loss code's recorder keeps of a frame)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(128, 8)
    activations: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def step() -> None:
        out = model(x)
        gc.collect()
        alive.append(sum(ref() is not None for ref in activations))
        hidden = torch.tanh(head(out))  # saved by l1's graph only: retained by its backward
        activations.append(weakref.ref(hidden))
        l1, l2 = hidden.pow(2).mean(), out.pow(2).mean()
        opt.zero_grad()
        scaler.scale(l1).backward(retain_graph=True)
        scaler.scale(l2).backward()
        scaler.step(opt)
        scaler.update()

    if watched is None:
        for _ in range(4):
            step()
    else:
        with nan_magic.watch(**watched) as w:
            for _ in range(4):
                step()
        assert w.report is None and not w.events, [event.message for event in w.events]
    gc.collect()
    return alive, [ref() is None for ref in activations], [
        p.detach().clone() for p in (*model.parameters(), *head.parameters())]


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_the_several_losses_recipe_keeps_no_retained_graph_past_its_step(mode: str) -> None:
    unwatched, freed, expected = _several_losses(None)
    assert unwatched == [0] * 4 and freed == [True] * 4  # (the harness: the loop frees each step's graph)
    alive, freed, got = _several_losses(MODE_OPTIONS[mode])
    assert alive == unwatched
    assert freed == [True] * 4  # (and the watch, left, holds none)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
