"""A replay of a call made in another training mode than the model is in when the check runs (a validation call
under ``eval()``, judged by the deferred check after the loop's ``train()``): the user's model leaves it as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic


class FreezesInEval(nn.Module):
    """A model whose ``train()`` override freezes its backbone in eval mode, and whose eval branch divides by a
    temperature that is 0 (the validation pass makes the NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("temperature", torch.zeros(()))

    def train(self, mode: bool = True) -> FreezesInEval:
        super().train(mode)
        for parameter in self.backbone.parameters():
            parameter.requires_grad_(mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.tanh(self.backbone(x)))
        return out if self.training else (out - out) / self.temperature


@pytest.mark.parametrize("defer", [False, True])
def test_a_replayed_validation_call_leaves_the_models_flags_and_requires_grad_as_the_loop_set_them(defer) -> None:
    torch.manual_seed(0)
    model = FreezesInEval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    watch = nan_magic.watch(model, opt, defer=defer, on_detect="warn")
    with pytest.warns(RuntimeWarning, match="first non-finite"), watch as w:
        for step in range(4):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
    report = w.report
    assert report is not None and report.module == ""  # the validation call, replayed in eval mode
    assert report.op == "aten.div.Tensor"
    assert all(parameter.requires_grad for parameter in model.parameters())  # the loop's train() left them so
    assert all(module.training for module in model.modules())
