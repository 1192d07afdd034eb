"""The lead's fixes of session 32's merges, each as a user sees it (module, phase, error kept)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic

MODES = [{}, {"defer": True}, {"mode": "full"}, {"ops": True}, {"ops": True, "defer": True}]
IDS = ["default", "defer", "full", "ops", "ops-defer"]


class _DiscardedThenShapeError(nn.Module):
    """A where's discarded NaN (sqrt of the negatives, kept out), then the user's own shape error two lines on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = torch.where(h > 0, h.sqrt(), torch.zeros_like(h))
        return h @ torch.ones(3, 1)  # 4 columns against 3 rows: the user's bug


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_users_shape_error_after_a_discarded_nan_stays_the_users(options: dict) -> None:
    # odds-s32's fallback for an index a NaN made (the step's first non-finite op) named the where's sqrt for any
    # RuntimeError under ops=True: the user's own error is theirs, only an indexing op's error is evidence of a NaN
    torch.manual_seed(0)
    model = _DiscardedThenShapeError()
    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught, nan_magic.watch(model, **options):
        model(torch.randn(8, 4))
    assert not isinstance(caught.value, nan_magic.NonFiniteError)


class _InvertsASingularMatrix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.inv(self.w)


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_linalg_error_is_the_users_to_catch_in_every_mode(options: dict) -> None:
    model = _InvertsASingularMatrix()
    with pytest.raises(torch.linalg.LinAlgError), nan_magic.watch(model, **options):
        model(torch.ones(1, 2))


class _EarlyStop(Exception):
    pass


@pytest.mark.parametrize("options", MODES, ids=IDS)
def test_a_users_unrelated_error_after_a_benign_scaler_overflow_stays_the_users(options: dict) -> None:
    # calm-s32-fix raised a GradScaler's held overflow on any exception exit: the scaler's usual first overflows
    # (it would skip the step and lower its scale) became a backward NaN report in place of the user's own error
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    x = torch.randn(16, 4) * 1e-20
    with torch.no_grad():  # the activations' gradients overflow under the scale, the scaled loss does not
        model[2].weight.mul_(1e3)
        model[0].bias.zero_()
        model[2].bias.zero_()
    with pytest.raises(_EarlyStop), nan_magic.watch(model, **options):
        opt.zero_grad()
        scaler.scale(model(x).mean()).backward()
        raise _EarlyStop("the user's own, before the scaler's step")


class _BansAnAction(nn.Module):
    """A policy banning action 0 through ``.data`` after its softmax (its log-probability -inf on purpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.fc(x), -1)
        p.data[:, 0] = 0.0
        return torch.log(p)


@pytest.mark.parametrize("options", [{}, {"mode": "full"}, {"ops": True}], ids=["default", "full", "ops"])
def test_a_log_of_a_softmax_zeroed_through_data_is_not_verified_as_log_softmax(options: dict) -> None:
    # hunt-s32-fix compared the fused form with the user's probabilities only where they were > 0: log_softmax puts
    # about -3 where the user's log is -inf on purpose, and read "verified"
    torch.manual_seed(0)
    model = _BansAnAction()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(2):
            loss = -model(torch.randn(6, 4))[:, 1].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    stable = [trial for trial in caught.value.report.fixes if trial.kind == "stable"]
    assert stable and all(trial.finite is not True for trial in stable), caught.value.report.fixes
