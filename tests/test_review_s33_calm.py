"""Review of calm-s33 (notes: calm-fixes-s33): a step with a held NaN batch that the user's own ``raise``/``assert``
(or a StopIteration) ends is settled as handled only where no value the raising code holds is non-finite but the
batch; a real NaN the user's check raised on (a loss, a metric, the model's own guard) is the batch's event.

Each incident row: unwatched, the user's exception; watched, before the fix, that exception and a benign "handled"
event for the batch (the NaN lost); now NonFiniteError, phase data, at the batch's step, naming its NaN count. The
calm rows: the user's own stop after a dict lookup (with its KeyError as context, or ``from None``) stays theirs.
"""

from __future__ import annotations

import math

import pytest
import torch
from calm_s30 import MODES
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


class AE(nn.Module):
    """An autoencoder that imputes its input (nan_to_num): its outputs stay finite, the loss against the raw batch
    does not."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 3), nn.Linear(3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.enc(x.nan_to_num(0.0))))


class Guarded(nn.Module):
    """A model with its own NaN guard in its forward, no submodule between the batch and the guard."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.head = nn.Parameter(torch.ones(6)), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x - x.mean(0)) * self.scale
        if torch.isnan(h).any():
            raise ValueError("NaN in normalised input")
        return self.head(h)


class Imputing(nn.Module):
    """Imputes its NaN-coded missing values (a learned fill and a missing mask): the batch is handled."""

    def __init__(self) -> None:
        super().__init__()
        self.fill, self.net = nn.Parameter(torch.zeros(6)), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.isnan()
        return self.net(torch.cat([torch.where(m, self.fill, x), m.float()], -1))


class Budget(Exception):
    pass


