"""The history's rows, made at every step's end without the frozen dataclass's ``__init__`` (step_cycle.end_step).

What a user sees of them: each is a :class:`StepSummary` equal to one the constructor makes from its fields,
holding no attribute that is not a field, frozen, hashable, and copied and pickled whole, in both timings.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn
from watching import train_steps

import nan_magic
from nan_magic.records import StepSummary

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


@pytest.mark.parametrize("options", TIMINGS)
def test_each_step_of_the_history_is_a_whole_frozen_step_summary(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as w:
        losses = train_steps(model, opt, [torch.randn(8, 4) for _ in range(4)])
    fields = {field.name for field in dataclasses.fields(StepSummary)}
    assert [row.step for row in w.history] == [0, 1, 2, 3]
    for row, loss in zip(w.history, losses):
        assert type(row) is StepSummary and set(vars(row)) <= fields  # (a misspelt field would be an extra key)
        assert row == StepSummary(**{name: getattr(row, name) for name in fields})
        assert row.loss == pytest.approx(loss) and row.grad_norm is not None and row.absmax is not None
        assert row.nonfinite is False and hash(row) == hash(copy.copy(row)) and pickle.loads(pickle.dumps(row)) == row
        with pytest.raises(dataclasses.FrozenInstanceError):
            row.loss = 0.0  # type: ignore[misc]
    assert w.history[1].full and w.history[1].layers and not w.history[2].layers  # the per-module step's layers
