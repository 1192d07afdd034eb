"""hunt26b, loops, optimizers and data: reported incidents, each with its healthy twin (layers and losses: hunt26).

SAM's second forward, at the ascent point, taking the log of a scale the perturbation pushed below 0; a loss divided
by ``accum_steps`` computed as 0 (the loop's ``% accum_steps`` then raises before any step); gradient standardisation
of a one-element parameter (the unbiased std of one number is NaN); the Polyak step size of a batch without a
labelled sample (``0 / 0`` as the learning rate); a prefetcher standardising the next batch one step ahead, a channel
constant in it. Each with the fix its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- SAM's ascent point below a scale's domain
class HeteroscedasticRegressor(nn.Module):
    """Predicts a mean and a noise scale; the scale is a raw parameter (the twin: ``exp`` of a log-scale)."""

    def __init__(self, log_parametrised: bool) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.log_parametrised = log_parametrised
        self.scale = nn.Parameter(torch.tensor(math.log(0.05) if log_parametrised else 0.05))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scale.exp() if self.log_parametrised else self.scale
        return self.body(x), scale.expand(x.shape[0], 1).log()  # producer: sam log scale


def _sam_ascent(log_parametrised: bool) -> Scenario:
    """SAM: the gradient's ascent step ``rho g / |g|`` (rho 0.1) moves the scale of 0.05 by nearly -0.1 (its gradient
    dominates), the second forward at ``w + e`` takes the log of a negative scale; the loop then restores ``w`` and
    steps. The twin parametrises the scale by its log."""
    torch.manual_seed(0)
    model = HeteroscedasticRegressor(log_parametrised)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = _batches(6, 4, steps=3), _batches(6, 1, steps=3)

    def nll(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        mean, log_scale = out
        return (0.5 * ((y - mean) / log_scale.exp()) ** 2 + log_scale).mean()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = nll(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                grads = [p.grad for p in model.parameters()]
                norm = torch.stack([g.norm() for g in grads]).norm()
                ascent = [0.1 * g / (norm + 1e-12) for g in grads]
                for p, e in zip(model.parameters(), ascent):
                    p.add_(e)
            opt.zero_grad()
            nll(model(xs[step]), ys[step]).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), ascent):
                    p.sub_(e)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loss divided by accum_steps of 0
def _accum_steps(floored: bool) -> Scenario:
    """``accum_steps = global_batch // micro_batch`` after the micro-batch was raised above the global batch: 0. The
    loss is divided by it (inf), then ``(i + 1) % accum_steps`` raises ZeroDivisionError before any step. The twin
    takes at least 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    micro_batch, global_batch = 8, 4
    accum_steps = global_batch // micro_batch
    if floored:
        accum_steps = max(1, accum_steps)
    xs, ys = _batches(micro_batch, 4), _batches(micro_batch, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for i in range(4):
            loss = F.mse_loss(model(xs[i]), ys[i]) / accum_steps  # producer: accumulation scale
            loss.backward()
            if (i + 1) % accum_steps == 0:
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- gradient standardisation of a scalar parameter
def _gradient_standardisation(skip_scalars: bool) -> Scenario:
    """The loop standardises each parameter's gradient, ``(g - mean) / (std + 1e-8)``, before the step; the PReLU's
    one slope has one gradient element, whose unbiased std is NaN. The twin leaves one-element gradients alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.PReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 4), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if skip_scalars and p.grad.numel() == 1:
                        continue
                    p.grad.sub_(p.grad.mean()).div_(p.grad.std() + 1e-8)  # producer: gradient standardisation
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the Polyak step size of a zero gradient
def _polyak(eps: float) -> Scenario:
    """The Polyak step size ``(f - f*) / |g|^2`` with ``f* = 0``, set as each step's learning rate; the batch of step
    2 has no labelled sample, its masked loss and every gradient are 0: ``0 / 0``. The twin adds eps to the squared
    norm (as SPS does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _batches(6, 4), _batches(6, 1)
    labelled = [torch.rand(6, 1) < 0.7 for _ in range(4)]
    labelled[2][:] = False

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            mask = labelled[step].float()
            loss = (mask * (model(xs[step]) - ys[step]) ** 2).sum() / mask.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            squared = sum(p.grad.pow(2).sum() for p in model.parameters())
            size = loss.detach() / (squared + eps)  # producer: polyak
            for group in opt.param_groups:
                group["lr"] = min(size.item(), 1.0) if eps else size.item()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a prefetcher standardising one batch ahead
class Prefetcher:
    """NVIDIA's data prefetcher shape: ``next()`` returns the batch prepared last time and prepares the next one
    (there on a side stream; here the per-batch standardisation it does)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], eps: float) -> None:
        self.batches, self.eps = iter(batches), eps
        self.preload()

    def preload(self) -> None:
        batch = next(self.batches, None)
        if batch is None:
            self.ready = None
            return
        x, y = batch
        x = (x - x.mean((0, 2, 3), keepdim=True)) / (x.std((0, 2, 3), keepdim=True) + self.eps)  # producer: prefetch
        self.ready = (x, y)

    def next(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        batch = self.ready
        self.preload()
        return batch


def _prefetcher(eps: float) -> Scenario:
    """The third batch's images come from a camera whose green channel is dead (0 everywhere): the prefetcher, at
    step 1, standardises it to ``0 / 0``; the loop trains on it at step 2. The twin adds eps to the std."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.rand(4, 3, 6, 6), torch.randint(0, 2, (4,))) for _ in range(4)]
    data[2][0][:, 1] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        prefetcher = Prefetcher(data, eps)
        batch = prefetcher.next()
        while batch is not None:
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            batch = prefetcher.next()
        return losses
    return Scenario((model, opt), run)


_SAM = Expect("forward", "", "HeteroscedasticRegressor", step=0, op="aten.log.default", marker="sam log scale",
              cause="log-domain")
_PREFETCH = Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="prefetch",
                   tensor=TensorRef.argument("input[0]"), cause="division-by-zero")

CASES = [
    Case("hunt26_sam_second_forward_log_of_a_scale_pushed_below_0", lambda: _sam_ascent(False), _SAM),
    Case("hunt26_sam_log_parametrised_scale_healthy", lambda: _sam_ascent(True), None),
    Case("hunt26_loss_divided_by_accum_steps_of_0", lambda: _accum_steps(False),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="accumulation scale",
                cause="division-by-zero")),
    Case("hunt26_loss_divided_by_accum_steps_floored_at_1_healthy", lambda: _accum_steps(True), None),
    Case("hunt26_gradient_standardisation_of_a_one_element_parameter", lambda: _gradient_standardisation(False),
         Expect("backward", None, step=0, op="aten.std.correction", marker="gradient standardisation",
                tensor=TensorRef.gradient("1.weight"), cause="division-by-zero")),
    Case("hunt26_gradient_standardisation_skipping_scalars_healthy", lambda: _gradient_standardisation(True), None),
    Case("hunt26_polyak_step_size_of_a_batch_without_a_labelled_sample", lambda: _polyak(0.0),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div.Tensor", marker="polyak",
                tensor=TensorRef.parameter("0.weight"), cause="division-by-zero")),
    Case("hunt26_polyak_step_size_with_eps_healthy", lambda: _polyak(1e-8), None),
    Case("hunt26_prefetcher_standardises_a_dead_channel_one_batch_ahead", lambda: _prefetcher(0.0), _PREFETCH,
         modes=("ops",)),
    Case("hunt26_prefetcher_standardises_a_dead_channel_one_batch_ahead_tiered", lambda: _prefetcher(0.0),
         _PREFETCH, modes=("default", "defer", "full")),
    Case("hunt26_prefetcher_std_eps_healthy", lambda: _prefetcher(1e-6), None),
]
