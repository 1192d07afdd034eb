"""The review of defer-s33 and user-s33: a backward cause read from counts that were not the op's, and operands named
from a line that did not say which expression ran the op. Every mode (default, defer, full, ops, ops+defer).

1-2. Reading every backward op's operands as forward code's, node known or not, read the boundary gradient's counts
   as the op's: acosh at 1 said "sqrt got 2 negatives in `self` of aten.rsqrt.default" (there were none: rsqrt got
   zeros), hypot at (0, 0) offered "add eps" to hypot's own result inside its derivative, tanh(cosh(z)) read an
   exp-overflow on a sinh the user never wrote. Taken back: "in the backward of AcoshBackward0 ...", unclassified.
3. The divisor named from the line's only ``/`` when another form ran the op: ``torch.div(h, b) / c`` said "`c` held
   8 zeros" (c >= 2; the zeros are b's). Every form is counted (``/``, torch.div, .div, .div_), and a line with
   another call that may divide inside (F.normalize, a user's function) names no operand: the schema name stays.
4. ``torch.xlogy(target, probs)``: the log's operand is ``other`` (probs), not ``self`` (target, the multiplier).
5. The deferred check's replay names no node for a backward op: its line is the forward's, and ``[v / n ...]`` there
   named ``n`` (a scalar 2.0) for a divisor inside the double backward. No name from the line in the backward phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from contract.hunt_s28 import CosineHead
from torch import nn

from nan_magic import NonFiniteError, watch
from nan_magic.render.words.causes.phrases import short_label
from nan_magic.render.words.operands import operand_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

MODES = [pytest.param({}, id="default"), pytest.param({"defer": True}, id="defer"),
         pytest.param({"mode": "full"}, id="full"), pytest.param({"ops": True}, id="ops"),
         pytest.param({"ops": True, "defer": True}, id="ops-defer")]


def _report(model: nn.Module, step: Callable[[int], torch.Tensor], options: dict[str, Any], steps: int = 2) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, watch(model, opt, fixes=False, **options):
        for i in range(steps):
            loss = step(i)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


# ---------------------------------------------------------------- 1-2: a backward cause from the op's own counts
class Keypoint(nn.Module):
    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc, self.which = nn.Linear(4, 2), which

    def forward(self, x: torch.Tensor, still: torch.Tensor, diag: torch.Tensor) -> torch.Tensor:
        d = self.fc(x) * still  # a keypoint predicted exactly on its target: error (0, 0)
        if self.which == "hypot":
            return torch.hypot(d[:, 0], d[:, 1]) / diag
        u = torch.cat([torch.sqrt(1 + (d ** 2).sum(-1, keepdim=True)), d], -1)
        inner = u[:, 0] * u[:, 0] - (u[:, 1:] * u[:, 1:]).sum(-1) + 0 * d.sum(-1)  # <u, u>_L = 1
        return torch.acosh(inner.clamp_min(1.0)) / diag  # the distance of a point to itself


def _keypoint(which: str, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = Keypoint(which)

    def step(i: int) -> torch.Tensor:
        still = torch.ones(8, 1)
        if i == 1:
            still[3] = 0.0
        return model(torch.randn(8, 4), still, torch.full((8,), 2.0)).mean()
    return _report(model, step, options)


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize(("which", "node"), [("acosh", "AcoshBackward0"), ("hypot", "HypotBackward0")])
def test_a_backward_through_a_pole_less_node_is_not_read_from_the_gradients_counts(
        which: str, node: str, options: dict[str, Any]) -> None:
    report = _keypoint(which, options)
    hint = report.cause.hint
    assert report.phase == "backward" and report.cause.label == "unclassified", (report.cause.label, hint)
    assert f"in the backward of {node}" in hint, hint
    assert "negative" not in hint and "add eps" not in hint, hint


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, k: float) -> torch.Tensor:
        return torch.tanh(torch.cosh(self.fc(x) * k)) / 2.0  # cosh overflows, tanh absorbs it: grad * sinh = 0 * inf


@pytest.mark.parametrize("options", MODES)
def test_inf_times_zero_in_a_cosh_backward_is_no_overflow_of_a_sinh_the_user_never_wrote(
        options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = Gate()
    report = _report(model, lambda i: model(torch.randn(8, 4), 1.0 if i == 0 else 1e3).sum(), options)
    assert report.phase == "backward" and report.cause.label == "unclassified", report.cause.hint
    assert report.op is None or "in the backward of CoshBackward0" in report.cause.hint, report.cause.hint


# ---------------------------------------------------------------- 3: the divisor named only where the line says it
class Net(nn.Module):
    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc, self.which = nn.Linear(4, 4), which

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        b = (x[:, :1] > 100).float()  # all zeros: the real divisor
        c = h.detach().abs() + 2.0  # never zero
        if self.which == "funcdiv_then_slash":
            return torch.div(h, b) / c
        if self.which == "methoddiv_then_slash":
            return h.div(b) / c
        if self.which == "inplace_div_method":
            return h.clone().div_(b) * (h / c)
        if self.which == "normalize_eps0":
            return F.normalize(h * b, dim=-1, eps=0.0) / c
        if self.which == "xlogy_and_log":
            return torch.xlogy(h, b) + torch.log(c)
        return h / b.sum()  # "slash_by_sum": one form, the line names it


def _net(which: str, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = Net(which)
    return _report(model, lambda i: model(torch.randn(8, 4)).sum(), options)


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("which", ["funcdiv_then_slash", "methoddiv_then_slash", "inplace_div_method",
                                   "normalize_eps0"])
def test_a_line_with_another_form_that_may_divide_keeps_the_schema_name(which: str, options: dict[str, Any]) -> None:
    report = _net(which, options)
    hint = report.cause.hint
    assert report.cause.label == "division-by-zero" and "divided by zero (`other` (8, " in hint, hint
    assert "`c`" not in hint, hint


@pytest.mark.parametrize("options", MODES)
def test_a_line_with_one_division_names_its_divisor(options: dict[str, Any]) -> None:
    hint = _net("slash_by_sum", options).cause.hint
    assert "divided by zero (`b.sum()`" in hint, hint


@pytest.mark.parametrize("options", MODES)
def test_a_loss_line_dividing_twice_keeps_the_schema_name(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    def step(i: int) -> torch.Tensor:
        out, y = model(torch.randn(8, 4)), torch.randn(8, 2)
        mask, n = torch.ones(8, 1) if i == 0 else torch.zeros(8, 1), torch.tensor(8.0)
        return torch.div(((out - y) ** 2 * mask).sum(0), mask.sum(0)).sum() / n
    hint = _report(model, step, options).cause.hint
    assert "divided by zero (`other` (1,)" in hint and "`n`" not in hint, hint


# ---------------------------------------------------------------- 4: xlogy's log operand is `other`
@pytest.mark.parametrize("options", MODES)
def test_xlogy_names_its_log_operand_not_its_multiplier(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    target = torch.tensor([[1., 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])

    def step(i: int) -> torch.Tensor:
        probs = torch.softmax(model(torch.randn(4, 4)), -1) * (torch.arange(3) != i + 1)  # step 1: class 2 is 0
        return -torch.xlogy(target, probs).sum(-1).mean()
    hint = _report(model, step, options).cause.hint
    assert "xlogy got 1 zero and 0 negatives in `probs` (`other` of aten.xlogy.Tensor" in hint, hint
    assert "`target`" not in hint, hint


@pytest.mark.parametrize("options", MODES)
def test_xlogy_beside_a_log_call_names_its_other(options: dict[str, Any]) -> None:
    hint = _net("xlogy_and_log", options).cause.hint
    assert "in `b` (`other` of aten.xlogy.Tensor" in hint and "`h`" not in hint, hint


# ---------------------------------------------------------------- 5: no name from the line in the backward phase
@pytest.mark.parametrize("options", MODES)
def test_a_backward_division_takes_no_name_from_the_forward_line(options: dict[str, Any]) -> None:
    """Hutchinson's trace with the probes scaled on the autograd.grad line (``[v / n for v in probes]``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), CosineHead(8, 3, "normalize"))
    xs = [torch.randn(4, 4) for _ in range(3)]
    ys = [torch.randint(0, 3, (4,)) for _ in range(3)]
    xs[1][2] = 0.0
    probes = [[torch.randint(0, 2, p.shape).float() * 2 - 1 for p in model.parameters()] for _ in range(3)]
    n = torch.tensor(2.0)

    def step(i: int) -> torch.Tensor:
        params = list(model.parameters())
        loss = F.cross_entropy(model(xs[i]), ys[i])
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hv = torch.autograd.grad(grads, params, [v / n for v in probes[i]], create_graph=True)
        return loss + 1e-3 * sum((v * h).sum() for v, h in zip(probes[i], hv))
    report = _report(model, step, options, steps=3)
    assert report.phase == "backward" and report.op == "aten.div.Tensor", report.cause.hint
    assert "`n`" not in report.cause.hint and "`v`" not in report.cause.hint, report.cause.hint
    # The same report under a line that says `v / n` alone (no autograd.grad call to give it up): the backward's
    # division is not that one, node or none (the deferred replay names none).
    other = next(ref for ref, _stats in report.input_stats if ref.name == "other")
    plain = replace(report, source=replace(report.source, line="scaled = v / n"))
    assert operand_names(plain.op, "scaled = v / n", {"self", "other"})["other"] == "n"
    assert short_label(plain, other) == "`other`", (report.autograd_node, short_label(plain, other))
