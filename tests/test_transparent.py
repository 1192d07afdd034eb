"""Pass-through modules: activations and dropouts on a finite input are not checked on their own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from watching import raised

import nan_magic
from nan_magic.hot.watched.transparent import output_bound, transparency
from nan_magic.records import TensorRef


def _forward_modules(report: nan_magic.Report) -> list[str | None]:
    return [row.module for row in report.layers if row.phase == "forward"]


class LogAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 1.0)  # NaN below 1


def test_an_activation_on_a_finite_input_has_no_row_and_changes_no_verdict() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.GELU(), nn.Dropout(0.1), LogAfter())  # a chain
    report = raised(lambda: model(torch.randn(3, 4)), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("forward", "4", "LogAfter")
    rows = _forward_modules(report)
    assert "0" in rows and "4" in rows
    # Passed through (finite in, finite out): listed in the table as unchecked, with no numbers.
    unchecked = {row.module: row for row in report.layers if row.module in {"1", "2", "3"}}
    assert set(unchecked) == {"1", "2", "3"}
    assert all(row.status == "unchecked" and row.stats is None and row.index is None for row in unchecked.values())


def test_a_backward_producer_behind_a_pass_through_is_still_its_consumer() -> None:
    class AcosHead(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.acos(x.clamp(-1.0, 1.0))  # infinite derivative at +-1

    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), AcosHead())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2) * 100)  # tanh saturates at exactly 1.0
        model[0].bias.zero_()
    report = raised(lambda: model(torch.ones(1, 2)).sum().backward(), model, mode="full")
    # The gradient is checked at Linear's output; its consumer is AcosHead, through the Tanh.
    assert (report.phase, report.module, report.module_type) == ("backward", "2", "AcosHead")
    assert report.source is not None and report.source.line.startswith("return torch.acos(x.clamp(-1.0, 1.0))")


def test_an_activation_given_a_nonfinite_input_is_checked_as_a_propagator() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias[0] = float("inf")
    with nan_magic.watch(model, on_detect="log", mode="full") as w:
        model(torch.randn(2, 4))
        calls = {call.name: call for call in w.log.calls if call.phase == "forward"}
        assert "1" in calls  # ReLU(inf) = inf: checked, since its input was not finite
        assert [record.status for record in calls["1"].outputs] == ["propagated"]
    assert w.report is not None and (w.report.module, w.report.tensor) == ("0", TensorRef.parameter("0.bias"))


def test_a_dropout_whose_scaling_would_overflow_is_checked() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    torch.manual_seed(0)
    x = torch.full((64, 1), 2e38)  # finite, but 2e38 / (1 - 0.5) overflows float32
    report = raised(lambda: model(x), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("forward", "1", "Dropout")
    assert report.posinf > 0


class Attention(nn.Module):
    """Softmax, then a dropout module on it: the dropout's input is this module's own value."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        scores = y @ y.transpose(-1, -2)  # overflows to inf for a huge scale
        return self.drop(scores.softmax(-1)) @ x


def _called(watch: nan_magic.Watch) -> set[str | None]:
    return {call.name for call in watch.log.calls if call.phase == "forward" and call.info is not None}


def test_a_dropout_on_a_value_its_parent_computed_is_left_to_the_parent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Attention())
    with nan_magic.watch(model, mode="full") as w:
        model(torch.randn(2, 3, 4)).sum().backward()
        assert _called(w) == {"", "0", "1"}  # no call of 1.drop: Attention's output check covers it
    with nan_magic.watch(model, defer=True, mode="full") as w:  # no replay to fall back on: checked
        model(torch.randn(2, 3, 4))
        assert "1.drop" in _called(w)

    model[1].scale = 1e25
    report = raised(lambda: model(torch.randn(2, 3, 4)), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("forward", "1", "Attention")
    assert report.op == "aten.bmm.default" and report.source is not None
    assert report.source.line.startswith("scores = y @ y.transpose(-1, -2)")


def test_a_dropout_that_overflows_inside_its_parent_is_named_by_the_replay() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(x * 1e38)  # 2e38 is finite; the dropout's 1 / (1 - 0.5) overflows it

    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(2.0)
    torch.manual_seed(0)
    report = raised(lambda: model(torch.ones(64, 4)), model, mode="full")
    assert (report.phase, report.module, report.module_type) == ("forward", "1", "Scaled")
    assert report.source is not None and report.source.line.startswith("return self.drop(x * 1e38)")
    assert "aten.mul.Tensor ran inside 1.drop, which is not checked on its own" in report.notes


@pytest.mark.parametrize("by_keyword", [False, True])  # kwargs are noted when the call returns
def test_a_module_consuming_such_a_pass_through_is_still_named_for_its_backward(by_keyword: bool) -> None:
    class AcosHead(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.acos(x.clamp(-1.0, 1.0))  # infinite derivative at +-1

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.act = nn.ReLU()
            self.acos = AcosHead()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # tanh is this module's own code: the ReLU on it is left to Head's check...
            y = self.act(torch.tanh(self.inner(x)))
            return self.acos(x=y) if by_keyword else self.acos(y)

    model = nn.Sequential(nn.Linear(2, 2), Head())
    with torch.no_grad():
        model[1].inner.weight.copy_(torch.eye(2) * 100)  # tanh saturates at exactly 1.0
        model[1].inner.bias.zero_()
    with nan_magic.watch(model, mode="full") as w:
        model(torch.ones(4, 2))
        assert "1.act" not in _called(w)
    report = raised(lambda: model(torch.ones(4, 2)).sum().backward(), model, mode="full")
    # ...but the gradient AcosHead's backward computes for its input is checked, and names AcosHead.
    assert (report.phase, report.module, report.module_type) == ("backward", "1.acos", "AcosHead")
    assert report.source is not None and report.source.line.startswith("return torch.acos(x.clamp(-1.0, 1.0))")


def test_dropout_in_half_precision_is_always_checked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), LogAfter()).half()
    report = raised(lambda: model(torch.randn(3, 4).half()), model, mode="full")
    assert "1" in _forward_modules(report)


def test_a_module_chosen_by_type_is_always_checked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), LogAfter())
    report = raised(lambda: model(torch.randn(3, 4)), model, types=["GELU", "LogAfter"], mode="full")
    assert "1" in _forward_modules(report)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.ReLU(), "any"),
        (nn.Tanh(), "any"),
        (nn.LeakyReLU(0.1), "any"),
        (nn.LeakyReLU(2.0), None),  # scales up: a backward factor above 1
        (nn.GELU(), "wide"),
        (nn.SiLU(), "wide"),
        (nn.Dropout(0.2), "dropout"),
        (nn.Softplus(), None),  # not on the list: checked
        (type("MyReLU", (nn.ReLU,), {})(), None),  # a subclass may compute anything
    ],
)
def test_which_modules_may_pass_through(module: nn.Module, expected: str | None) -> None:
    assert transparency(module) == expected


def test_the_output_bound_covers_a_modules_own_constants() -> None:
    assert output_bound("any", nn.ReLU(), -3.0, 2.0) == 3.0
    assert output_bound("any", nn.Hardtanh(5.0, 10.0), 0.0, 0.0) == 10.0  # clamps 0 up to 5, at most 10
    assert output_bound("wide", nn.ELU(alpha=4.0), -0.5, 0.5) == 4.0
    assert output_bound("dropout", nn.Dropout(0.5), -1.0, 2.0) == 4.0
    assert output_bound("dropout", nn.Dropout(0.5).eval(), -1.0, 2.0) == 2.0
