"""An optimizer's eps of 0 over an unused embedding row: the hint names that optimizer's own default eps (hunt-s33).

Adagrad with ``eps=0`` divides a row's gradient of 0 by ``sqrt(0)``; the cause said "use eps = 1e-8 (the default)"
whatever the optimizer, where Adagrad's default is 1e-10 and Adadelta's 1e-6. The hint now reads the default from
the optimizer's own signature (torch.optim's), and names Adam's for an optimizer torch.optim does not hold.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]  # (conftest.py: small models, torch on one thread)


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


@pytest.mark.parametrize(("optimizer", "default"), [("Adagrad", "1e-10"), ("Adadelta", "1e-6"),
                                                     ("RMSprop", "1e-8")])
def test_the_hint_names_the_optimizers_own_default_eps(optimizer: str, default: str) -> None:
    torch.manual_seed(0)
    model = BagOfWords()
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.1, eps=0.0)
    tokens, ys = torch.randint(0, 15, (4, 6)), torch.randint(0, 2, (4,))
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        loss = F.cross_entropy(model(tokens), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.cause and report.cause.label) == (
        "optimizer", "emb", "optimizer-eps-underflow"), report.message
    assert f"use eps = {default} (the default)" in report.to_text()
