"""A batch the model makes a tensor of itself: a list of Python numbers, a numpy array inside a tuple.

A policy given an environment's observation, a model fed a CSV reader's rows, a wrapper passed ``(features, meta)``
calls ``torch.tensor(rows)`` in its own ``forward``. A NaN the rows bring in is data (PRODUCT.md: phase data,
"bad input data"), not "unclassified: the op is unknown" at the first module reading the tensor, as it was: the
top-level call's list or tuple argument of numbers, or of rows of them, is summed (no tensor made for a finite
batch) and, where the sum is not finite, read as a float64 tensor; a numpy array inside a tuple or list argument is
read as one passed alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.hot.kept.call_records import unfinite_numbers

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}

NAN_ROWS = [[1.0, 2.0, 3.0], [4.0, math.nan, 6.0]]


class FromRows(nn.Module):
    """Makes its input tensor from what it is given (rows, or the first item of a tuple)."""

    def __init__(self, impute: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.impute = impute

    def forward(self, rows: Any = None, obs: Any = None) -> torch.Tensor:
        x = torch.as_tensor(rows if rows is not None else obs[0], dtype=torch.float32)
        return self.fc(torch.nan_to_num(x) if self.impute else x)


def _report(model: nn.Module, call: Any, options: dict[str, Any]) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(2):
            call(model).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return caught.value.report


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("passed", "path"), [
    (lambda model: model(NAN_ROWS), "input[0]"),
    (lambda model: model(rows=NAN_ROWS), "kwargs['rows']"),
    (lambda model: model(tuple(map(tuple, NAN_ROWS))), "input[0]"),
    (lambda model: model(None, (np.array(NAN_ROWS), "meta")), "input[1][0]"),
    (lambda model: model(None, [np.array(NAN_ROWS, dtype=np.float32)]), "input[1][0]"),
], ids=["list-of-rows", "keyword", "tuple-of-tuples", "numpy-in-a-tuple", "numpy-in-a-list"])
def test_a_nan_the_models_own_rows_bring_in_is_data(mode: str, passed: Any, path: str) -> None:
    report = _report(FromRows(), passed, MODES[mode])
    assert (report.phase, report.module, report.module_type, report.tensor.path) == ("data", "", "FromRows", path)
    assert "1 nan of 6" in report.message
    assert report.cause.label == "bad-input-data"


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_whose_nan_the_model_imputes_are_calm(mode: str) -> None:
    model = FromRows(impute=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, **MODES[mode]):
        for _ in range(3):
            model(NAN_ROWS).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.parametrize("mode", list(MODES))
def test_bounds_of_plus_infinity_given_as_a_list_are_calm(mode: str) -> None:
    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, bounds: list[float]) -> torch.Tensor:
            return self.fc(x).clamp(bounds[0], bounds[1])

    model = Clamped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nan_magic.watch(model, opt, **MODES[mode]):
        for _ in range(3):
            model(torch.randn(2, 3), [0.0, math.inf]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_only_a_list_of_numbers_holding_one_not_finite_is_made_a_tensor() -> None:
    assert unfinite_numbers([[1.0, 2.0], [3.0, 4.0]]) is None  # finite: summed, no tensor made
    assert unfinite_numbers([1, 2, 10**400]) is None  # (an int past floats: no float batch)
    assert unfinite_numbers(["a", "b"]) is None
    assert unfinite_numbers([torch.ones(2), torch.ones(2)]) is None
    assert unfinite_numbers([[1.0, math.nan], [2.0]]) is None  # ragged rows: no tensor of them
    made = unfinite_numbers([[1.0, math.inf], [2.0, -math.inf]])
    assert made is not None and made.dtype == torch.float64 and made.tolist() == [[1.0, math.inf], [2.0, -math.inf]]
    assert unfinite_numbers((0.5, math.nan)) is not None
    assert unfinite_numbers([math.inf, -math.inf]) is not None  # (fsum refuses the pair: not finite either)
    assert unfinite_numbers([1e308, 1e308]) is None  # finite numbers whose sum overflows: no batch of NaN
    assert unfinite_numbers([1.0, torch.ones(3)]) is None  # a tensor among numbers: not a list of numbers


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_skip_batch_says_a_list_of_numbers_cannot_be_cut(mode: str) -> None:
    report = _report(FromRows(), lambda model: model(NAN_ROWS), MODES[mode])
    assert "entered the model in a numpy array, a list of Python numbers" in report.to_text()


class Graph:
    """A batch object of the user's class (a graph library's ``Data``): its tensors are its attributes."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class FromGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, data: Graph) -> torch.Tensor:
        return self.fc(data.x)


@pytest.mark.parametrize("mode", ["default", "defer"])
@pytest.mark.parametrize("kind", ["list", "numpy", "object"])
def test_the_layer_table_names_the_batch_the_producer_and_the_models_output_propagated(mode: str, kind: str) -> None:
    """The model call consumed the batch it was given however it came (an object's attribute, an array, rows of
    numbers): its output propagated the NaN, as for a tensor batch (was 'producer' twice: the call's output too)."""
    model: nn.Module
    if kind == "object":
        model, call = FromGraph(), (lambda m: m(Graph(torch.tensor(NAN_ROWS, dtype=torch.float32))))
    else:
        batch = NAN_ROWS if kind == "list" else np.array(NAN_ROWS)
        model, call = FromRows(), (lambda m: m(batch))
    report = _report(model, call, MODES[mode])
    rows = {(layer.phase.value, layer.tensor.path if layer.tensor else None): layer.status for layer in report.layers
            if layer.module == ""}
    assert rows[("data", report.tensor.path)] == "producer"
    assert rows[("forward", "output")] == "propagated", rows
