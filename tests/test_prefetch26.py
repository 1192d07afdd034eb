"""What the records kept for hunt26b's prefetcher and Polyak rows hold, and for how long (localize/outside/recorder.py).

The previous data region's records stay one data region more (a prefetcher's batch is made a step ahead); the update
region's records stay through the optimizer step where its code read a number (``lr = size.item()``). Neither may
keep what it holds any longer than that, nor a healthy loop's result change.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import Report

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}}


@pytest.mark.parametrize("mode", MODES)
def test_a_data_region_s_temporaries_go_one_data_region_later(mode: str) -> None:
    """A temporary the data code made (a standardised batch's mean) is held by the data region's records, then by
    ``_data_prior`` (a prefetcher's next batch is judged at the next call), and freed as the next step's records
    replace them: alive after its own step, gone after the next."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive: list[list[bool]] = []
    with nan_magic.watch(model, opt, **MODES[mode]):
        for _step in range(5):
            raw = torch.rand(6, 4)
            mean = raw.mean(0, keepdim=True)
            refs.append(weakref.ref(mean))
            x = raw - mean
            del mean
            loss = F.mse_loss(model(x), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            gc.collect()
            alive.append([ref() is not None for ref in refs])
    # Step k's data code ran before step k's call: held through step k (the next call may judge what it made), gone
    # once step k+1's data records take their place.
    assert alive == [[False] * step + [True] for step in range(5)], alive


@pytest.mark.parametrize("mode", MODES)
def test_the_update_region_s_records_go_after_the_step_that_read_a_number(mode: str) -> None:
    """A loop that logs ``.item()`` between backward and the step (its update region read a number): what that region
    made is kept through the step, for a NaN learning rate's source, and freed as the step returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    freed = []
    with nan_magic.watch(model, opt, **MODES[mode]):
        for _step in range(4):
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
            opt.zero_grad()
            loss.backward()
            norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
            ref = weakref.ref(norm)
            norm.item()
            del norm
            opt.step()
            gc.collect()
            freed.append(ref() is None)
    assert all(freed), freed


def test_a_finite_learning_rate_the_loop_computes_keeps_the_result_and_says_nothing() -> None:
    """The Polyak twin (eps in the squared norm): the same numbers watched and unwatched, no event."""

    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with nan_magic.watch(model, opt) if watched else contextlib.nullcontext():
            for _step in range(4):
                loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1))
                opt.zero_grad()
                loss.backward()
                squared = sum(p.grad.pow(2).sum() for p in model.parameters())
                for group in opt.param_groups:
                    group["lr"] = min((loss.detach() / (squared + 1e-8)).item(), 1.0)
                opt.step()
                losses.append(loss.detach())
        return losses

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def polyak_nan_lr_report(options: dict) -> Report:
    """The report of a Polyak step size ``loss / |g|^2`` at 0 / 0 (step 1), read with ``.item()`` into
    ``param_groups`` (also test_gaps_s27's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            loss = F.mse_loss(model(torch.rand(6, 4)), torch.zeros(6, 1)) * (0.0 if step == 1 else 1.0)
            opt.zero_grad()
            loss.backward()
            squared = sum(p.grad.pow(2).sum() for p in model.parameters())
            size = loss.detach() / squared  # 0 / 0 at step 1
            for group in opt.param_groups:
                group["lr"] = size.item()
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("mode", MODES)
def test_a_learning_rate_the_loop_made_nan_is_its_code_s_in_every_sentence(mode: str) -> None:
    """The cause and the operands' evidence place the division in the loop's code at its line, not in the stepped
    parameter's module; the fixes' note says why no trial ran (the loop's update code), not the optimizer's."""
    report = polyak_nan_lr_report(MODES[mode])
    assert (report.phase, report.step, report.op) == ("optimizer", 1, "aten.div.Tensor")
    assert report.cause is not None and report.cause.label == "division-by-zero"
    text = report.to_text()
    assert "aten.div.Tensor in the code at " in text and "in 0 (Linear)" not in text
    assert ("no fix was tried: the producer (aten.div.Tensor) ran in the loop's code between backward() and the step, "
            "which the trials do not run again") in report.notes
    assert not any("step, whose trials redo it" in note for note in report.notes)
