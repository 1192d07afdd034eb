"""An op given a Python number that is not finite: the number made the value, and the report says so.

``(1 - keep) * float("-inf")`` (an additive mask by a product: 0 * -inf is NaN where a position is kept) and a scale
of inf from a config read the same: the op's tensors are finite, its Python-number argument is not. Before, the
report said "inputs finite" and read it as an overflow; and it named ``scale * x``'s tensor ``scale``, since torch
runs a number times a tensor with the tensor first.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

MODES = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred"),
         pytest.param({"ops": True}, id="ops"), pytest.param({"mode": "full"}, id="full")]


class MaskByProduct(nn.Module):
    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        bias = (1 - keep) * float("-inf")  # producer: mask by a product
        return torch.softmax(scores + bias, -1)


class ScaledByConfig(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        return scale * self.lin(x)  # producer: scaled by config


@pytest.mark.parametrize("options", MODES)
def test_a_mask_multiplied_by_minus_inf_is_read_as_the_number_it_was_given(options) -> None:
    model = MaskByProduct()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.randn(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    report = caught.value.report
    assert (report.module, report.op, report.nan, report.neginf) == ("", "aten.mul.Tensor", 2, 1)
    assert report.source is not None and report.source.lineno == marked_line("mask by a product", where=MaskByProduct)
    assert report.nonfinite_numbers == (("other", float("-inf")),)
    assert report.cause is not None and report.cause.label == "nonfinite-number"
    text = report.to_text()
    assert "inputs      tensors finite; a Python number was not" in text
    assert 'float("-inf") (other): -inf (a Python number)' in text
    assert "1 - keep (self): f32[1,3] finite" in text
    assert "masked_fill(mask, float('-inf'))" in report.cause.hint


@pytest.mark.parametrize("options", MODES)
def test_a_scale_of_inf_names_no_operand_it_cannot_tell_apart(options) -> None:
    model = nn.Sequential(ScaledByConfig(float("inf")))
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.randn(2, 3))
    report = caught.value.report
    assert (report.module, report.op) == ("0", "aten.mul.Tensor")
    assert report.cause is not None and report.cause.label == "nonfinite-number"
    text = report.to_text()
    # ``scale * x`` runs as mul(x, scale): which name is the number, the line does not say; no name is guessed.
    assert "\n              self: f32[2,3] finite" in text and "scale (self)" not in text
    assert "\n              other: inf (a Python number)" in text


def test_a_finite_number_times_a_tensor_names_both_sides() -> None:
    from nan_magic.render.words.operands import operand_names

    def names(line: str, tensors: set[str]) -> tuple[str | None, str | None]:
        found = operand_names("aten.mul.Tensor", line, tensors)
        return found.get("self"), found.get("other")

    assert names("y = 1e30 * x", {"self"}) == ("x", "1e30")
    assert names("y = x * -2.0", {"self"}) == ("x", "-2.0")
    assert names("y = lr * g", {"self"}) == (None, None)
    assert names("y = a * b", {"self", "other"}) == ("a", "b")
    # A division by a Python number runs div(x, t): its left side is ``self`` whatever t is (2 / x runs reciprocal).
    divided = operand_names("aten.div.Tensor", "y = self.lin(x) / t", {"self"})
    assert (divided.get("self"), divided.get("other")) == ("self.lin(x)", "t")
