"""Helpers shared by the test modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


def raised(run: Callable[[], Any], *targets: Any, **options: Any) -> nan_magic.Report:
    """Run ``run()`` under ``watch(*targets, **options)``; the report of the error it must raise."""
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **options):
        run()
    return caught.value.report


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    """One plain training step per batch (squared output as the loss); the losses."""
    losses = []
    for x in batches:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def amp_training(
    model: nn.Module,
    steps: int,
    init_scale: float,
    lr: float = 0.01,
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.optim.SGD, torch.amp.GradScaler, Callable[[], None]]:
    """A float16-autocast classifier loop with a GradScaler: ``(opt, scaler, train)``.

    ``batch()`` gives each step's ``(x, y)``; by default one fixed batch of 32 x 16 features, 4 classes.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    if batch is None:
        fixed = torch.randn(32, 16), torch.randint(0, 4, (32,))

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return fixed

    def train() -> None:
        for _ in range(steps):
            x, y = batch()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return opt, scaler, train


def sgd_regression(lr: float, steps: int = 400, **options) -> nan_magic.Watch:
    """Least squares by SGD: above 2/λmax every step multiplies the error, the loss grows geometrically."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    with nan_magic.watch(model, opt, **options) as w:
        for _ in range(steps):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if w.report is not None:
                break
    return w


def attributes_read(package: str, names: tuple[str, ...], allowed: str) -> list[str]:
    """Where the modules of nan_magic's ``package`` folder (all but the one named ``allowed``) read one of ``names``.

    The modes are objects (hot/timing.py, hot/watched/coverage.py): a read of the mode's flag elsewhere is a mode
    leaking out of its object.
    """
    import ast
    from pathlib import Path

    folder = Path(nan_magic.__file__).parent / package
    return [
        f"{path.relative_to(folder)}:{node.lineno} .{node.attr}"
        for path in sorted(folder.rglob("*.py")) if path.name != allowed
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in names
    ]


#: The modes a localization test runs in: the default watch and ops=True, each in both timings, and the full mode.
FIVE_MODES = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred"),
              pytest.param({"ops": True}, id="ops"), pytest.param({"ops": True, "defer": True}, id="ops-deferred"),
              pytest.param({"mode": "full"}, id="full")]


class LogWhenTold(nn.Module):
    """log(x - 10): NaN for the usual activations, on the step the loop sets ``fire``."""

    def __init__(self) -> None:
        super().__init__()
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10) if self.fire else x  # producer: log when told
