"""cause_s29: incidents where a plausible rule gave the wrong likely cause, each with its healthy twin.

A diffusion loop whose noise schedule ends at alpha_bar = 5.7e-31 (a cosine schedule's last steps, rounded): its
``x0 = (x_t - sqrt(1 - alpha_bar) eps) / sqrt(alpha_bar)`` makes the loss 5e29 and the gradients about 1e28 in one
step, until Adam's ``exp_avg_sq`` overflows; the report must point at the loss's own code, not at a learning rate. The
twin clamps alpha_bar to 1e-5, as samplers do.
A temperature the loop anneals by 1e-6 a step (``logits / tau``) and a hand-made loss scale the loop multiplies by 1e5
a step (no GradScaler): the loss rises for steps before the overflow, so a divergence rule read a learning rate too
high; the value that grew is the loop's own. The twins give the temperature a floor and cap the scale.
A regression target of 3e20 (a sentinel a data export wrote for "unknown") squared in the loss: the hint said to
find what grew the values and lower the learning rate; it names the target. The twin drops the sentinel row.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


def _diffusion(floor: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100), 0)
    alpha_bar[60:] = 5.7e-31  # the schedule's tail, as a cosine schedule's last steps round
    xs = _batches(4, 8, steps=4)
    ts = [torch.tensor([3, 10, 20, 30]), torch.tensor([5, 99, 7, 8]), torch.tensor([1, 2, 3, 4]),
          torch.tensor([9, 9, 9, 9])]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x0, ab = xs[step], alpha_bar[ts[step]][:, None].clamp(min=floor)
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * torch.randn_like(x0)
            x0_pred = (xt - (1 - ab).sqrt() * model(xt)) / ab.sqrt()
            loss = F.mse_loss(x0_pred, x0)
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adam
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _temperature(floor: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 4, steps=8), [torch.randint(0, 3, (8,)) for _ in range(8)]

    def run() -> list[torch.Tensor]:
        losses, tau = [], torch.tensor(1.0)
        for step in range(8):
            logits = model(xs[step]) / tau  # producer: temperature
            loss = F.cross_entropy(logits, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                tau = (tau * 1e-6).clamp(min=floor)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _loss_scale(cap: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 4, steps=10), _batches(8, 1, steps=10)

    def run() -> list[torch.Tensor]:
        losses, scale = [], torch.tensor(1.0)
        for step in range(10):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            (loss * scale).backward()
            for parameter in model.parameters():
                parameter.grad /= scale
            opt.step()
            scale = (scale * 1e5).clamp(max=cap)  # producer: scale
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _sentinel_target(drop: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 4, steps=4), _batches(8, 1, steps=4)
    ys[2][3] = 3e20  # the export's "unknown"

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            kept = ys[step].abs() < 1e6 if drop else torch.ones_like(ys[step], dtype=torch.bool)
            out = model(xs[step])
            loss = F.mse_loss(out[kept], ys[step][kept])  # producer: sentinel
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("cause_s29_diffusion_x0_over_sqrt_alpha_bar_5_7e_31", lambda: _diffusion(0.0),
         Expect("optimizer", "0", "Linear", step=1, op="aten.addcmul_.default", marker="adam", cause="overflow"),
         note="defer too (defer-s37): a step after gradients of 1e18 or more is read as it ends, gradient in place"),
    Case("cause_s29_diffusion_alpha_bar_clamped_healthy", lambda: _diffusion(1e-5), None),
    Case("cause_s29_temperature_annealed_by_1e_6_a_step", lambda: _temperature(0.0),
         Expect("forward", None, step=4, op="aten.div.Tensor", marker="temperature", cause="overflow")),
    Case("cause_s29_temperature_with_a_floor_healthy", lambda: _temperature(0.1), None),
    Case("cause_s29_hand_made_loss_scale_grown_1e5_a_step", lambda: _loss_scale(math.inf),
         Expect("data", None, step=8, op="aten.mul.Tensor", marker="scale", cause="overflow")),
    Case("cause_s29_hand_made_loss_scale_capped_healthy", lambda: _loss_scale(2.0 ** 16), None),
    Case("cause_s29_regression_target_3e20_sentinel_squared", lambda: _sentinel_target(False),
         Expect("forward", None, step=2, op="aten.mse_loss.default", marker="sentinel", cause="overflow")),
    Case("cause_s29_regression_sentinel_rows_dropped_healthy", lambda: _sentinel_target(True), None),
]
