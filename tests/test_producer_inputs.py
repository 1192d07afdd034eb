"""The report's histograms show the producer module's input in every mode, not only in mode="full" (round 21).

A per-module check (mode="full") reports the producer call's arguments beside the failing op's operands; the
default, deferred and ops modes name the op by a replay (or the op tracer) that holds the same call's arguments,
and their reports had the op's operands only: the histogram of what entered the module was missing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.records import TensorRole

MODES = {
    "default": {},
    "defer": {"defer": True},
    "full": {"mode": "full"},
    "ops": {"ops": True},
    "ops+defer": {"ops": True, "defer": True},
}


class LogOf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x))  # a log of negative values: NaN


@pytest.mark.parametrize("mode", MODES)
def test_the_producer_modules_input_has_its_histogram_and_stats(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogOf(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, on_detect="log", **MODES[mode]) as watch:
        loss = model(torch.randn(8, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = watch.report
    assert report is not None and (report.module, report.op) == ("1", "aten.log.default"), report
    producers = [sample for sample in report.samples if sample.producer]
    inputs = [sample for sample in producers if sample.tensor is not None and sample.tensor.role is TensorRole.INPUT]
    assert [str(sample.tensor) for sample in inputs] == ["input[0]"], [str(s.tensor) for s in producers]
    assert inputs[0].numel == 32 and inputs[0].nan == 0  # what entered the module: finite (the log made the NaN)
    assert [str(ref) for ref, _stats in report.input_stats] == ["input[0]", "self"], report.input_stats
