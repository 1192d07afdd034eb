"""Session 34's walk as contract rows, each beside its healthy twin, in every mode: a Beta regression's log_prob of a
target at 1.0 with a concentration below 1 (xlogy's +inf: a log of zero, which read "unclassified" before), and a
per-batch standardisation dividing by a column all 0 in the 3rd batch (its divisor ``x.std(0)``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributions import Beta
from torch.nn import functional as F

from contract import Case, Expect, Scenario

STEPS = 4


class _BetaHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)
        with torch.no_grad():
            self.body.bias.fill_(-1.0)  # both concentrations below 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = F.softplus(self.body(x)).unbind(-1)
        return a + 1e-3, b + 1e-3


def _beta(edge: float) -> Scenario:
    """Fractions in (0, 1); batch 2's 4th is ``edge`` (1.0: sold out, a log of 1 - 1 = 0)."""
    torch.manual_seed(0)
    net = _BetaHead()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    xs = [torch.randn(8, 4) * 0.1 for _ in range(STEPS)]
    ys = [torch.rand(8) * 0.8 + 0.1 for _ in range(STEPS)]
    ys[2][3] = edge

    def run() -> list[torch.Tensor]:
        seen = []
        for x, y in zip(xs, ys):
            a, b = net(x)
            loss = -Beta(a, b).log_prob(y).mean()  # producer: beta
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.detach())
        return seen
    return Scenario((net, opt), run)


class _BatchStandardize(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / (x.std(0) + self.eps)  # producer: std


def _standardised(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(_BatchStandardize(eps), nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(16, 5) for _ in range(STEPS)]
    xs[2][:, 4] = 0.0  # a yes/no column nobody said yes to in batch 2
    ys = [torch.randn(16, 1) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        seen = []
        for x, y in zip(xs, ys):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.detach())
        return seen
    return Scenario((model, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect, healthy: Callable[[], Scenario]) -> list[Case]:
    return [Case(f"user_s34_{name}", build, expect), Case(f"user_s34_{name}_healthy", healthy, None)]


CASES = [
    *_row("beta_log_prob_of_a_target_at_one", lambda: _beta(1.0),
          Expect("forward", None, step=2, op="aten.xlogy.Tensor", marker="beta", cause="log-domain"),
          lambda: _beta(0.999)),
    *_row("batch_standardisation_of_a_constant_column", lambda: _standardised(0.0),
          Expect("forward", "0", "_BatchStandardize", step=2, op="aten.div.Tensor", marker="std",
                 cause="division-by-zero"),
          lambda: _standardised(1e-5)),
]
