"""Healthy training that must stay silent in every mode (session 28, part two): exports and quantized inference
inside the watch, inputs that carry gradients, backward calls with explicit gradients, and forwards whose outputs
are not fresh activations.

``torch.export.export`` of the trained model, quantization-aware training with per-channel fake quantization
converted to int8 and run, a module that returns its own parameter (a learned positional table), FGSM
adversarial training (the batch's own ``.grad``), ``backward(gradient=...)`` of a vector and a batched
``autograd.grad`` (``is_grads_batched``), a DataLoader with persistent workers over two epochs, a head
re-initialised by ``reset_parameters`` mid-training, and a forward returning ``torch.return_types.max``.
Compared with an unwatched run as calm_s27's rows are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish, training
from contract.calm_s27 import settled


def _mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           steps: int = 3) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _export_at_end() -> Scenario:
    """The trained model exported by ``torch.export.export`` inside the watch (the model run under fake tensors),
    the exported program's module run on the batch, then one more eager step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y)
        exported = torch.export.export(model, (x,))
        with torch.no_grad():
            losses.append(exported.module()(x))
        losses += _steps(model, opt, x, y, 1)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class QuantNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _qat_convert_int8() -> Scenario:
    """Eager-mode QAT: ``prepare_qat`` with the x86 qconfig (per-channel weight fake quantization, histogram-free
    moving-average observers) before the watch, three steps, then ``convert`` to int8 inside it and the quantized
    model run (its submodules' outputs quint8 tensors)."""
    torch.manual_seed(0)
    torch.backends.quantized.engine = "x86"
    model = QuantNet()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    torch.ao.quantization.prepare_qat(model, inplace=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = _steps(model, opt, x, y)
        model.eval()
        quantized = torch.ao.quantization.convert(model, inplace=False)
        losses.append(quantized(x))
        model.train()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class PositionTable(nn.Module):
    """Learned positions: its forward takes no input and returns its own parameter (a leaf, not an activation)."""

    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(length, width) * 0.02)

    def forward(self) -> torch.Tensor:
        return self.table


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos, self.head = nn.Embedding(10, 8), PositionTable(5, 8), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids) + self.pos()))


def _module_returns_its_parameter() -> Scenario:
    torch.manual_seed(0)
    model = Tagger()
    ids, tags = torch.randint(0, 10, (4, 5)), torch.randint(0, 3, (4, 5))
    return training(model, lambda s: F.cross_entropy(model(ids).flatten(0, 1), tags.flatten()),
                    opt=torch.optim.Adam(model.parameters(), lr=1e-2))


def _fgsm_adversarial() -> Scenario:
    """FGSM adversarial training: the batch requires grad, the clean loss's backward fills ``x.grad`` (and the
    parameters' grads, zeroed after), the adversarial batch ``x + eps * sign(x.grad)`` trains the model."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        out = []
        for _ in range(3):
            xr = x.clone().requires_grad_(True)
            clean = F.mse_loss(model(xr), y)
            clean.backward()
            adv = (xr + 0.1 * xr.grad.sign()).detach()
            opt.zero_grad()
            loss = 0.5 * F.mse_loss(model(x), y) + 0.5 * F.mse_loss(model(adv), y)
            loss.backward()
            opt.step()
            out += [clean.detach(), loss.detach(), xr.grad.clone()]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


def _backward_with_gradient() -> Scenario:
    """A per-sample loss vector backward'ed with ``gradient=`` weights (no reduction to a scalar), then the input
    Jacobian's rows from one batched ``autograd.grad`` (``is_grads_batched``) penalised at the next step."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    weights = torch.rand(6)

    def run() -> tuple[Any, ...]:
        out = []
        for _ in range(3):
            per_sample = (model(x) - y).pow(2).mean(1)
            opt.zero_grad()
            per_sample.backward(gradient=weights)
            opt.step()
            xr = x.clone().requires_grad_(True)
            o = model(xr)
            basis = torch.eye(2).unsqueeze(1).expand(2, 6, 2)
            (jac,) = torch.autograd.grad(o, xr, basis, is_grads_batched=True)
            out += [per_sample.detach(), jac]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


def _persistent_workers() -> Scenario:
    """A DataLoader with one persistent worker and a seeded shuffling generator, two epochs (the worker kept
    between them), the batch and its augmentation noise drawn in the worker."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 2))

    def run() -> tuple[Any, ...]:
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=1,
                                             persistent_workers=True, generator=torch.Generator().manual_seed(3))
        losses = []
        for _ in range(2):
            for xb, yb in loader:
                losses += _steps(model, opt, xb, yb, 1)
        del loader
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _reinit_head_mid_training() -> Scenario:
    """The head re-initialised by ``reset_parameters`` at step 2 (kaiming and uniform draws from the global RNG,
    written in place under no_grad), its momentum buffers cleared by hand."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(4):
            if step == 2:
                model[2].reset_parameters()
                for p in model[2].parameters():
                    opt.state.pop(p, None)
            losses += _steps(model, opt, x, y, 1)
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class MaxPool(nn.Module):
    """Pools over time by ``max(dim=1)``: returns ``torch.return_types.max`` (values and int64 indices)."""

    def forward(self, h: torch.Tensor) -> Any:
        return h.max(dim=1)


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(8, 16), MaxPool(), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.pool(torch.relu(self.enc(x)))
        return self.head(pooled.values), pooled.indices


def _return_types_max() -> Scenario:
    torch.manual_seed(0)
    model = Pooled()
    x, y = torch.randn(4, 5, 8), torch.randn(4, 2)
    return training(model, lambda s: F.mse_loss(model(x)[0], y))


ROWS = {
    "export-at-end": _export_at_end,
    "qat-per-channel-convert-int8": _qat_convert_int8,
    "module-returns-its-parameter": _module_returns_its_parameter,
    "fgsm-adversarial-input-grad": _fgsm_adversarial,
    "backward-gradient-arg-and-batched-grad": _backward_with_gradient,
    "dataloader-persistent-worker": _persistent_workers,
    "reinit-head-mid-training": _reinit_head_mid_training,
    "return-types-max-pool": _return_types_max,
}

CASES = [Case(f"calm_s28_{name}", lambda build=build: settled(build()), None, benign=0) for name, build in ROWS.items()]
