"""Which of several watched models holds a bad parameter or gradient: found by the module objects (review of
hunt-b-s41).

Two models watched together may share a gradient tensor (``b.head.weight.grad = a[0].weight.grad``) or a label
(two ``nn.Sequential`` found by ``watch()`` with no model, as a script's ``main()`` builds them). The report names
the module that registers the tensor, with its type, in the model that holds it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nan_magic

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_gradient_two_models_share_is_named_where_its_name_is(mode: str) -> None:
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(4, 4)), Head()
    xs = [torch.randn(8, 4) for _ in range(3)]
    (a(xs[0]).pow(2).mean() + b(xs[0]).pow(2).mean()).backward()
    b.head.weight.grad = a[0].weight.grad  # one buffer for both
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1e-2), torch.optim.SGD(b.parameters(), lr=1e-2)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(a, b, **MODES[mode]):
        for step in range(3):
            opt_a.zero_grad(set_to_none=False)
            opt_b.zero_grad(set_to_none=False)
            (a(xs[step]).pow(2).mean() + b(xs[step]).pow(2).mean()).backward()
            if step == 1:
                b.head.weight.grad[0, 0] = float("nan")
            opt_b.step()
            opt_a.step()
    report = caught.value.report
    # (Since session 46 the loop's line that wrote the NaN is the producer, outside every module, as for a gradient
    # its mul_ wrote: the model holding the shared gradient is still the one named, with the gradient's name in it.)
    assert (report.step, report.module, report.model, report.op) == (1, None, "Head", "aten.lift_fresh.default"), \
        report.message
    assert report.tensor.name == "head.weight"


@pytest.mark.parametrize("mode", list(MODES))
def test_two_models_under_one_label_name_the_holding_models_module_type(mode: str) -> None:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    d = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(d[1].parameters(), lr=1e-3, eps=0.0)  # a zero gradient: 0 / (0 + 0)
    xs = [torch.randn(8, 4) for _ in range(3)]
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(**MODES[mode]):  # found, not given
        for step in range(3):
            weight = 0.0 if step == 0 else 1.0
            loss = g(xs[step]).pow(2).mean() + weight * d(xs[step]).pow(2).mean()
            opt_g.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            opt_g.step()
            opt_d.step()
    report = caught.value.report
    assert (report.step, report.module, report.module_type) == (0, "1", "BatchNorm1d"), report.message
