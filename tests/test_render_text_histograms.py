"""The text report's histograms (round 20): a terminal showed none, only each input's range.

Each row is one of the producer's values, named as the figures name it (the line's own expression for an operand),
its finite values in bars and its non-finite counts apart; other layers' samples are not drawn there (the widget's
selector has them).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.render.text_histograms import TEXT_BINS

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True}}


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h / h.norm(dim=-1, keepdim=True)


class Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x)).sum(-1, keepdim=True)


def report_of(model: nn.Module, options: dict, zero_at: int | None = None) -> nan_magic.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt, **options):
        for step in range(3):
            if step == zero_at:
                with torch.no_grad():
                    model[1].lin.weight.zero_()
                    model[1].lin.bias.zero_()
            loss = model(torch.randn(8, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return raised.value.report


def section(report: nan_magic.Report) -> list[str]:
    text = report.to_text()
    assert text.count("\nHistograms of the producer's values ") == 1
    return text[text.index("Histograms of ") :].split("\n\n")[0].splitlines()[1:]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_text_report_draws_the_failing_ops_operands_and_output(mode: str) -> None:
    torch.manual_seed(0)
    report = report_of(nn.Sequential(nn.Linear(4, 4), Normed(), nn.Linear(4, 1)), MODES[mode], zero_at=1)
    assert (report.module, report.op) == ("1", "aten.div.Tensor")
    rows = section(report)
    pairs = {rows[index].strip(): rows[index + 1] for index in range(0, len(rows), 2)}
    h, norm = "h (self of aten.div.Tensor)", "h.norm(dim=-1, keepdim=True) (other of aten.div.Tensor)"
    assert list(pairs)[:3] == [h, norm, "output of aten.div.Tensor"], list(pairs)
    assert pairs[h] == "      every finite value is 0   float32, 32 finite of 32, 32 exactly 0"
    assert pairs["output of aten.div.Tensor"] == "      no finite value   float32, 0 finite of 32; 32 nan"
    # The producer's own values only: no neighbour's (the first Linear's output, the model's input)
    assert not any(label.startswith(("0 output", "(root)", "2 output")) for label in pairs), list(pairs)


def test_spread_values_are_bars_between_their_extremes() -> None:
    torch.manual_seed(0)
    report = report_of(nn.Sequential(nn.Linear(4, 4), Logged()), {})
    rows = section(report)
    # (the line ``self.lin(x).log()`` also calls a submodule, which may run the op inside: the schema name, since
    # session 33's review of operand names)
    (operand,) = [index for index, row in enumerate(rows) if row == "  self of aten.log.default"]
    bars = re.fullmatch(r"      (-?[\d.e+-]+) \|(.*)\| (-?[\d.e+-]+)   float32, 32 finite of 32", rows[operand + 1])
    assert bars is not None, rows[operand + 1]
    low, drawn, high = float(bars.group(1)), bars.group(2), float(bars.group(3))
    assert len(drawn) == TEXT_BINS and set(drawn) <= set(" \u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588")
    assert drawn[0] != " " and drawn[-1] != " " and "\u2588" in drawn  # the extremes' bins hold them; the tallest
    assert low < 0 < high  # (log of the negatives is the NaN)
    (output,) = [index for index, row in enumerate(rows) if row == "  output of aten.log.default"]
    assert re.search(r"\| -?[\d.e+-]+   float32, \d+ finite of 32; \d+ nan$", rows[output + 1]), rows[output + 1]
