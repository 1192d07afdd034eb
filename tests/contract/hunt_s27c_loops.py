"""hunt_s27c (continued), incidents the training loop's own code makes, each with its twin.

Kendall's uncertainty weighting as the popular ``AutomaticWeightedLoss`` module (never passed to ``watch``; its
sigmas in the optimizer) whose sigma Adam drives negative before ``log``; a projected-gradient loop clamping a gain at
exactly 0 after each step, so that ``sqrt``'s backward is inf at the next; an ordinal regression's censored
likelihood under bfloat16 autocast in the loop, whose cdf rounds to exactly 1: the ``-inf`` it makes is not in the
gathered loss, the NaN its backward makes is; log-target regression whose targets the code takes the log of once,
before the loop (a zero price: ``-inf`` stored in the ``TensorDataset``), inside the watch and before it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


class AutomaticWeightedLoss(nn.Module):
    """Kendall's weighting as the popular ``AutomaticWeightedLoss`` module: its sigmas are its own parameters."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.sigmas, self.safe = nn.Parameter(torch.full((2,), 0.15)), safe

    def forward(self, *losses: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for sigma, loss in zip(self.sigmas, losses):
            sigma = sigma.abs() + 1e-3 if self.safe else sigma
            total = total + loss / (2 * sigma ** 2) + torch.log(sigma)  # producer: awl log
        return total


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 3)
        with torch.no_grad():
            for head in (self.a, self.b):
                head.weight.zero_()
                head.bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.a(h), self.b(h)


def _awl(safe: bool) -> Scenario:
    """Sigma starts at 0.15 in its own Adam group at lr 0.1; the task losses of zero-initialised heads on small
    targets are about 1e-4, so the log term wins and sigma is below 0 after step 1's update: step 2's ``log`` is
    NaN. The twin takes ``|sigma| + 1e-3``, as the module's common fork does."""
    torch.manual_seed(0)
    model, weigh = TwoHeads(), AutomaticWeightedLoss(safe)
    opt = torch.optim.Adam([{"params": model.parameters(), "lr": 1e-3}, {"params": weigh.parameters(), "lr": 0.1}])
    xs, ya, yb = _batches(8, 4), _batches(8, 1), _batches(8, 3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            a, b = model(xs[step])
            loss = weigh(F.mse_loss(a, ya[step] * 0.01), F.mse_loss(b, yb[step] * 0.01))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


class Gain(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.gain, self.eps = nn.Linear(4, 1), nn.Parameter(torch.tensor(0.05)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.sqrt(self.gain + self.eps)  # producer: projected sqrt


def _projected(eps: float) -> Scenario:
    """Projected gradient: the loop clamps the gain at 0 after each step. Step 0's update drives it below 0 and the
    clamp sets it to exactly 0, so step 1's output is 0, its loss gradient 0, and ``0`` times the
    ``1 / (2 sqrt(0))`` of the root's backward is NaN. The twin adds an eps under the root."""
    torch.manual_seed(0)
    model = Gain(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    xs, ys = _batches(8, 4), [torch.zeros(8, 1) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.gain.clamp_(min=0.0)
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


def _ordinal_cdf(stable: bool) -> Scenario:
    """Ordinal regression's censored likelihood in the loop under bf16 autocast: ``log(1 - cumsum(softmax))``; in
    bfloat16 the cdf of step 1's confident row rounds to exactly 1 before its last class: ``log(0)``'s ``-inf``
    sits in a column the gather does not take, and its backward ``0 / 0`` is NaN. The twin clamps the cdf in
    float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, grades = [torch.rand(4, 4) for _ in range(4)], [torch.randint(0, 5, (4,)) for _ in range(4)]
    xs[1][0] = 30.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xs[step])
                probs = torch.softmax(logits, -1).to(logits.dtype)
                cdf = torch.cumsum(probs, -1)[:, :-1]  # P(grade <= k) for the five thresholds below the top
                if stable:
                    cdf = cdf.float().clamp(max=1 - 1e-6)
                survival = torch.log(1 - cdf)  # producer: ordinal survival
            loss = -survival.float().gather(1, grades[step][:, None]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- log targets taken once, before the loop
def _log_targets_first(log1p: bool, inside: bool) -> Scenario:
    """The log of every price is taken once, then a ``TensorDataset`` serves it: listing 6's price is 0, its
    target ``-inf``, and the batch of step 1 carries it into the loss. ``inside``: the log runs in the watched
    code, before the loop; otherwise before the watch. The twin takes ``log1p``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, prices = torch.randn(16, 4), torch.rand(16, 1) * 100 + 50
    prices[6] = 0.0

    def targets() -> torch.Tensor:
        return torch.log1p(prices) if log1p else torch.log(prices)  # producer: log targets first
    before = None if inside else targets()

    def run() -> list[torch.Tensor]:
        y = targets() if before is None else before
        losses = []
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=4):
            loss = F.mse_loss(model(xb), yb)  # producer: stored target
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


#: Why the log taken in the watched code before the loop is not named as ops=True names it (op and line).
_FIRST_RECORDED = (
    "op None at the loss line, not aten.log.default at the log's: the log ran in step 0's data region, whose records "
    "localize/outside/recorder.py's OutsideRecorder drops once step 0's model call has judged its (finite) batch; at "
    "step 1 the -inf reaches the loss through the DataLoader's collate (a copy, no producer), so "
    "OutsideRecorder.claim finds no op and the report names the batch and dataset index")

CASES = [
    Case("hunt_s27c_automatic_weighted_loss_sigma_adam_drives_negative_then_log", lambda: _awl(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="awl log", cause="log-domain")),
    Case("hunt_s27c_automatic_weighted_loss_abs_sigma_healthy", lambda: _awl(True), None),
    Case("hunt_s27c_projected_gradient_clamps_a_gain_at_0_then_sqrt_backward", lambda: _projected(0.0),
         Expect("backward", "", "Gain", step=1, op="aten.div.Tensor", marker="projected sqrt", cause="sqrt-domain")),
    Case("hunt_s27c_projected_gradient_sqrt_with_eps_healthy", lambda: _projected(1e-6), None),
    Case("hunt_s27c_bf16_autocast_ordinal_cdf_rounded_to_1_log_backward", lambda: _ordinal_cdf(False),
         Expect("backward", None, step=1, op="aten.div.Tensor", marker="ordinal survival", cause="log-domain")),
    Case("hunt_s27c_bf16_autocast_ordinal_cdf_clamped_in_float32_healthy", lambda: _ordinal_cdf(True), None),
    Case("hunt_s27c_log_targets_taken_before_the_loop_inside_the_watch", lambda: _log_targets_first(False, True),
         Expect("data", None, step=1, op="aten.log.default", marker="log targets first", cause="log-domain"),
         # ops=True: the op tracer saw the log make the -inf in step 0's data region, on prices no parameter nor model
         # output went into (localize/ops/derived.py): data.
         gaps=(("default", _FIRST_RECORDED), ("defer", _FIRST_RECORDED), ("full", _FIRST_RECORDED))),
    Case("hunt_s27c_log_targets_taken_before_the_watch", lambda: _log_targets_first(False, False),
         Expect("data", None, step=1, op=None, marker="stored target", cause="bad-input-data")),
    Case("hunt_s27c_log1p_targets_taken_before_the_loop_healthy", lambda: _log_targets_first(True, True), None),
]
