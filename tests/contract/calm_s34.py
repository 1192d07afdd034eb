"""Healthy rows (calm_s34) in the contract table: copies of the watched model made inside the watch.

A whole-model ``torch.save`` loaded back and a ``copy.deepcopy`` (a best-model copy), and an ``AveragedModel`` built
inside the watch (torch deep-copies the model): each must carry no forward hook (the watch's stand-in was one, and
torch.jit.script of the copy failed on it: tests/test_calm_s34_loops.py), and the losses, the copies' outputs and
everything of the user's must be the unwatched run's. The other rows of the round: tests/test_calm_s34*.py.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish


def _hooks(model: nn.Module) -> torch.Tensor:
    return torch.tensor(sum(len(m._forward_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules()))


def _copied(kind: str) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def run() -> tuple[Any, ...]:
        out = []
        swa = None
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
            if kind == "averaged":  # (built after the first step: the watch's hook is on the model by then)
                swa = swa or torch.optim.swa_utils.AveragedModel(model)
                swa.update_parameters(model)
        if kind == "saved":
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            copies = [torch.load(buffer, weights_only=False), copy.deepcopy(model)]
        else:
            copies = [swa.module]
        out += [_hooks(c) for c in copies]
        with torch.no_grad():
            out += [c(x) for c in copies]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


CASES = [
    Case("calm_s34_saved-and-deep-copied-in-the-watch", lambda: _copied("saved"), None, benign=0),
    Case("calm_s34_averaged-model-built-in-the-watch", lambda: _copied("averaged"), None, benign=0),
]
