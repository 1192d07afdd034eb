"""hunt_s47b, more research training code: a diffusion decoder's discretised Gaussian likelihood in bits per dim (the
log of a bin's probability, which underflows to 0 far from the mean), and a normalising flow whose affine coupling
takes the scale itself from a zero-initialised layer (``log|s|`` of 0 in its log-determinant). Each with its twin.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


# ---------------------------------------------------------------- bits per dim of a discretised Gaussian
def _approx_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF (guided-diffusion's ``approx_standard_normal_cdf``)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 16))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_scale = self.net(z).chunk(2, -1)
        return mean, log_scale


def _bits_per_dim(floor: float) -> Scenario:
    """The decoder's NLL of images in [-1, 1] with 256 levels: the log of each pixel's bin ``cdf(x + 1/255) -
    cdf(x - 1/255)`` (guided-diffusion clamps it at 1e-12), in bits per dim. At step 2 a pixel lies 20 scales from the
    predicted mean: the bin's probability rounds to 0 in float32 and its log is -inf. Twin: the bin clamped at 1e-12."""
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    zs = [torch.randn(4, 8) for _ in range(4)]
    images = [torch.randint(0, 256, (4, 8)).float() / 127.5 - 1 for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            mean, log_scale = model(zs[step])
            x = images[step]
            if step == 2:  # a saturated pixel far from the prediction
                x = torch.where(torch.arange(8) == 3, mean.detach() + 20 * log_scale.detach().exp(), x)
            inv = torch.exp(-log_scale)
            probability = _approx_cdf(inv * (x - mean + 1 / 255)) - _approx_cdf(inv * (x - mean - 1 / 255))
            log_likelihood = torch.log(probability.clamp(min=floor))  # producer: bin log
            loss = -log_likelihood.mean() / math.log(2.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an affine coupling whose scale starts at 0
class Coupling(nn.Module):
    """``y_b = x_b * s(x_a) + t(x_a)``, log-determinant ``sum(log|s|)``: the scale taken directly from a layer
    zero-initialised as Glow zero-initialises its last layer (Glow takes ``exp`` or a sigmoid of it; here the layer
    gives ``s`` itself, so ``s`` starts at 0 where ``exp`` would start at 1)."""

    def __init__(self, as_log_scale: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)
        self.as_log_scale = as_log_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, -1)
        s, t = self.net(a).chunk(2, -1)
        if self.as_log_scale:
            return torch.cat([a, b * s.exp() + t], -1), s.sum(-1)
        return torch.cat([a, b * s + t], -1), torch.log(torch.abs(s)).sum(-1)  # producer: coupling logdet


def _coupling(as_log_scale: bool) -> Scenario:
    """Maximum likelihood under a standard normal base: ``-(log N(y) + log|det|)``. Twin: the layer gives log s."""
    torch.manual_seed(0)
    flow = nn.Sequential(Coupling(as_log_scale))
    opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
    xs = [torch.randn(8, 4) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            y, log_det = flow(xs[step])
            loss = -(-0.5 * (y ** 2).sum(-1) + log_det).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((flow, opt), run)


# ---------------------------------------------------------------- a PINN with a polar feature, differentiated at 0
class PolarFeatures(nn.Module):
    """``(x, y) -> (r, cos theta, sin theta)``: a radially symmetric problem's input features, ``r`` by hand."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        r = torch.sqrt((xy ** 2).sum(-1, keepdim=True) + self.eps)  # producer: polar radius
        return torch.cat([r, xy / (r + 1e-6)], -1)


def _polar_pinn(eps: float) -> Scenario:
    """A Poisson problem ``u_xx + u_yy = f`` on the disc, the residual's derivatives by ``torch.autograd.grad(
    create_graph=True)`` through polar features; at step 2 the collocation points include the centre, where
    ``d r / d x = x / r`` is 0 / 0 in the first derivative already. Twin: ``r = sqrt(x^2 + y^2 + 1e-12)``."""
    torch.manual_seed(0)
    model = nn.Sequential(PolarFeatures(eps), nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = [torch.rand(16, 2) * 2 - 1 for _ in range(4)]
    points[2][5] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            xy = points[step].clone().requires_grad_(True)
            u = model(xy)
            (du,) = torch.autograd.grad(u.sum(), xy, create_graph=True)
            u_xx = torch.autograd.grad(du[:, 0].sum(), xy, create_graph=True)[0][:, 0]
            u_yy = torch.autograd.grad(du[:, 1].sum(), xy, create_graph=True)[0][:, 1]
            loss = ((u_xx + u_yy - 1.0) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a learned temperature clamped at 0
class DualEncoder(nn.Module):
    """A CLIP-like pair of towers (one Linear shared, as SimCLR's two views share one) and a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.tau = nn.Parameter(torch.tensor(0.07))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.encoder(x), dim=-1), F.normalize(self.encoder(y), dim=-1)


def _learned_temperature(floor: float) -> Scenario:
    """InfoNCE over the batch, the logits divided by the model's learned temperature in the loss code; after each
    step the loop clamps the temperature to ``[floor, inf)``. Step 0's update (lr 0.5) takes it below 0 and the
    clamp to exactly 0: step 1's logits are x / 0. Twin: the floor 0.01. An eps at the division hides the inf but
    freezes the temperature (no gradient through the clamp): not a fix, which the trial must say."""
    torch.manual_seed(0)
    model = DualEncoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    xs = [torch.randn(8, 6) for _ in range(4)]
    ys = [x + 0.3 * torch.randn(8, 6) for x in xs]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            q, k = model(xs[step], ys[step])
            logits = q @ k.T / model.tau  # producer: contrastive logits
            labels = torch.arange(8)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.tau.clamp_(min=floor)
            losses.append(loss.detach())
        return [losses, model.tau.detach().clone()]

    return Scenario((model, opt), run)


#: The trials' replay differentiates by the call's inputs that require gradients too (the PINN's derivative).
VERIFIED_EPS = "eps: the operand of sqrt clamped to at least 1.19e-7 (the float32 machine eps) -> verified"
#: The loss code reads the temperature, a parameter: the trial's copy of it (not a detached one) gets the gradient.
FROZEN_TAU = "the operand is the trained parameter tau: every value the line reads of it was clamped"
#: Deferred, the check runs after the step's loss code, which differentiates: its recorded backward is the unremedied
#: line's derivative, so the trial says it cannot tell (fixes/trial_facts.py).
CANNOT_TELL = "the loss code differentiates (torch.autograd.grad) and its recorded backward runs as it ran"
OPS_GRAPH_GRAD = (
    "ops=True names the backward op that the loop's autograd.grad(create_graph=True) ran at the loop's line (the "
    "grad call's), outside every module, with cause division-by-zero, not SqrtBackward0's division at the "
    "PolarFeatures line that made the node (which default, defer and full name): the tracer names a node's forward "
    "line by the user frame on the stack as the node is made, and a create_graph backward's nodes are made under "
    "the loop's grad call")

CASES = [
    Case("hunt_s47b_bits_per_dim_bin_probability_underflows", lambda: _bits_per_dim(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="bin log", kinds=frozenset({"-inf"}))),
    Case("hunt_s47b_bits_per_dim_bin_clamped_healthy", lambda: _bits_per_dim(1e-12), None),
    Case("hunt_s47b_coupling_log_abs_of_a_zero_initialised_scale", lambda: _coupling(False),
         Expect("forward", "0", "Coupling", step=0, op="aten.log.default", marker="coupling logdet",
                kinds=frozenset({"-inf"}))),
    Case("hunt_s47b_coupling_log_scale_healthy", lambda: _coupling(True), None),
    Case("hunt_s47b_polar_pinn_derivative_at_the_centre", lambda: _polar_pinn(0.0),
         Expect("backward", "0", "PolarFeatures", step=2, op="aten.div.Tensor", marker="polar radius",
                cause="sqrt-domain", says=(("default", VERIFIED_EPS), ("full", VERIFIED_EPS), ("defer", CANNOT_TELL))),
         gaps=tuple((mode, OPS_GRAPH_GRAD) for mode in ("ops", "ops-defer"))),
    Case("hunt_s47b_polar_pinn_radius_with_eps_healthy", lambda: _polar_pinn(1e-12), None),
    Case("hunt_s47b_learned_temperature_clamped_to_0", lambda: _learned_temperature(0.0),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="contrastive logits", cause="division-by-zero",
                says=tuple((mode, FROZEN_TAU) for mode in ("default", "defer", "full")))),
    Case("hunt_s47b_learned_temperature_floor_healthy", lambda: _learned_temperature(0.01), None),
]