def _batches() -> list[torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    xb = x.clone()
    xb[0, 0] = float("nan")
    return [x, x, xb, x]


def _autoencoder(model: nn.Module, check: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b in _batches():
        loss = F.mse_loss(model(b), b)
        if check == "raise":
            if torch.isnan(loss):
                raise ValueError("loss is nan")
        elif check == "assert":
            assert torch.isfinite(loss), "loss not finite"
        elif check == "item":
            value = loss.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"loss {value}")
        opt.zero_grad()
        loss.backward()
        opt.step()


def _metric(model: nn.Module, check: str) -> None:
    """The model imputes its batch and the loss is finite; the loop's own metric over the raw batch is NaN."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 3, (8,))
    for b in _batches():
        loss = F.cross_entropy(model(b), y)
        mean_input = b.mean() if check == "tensor" else float(b.mean())
        if math.isnan(mean_input):
            raise ValueError("input metric is nan")
        opt.zero_grad()
        loss.backward()
        opt.step()


def _guard(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 3, (8,))
    for b in _batches():
        loss = F.cross_entropy(model(b), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _evaluation(model: nn.Module) -> None:
    """An evaluation loop summing the autoencoder's loss against the raw batch, left by next()'s StopIteration right
    after the NaN batch (the last)."""
    model.eval()
    it, total = iter(_batches()[:3]), 0.0
    with torch.no_grad():
        while True:
            b = next(it)
            total += F.mse_loss(model(b), b).item()


def _history_checked(model: nn.Module) -> None:
    """The autoencoder's evaluation keeps a loss history (no other local holds a loss) and checks its last entry."""
    losses: list[float] = []
    with torch.no_grad():
        for b in _batches():
            losses.append(F.mse_loss(model(b), b).item())
            if not math.isfinite(losses[-1]):
                raise FloatingPointError("loss history")


INCIDENTS = {
    "loss_history_checked": (AE, _history_checked, FloatingPointError),
    "loss_checked_by_raise": (AE, lambda m: _autoencoder(m, "raise"), ValueError),
    "loss_checked_by_assert": (AE, lambda m: _autoencoder(m, "assert"), AssertionError),
    "loss_checked_by_item": (AE, lambda m: _autoencoder(m, "item"), FloatingPointError),
    "metric_tensor_checked": (Imputing, lambda m: _metric(m, "tensor"), ValueError),
    "metric_number_checked": (Imputing, lambda m: _metric(m, "number"), ValueError),
    "guard_inside_the_forward": (Guarded, _guard, ValueError),
    "evaluation_sum_nan_then_stop_iteration": (AE, _evaluation, StopIteration),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(INCIDENTS))
def test_a_nan_the_users_check_raised_on_is_the_batchs_event(name: str, mode: str) -> None:
    build, run, theirs = INCIDENTS[name]
    with pytest.raises(theirs):
        run(build())  # unwatched: their exception
    model = build()
    watching = nan_magic.watch(model, **MODE_OPTIONS[mode])
    with pytest.raises(nan_magic.NonFiniteError) as caught, watching:
        run(model)
    report = caught.value.report
    assert (report.phase, report.step, report.nan) == ("data", 2, 1), (report.phase, report.step, report.nan)
    assert not any(event.benign for event in watching.events), "the batch was called handled"


class _Meter:
    """An average meter as training scripts write it: the NaN loss is in its ``sum``, one attribute down."""

    def __init__(self) -> None:
        self.sum, self.n = 0.0, 0

    def update(self, value: float) -> None:
        self.sum += value
        self.n += 1


def _meter_checked(model: nn.Module) -> None:
    meter = _Meter()
    with torch.no_grad():
        for b in _batches():
            meter.update(F.mse_loss(model(b), b).item())
            if math.isnan(meter.sum / meter.n):
                raise FloatingPointError("average loss is nan")


def _numpy_checked(model: nn.Module) -> None:
    with torch.no_grad():
        for b in _batches():
            value = F.mse_loss(model(b), b).numpy()  # a 0-d numpy array
            if value != value:
                raise FloatingPointError("loss is nan")


INCIDENTS.update({"meter_attribute": (AE, _meter_checked, FloatingPointError),
                  "numpy_loss": (AE, _numpy_checked, FloatingPointError)})


def _own_stop(model: nn.Module, variant: str) -> None:
    """The imputing model (a handled batch); at step 1 the loop stops on its own after a dict lookup fails."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    x[0, 0] = float("nan")
    cfg: dict[str, int] = {}
    for step in range(3):
        loss = F.cross_entropy(model(x), y)
        if step == 1:
            if variant == "keyerror_as_context":
                try:
                    cfg["max_steps"]
                except KeyError:
                    raise Budget("no max_steps: stop")  # noqa: B904 (the context is the point)
            try:
                cfg["max_steps"]
            except KeyError:
                raise Budget("no max_steps: stop") from None
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["keyerror_as_context", "from_none"])
def test_the_users_own_stop_after_a_dict_lookup_stays_theirs(variant: str, mode: str) -> None:
    torch.manual_seed(0)
    model = Imputing()
    watching = nan_magic.watch(model, **MODE_OPTIONS[mode])
    with pytest.raises(Budget, match="no max_steps"), watching:
        _own_stop(model, variant)
    assert watching.report is None
    assert [(event.phase.value, event.step, event.benign) for event in watching.events] == [("data", 0, True)]


# --------------------------------------------- fixes-s33, item 4: an oscillating real divergence is still one
def test_a_divergence_whose_loss_falls_back_part_way_is_still_one() -> None:
    """A run that began at ~1 and diverged to the 1e6 scale, its loss 1e4 on a small batch the step before the
    failing one: was (fixes-s33's "falling" rule) not diverged, and a lowered update's trial loss of 5e3 could read
    verified; the state it was redone from had diverged."""
    from nan_magic.fixes.remedies.diverged import diverged_before, diverged_loss
    from nan_magic.step_records import StepSummary

    losses = [1.0, 0.9, 0.8, 0.8, 0.7, 1e3, 5e4, 2e6, 8e5, 1e4]
    history = [StepSummary(step=index, loss=loss, absmax=None) for index, loss in enumerate(losses)]
    assert diverged_before(history, 8) is not None
    assert diverged_loss(history, 9, 5e3) == (4, 0.7)


# --------------------------------------------- fixes-s33, item 5: a bool or integer tensor exponent is whole
@pytest.mark.parametrize(("exponent", "whole"), [
    (torch.tensor([True, False]), True), (torch.tensor([2, 3]), True), (torch.tensor([2, -1]), False),
    (torch.tensor([2.0, 0.5]), False), (torch.tensor([2.0, 3.0]), True), (torch.tensor([2 + 0j]), False),
])
def test_a_whole_power_reads_any_dtype_of_exponent(exponent: torch.Tensor, whole: bool) -> None:
    """Was: ``NotImplementedError: "round" not implemented for 'Bool'`` inside the trial for ``x ** mask``."""
    from nan_magic.fixes.remedies.domain import _whole_power

    assert _whole_power(exponent) is whole


def _inline_checked(model: nn.Module) -> None:
    """The autoencoder's loop checks its loss where no local holds it."""
    for b in _batches():
        if torch.isnan(F.mse_loss(model(b), b)):
            raise ValueError("loss is nan")


@pytest.mark.xfail(strict=True, reason=(
    "a NaN value the user's own check raised on where no local holds it (an expression in the if) is not seen: the "
    "held batch is settled as handled (a benign event) and the user's ValueError reaches them, no data report"))
@pytest.mark.parametrize("mode", ["default", "ops"])
def test_a_nan_checked_where_no_local_holds_it(mode: str) -> None:
    model = AE()
    watching = nan_magic.watch(model, **MODE_OPTIONS[mode])
    with pytest.raises(nan_magic.NonFiniteError), watching:
        _inline_checked(model)


def _own_stop_beside(model: nn.Module, sentinel: str) -> None:
    """The imputing model; the loop holds an infinity of its own (a best-loss sentinel, a deadline, a causal mask,
    a tensor subclass that refuses reads) and stops itself at step 1."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    x[0, 0] = float("nan")
    best = float("inf") if sentinel == "best" else 0.0
    deadline = math.inf if sentinel == "deadline" else 10.0
    mask = torch.full((4, 4), float("-inf")).triu(1) if sentinel == "mask" else None
    for step in range(3):
        loss = F.cross_entropy(model(x), y)
        best = min(best, loss.item()) if step else best
        if step == 1:
            raise Budget(f"stop ({best}, {deadline}, {mask is not None})")
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sentinel", ["best", "deadline", "mask"])
def test_the_users_own_infinity_beside_a_handled_batch_leaves_their_stop_theirs(sentinel: str, mode: str) -> None:
    # the first fix read any non-finite value in the loop's frames as what the user's check raised on: a best loss
    # of float("inf"), a deadline of math.inf, a causal mask turned their own stop into a data report
    torch.manual_seed(0)
    model = Imputing()
    watching = nan_magic.watch(model, **MODE_OPTIONS[mode])
    with pytest.raises(Budget, match="stop"), watching:
        _own_stop_beside(model, sentinel)
    assert watching.report is None
