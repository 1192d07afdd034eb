"""Optimisation idioms that move parameters or inputs outside a plain ``opt.step()`` stay calm in the five modes
(issue 25; harness: test_calm16.py): SAM (a perturbation added to the weights under no_grad, a second forward and
backward, the weights put back, then the base step), adversarial training by PGD (a perturbation updated by the
sign of its gradient through ``.data``), an input optimised with Adam and clamped in place (style transfer), a
SimCLR loss whose self-similarities are masked with -inf, a VAE with ``kl_divergence``, activations saved on the
CPU (``save_on_cpu``), ``backward(inputs=...)``, gradients edited in place (gradient centralisation), and
``parameters_to_vector``/``vector_to_parameters``; and every stock optimizer, six steps.
"""

from __future__ import annotations

import pytest
import torch
from test_calm16 import Loop, assert_calm, sgd_loop
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(steps)]


def sam() -> Loop:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data, rho = _data(), 0.05

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                eps = [p.grad * (rho / (norm + 1e-12)) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps, strict=True):
                    p.add_(e)  # climb to the worst point nearby
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps, strict=True):
                    p.sub_(e)  # back, with the sharpness-aware gradient
            opt.step()
            out.append(loss.detach())
        return out
    return Loop((model, opt), (model, opt), run)


def pgd_training() -> Loop:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, eps, alpha = _data(), 0.1, 0.03

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            delta = torch.zeros_like(x).uniform_(-eps, eps).requires_grad_(True)
            for _ in range(3):
                F.cross_entropy(model(x + delta), y).backward()
                delta.data = (delta + alpha * delta.grad.sign()).clamp(-eps, eps)
                delta.grad.zero_()
            loss = F.cross_entropy(model(x + delta.detach()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out += [loss.detach(), delta.detach()]
        return out
    return Loop((model, opt), (model, opt), run)


def input_optimisation() -> Loop:
    """The model frozen, the image is the parameter: Adam on it, clamped to [0, 1] in place."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    model.requires_grad_(False)
    target = torch.rand(1, 4, 8, 8)
    image = torch.rand(1, 3, 8, 8).requires_grad_(True)
    opt = torch.optim.Adam([image], lr=0.05)

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(4):
            loss = F.mse_loss(model(image), target) + 1e-3 * image.diff(dim=-1).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                image.clamp_(0, 1)
            out += [loss.detach(), image.detach().clone()]
        return out
    return Loop((model, opt), (model, opt), run)


def simclr() -> Loop:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
    views = [torch.randn(4, 6) for _ in range(3)]

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        x = views[step]
        z = F.normalize(m(torch.cat([x, x + 0.1 * torch.randn_like(x)])), dim=-1)
        sim = (z @ z.T / 0.5).masked_fill(torch.eye(8, dtype=torch.bool), NEG_INF)  # no pair with itself
        positives = torch.arange(8).roll(4)
        return F.cross_entropy(sim, positives)
    return sgd_loop(model, loss_of)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 8), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.enc(x).chunk(2, -1)
        q = torch.distributions.Normal(mu, (0.5 * log_var).exp())
        kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(-1).mean()
        return self.dec(q.rsample()), kl


def vae() -> Loop:
    x = torch.randn(8, 6)

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        recon, kl = m(x)
        return F.mse_loss(recon, x) + 0.1 * kl
    return sgd_loop(VAE(), loss_of, lr=0.01)


def save_on_cpu_and_partial_backward() -> Loop:
    """Activations kept by ``save_on_cpu``; the head trained by ``backward(inputs=...)``, the trunk by another loss;
    gradients centralised in place; the weights moved through ``parameters_to_vector``."""
    trunk, head = nn.Linear(6, 16), nn.Linear(16, 3)
    model = nn.Sequential(trunk, nn.ReLU(), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = _data()

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            with torch.autograd.graph.save_on_cpu():
                logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward(inputs=list(head.parameters()), retain_graph=True)
            (0.1 * logits.pow(2).mean()).backward(inputs=list(trunk.parameters()))
            for p in model.parameters():
                if p.grad is not None and p.grad.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=1, keepdim=True))  # gradient centralisation
            opt.step()
            with torch.no_grad():
                vec = torch.nn.utils.parameters_to_vector(model.parameters())
                torch.nn.utils.vector_to_parameters(vec * 0.999, model.parameters())  # weight decay by hand
            out.append(loss.detach())
        return out
    return Loop((model, opt), (model, opt), run)


OPTIM = {
    "sam-two-passes": sam,
    "pgd-adversarial-training": pgd_training,
    "input-optimisation-clamped": input_optimisation,
    "simclr-masked-self-similarity": simclr,
    "vae-kl-divergence": vae,
    "save-on-cpu-partial-backward-grad-edits": save_on_cpu_and_partial_backward,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", OPTIM)
def test_optimisation_idioms_outside_a_plain_step_are_calm(name: str, options: dict) -> None:
    assert_calm(OPTIM[name], options)


_O = torch.optim
#: Every stock optimizer, with the options that keep extra state (amsgrad's max, centered RMSprop, Rprop's step
#: sizes, ASGD's averages, NAdam's mu product).
OPTIMIZERS = {
    "sgd-nesterov": lambda p: _O.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "sgd-maximize": lambda p: _O.SGD(p, lr=0.01, maximize=True),
    "adam-amsgrad": lambda p: _O.Adam(p, lr=1e-2, amsgrad=True),
    "adam-foreach-off": lambda p: _O.Adam(p, lr=1e-2, foreach=False),
    "adamax": lambda p: _O.Adamax(p, lr=1e-2),
    "nadam-decoupled": lambda p: _O.NAdam(p, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "radam": lambda p: _O.RAdam(p, lr=1e-2),
    "adagrad-lr-decay": lambda p: _O.Adagrad(p, lr=0.1, lr_decay=0.01),
    "adadelta": lambda p: _O.Adadelta(p),
    "rmsprop-centered": lambda p: _O.RMSprop(p, lr=1e-2, centered=True, momentum=0.5),
    "rprop": lambda p: _O.Rprop(p),
    "asgd": lambda p: _O.ASGD(p, lr=1e-2, t0=1),
}


def optimizer_loop(name: str) -> Loop:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = OPTIMIZERS[name](model.parameters())
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(6):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out
    return Loop((model, opt), (model, opt), run)


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_stock_optimizer_is_calm(name: str, options: dict) -> None:
    assert_calm(lambda: optimizer_loop(name), options)
