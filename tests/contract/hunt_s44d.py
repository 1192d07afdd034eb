"""hunt_s44d, loop idioms whose order the deferred check must keep, in every mode (all right already: evidence).

A BYOL-style step whose target view runs under ``no_grad`` and whose second view is made from the same batch in
place (``x.add_(noise)``) after it: the target's ``0 / 0`` is judged by the deferred check after the batch changed.
Two events in one step, a validation forward under ``no_grad`` (``0 / 0`` in the model) and the loss code's
``sqrt(0)`` backward, in either order before the optimizer step: the first in execution order is the one named, by
the immediate and the deferred check alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


class UnitProjector(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc, self.head = eps, nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: unit projection
        return self.head(h)


def _projector(eps: float) -> UnitProjector:
    torch.manual_seed(0)
    model = UnitProjector(eps)
    with torch.no_grad():
        model.fc.bias.zero_()
    return model


def _in_place_view(eps: float) -> Scenario:
    """At step 2 a sample is blank: the target view's projection is ``0 / 0``; the noise added in place after it
    makes the second view finite. Twin: an eps."""
    model = _projector(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = _batches(3, 4), _batches(3, 1)
    xs[2][1] = 0.0
    noise = [torch.randn(3, 4) * 0.1 for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x = xs[step].clone()
            with torch.no_grad():
                target = model(x)
            x.add_(noise[step])  # the second view, made in place
            online = model(x)
            loss = F.mse_loss(online, target) + F.mse_loss(online, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _two_events(validate_first: bool, broken: bool = True) -> Scenario:
    """At step 2 the loss masks a sample out (``sqrt((0 * d) ** 2)``: its backward is ``0 * inf``) and the validation
    batch holds a blank sample (``0 / 0`` in the model), the validation before or after ``backward()``. Twin: no
    masked sample, no blank one."""
    model = _projector(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys, vals = _batches(3, 4), _batches(3, 1), _batches(3, 4)
    mask = torch.ones(3, 1)
    if broken:
        vals[2][0] = 0.0
        mask[1] = 0.0

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(4):
            diff = (model(xs[step]) - ys[step]) * (mask if step == 2 else 1.0)
            loss = torch.sqrt(diff ** 2).mean()  # producer: masked l1
            opt.zero_grad()
            if validate_first:
                with torch.no_grad():
                    val = model(vals[step])
                loss.backward()
            else:
                loss.backward()
                with torch.no_grad():
                    val = model(vals[step])
            opt.step()
            logged.append(torch.stack([loss.detach(), val.sum()]))
        return logged

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s44_byol_target_view_then_in_place_second_view", lambda: _in_place_view(0.0),
         Expect("forward", "", "UnitProjector", step=2, op="aten.div.Tensor", marker="unit projection")),
    Case("hunt_s44_byol_in_place_second_view_healthy", lambda: _in_place_view(1e-6), None),
    Case("hunt_s44_validation_nan_before_a_backward_nan", lambda: _two_events(True),
         Expect("forward", "", "UnitProjector", step=2, op="aten.div.Tensor", marker="unit projection")),
    Case("hunt_s44_backward_nan_before_a_validation_nan", lambda: _two_events(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="masked l1", cause="sqrt-domain",
                op_modes=("default", "defer", "full", "ops"))),
    Case("hunt_s44_validation_and_masked_l1_healthy", lambda: _two_events(False, broken=False), None),
]
