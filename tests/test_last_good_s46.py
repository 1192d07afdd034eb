"""``report.restore()`` puts back the state right after the last finite step, in the deferred mode as in the immediate.

Before session 46 the deferred mode kept the state one step older: a step's result is judged at the next step's
check, and an event in that step's calls stopped the check before the finite step was kept. Now the state is copied
right after each step and kept as soon as the check finds the step finite, before it judges the new step's calls
(scene/last_good.py ``stage``/``promote``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic

BAD_STEP = 3
MODES = {"default": {}, "defer": {"defer": True}, "ops-defer": {"ops": True, "defer": True}}


def _train(how: str, kept: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(6):
            x = torch.randn(5, 4)
            if step == BAD_STEP and how == "data":
                x[0, 0] = float("nan")  # the batch: its forward folds the NaN into the running statistics
            loss = F.mse_loss(model(x), torch.zeros(5, 2))
            if step == BAD_STEP and how == "loss":
                loss = loss * torch.log(torch.zeros(()))
            opt.zero_grad()
            loss.backward()
            if step == BAD_STEP and how == "gradient":
                model[0].weight.grad[0, 0] = float("inf")
            if step == BAD_STEP and how == "lr":
                opt.param_groups[0]["lr"] = float("inf")
            opt.step()
            if step == BAD_STEP - 1 and how == "edit":
                with torch.no_grad():  # the loop's hand edit after the last finite step: not part of that state
                    model[0].weight.mul_(2)
                    model[0].weight[0, 0] = float("nan")
            kept[step] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                          {k: torch.clone(v) if isinstance(v, torch.Tensor) else v
                           for k, v in opt.state_dict()["state"][0].items()})

    return model, opt, run


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", ["data", "loss", "gradient", "lr"])
def test_restore_puts_back_the_state_right_after_the_last_finite_step(mode: str, how: str) -> None:
    kept: dict[int, Any] = {}
    model, opt, run = _train(how, kept)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, keep_last_good="cpu",
                                                                            **MODES[mode]):
        run()
    report = caught.value.report
    assert report.step == BAD_STEP
    assert f"report.restore() puts back the model and optimizer state after step {BAD_STEP - 1}" in report.notes
    report.restore()
    state, adam = kept[BAD_STEP - 1]
    now = model.state_dict()
    # (the running statistics too: a NaN batch's forward had moved them before the deferred check found it)
    assert all(torch.equal(now[name], value) for name, value in state.items()), how
    assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()
    restored = opt.state_dict()["state"][0]
    assert torch.equal(restored["exp_avg_sq"], adam["exp_avg_sq"]) and float(restored["step"]) == BAD_STEP


@pytest.mark.parametrize("mode", list(MODES))
def test_a_hand_edit_after_the_last_finite_step_is_not_kept(mode: str) -> None:
    # The loop writes a NaN into a weight after step 2's update: the event is step 3's; the state kept is step 2's
    # update without the edit, in both timings (before, the deferred check judged step 2 at step 3's check).
    kept: dict[int, Any] = {}
    model, opt, run = _train("edit", kept)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, keep_last_good="cpu",
                                                                            **MODES[mode]):
        run()
    report = caught.value.report
    assert (report.phase, report.step) == ("optimizer", BAD_STEP)
    report.restore()
    weight = model[0].weight.detach()
    edited = kept[BAD_STEP - 1][0]["0.weight"]
    assert torch.isfinite(weight).all()
    assert torch.equal(weight[1:] * 2, edited[1:])  # the update's values, before the loop doubled them
