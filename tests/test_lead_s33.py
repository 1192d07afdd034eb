"""Session 33's last review (final): a module alias of torch is no tensor whose method runs, and a NaN-coded dataset
the loop holds is no evidence that the user's own stop was about a NaN.

- ``import torch as th; th.div(h, b)``: the line was read as ``h.div(b)`` called on a tensor named ``th``, and the
  divisor was named ``h`` (the numerator; b held the zeros); ``th.xlogy(c, b)`` named the multiplier as the log's
  operand. A call on a bare name with as many arguments as the op's function form takes is not said.
- A step with a held NaN batch that the user's own ``raise`` ends: a NaN-coded dataset the loop holds (many batches
  of samples) turned their Budget into a data report; a value counts only up to 16 times the batch's elements.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic.render.words.operands import operand_names

MODES = [{}, {"defer": True}, {"mode": "full"}, {"ops": True}, {"ops": True, "defer": True}]
IDS = ["default", "defer", "full", "ops", "ops-defer"]


@pytest.mark.parametrize(("op", "line"), [
    ("aten.div.Tensor", "return th.div(h, b)"),
    ("aten.xlogy.Tensor", "return th.xlogy(c, b)"),
    ("aten.log.default", "return th.log(b) + c"),
])
def test_a_call_on_an_alias_of_torch_names_no_operand(op: str, line: str) -> None:
    assert operand_names(op, line) == {}


@pytest.mark.parametrize(("op", "line", "names"), [
    ("aten.div.Tensor", "return h.div(b)", {"self": "h", "other": "b"}),
    ("aten.div.Tensor", "return torch.div(h, b)", {"self": "h", "other": "b"}),
    ("aten.log.default", "return probs.log()", {"self": "probs"}),
])
def test_a_tensors_method_and_torchs_function_still_name_their_operands(op: str, line: str, names: dict) -> None:
    found = operand_names(op, line)
    assert {key: found.get(key) for key in names} == names


class _Imputing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fill, self.net = nn.Parameter(torch.zeros(6)), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.isnan()
        return self.net(torch.cat([torch.where(m, self.fill, x), m.float()], -1))


class Budget(Exception):
    pass


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_nan_coded_dataset_the_loop_holds_leaves_the_users_own_stop_theirs(options: dict) -> None:
    torch.manual_seed(0)
    data = torch.randn(1024, 6)
    data[::7, 2] = float("nan")  # missing values, coded as NaN: the model imputes them
    labels = torch.randint(0, 3, (1024,))
    model = _Imputing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watching = nan_magic.watch(model, opt, **options)
    with pytest.raises(Budget), watching:
        for step in range(4):
            loss = F.cross_entropy(model(data[step * 8:(step + 1) * 8].clone()), labels[step * 8:(step + 1) * 8])
            if step == 2:
                raise Budget("time budget spent")
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert watching.report is None
