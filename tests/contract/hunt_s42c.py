"""hunt_s42c: a learning rate that is not finite, and a divisor read from a schedule by timestep.

A NaN rate the loop writes as a literal (``group["lr"] = float("nan")``) is the number itself, cause
``nonfinite-number``, at the step's line in every mode; a diffusion schedule whose first ``alphas_cumprod`` entry is 0,
gathered by timestep and divided by, is a division by zero in the model's own forward. Each has a healthy twin running
the same code.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


def _literal_lr(rate: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step, (x, y) in enumerate(batches):
            if step == 2:
                opt.param_groups[0]["lr"] = rate
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: literal lr step
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


class _ScheduleDivided(nn.Module):
    """``h / alphas_cumprod[t]``, the schedule's first entry ``first``."""

    def __init__(self, first: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("alphas_cumprod", torch.cat([torch.full((1,), first), torch.linspace(0.9, 0.1, 9)]))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t].view(-1, 1)
        return self.lin(x) / a  # producer: gathered schedule divisor


def _schedule(first: float) -> Scenario:
    torch.manual_seed(0)
    model = _ScheduleDivided(first)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(6, 8), torch.tensor(t)) for t in ([4, 2, 9, 1, 3, 5], [6, 8, 7, 2, 3, 1],
                                                            [3, 0, 5, 2, 7, 1])]

    def run() -> list[torch.Tensor]:
        losses = []
        for x, t in batches:
            loss = model(x, t).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s42c_nan_learning_rate_written_as_a_literal", lambda: _literal_lr(float("nan")),
         Expect("optimizer", "0", "Linear", step=2, op="aten.add_.Tensor", marker="literal lr step",
                tensor=TensorRef.parameter("0.weight"), cause="nonfinite-number")),
    Case("hunt_s42c_learning_rate_written_as_a_literal_healthy", lambda: _literal_lr(0.05), None),
    Case("hunt_s42c_schedule_entry_zero_gathered_by_timestep", lambda: _schedule(0.0),
         Expect("forward", "", "_ScheduleDivided", step=2, op="aten.div.Tensor", marker="gathered schedule divisor",
                cause="division-by-zero")),
    Case("hunt_s42c_schedule_without_a_zero_entry_healthy", lambda: _schedule(0.99), None),
]
