"""Forward producers: a module's own op, a parent's own code between its children."""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario


class DivParent(nn.Module):
    """The root's own division by a zero makes ±inf; its child ``b`` turns that into NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h / x[:, :1]  # producer: parent div
        return self.b(h)


def _parent_div() -> Scenario:
    torch.manual_seed(0)
    model = DivParent()
    x = torch.randn(3, 4)
    x[0, 0] = 0.0
    return Scenario((model,), lambda: model(x))


CASES = [
    Case("parent_own_division", _parent_div,
         Expect("forward", "", "DivParent", op="aten.div.Tensor", marker="parent div")),
]
