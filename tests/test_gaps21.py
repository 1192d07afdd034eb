"""gaps21: the optimizer's weight decay read at the event (a diverging run's hint names it where it alone flips the
weights); the contract rows are tests/contract/gaps21.py and hunt20_runs.py's weight decay rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nan_magic.explain.diagnose import diagnose
from nan_magic.hot.checks.optimizer.step_layout import largest_decay
from nan_magic.records import Phase, Report, StepSummary, TensorRef


def _diverging(decay: tuple[float, float] | None) -> Report:
    return Report(
        phase=Phase.FORWARD,
        module=None,
        module_type=None,
        step=5,
        nan=0,
        posinf=1,
        neginf=0,
        numel=1,
        dtype="float32",
        tensor=TensorRef.output(),
        op="aten.mse_loss.default",
        optimizer_decay=decay,
        history=tuple(StepSummary(step=step, loss=loss, absmax=1.0) for step, loss in enumerate([1.2, 5e3, 2e10])),
    )


def test_a_weight_decay_that_flips_the_weights_is_named_in_the_diverging_hint() -> None:
    cause = diagnose(_diverging((0.1, 5e4)))
    assert cause.label == "learning-rate-too-high"
    assert cause.fact("decay") == (0.1, 5e4)
    assert "weight_decay=50000 with lr=0.1" in cause.hint, cause.hint
    assert "1 - lr * weight_decay = -4999" in cause.hint


@pytest.mark.parametrize("decay", [None, (0.1, 5e-4), (1e-3, 0.01)])
def test_a_usual_weight_decay_leaves_the_learning_rate_hint(decay: tuple[float, float] | None) -> None:
    cause = diagnose(_diverging(decay))
    assert cause.label == "learning-rate-too-high" and cause.fact("decay") is None
    assert "lower the learning rate" in cause.hint and "weight_decay" not in cause.hint


def test_the_largest_decay_over_groups_and_optimizers() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd = torch.optim.SGD(
        [{"params": a.parameters(), "weight_decay": 0.0}, {"params": [b.weight], "lr": 0.5, "weight_decay": 1e-2}],
        lr=0.1,
    )
    adamw = torch.optim.AdamW([b.bias], lr=torch.tensor(0.01), weight_decay=3.0)  # (a tensor lr: read at the event)
    assert largest_decay([sgd]) == (0.5, 1e-2)
    assert largest_decay([sgd, adamw]) == pytest.approx((0.01, 3.0))
    assert largest_decay([torch.optim.SGD(a.parameters(), lr=0.1)]) is None
    assert largest_decay([]) is None
