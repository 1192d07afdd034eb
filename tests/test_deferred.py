"""Deferred checks: one host transfer per step, the same producers as immediate checks.

On CUDA the watch keeps per-call results on the device and reads them once
per step. The same code runs here with the CPU as the device (``defer=True``),
and a transfer counter stands in for CUDA's sync debug mode.
"""

from __future__ import annotations

import pytest
import torch
from faults import fp16_adam_step
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.engine import calls, optim, stats, watch

# Functions that read tensor values on the host: none may run in a healthy deferred step.
PER_TENSOR_READS = ("kinds_of", "tensor_stats")


@pytest.fixture
def transfers(monkeypatch):
    """Count deferred transfers; fail on any per-tensor read."""
    count = {"reads": 0}
    real = stats.read_scalars

    def counting(scalars):
        count["reads"] += 1
        return real(scalars)

    for module in (calls, watch, optim):
        if hasattr(module, "read_scalars"):
            monkeypatch.setattr(module, "read_scalars", counting)

    def forbidden(*args, **kwargs):
        raise AssertionError("a per-tensor host read in a healthy deferred step")

    from nan_magic.engine import gradients

    for module in (watch, gradients, optim):
        for name in PER_TENSOR_READS:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    return count


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 3))


def test_a_healthy_training_step_costs_one_transfer(transfers) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    # The last step is a full parameter check (optim.FULL_CHECK_EVERY), read at the end.
    steps = optim.FULL_CHECK_EVERY + 1
    with nan_magic.watch(model, opt, defer=True) as w:
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        during = transfers["reads"]
    assert during == steps  # one per step, at the optimizer step
    assert transfers["reads"] == steps + 1  # and one at the end for the last step's result
    assert w.report is None and w.step == steps
    assert [summary.loss is not None for summary in w.history] == [True] * steps


def test_inference_costs_one_transfer_per_forward(transfers) -> None:
    model = _mlp().eval()
    with torch.no_grad(), nan_magic.watch(model, defer=True):
        for _ in range(4):
            model(torch.randn(2, 8))
    assert transfers["reads"] == 4


def test_deferred_finds_backward_producers() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(embed, defer=True):
        torch.sqrt(((embed(x) - embed(x.clone())) ** 2).sum(-1)).sum().backward()
    report = caught.value.report
    assert (report.phase, report.module) == ("backward", None)


def test_deferred_finds_optimizer_producers_at_the_next_sync() -> None:
    model, opt, step = fp16_adam_step()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=True):
        step()
    report = caught.value.report
    assert (report.phase, report.module, report.tensor, report.step) == ("optimizer", "0", "parameter 0.weight", 0)


def test_deferred_names_a_freed_producer_from_its_probe() -> None:
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught, torch.no_grad(), nan_magic.watch(model, defer=True):
        model(torch.randn(8, 4))  # no autograd: Log's output is freed before the check
    report = caught.value.report
    assert (report.module, report.module_type) == ("1", "Log")
    assert "detected at the deferred check" in report.notes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_makes_at_most_one_host_sync() -> None:
    import warnings

    torch.manual_seed(0)
    model = _mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 3, (16,), device="cuda")

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def syncs(watched: bool) -> int:
        step()  # warm-up outside the count
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if watched:
                    with nan_magic.watch(model, opt) as w:
                        for _ in range(3):
                            step()
                        w.optimizers.carried = None  # the exit flush is not part of a step
                else:
                    for _ in range(3):
                        step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(item.message) for item in caught)

    assert syncs(True) - syncs(False) <= 3
