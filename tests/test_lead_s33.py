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


_P = 2


def _root_of_inverse_p(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b) ** _P).sum(-1) ** (1 / _P)


def _root_of_half(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b) ** _P).sum(-1) ** 0.5


@pytest.mark.parametrize("options", MODES[:3], ids=IDS[:3])  # (ops modes run no eps trial at a loss-code pow)
@pytest.mark.parametrize(("distance", "edit"), [
    (_root_of_half, "((a - b) ** _P).sum(-1).clamp_min(1.2e-07) ** 0.5"),
    (_root_of_inverse_p, None),
], ids=["half", "inverse-p"])
def test_the_edit_of_a_pow_trial_is_the_pow_it_ran_or_none(options: dict, distance, edit: str | None) -> None:
    # a contrastive distance at a duplicate pair: the trial clamps the root's base only; ``** (1 / P)`` is no number
    # on the line, so the edit clamped (a - b) too (every negative difference to eps: not what the trial ran)
    from nan_magic.render.edits import suggested_edit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lefts, rights = torch.randn(4, 6), torch.randn(4, 6)
    rights[1] = lefts[1]
    same = torch.tensor([1.0, 1.0, 0.0, 0.0])
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        out = model(torch.cat([lefts, rights]))
        d = distance(out[:4], out[4:])
        ((same * d**2 + (1 - same) * torch.relu(1.0 - d) ** 2).mean() / 2).backward()
        opt.step()
    trial = next(t for t in caught.value.report.fixes if t.kind == "eps")
    assert trial.finite
    written = suggested_edit(trial)
    assert (written.split(": ", 1)[1].strip() if written else None) == (f"return {edit}" if edit else None)


@pytest.mark.parametrize(("line", "names"), [
    ("logits = model(xs[step]) / tau", {"self": "model(xs[step])", "other": "tau"}),
    ("loss = criterion(net(x), y) / accum_steps", {"self": "criterion(net(x), y)", "other": "accum_steps"}),
    ("z = normalize(h) / tau", {}),  # (torch's F.normalize imported bare: it divides at this line)
    ("z = self.head(h) / tau", {}),  # (a submodule's call: which division ran is not said by the line)
])
def test_the_users_model_called_by_a_bare_name_runs_no_op_at_the_line(line: str, names: dict) -> None:
    # the review's strict rule (any call but a plain one names nothing) lost `tau` in `model(x) / tau`, the
    # temperature row's hint read "it divided by `other` = 1e-24": a bare name's call is the user's callable (a
    # model, a criterion, a function), whose ops ran on their own lines, not this one
    found = operand_names("aten.div.Tensor", line)
    assert {key: found.get(key) for key in ("self", "other")} == {**{"self": None, "other": None}, **names}
